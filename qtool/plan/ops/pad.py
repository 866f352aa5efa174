"""Pad: only moves values and adds a border, so the output keeps the input's scale and
zero point. A constant pad of real 0 is exactly the zero point (every range contains 0),
which is TPU-MLIR's rule for asymmetric Pad (fill with Z_x). A non-zero constant value
must be representable too: the planner widens the shared range to include it
(`pad_value`), so the border is not clipped."""

import numpy as np
from onnx import numpy_helper

from qtool.graph.index import attribute
from qtool.plan.ops.rule import OpRule


def pad_value(node, ctx) -> float:
    """The real value a constant-mode Pad writes (0 unless given); 0 for reflect/edge."""
    mode = attribute(node, "mode", b"constant")
    if (mode.decode() if isinstance(mode, bytes) else mode) != "constant":
        return 0.0
    if len(node.input) > 2 and node.input[2]:
        init = ctx.initializers.get(node.input[2])
        return float(numpy_helper.to_array(init).reshape(-1)[0]) if init is not None else float("nan")
    return float(attribute(node, "value", 0.0))  # opset < 11


def _known_value(node, ctx) -> bool:
    # A computed pad value cannot be placed in the range ahead of time: keep that Pad float.
    return bool(np.isfinite(pad_value(node, ctx)))


RULES = (OpRule("Pad", activations=(0,), output="tie", applies=_known_value),)
