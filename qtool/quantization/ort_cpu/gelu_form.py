"""Erf-GELUs computed in float between int8 tensors, written as onnxruntime's Gelu (ort-cpu).

A GELU written out as x * 0.5 * (1 + erf(x / sqrt 2)) stays float in the int8 model (its block
rule, qtool.plan.ops.blocks). onnxruntime fuses such a chain into one Gelu kernel, but not when x
is a DequantizeLinear output: before its fusions it gives every reader of a DequantizeLinear a copy
of its own (so that each QDQ node group has one), and the chain's two reads of x then come from
two tensors, which the fusion does not match; nor when x is an int8 MatMul's or Gemm's float output
and the chain scales x by 1/sqrt 2 (the front end's Div -> Mul). The five float ops then run one by one, which can
make the int8 model slower than fp32. Written as the com.microsoft Gelu op, the chain runs as in
the fp32 model, with the same values up to float32 rounding. A kernel form of the quantized model,
written last (quantize's `kernel_forms`). Figures: docs/targets.md, "Fusion-aware placement".
"""

from __future__ import annotations

import math

import onnx
from onnx import helper

from qtool.graph.edit import drop_unread
from qtool.graph.index import GraphIndex, replace_nodes
from qtool.plan.ops.blocks import gelu_chains

MS_DOMAIN = "com.microsoft"
NOTE = ("{} GELU(s) written out with Erf and computed in float after a DequantizeLinear or an int8 MatMul/Gemm "
        "written as onnxruntime's Gelu op, which it otherwise cannot fuse there: one float kernel instead of five")


def _close(value, target: float) -> bool:
    return value is not None and math.isclose(value, target, rel_tol=1e-6)


def _exact_gelu(index: GraphIndex, chain: list[onnx.NodeProto]) -> bool:
    """Whether the chain is x / sqrt 2 (or x * 1/sqrt 2) -> Erf -> Add 1 -> one product with x and
    one with 0.5, its inner tensors read by the chain alone."""
    scale, erf, tail = chain[0], chain[1], chain[2:]
    x = scale.input[0]
    if erf.op_type != "Erf" or len(tail) != 3 or any(n.op_type != "Mul" for n in tail[1:]):
        return False
    factor = index.scalar(scale.input[1])
    if not (_close(factor, math.sqrt(2.0)) if scale.op_type == "Div" else _close(factor, math.sqrt(0.5))):
        return False
    inner = {n.output[0] for n in chain[:-1]}
    others = [i for n in tail[1:] for i in n.input if i not in inner]  # x and the 0.5, in any order
    if len(others) != 2 or x not in others or not _close(index.scalar(next(i for i in others if i != x)), 0.5):
        return False
    chain_nodes = {id(n) for n in chain}
    return all(name not in index.outputs and all(id(r) in chain_nodes for r in index.consumers.get(name, []))
               for name in inner)


def fused_gelus(model: onnx.ModelProto) -> int:
    """In place: each float Erf-GELU whose input a DequantizeLinear writes, or an int8 MatMul/Gemm (one
    that reads a DequantizeLinear) writes in float, becomes one com.microsoft Gelu node (module doc);
    the number rewritten."""
    index = GraphIndex(model)

    def after_int8(name: str) -> bool:
        source = index.producer.get(name)
        if source is None:
            return False
        if source.op_type == "DequantizeLinear":
            return True
        reads = index.producer.get(source.input[0]) if source.input else None
        return source.op_type in ("MatMul", "Gemm") and reads is not None and reads.op_type == "DequantizeLinear"

    chains = [chain for chain in gelu_chains(index) if after_int8(chain[0].input[0]) and _exact_gelu(index, chain)]
    if not chains:
        return 0
    first = {id(chain[0]): chain for chain in chains}
    dropped = {id(n) for chain in chains for n in chain}
    keep = []
    for node in model.graph.node:
        chain = first.get(id(node))
        if chain is not None:
            keep.append(helper.make_node("Gelu", [chain[0].input[0]], [chain[-1].output[0]],
                                         name=(chain[-1].name or chain[-1].output[0]) + "_gelu", domain=MS_DOMAIN))
        elif id(node) not in dropped:
            keep.append(node)
    replace_nodes(model.graph, keep)
    drop_unread(model.graph)
    if not any(o.domain == MS_DOMAIN for o in model.opset_import):
        model.opset_import.append(helper.make_opsetid(MS_DOMAIN, 1))
    return len(chains)
