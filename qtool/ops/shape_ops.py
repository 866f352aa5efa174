"""Ops that only move values: the output keeps the input's quantization parameters.

Only the data input (index 0) is an activation; shape and axes inputs are int64.
Concat ties all of its inputs and its output to one scale, as the LiteRT spec requires.
"""

from qtool.ops import OpRule, register

register(
    *(OpRule(op, activations=(0,), output="tie") for op in ("Reshape", "Flatten", "Squeeze", "Unsqueeze", "Transpose")),
    OpRule("Concat", activations=None, output="tie"),
)
