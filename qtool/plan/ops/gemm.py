"""Gemm: Y = alpha * A' B' + beta * C. The weight B's output axis depends on transB."""

from qtool.graph.index import attribute
from qtool.plan.ops.rule import OpRule


def _gemm_axis(node, rank: int) -> int:
    # B is (N, K) when transB = 1, else (K, N); the output channels are N.
    return 0 if attribute(node, "transB", 0) else 1


def _plain_gemm(node, ctx) -> bool:
    # transA would put the batch on the wrong axis of A; keep such Gemms float.
    return not attribute(node, "transA", 0)


RULES = (OpRule("Gemm", activations=(0,), weight=1, weight_axis=_gemm_axis, bias=2,
                absorbs_activation=True, float_output=True, applies=_plain_gemm),)
