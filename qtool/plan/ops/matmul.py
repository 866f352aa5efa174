"""MatMul: a constant B is a weight, per output column (its last axis); a
non-constant B is an activation quantized per tensor like A."""

from qtool.plan.ops.rule import OpRule

RULES = (OpRule("MatMul", activations=(0, 1), weight=1, weight_axis=lambda node, rank: rank - 1,
                absorbs_activation=True, float_output=True),)
