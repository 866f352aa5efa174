"""Sequence-recognizer fidelity: greedy CTC decoding of both models' outputs, then the texts compared.

A text-line recognizer (CRNN-style OCR, speech CTC heads) outputs [N, T, C] per-step class
scores, or [T, N, C] (time first, as a recurrent head exported from PyTorch often leaves them,
told apart by the batch's sample count); its text is the greedy CTC decode: the argmax of every
step, repeats collapsed, blanks dropped. The cosine of the scores says little about that text: a recognizer whose
softmax peaks move a little keeps its text, and one flipped argmax at one step changes it.
So the figures are the decoded texts: how many int8 texts are identical to fp32's, and the
mean edit distance between the two as a ratio of the longer text. The blank is class 0
(PaddleOCR's and PyTorch's CTCLoss convention).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import Optional

import numpy as np

from qtool.errors import QtoolError
from qtool.evaluation.metrics import add_counts

BLANK = 0


def greedy_decode(scores: np.ndarray, samples: Optional[int] = None) -> list[tuple[int, ...]]:
    """One class sequence per sample of [N, T, C] scores (probabilities or logits: argmax only).
    With `samples` (N) given, [T, N, C] scores, whose first axis is not N but whose second is,
    are read time first."""
    if scores.ndim != 3:
        raise QtoolError(f"the ctc task needs an output of shape [N, T, classes], got {list(scores.shape)}")
    if samples is not None and scores.shape[0] != samples and scores.shape[1] == samples:
        scores = scores.transpose(1, 0, 2)
    best = scores.argmax(axis=-1)
    texts = []
    for steps in best:
        first = np.ones(len(steps), bool)
        first[1:] = steps[1:] != steps[:-1]  # a repeat without a blank between is one character
        texts.append(tuple(int(c) for c in steps[first & (steps != BLANK)]))
    return texts


def edit_distance(a: tuple[int, ...], b: tuple[int, ...]) -> int:
    """Levenshtein distance (insertions, deletions, substitutions), one row at a time."""
    row = list(range(len(b) + 1))
    for i, x in enumerate(a, 1):
        diagonal, row[0] = row[0], i
        for j, y in enumerate(b, 1):
            diagonal, row[j] = row[j], min(row[j] + 1, row[j - 1] + 1, diagonal + (x != y))
    return row[-1]


def edit_ratio(a: tuple[int, ...], b: tuple[int, ...]) -> float:
    """Edit distance over the longer text's length: 0 identical, 1 nothing in common; two empty texts: 0."""
    longest = max(len(a), len(b))
    return edit_distance(a, b) / longest if longest else 0.0


@dataclass
class CtcAccumulator:
    """Counts over all samples: identical decoded texts, and the sum of edit-distance ratios."""

    samples: int = 0
    kept: int = 0
    ratio_sum: float = 0.0
    ref_chars: int = 0

    def update(self, ref: np.ndarray, test: np.ndarray, samples: Optional[int] = None) -> None:
        """One batch of `samples` samples; its ratios are summed before they join the total (see
        DetectionAccumulator.update)."""
        batch_ratio = 0.0
        for r, t in zip(greedy_decode(ref, samples), greedy_decode(test, samples)):
            self.samples += 1
            self.kept += int(r == t)
            self.ref_chars += len(r)
            batch_ratio += edit_ratio(r, t)
        self.ratio_sum += batch_ratio

    def merge(self, other: "CtcAccumulator") -> None:
        add_counts(self, other, (f.name for f in fields(self)))

    def result(self) -> dict:
        return {
            "samples": self.samples,
            "texts_kept": self.kept,
            "texts_kept_fraction": self.kept / self.samples if self.samples else math.nan,
            "mean_edit_ratio": self.ratio_sum / self.samples if self.samples else math.nan,
            "fp32_chars": self.ref_chars,
            "blank": BLANK,
        }
