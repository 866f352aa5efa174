"""Per-op quantization rules: a registry from ONNX op type to what quantizing it means.

Like onnx's reference evaluator, one small module per operator family lists its rules (`RULES`);
this package joins them below, in one visible list. The planner asks a node's rule which inputs are
activations (int8 per tensor), which is a weight (int8 per output channel), which a bias (int32),
and how its output gets its range (qtool.plan.ops.rule.OpRule). An op type without a rule stays
float; Q/DQ go at its boundary only where its neighbours are quantized. A block rule keeps a chain
of nodes float as a whole (a decomposed LayerNorm, a GELU, attention scores), because rounding
inside the chain costs more than the int8 kernels save (qtool.plan.ops.blocks).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from qtool.graph.index import node_label
from qtool.plan.ops import (activations, blocks, conv, elementwise, gemm, matmul, pad, pooling, recurrent, resize,
                            shape_ops, softmax)
from qtool.plan.ops.rule import BlockRule, OpRule


def by_type(*rules: OpRule) -> dict[str, OpRule]:
    """The op rules keyed by op type; one rule per type."""
    table: dict[str, OpRule] = {}
    for rule in rules:
        if rule.op_type in table:
            raise ValueError(f"two op rules for {rule.op_type}")
        table[rule.op_type] = rule
    return table


RULES: dict[str, OpRule] = by_type(
    *activations.RULES, *conv.RULES, *elementwise.RULES, *gemm.RULES, *matmul.RULES, *pad.RULES, *pooling.RULES,
    *recurrent.RULES, *resize.RULES, *shape_ops.RULES, *softmax.RULES,
)

# Block rules, in the order they claim nodes (a node in two blocks is named after the first).
BLOCKS: tuple[BlockRule, ...] = blocks.RULES


@dataclass(frozen=True)
class FloatBlocks:
    """What the block rules found in one graph."""
    nodes: dict[str, str]  # node label -> the block that keeps it float
    tensors: frozenset[str]  # never quantized
    counts: dict[str, int]  # block name -> occurrences


def float_blocks(ctx) -> FloatBlocks:
    """Run every block rule over the graph (a GraphIndex)."""
    nodes: dict[str, str] = {}
    tensors: set[str] = set()
    counts: dict[str, int] = {}
    for rule in BLOCKS:
        for chain in rule.match(ctx):
            counts[rule.name] = counts.get(rule.name, 0) + 1
            for node in chain:
                nodes.setdefault(node_label(node), rule.name)
        if rule.never_quantized is not None:
            tensors |= rule.never_quantized(ctx)
    return FloatBlocks(nodes, frozenset(tensors), counts)


def rule_for(op_type: str, domain: str = "") -> Optional[OpRule]:
    if domain not in ("", "ai.onnx"):
        return None
    return RULES.get(op_type)
