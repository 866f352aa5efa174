"""Early saturation: tensors whose extremes can no longer change stop having them reduced.

A tensor bounded by construction (the output of a Clip with constant bounds [lo, hi],
ReLU6 being [0, 6]) can never hold a value below lo or above hi. Once its observed
extremes have reached both bounds, no later batch can move its min or its max, so the
observer may stop reducing them: on EfficientNet-Lite0 the 33 ReLU6 outputs, ~85% of the
observed activation bytes, reach 6.0 in the first batch of 8 photos. onnxruntime computes
every node of a session whatever outputs are requested, so the observer drops the
reductions by building a new session (~0.07 s for EfficientNet-Lite0), and only when the
saturated tensors hold a large share of the bytes it still reads (see `worth_rebuilding`).

* plain min-max (no histogram): nothing of the tensor is computed any more.
* the histogram methods (percentile, entropy, mse, aciq): its GlobalMaxPool/ReduceMin go,
  its strided sample stays (for a non-negative 4-D tensor the cheap 1x1 MaxPool grid on
  the NCHWc layout), so the histogram receives exactly the same values, and its count
  grows exactly as before, computed from the sample source's size; only tensors whose
  dims other than the batch are static qualify (`static`). Their extremes are the bounds
  (a non-negative tensor's min is recorded as 0 either way), so tables are byte-identical.

Valid only where nothing but the overall extremes (and the histogram) is used: not for the
averaged (moving_average) min-max, which needs every batch's extremes (`saturable`). What a
saturated tensor's statistics no longer track: the per-batch extremes sums (each batch then
adds the bounds), for plain min-max its `count` and `batches` (they stop at the values
seen until it saturated: nothing reads `count` but `seen`), and NaN/Inf appearing in it
afterwards are not counted (a saturated histogram tensor's sample may then hold them: the
range methods ignore non-finite keys). Shard files, which a later merge may give any
method, are never saturated.
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
