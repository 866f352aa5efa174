"""Whether a model takes the batches its declared dynamic first axis promises.

Calibration, the measured choices, bias correction, adaptive rounding, the run check, the search
and evaluate stack samples of one shape along the inputs' first axis when every input declares it
dynamic (qtool.data.dataset.batches). Exporters often bake batch 1 into the graph all the same (a
Reshape to a constant shape, an Expand or a Tile to a fixed one, a Squeeze of the batch axis):
onnxruntime then refuses a batch of several samples, or the outputs mix them. So a job probes once,
on its first real batch of several samples (or, when the first samples differ in shape, the first
one stacked with itself), before anything runs on batches: the fp32 model at the configured batch
size, then its first sample alone. When the batch is refused, or an output does
not hold the batch (no axis of its grows from 1 for one sample to n for n: a 0-d scalar, a sum
over the batch, detections of all samples in one list), while the sample runs, the job feeds one
sample at a time throughout, with one note. When the sample is refused too, the model does not run on the data:
RunRefused, exit 2.
"""

from __future__ import annotations

import copy
import itertools
from typing import Iterator, Optional

import numpy as np
import onnx

from qtool.data.dataset import Batch, DataSource, MemorySource, batches, model_batch_size
from qtool.errors import QtoolError, RunRefused
from qtool.graph.runtime import create_session

LOOK_AHEAD = 4  # batches read to find the first of several samples (samples of varying shapes batch apart)


def batch_refusal(model: onnx.ModelProto | str, source: DataSource | MemorySource, batch_size: int,
                  label: str = "fp32 model") -> Optional[str]:
    """None when `model` runs the first batch of several samples of `source` at `batch_size` as it
    runs one sample, or when `source` makes no such batch; else why not, in a few words."""
    if model_batch_size(source.specs, batch_size) <= 1:
        return None
    if isinstance(source, MemorySource) and isinstance(source.data, Iterator):  # read once: read its head again
        head = list(itertools.islice(source.data, LOOK_AHEAD * batch_size))
        source.data = itertools.chain(head, source.data)
        source = copy.copy(source)
        source.data = head
    head: list[Batch] = []
    try:
        for batch in itertools.islice(batches(source, batch_size, LOOK_AHEAD * batch_size), LOOK_AHEAD):
            head.append(batch)
            if len(batch) > 1:  # read no further than the first batch of several samples
                break
    except QtoolError:  # the data's own errors: reported where the job reads it, after the model's
        return None
    first = next((b for b in head if len(b) > 1), None)
    if first is None and head:  # samples of varying shapes: later ones may still batch, so the first
        first = _repeated(head[0], model_batch_size(source.specs, batch_size))  # sample is stacked with itself
    if first is None:
        return None
    return refusal(model, first, label)


def _repeated(batch: Batch, n: int) -> Batch:
    """`batch`'s first sample n times, as a batch: what any n samples of its shape make."""
    return Batch([batch.keys[0]] * n, {name: np.repeat(array[:1], n, axis=0) for name, array in batch.feeds.items()})


def refusal(model: onnx.ModelProto | str, batch: Batch, label: str = "fp32 model") -> Optional[str]:
    """None when `model` runs `batch` (of several samples, every input batched along axis 0) as it
    runs its first sample alone; else why not. RunRefused when it does not run that sample either."""
    session = create_session(model, label=str(model) if isinstance(model, str) else label, log_level=4)
    one = {name: array[:1] for name, array in batch.feeds.items()}
    try:
        together = session.run(None, batch.feeds)
    except RunRefused as exc:
        session.run(None, one)  # the model refuses the data itself: that is the error to report
        return f"onnxruntime refuses a batch of {len(batch)} samples ({exc.reason})"
    alone = session.run(None, one)
    for output, many, single in zip(session.get_outputs(), together, alone):
        if not _stacked(np.shape(_array(single)), np.shape(_array(many)), len(batch)):
            return (f"output '{output.name}' does not hold the batch (shape {list(np.shape(_array(single)))} for one "
                    f"sample, {list(np.shape(_array(many)))} for {len(batch)})")
    return None


def _array(value) -> np.ndarray:
    if isinstance(value, (list, tuple)):  # a sequence output: its length is what may hold the batch
        return np.zeros((len(value),))
    return np.asarray(value)


def _stacked(one: tuple, many: tuple, n: int) -> bool:
    """Whether an output of shape `many` for n samples can hold them: the same rank as for one
    sample, and an axis of length 1 for one sample and n for n. The other axes may differ: a
    decoder's output is as long as the batch's longest."""
    return len(one) == len(many) and any(a == 1 and b == n for a, b in zip(one, many))
