"""Binary elementwise ops: both inputs per tensor, output with its own range.

A constant operand (an Add's bias vector, a Sub's mean) stays float: the planner
quantizes only the non-constant inputs.
"""

from qtool.ops import OpRule, register

register(
    OpRule("Add", activations=(0, 1), absorbs_activation=True),
    OpRule("Sub", activations=(0, 1)),
    OpRule("Mul", activations=(0, 1)),
)
