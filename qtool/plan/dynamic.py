"""Which MatMul/Gemm run with dynamic int8 activations, and when `auto` chooses that.

A transformer's residual stream carries a few channels 10-100x larger than the rest, so one
static range either clips them or leaves the others a handful of codes. Quantizing each MatMul
input at run time (DynamicQuantizeLinear: min/max of that very tensor), with the weight int8 per
output column (or per tensor where measured lossless), keeps them; LayerNorm, Softmax, GELU, the
attention MatMuls of two activations and the residual adds stay float, as in onnxruntime's
quantize_dynamic. No calibrated range is needed. Figures: docs/accuracy.md, "Dynamic int8 MatMul".
"""

from __future__ import annotations

from collections import Counter
from typing import Optional

import onnx

from qtool.config import QuantizeConfig
from qtool.graph.index import GraphIndex, attribute
from qtool.plan.ops.blocks import ATTENTION_OPS, NORM_OPS
from qtool.targets import target_of

CONV_OPS = ("Conv", "ConvTranspose")
RECURRENT_OPS = ("LSTM", "GRU", "RNN")
LAYER_DOMAINS = ("", "ai.onnx", "com.microsoft")
STEM_RATIO = 2  # weighted MatMul/Gemm layers per Conv at least for `auto` to take dynamic


def matmul_strategy(model: onnx.ModelProto, ctx: GraphIndex, options: QuantizeConfig) -> tuple[str, Optional[str]]:
    """(static or dynamic, why `auto` chose dynamic; None when it was not `auto`'s choice to report).

    `auto` takes dynamic for a transformer or a recurrent net: a graph with a LayerNorm (the
    LayerNormalization op, RMSNormalization, or onnxruntime's fused Skip/Embed/Simplified forms),
    attention (a MatMul of two activations, or an Attention op: ONNX's or onnxruntime's fused
    ones) or an LSTM/GRU/RNN, MatMul/Gemm layers with a constant weight (a single Gemm after
    recurrent layers included), and at most one Conv per `STEM_RATIO` of them: Convs that are only
    a stem or a head (a speech encoder's Conv1d front end, a ViT's patch embedding) stay float under
    dynamic. A Conv net with attention blocks keeps static int8 for its Convs; dynamic int8 is
    measured on onnxruntime CPU only, so a target without
    Target.dynamic_matmul keeps static."""
    if options.matmul != "auto":
        return options.matmul, None
    if not target_of(options).dynamic_matmul:
        return "static", None
    ops = [n for n in model.graph.node if n.domain in ("", "ai.onnx")]
    layers = [n for n in model.graph.node if n.domain in LAYER_DOMAINS]
    matmuls = sum(weighted_matmul(n, ctx) for n in ops)
    weighted = matmuls + sum(fused_attention(n, ctx) for n in layers)
    convs = sum(n.op_type in CONV_OPS for n in ops)
    if not weighted or convs * STEM_RATIO > weighted:
        return "static", None
    fused = Counter(n.op_type for n in layers if n.op_type in NORM_OPS + ATTENTION_OPS)
    attention = sum(_attention_matmul(n, ctx) for n in ops)
    recurrent = sum(n.op_type in RECURRENT_OPS for n in ops)
    if not fused and not attention and not recurrent:
        return "static", None
    found = ", ".join([f"{count} {op}" for op, count in sorted(fused.items(), key=lambda kv: kv[0] not in NORM_OPS)]
                      + [f"{count} {what}" for count, what in ((attention, "MatMul(s) of two activations"),
                                                               (recurrent, "recurrent layer(s)")) if count])
    stem = f"{convs} Conv kept float" if convs else "no Conv"
    return "dynamic", (f"MatMul/Gemm with constant weights quantized dynamically (int8 weights, "
                       f"activations quantized at run time; every other node float): the graph has attention, "
                       f"LayerNorm or recurrent blocks ({found}, {matmuls} weighted MatMul/Gemm, {stem}), whose "
                       f"activation outliers one static range cannot hold (--matmul static to override)")


def weighted_matmul(node: onnx.NodeProto, ctx: GraphIndex) -> bool:
    """A MatMul or plain Gemm (no transA, alpha = beta = 1) of a float activation by a 2-D float
    weight initializer: the form DynamicQuantizeLinear + MatMulInteger computes."""
    if node.domain not in ("", "ai.onnx") or node.op_type not in ("MatMul", "Gemm") or len(node.input) < 2:
        return False
    data, weight = node.input[0], node.input[1]
    if (weight not in ctx.initializers or not ctx.is_float(weight) or ctx.rank(weight) != 2
            or ctx.is_constant(data) or not ctx.is_float(data)):
        return False
    if node.op_type == "Gemm":
        return (not attribute(node, "transA", 0) and attribute(node, "alpha", 1.0) == 1.0
                and attribute(node, "beta", 1.0) == 1.0)
    return True


# com.microsoft Attention inputs and attributes QAttention takes too (input 3 the mask; past,
# attention bias and past length have no int8 form, nor Q/K/V of different widths)
ATTENTION_INPUTS = 4
QATTENTION_ATTRIBUTES = ("num_heads", "unidirectional", "mask_filter_value", "scale")


def fused_attention(node: onnx.NodeProto, ctx: GraphIndex) -> bool:
    """onnxruntime's com.microsoft Attention with its Q/K/V projection weight a 2-D float
    initializer [hidden, 3 x hidden] and a bias, no past state, attention bias or rotary embedding:
    what com.microsoft QAttention computes with DynamicQuantizeLinear's codes of its input (the
    onnxruntime transformer optimizer's BERT attention)."""
    if node.domain != "com.microsoft" or node.op_type != "Attention" or len(node.input) < 3:
        return False
    data, weight, bias = node.input[:3]
    return (weight in ctx.initializers and ctx.is_float(weight) and ctx.rank(weight) == 2
            and bias in ctx.initializers and ctx.is_float(bias) and not ctx.is_constant(data)
            and ctx.is_float(data) and not any(node.input[ATTENTION_INPUTS:])
            and not any(node.output[1:]) and all(a.name in QATTENTION_ATTRIBUTES for a in node.attribute))


def dynamic_layer(node: onnx.NodeProto, ctx: GraphIndex) -> bool:
    """A node `--matmul dynamic` quantizes: a weighted MatMul/Gemm or a fused attention."""
    return weighted_matmul(node, ctx) or fused_attention(node, ctx)


def _attention_matmul(node: onnx.NodeProto, ctx: GraphIndex) -> bool:
    return (node.op_type == "MatMul" and len(node.input) == 2
            and not any(ctx.is_constant(name) for name in node.input))
