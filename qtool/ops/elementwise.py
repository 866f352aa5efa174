"""Binary elementwise ops: both inputs per tensor, output with its own range."""

from qtool.ops import OpRule, register

register(
    OpRule("Add", activations=(0, 1), absorbs_activation=True),
    OpRule("Mul", activations=(0, 1)),
)
