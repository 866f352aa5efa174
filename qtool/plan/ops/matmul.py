"""MatMul: a constant B is a weight, per output column (its last axis); a
non-constant B is an activation quantized per tensor like A. A constant B of rank above 2 (one
matrix per batch) is per tensor: a per-column scale of it is a 1-D scale against an N-D B, which
onnxruntime's integer MatMul refuses ("b zero point is not valid")."""

from qtool.plan.ops.rule import OpRule

RULES = (OpRule("MatMul", activations=(0, 1), weight=1, weight_axis=lambda node, rank: 1 if rank == 2 else None,
                absorbs_activation=True, float_output=True),)
