"""Pointwise activations.

Relu and Clip with constant bounds can be absorbed by the compute op before them:
the runtime clamps while requantizing, so the pair shares one output range.
Sigmoid's output is fixed to [0, 1) per the LiteRT spec (scale 1/256, zero point -128
int8 / 0 uint8), Tanh's to [-1, 1) (scale 1/128, zero point 0 int8 / 128 uint8).
LeakyRelu, PRelu, HardSigmoid and HardSwish compute new values: their own range.
PRelu's slope stays a float constant (it is tiny and per channel; int8 would only lose
precision, and onnxruntime runs the op in float between DQ and Q either way).
"""

from qtool.plan.ops.rule import OpRule


def _constant_bounds(node, ctx) -> bool:
    # Clip's bounds are inputs since opset 11; a computed bound cannot be folded in.
    return all(not name or ctx.is_constant(name) for name in node.input[1:])


def _sigmoid_params(dtype: str) -> tuple[float, int]:
    return 1.0 / 256.0, (-128 if dtype == "int8" else 0)


def _tanh_params(dtype: str) -> tuple[float, int]:
    return 1.0 / 128.0, (0 if dtype == "int8" else 128)


RULES = (
    OpRule("Relu", fusable_activation=True),
    OpRule("Clip", fusable_activation=True, applies=_constant_bounds),
    OpRule("Sigmoid", output="fixed", fixed=_sigmoid_params),
    OpRule("Tanh", output="fixed", fixed=_tanh_params),
    OpRule("LeakyRelu"),
    OpRule("PRelu", activations=(0,)),
    OpRule("HardSigmoid"),
    OpRule("HardSwish"),
)
