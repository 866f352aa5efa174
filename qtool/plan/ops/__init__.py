"""Per-op quantization rules: a registry from ONNX op type to what quantizing it means.

Shaped like onnx's reference evaluator (one small module per operator family, a
registry mapping op type to implementation): the planner asks the rule of each node
which inputs carry activations (int8 per tensor), which input is a weight (int8 per
output channel, and on which axis), which is a bias (int32), and what the output's
quantization parameters are:

- "own":   the output gets its own calibrated range (Conv, Add, Relu, ...);
- "tie":   the output keeps its input's scale and zero point, because the op only
           moves or selects values (MaxPool, Reshape, Transpose, Concat, ...) and a
           requantization there would cost time and accuracy for nothing;
- "fixed": the output range is fixed by the op's math (Softmax/Sigmoid: [0, 1),
           Tanh: [-1, 1)), as the LiteRT int8 spec prescribes.

A weight-only rule (`kernel`) is different: the op becomes a runtime kernel that takes int8
weights and quantizes its activations itself while it runs (onnxruntime's DynamicQuantizeLSTM),
so it gets no Q/DQ and no calibration; only its weights are planned. On a target whose runtime
lacks the kernel (Target.kernels) the node stays float with a note that says so (GRU's kernel
is on no target: its rule only records why it is never int8).

An op type that has no rule stays in float; the planner puts DequantizeLinear /
QuantizeLinear at its boundary only where its neighbours are quantized.

A block rule (`BlockRule`) recognises a chain of nodes that together compute one higher-level
op (a LayerNorm written as ReduceMean-Sub-Pow-..., a GELU, attention scores): its nodes stay
float whatever their own op rules say, and the tensors it names are never quantized (a mask
of -1e4), because rounding inside the chain costs more than the int8 kernels save
(qtool.plan.ops.blocks).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterable, Optional

import onnx

from qtool.graph.index import node_label

# (scale, zero point) of a fixed-range output, by activation dtype.
FixedParams = Callable[[str], tuple[float, int]]


@dataclass(frozen=True)
class OpRule:
    op_type: str
    # Input indices quantized per tensor as activations. None: every input.
    activations: Optional[tuple[int, ...]] = (0,)
    # Index of the weight input (quantized per output channel when it is a constant).
    weight: Optional[int] = None
    # Output-channel axis of the weight, from the node's attributes and the weight's rank.
    weight_axis: Optional[Callable[[onnx.NodeProto, int], int]] = None
    # Index of the bias input, quantized to int32 with scale s_input * s_weight.
    bias: Optional[int] = None
    output: str = "own"  # "own" | "tie" | "fixed"
    fixed: Optional[FixedParams] = None
    # A compute op whose output may flow straight into a following activation (Conv -> Relu):
    # runtimes fuse the pair, so no Q/DQ belongs between them.
    absorbs_activation: bool = False
    # A weighted op whose integer kernel can also write float (onnxruntime's QGemm and
    # MatMulIntegerToFloat, TensorRT's layers): an output it delivers to the graph's outputs needs
    # no Q/DQ. Conv's kernel writes int8 only, so its output keeps them.
    float_output: bool = False
    # An activation that a preceding compute op can absorb (Relu, Clip).
    fusable_activation: bool = False
    # Extra condition on the node (e.g. Clip with constant bounds only).
    applies: Optional[Callable[[onnx.NodeProto, "object"], bool]] = None
    # Constant float operands among `activations` are stored quantized per tensor like an
    # activation (Add's bias vector, HardSwish's "+ 3"): onnxruntime fuses DQ -> Add -> Q into
    # QLinearAdd only when every input comes from a DequantizeLinear.
    quantize_constants: bool = False
    # Weight-only op: the runtime kernel it becomes (its domain's op type), and the indices of the
    # constant weights stored int8 for it. `activations` is () for such a rule. On a target whose
    # runtime lacks the kernel (not in Target.kernels), or where `applies` rejects the node, it
    # stays float and the user is told why: `unsupported` says what the kernel cannot take.
    kernel: Optional[str] = None
    kernel_weights: tuple[int, ...] = ()
    unsupported: str = ""


RULES: dict[str, OpRule] = {}


@dataclass(frozen=True)
class BlockRule:
    name: str
    # Every occurrence in the graph: the nodes kept float.
    match: Callable[["object"], Iterable[list[onnx.NodeProto]]]
    # Tensors no quantized op may give a range to (a mask's -1e4), whoever reads them.
    never_quantized: Optional[Callable[["object"], set[str]]] = None


BLOCKS: list[BlockRule] = []


@dataclass(frozen=True)
class FloatBlocks:
    """What the block rules found in one graph."""
    nodes: dict[str, str]  # node label -> the block that keeps it float
    tensors: frozenset[str]  # never quantized
    counts: dict[str, int]  # block name -> occurrences


def register_block(*rules: BlockRule) -> None:
    BLOCKS.extend(rules)


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


def register(*rules: OpRule) -> None:
    for rule in rules:
        RULES[rule.op_type] = rule


def rule_for(op_type: str, domain: str = "") -> Optional[OpRule]:
    if domain not in ("", "ai.onnx"):
        return None
    return RULES.get(op_type)


# Importing the rule modules fills RULES.
from qtool.plan.ops import (activations, blocks, conv, elementwise, gemm, matmul, pad, pooling,  # noqa: E402,F401
                       recurrent, resize, shape_ops, softmax)
