"""Running calibration data through the fp32 graph and summarising the tensors the plan needs.

Reducing inside the graph. Fetching ~60 full activations per batch as extra session
outputs costs more than the inference itself (onnxruntime copies each one out, cannot
reuse its buffers, and must convert each from its blocked NCHWc layout), and numpy then
reads each twice more for its min and max. So the observer adds, for each observed
tensor, a few nodes to a copy of the model:

    Reshape(t, [-1]) -> ReduceMin, ReduceMax, Size      exact extremes and count, as scalars
                     -> Slice(step = s - s % 2 + 1, s = Size // K)
                                                         a strided sample of ~K values (K/2..2K),
                                                         only for tensors whose method needs
                                                         a histogram

onnxruntime's C++ kernels do the reductions in the same single pass as the real
outputs; Python receives a few scalars and bounded samples per tensor and batch, and
folds them into fixed-size summaries (qtool.statistics) before the next batch. The
odd step keeps the sample from locking onto one channel or column of a power-of-two
layout. A batch whose extremes are not finite (NaN/Inf) is re-run with the offending
tensors exposed whole so their non-finite values can be counted and excluded exactly.
"""

from __future__ import annotations

from typing import Callable, Collection, Iterable, Optional

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from qtool.dataset import Batch
from qtool.runtime import create_session
from qtool.statistics import SAMPLE_LIMIT, TensorStats

_PREFIX = "qtool_observe"


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


def _elem_types(model: onnx.ModelProto) -> dict[str, int]:
    graph = model.graph
    return {v.name: v.type.tensor_type.elem_type for v in [*graph.value_info, *graph.output, *graph.input]}


def with_reductions(model: onnx.ModelProto, names: list[str], sampled: Collection[str],
                    sample_limit: int) -> tuple[onnx.ModelProto, dict[str, tuple[str, ...]]]:
    """A copy of `model` that outputs, per tensor, (min, max, size[, sample]) as described above."""
    reduced = onnx.ModelProto()
    reduced.CopyFrom(model)
    graph = reduced.graph
    types = _elem_types(model)
    flat, limit, two, one = (f"{_PREFIX}_flat", f"{_PREFIX}_limit", f"{_PREFIX}_two", f"{_PREFIX}_one")
    graph.initializer.extend([numpy_helper.from_array(np.array([-1], np.int64), flat),
                              numpy_helper.from_array(np.array(sample_limit, np.int64), limit),
                              numpy_helper.from_array(np.array(2, np.int64), two),
                              numpy_helper.from_array(np.array([1], np.int64), one),
                              numpy_helper.from_array(np.array([0], np.int64), f"{_PREFIX}_zero"),
                              numpy_helper.from_array(np.array([np.iinfo(np.int64).max], np.int64),
                                                      f"{_PREFIX}_end")])
    outputs: dict[str, tuple[str, ...]] = {}
    for i, name in enumerate(names):
        p = f"{_PREFIX}_{i}"
        elem = types.get(name, TensorProto.FLOAT) or TensorProto.FLOAT
        nodes = [helper.make_node("Reshape", [name, flat], [f"{p}_flat"], name=f"{p}_reshape"),
                 helper.make_node("ReduceMin", [f"{p}_flat"], [f"{p}_min"], keepdims=0, name=f"{p}_min"),
                 helper.make_node("ReduceMax", [f"{p}_flat"], [f"{p}_max"], keepdims=0, name=f"{p}_max"),
                 helper.make_node("Size", [f"{p}_flat"], [f"{p}_size"], name=f"{p}_size")]
        outs = [helper.make_tensor_value_info(f"{p}_min", elem, []),
                helper.make_tensor_value_info(f"{p}_max", elem, []),
                helper.make_tensor_value_info(f"{p}_size", TensorProto.INT64, [])]
        if name in sampled:
            nodes += [helper.make_node("Div", [f"{p}_size", limit], [f"{p}_s"], name=f"{p}_div"),
                      helper.make_node("Mod", [f"{p}_s", two], [f"{p}_odd"], name=f"{p}_mod"),
                      helper.make_node("Sub", [f"{p}_s", f"{p}_odd"], [f"{p}_even"], name=f"{p}_sub"),
                      helper.make_node("Add", [f"{p}_even", one], [f"{p}_step"], name=f"{p}_step"),
                      helper.make_node("Slice", [f"{p}_flat", f"{_PREFIX}_zero", f"{_PREFIX}_end",
                                                 f"{_PREFIX}_zero", f"{p}_step"], [f"{p}_sample"],
                                       name=f"{p}_slice")]
            outs.append(helper.make_tensor_value_info(f"{p}_sample", elem, [None]))
        graph.node.extend(nodes)
        graph.output.extend(outs)
        outputs[name] = tuple(o.name for o in outs)
    return reduced, outputs


def observe(model: onnx.ModelProto, tensors: list[str], batches: Iterable[Batch],
            histogram_for: Collection[str] = (), threads: int = 0,
            on_batch: Optional[Callable[[Batch], None]] = None,
            sample_limit: int = SAMPLE_LIMIT) -> dict[str, TensorStats]:
    """One pass over `batches`; returns a summary per tensor (with a histogram for `histogram_for`)."""
    inputs = {i.name for i in model.graph.input}
    fetched = [t for t in tensors if t not in inputs]  # graph inputs are read from the feeds
    reduced, outputs = with_reductions(model, fetched, set(histogram_for), sample_limit)
    session = create_session(reduced, threads)
    names = [o for t in fetched for o in outputs[t]]
    fallback = None
    stats = {t: TensorStats.with_histogram() if t in histogram_for else TensorStats() for t in tensors}
    for s in stats.values():
        s.sample_limit = sample_limit  # the same stride for graph inputs, sampled in numpy
    for batch in batches:
        values = dict(zip(names, session.run(names, batch.feeds))) if fetched else {}
        bad = []
        for name in fetched:
            out = outputs[name]
            size = int(values[out[2]])
            if size == 0:
                continue
            lo, hi = float(values[out[0]]), float(values[out[1]])
            if not (np.isfinite(lo) and np.isfinite(hi)):
                bad.append(name)
                continue
            stats[name].add_extremes(lo, hi, size)
            if len(out) > 3:
                stats[name].add_sample(values[out[3]])
        if bad:  # rare: NaN/Inf in this batch; count and exclude them exactly from the full tensors
            fallback = fallback or create_session(with_outputs(model, fetched), threads)
            for name, array in zip(bad, fallback.run(bad, batch.feeds)):
                stats[name].update(array)
        for name in tensors:
            if name in inputs:
                stats[name].update(batch.feeds[name])
        del values
        if on_batch:
            on_batch(batch)
    for s in stats.values():
        s.flush()
    return stats
