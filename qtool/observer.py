"""Running calibration data through the fp32 graph and summarising the tensors the plan needs.

The observed tensors are exposed as extra graph outputs of a copy of the model, so
onnxruntime computes them in the same single pass as the real outputs; each batch's
arrays are reduced into fixed-size summaries and dropped before the next batch.
"""

from __future__ import annotations

from typing import Callable, Iterable, Optional

import onnx

from qtool.dataset import Batch
from qtool.runtime import create_session
from qtool.statistics import TensorStats


def with_outputs(model: onnx.ModelProto, names: Iterable[str]) -> onnx.ModelProto:
    """A copy of `model` that also outputs the named intermediate tensors."""
    exposed = onnx.ModelProto()
    exposed.CopyFrom(model)
    present = {o.name for o in exposed.graph.output} | {i.name for i in exposed.graph.input}
    types = {v.name: v.type.tensor_type.elem_type for v in exposed.graph.value_info}
    for name in names:
        if name not in present:
            exposed.graph.output.append(
                onnx.helper.make_tensor_value_info(name, types.get(name, onnx.TensorProto.FLOAT), None))
    return exposed


def observe(model: onnx.ModelProto, tensors: list[str], batches: Iterable[Batch],
            make_stats: Callable[[], TensorStats] = TensorStats, threads: int = 0,
            on_batch: Optional[Callable[[Batch], None]] = None) -> dict[str, TensorStats]:
    """One pass over `batches`; returns a summary per tensor."""
    inputs = {i.name for i in model.graph.input}
    fetched = [t for t in tensors if t not in inputs]  # graph inputs are read from the feeds
    session = create_session(with_outputs(model, fetched), threads)
    stats = {t: make_stats() for t in tensors}
    for batch in batches:
        arrays = session.run(fetched, batch.feeds) if fetched else []
        for name, array in zip(fetched, arrays):
            stats[name].update(array)
        for name in tensors:
            if name in inputs:
                stats[name].update(batch.feeds[name])
        del arrays
        if on_batch:
            on_batch(batch)
    return stats
