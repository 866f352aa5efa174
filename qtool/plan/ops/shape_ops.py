"""Ops that only move or select values: the output keeps the input's quantization parameters.

Only the data input (index 0) is an activation; shape, axes, indices, pads and starts
inputs are int64. Concat ties all of its inputs and its output to one scale, as the LiteRT
spec requires; Split ties all of its outputs to its input. Gather selects along an axis
of a quantized data tensor; a constant table (an embedding) is no activation: the planner
may store it int8 per row, weight-only (planner._embedding_tables).
"""

from qtool.plan.ops.rule import OpRule

_MOVERS = ("Reshape", "Flatten", "Squeeze", "Unsqueeze", "Transpose", "Slice", "Gather", "Split")

RULES = (
    *(OpRule(op, activations=(0,), output="tie") for op in _MOVERS),
    OpRule("Concat", activations=None, output="tie"),
)
