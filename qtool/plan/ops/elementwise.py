"""Binary elementwise ops: both inputs per tensor, output with its own range.

A constant operand (an Add's bias vector, a Sub's mean, HardSwish's "+ 3" and "* 1/6") is
stored quantized per tensor with its own range, as the LiteRT spec has every ADD/MUL input
int8, and so that onnxruntime fuses the op into QLinearAdd/QLinearMul instead of running
it in float between a DequantizeLinear and a QuantizeLinear.
"""

from qtool.plan.ops.rule import OpRule

RULES = (
    OpRule("Add", activations=(0, 1), absorbs_activation=True, quantize_constants=True),
    OpRule("Sub", activations=(0, 1), quantize_constants=True),
    OpRule("Mul", activations=(0, 1), quantize_constants=True),
)
