"""Early saturation: tensors whose extremes can no longer change stop having them reduced.

A Clip output with constant bounds [lo, hi] (ReLU6: [0, 6]) cannot leave them, so once its observed
extremes reach both, no later batch can move its min or max. onnxruntime computes every node of a
session whatever outputs are fetched, so the observer drops those reductions by building a new
session, when the saturated tensors hold a large share of the bytes it reads (`worth_rebuilding`).
Plain min-max then computes nothing of the tensor; the histogram methods keep its strided sample
and exact count (`static` dims only). Tables stay byte-identical. Not for the moving-average
min-max, which needs every batch's extremes (`saturable`), nor for shard files, which a later
merge may give any method. What a saturated tensor no longer tracks: docs/design/observer.md.
"""

from __future__ import annotations

import onnx
from onnx import numpy_helper

from qtool.config import CalibrationConfig

MAX_REBUILDS = 2  # sessions built after the first one: each costs about one batch of inference
MIN_SHARE = 0.25  # rebuild only when the newly saturated tensors hold this share of the observed bytes


def _constants(model: onnx.ModelProto) -> dict[str, float]:
    found = {}
    for t in model.graph.initializer:
        if len(t.dims) == 0 or (len(t.dims) == 1 and t.dims[0] == 1):
            found[t.name] = float(numpy_helper.to_array(t).reshape(-1)[0])
    for node in model.graph.node:
        if node.op_type == "Constant" and node.attribute and node.attribute[0].name == "value":
            t = node.attribute[0].t
            if len(t.dims) == 0 or (len(t.dims) == 1 and t.dims[0] == 1):
                found[node.output[0]] = float(numpy_helper.to_array(t).reshape(-1)[0])
    return found


def bounds(model: onnx.ModelProto) -> dict[str, tuple[float, float]]:
    """Tensors with constant bounds [lo, hi] by construction: outputs of Clip with a constant min and max."""
    constants = _constants(model)
    found = {}
    for node in model.graph.node:
        if node.op_type != "Clip":
            continue
        lo = constants.get(node.input[1]) if len(node.input) > 1 and node.input[1] else None
        hi = constants.get(node.input[2]) if len(node.input) > 2 and node.input[2] else None
        for attr in node.attribute:  # opset < 11
            if attr.name == "min":
                lo = attr.f
            elif attr.name == "max":
                hi = attr.f
        if lo is not None and hi is not None and lo <= hi:
            found[node.output[0]] = (lo, hi)
    return found


def saturable(methods: dict[str, str], calib: CalibrationConfig) -> set[str]:
    """The tensors whose table entry depends on nothing but their overall extremes and, for the
    histogram methods, their histogram: every tensor but those of the averaged min-max."""
    return {name for name, method in methods.items() if method != "minmax" or not calib.moving_average}


def static(dims) -> bool:
    """Whether a tensor's dims other than the batch are all known (a sampled tensor's count
    per batch is then exact from its sample's size)."""
    return dims is not None and len(dims) >= 1 and all(d for d in dims[1:])


def saturated(lo_seen: float, hi_seen: float, bound: tuple[float, float]) -> bool:
    """True once the observed extremes reach both bounds (the observed min of a non-negative
    tensor whose minimum is not reduced is recorded as 0, its true low end)."""
    return lo_seen <= bound[0] and hi_seen >= bound[1]


def worth_rebuilding(dropped: int, observed: int, rebuilds: int) -> bool:
    """Rebuild the observing session when the newly saturated tensors hold at least MIN_SHARE
    of the bytes (per sample) it reduces, at most MAX_REBUILDS times."""
    return rebuilds < MAX_REBUILDS and observed > 0 and dropped >= MIN_SHARE * observed
