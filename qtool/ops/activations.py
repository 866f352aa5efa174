"""Pointwise activations.

Relu and Clip with constant bounds can be absorbed by the compute op before them:
the runtime clamps while requantizing, so the pair shares one output range.
Sigmoid's output is fixed to [0, 1) per the LiteRT spec (scale 1/256).
"""

from qtool.ops import OpRule, register


def _constant_bounds(node, ctx) -> bool:
    # Clip's bounds are inputs since opset 11; a computed bound cannot be folded in.
    return all(not name or ctx.is_constant(name) for name in node.input[1:])


def _sigmoid_params(dtype: str) -> tuple[float, int]:
    return 1.0 / 256.0, (-128 if dtype == "int8" else 0)


register(
    OpRule("Relu", fusable_activation=True),
    OpRule("Clip", fusable_activation=True, applies=_constant_bounds),
    OpRule("Sigmoid", output="fixed", fixed=_sigmoid_params),
)
