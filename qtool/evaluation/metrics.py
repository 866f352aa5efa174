"""Fidelity and accuracy figures, accumulated batch by batch (nothing kept per sample)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterable, Mapping, Optional

import numpy as np


def softmax(x: np.ndarray, axis: int = -1) -> np.ndarray:
    z = x.astype(np.float64) - x.max(axis=axis, keepdims=True)
    e = np.exp(z)
    return e / e.sum(axis=axis, keepdims=True)


def as_probabilities(x: np.ndarray) -> np.ndarray:
    """Rows that already are distributions (summing to 1 within 1e-3) are made to sum to exactly 1
    (an int8 model's rounded probabilities may sum to 1.0004, and KL against them would go below
    0); logits go through softmax."""
    x = x.astype(np.float64)
    if x.min() >= 0 and np.allclose(x.sum(axis=-1), 1.0, atol=1e-3):
        return x / x.sum(axis=-1, keepdims=True)
    return softmax(x)


def sqnr_db(signal_power: float, noise_power: float) -> float:
    if noise_power == 0:
        return math.inf
    if signal_power == 0:
        return -math.inf
    return 10.0 * math.log10(signal_power / noise_power)


def as_array(value) -> np.ndarray:
    """A model output as a numpy array: a tensor as it is; a sequence output (onnxruntime gives a
    list) as one row of all its values, a sequence of maps (a classifier's per-class scores) as one
    row per map of its values in key order."""
    if isinstance(value, np.ndarray):
        return value
    if isinstance(value, (list, tuple)):
        if value and all(isinstance(v, Mapping) for v in value):
            return np.array([[float(v[k]) for k in sorted(v)] for v in value], dtype=np.float64)
        if not value:
            return np.zeros((0,), np.float64)
        return np.concatenate([np.asarray(v, dtype=np.float64).ravel() for v in value])
    return np.asarray(value)


def rows(array: np.ndarray, samples: Optional[int] = None) -> np.ndarray:
    """`array` as one row per sample: along axis 0 when that axis holds the batch (its length is
    `samples`, or any length when `samples` is None); else, a 0-d scalar or an output without the
    batch axis, one row for the whole batch, which is one row per sample at batch 1."""
    array = as_array(array)
    if array.ndim == 0 or (samples is not None and array.shape[0] != samples):
        return array.reshape(1, -1)
    return array.reshape(array.shape[0], -1)


def sample_cosines(ref: np.ndarray, test: np.ndarray, samples: Optional[int] = None) -> np.ndarray:
    """The cosine of every row (rows(): one per sample when the output holds the batch along axis 0,
    one for the batch otherwise) of `test` to `ref`; a 0-d scalar is one row."""
    r = rows(ref, samples).astype(np.float64)
    t = rows(test, samples).astype(np.float64).reshape(r.shape[0], -1)
    return row_cosines(r, t, np.sum(r * t, axis=1), np.linalg.norm(r, axis=1) * np.linalg.norm(t, axis=1))


def row_cosines(r: np.ndarray, t: np.ndarray, dots: np.ndarray, norms: np.ndarray) -> np.ndarray:
    """Per row of `r` and `t`, dots / norms (their dot products and the products of their norms);
    two all-zero rows are identical: cosine 1."""
    return np.where(norms > 0, dots / np.where(norms > 0, norms, 1.0), np.where(np.all(r == t, axis=1), 1.0, 0.0))


def add_counts(total, part, names: Iterable[str]) -> None:
    """An accumulator's merge: add `part`'s named counts and sums into `total`'s."""
    for name in names:
        setattr(total, name, getattr(total, name) + getattr(part, name))


@dataclass
class FidelityAccumulator:
    """Reference vs test tensor: SQNR over everything, mean per-sample cosine, abs errors. An output
    of one value per sample (a score, a presence flag: [N, 1], [N], a 0-d scalar at batch 1) has no
    per-sample cosine (it would be 1 wherever the sign holds): its cosine is that of its values over
    all samples."""

    signal: float = 0.0
    noise: float = 0.0
    cosine_sum: float = 0.0
    samples: int = 0
    abs_sum: float = 0.0
    abs_max: float = 0.0
    values: int = 0
    dot: float = 0.0  # sum of ref * test, and of test * test: the cosine over samples
    test_power: float = 0.0
    width: int = 0  # the most values a sample's row had

    def update(self, ref: np.ndarray, test: np.ndarray, samples: Optional[int] = None) -> np.ndarray:
        """Add one batch (of `samples` samples, when known: see rows()); returns its cosines, one per
        row: per sample when the output holds the batch along axis 0, else one for the batch."""
        # sample_cosines' sums, bit for bit, from one float64 copy of each side and two scratch
        # arrays (a CTC map or a detector head runs to millions of values per batch)
        ref = as_array(ref).astype(np.float64, copy=False)
        test = as_array(test).astype(np.float64, copy=False)
        diff = np.subtract(test, ref, out=np.empty_like(ref))
        square = np.multiply(ref, ref, out=np.empty_like(ref))
        self.signal += float(np.sum(square))
        r = rows(ref, samples)
        t = test.reshape(r.shape[0], -1)
        norms = np.sqrt(np.add.reduce(square.reshape(r.shape), axis=1))
        np.multiply(test, test, out=square)
        norms = norms * np.sqrt(np.add.reduce(square.reshape(r.shape), axis=1))
        np.multiply(ref, test, out=square)
        dots = np.sum(square.reshape(r.shape), axis=1)
        np.multiply(diff, diff, out=square)
        self.noise += float(np.sum(square))
        np.abs(diff, out=diff)
        self.abs_sum += float(np.sum(diff))
        self.abs_max = max(self.abs_max, float(np.max(diff)) if diff.size else 0.0)
        self.values += diff.size
        self.dot += float(np.vdot(ref, test))
        self.test_power += float(np.vdot(test, test))
        cos = row_cosines(r, t, dots, norms)
        self.cosine_sum += float(np.sum(cos))
        self.samples += len(cos)
        if len(cos):
            self.width = max(self.width, ref.size // len(cos))  # values per row (one row per sample)
        return cos

    def merge(self, other: "FidelityAccumulator") -> None:
        """Add another batch's (or shard's) sums: merging each batch in order gives the very floats
        of updating batch by batch."""
        self.signal += other.signal
        self.noise += other.noise
        self.cosine_sum += other.cosine_sum
        self.samples += other.samples
        self.abs_sum += other.abs_sum
        self.abs_max = max(self.abs_max, other.abs_max)
        self.values += other.values
        self.dot += other.dot
        self.test_power += other.test_power
        self.width = max(self.width, other.width)

    def cosine(self) -> float:
        """The mean per-sample cosine; over the samples for an output of one value per sample."""
        if not self.samples:
            return math.nan
        if self.width == 1:
            norms = math.sqrt(self.signal * self.test_power)
            return self.dot / norms if norms > 0 else (1.0 if self.noise == 0 else 0.0)
        return self.cosine_sum / self.samples

    def result(self) -> dict[str, float]:
        return {
            "cosine": self.cosine(),
            "sqnr_db": sqnr_db(self.signal, self.noise),
            "max_abs_error": self.abs_max,
            "mean_abs_error": self.abs_sum / self.values if self.values else math.nan,
        }


@dataclass
class ClassificationAccumulator:
    """Top-k accuracy of both models (when labels exist), agreement and KL(fp32 || int8)."""

    top_k: int = 5
    samples: int = 0
    labelled: int = 0
    agree: int = 0
    kl_sum: float = 0.0
    ref_top1: int = 0
    ref_topk: int = 0
    test_top1: int = 0
    test_topk: int = 0

    def update(self, ref: np.ndarray, test: np.ndarray, labels: list[int | None]) -> None:
        ref2 = rows(ref, len(labels)).astype(np.float64)
        test2 = rows(test, len(labels)).astype(np.float64).reshape(ref2.shape[0], -1)
        if ref2.shape[0] != len(labels):  # an output without the batch axis: one row for the batch
            labels = [None] * ref2.shape[0]
        p, q = as_probabilities(ref2), as_probabilities(test2)
        eps = 1e-12
        self.kl_sum += float(np.sum(p * (np.log(p + eps) - np.log(q + eps))))
        self.agree += int(np.sum(ref2.argmax(axis=1) == test2.argmax(axis=1)))
        self.samples += ref2.shape[0]
        if all(label is None for label in labels):
            return  # the ranks serve only the labelled top-k (a sort of every row: seconds on a CTC map)
        k = min(self.top_k, ref2.shape[1])
        ref_rank = np.argsort(-ref2, axis=1, kind="stable")[:, :k]
        test_rank = np.argsort(-test2, axis=1, kind="stable")[:, :k]
        for i, label in enumerate(labels):
            if label is None:
                continue
            self.labelled += 1
            self.ref_top1 += int(ref_rank[i, 0] == label)
            self.test_top1 += int(test_rank[i, 0] == label)
            self.ref_topk += int(label in ref_rank[i])
            self.test_topk += int(label in test_rank[i])

    def merge(self, other: "ClassificationAccumulator") -> None:
        """Add another batch's counts and KL sum (see FidelityAccumulator.merge)."""
        add_counts(self, other, ("samples", "labelled", "agree", "kl_sum", "ref_top1", "ref_topk", "test_top1",
                                 "test_topk"))

    def result(self) -> dict:
        out = {"samples": self.samples, "agreement": self.agree / self.samples if self.samples else math.nan,
               # eps-smoothed terms can sum a hair below 0 where the two models agree: KL is never negative
               "mean_kl": max(0.0, self.kl_sum / self.samples) if self.samples else math.nan,
               "labelled": self.labelled}
        if self.labelled:
            n = self.labelled
            out.update({
                "top1": {"fp32": self.ref_top1 / n, "int8": self.test_top1 / n},
                f"top{self.top_k}": {"fp32": self.ref_topk / n, "int8": self.test_topk / n},
                "top1_drop": (self.ref_top1 - self.test_top1) / n,
            })
        return out


def percentile_ms(times: list[float], q: float) -> float:
    return float(np.percentile(np.asarray(times) * 1000.0, q))
