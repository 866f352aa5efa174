"""Gemm: Y = alpha * A' B' + beta * C. The weight B's output axis depends on transB.

A is quantized per tensor, so transA changes nothing of its Q/DQ: onnxruntime's QGemm takes
transA, alpha and beta (beta != 1 only keeps C float: the planner's int32 bias needs alpha = beta = 1)."""

from qtool.graph.index import attribute
from qtool.plan.ops.rule import OpRule


def _gemm_axis(node, rank: int) -> int:
    # B is (N, K) when transB = 1, else (K, N); the output channels are N.
    return 0 if attribute(node, "transB", 0) else 1


RULES = (OpRule("Gemm", activations=(0,), weight=1, weight_axis=_gemm_axis, bias=2,
                absorbs_activation=True, float_output=True),)
