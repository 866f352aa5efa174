"""Merge the MatMuls that read one activation into one MatMul and a Split (BERT's Q, K, V).

    x -> MatMul(W_q) [-> Add(b_q)]         x -> MatMul([W_q | W_k | W_v]) [-> Add([b_q | b_k | b_v])]
    x -> MatMul(W_k) [-> Add(b_k)]   ==>     -> Split(last axis, [N_q, N_k, N_v]) -> q, k, v
    x -> MatMul(W_v) [-> Add(b_v)]

Exact in fp32 up to summation order. Run where MatMuls are quantized dynamically
(qtool.plan.dynamic): onnxruntime pays a fixed cost per DynamicQuantizeMatMul call, so one GEMM
runs faster than three, and the per-column weight scales keep the numbers the same. Left alone:
MatMuls whose weight another node reads, whose output a graph output or a body reads, or excluded.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Collection, Optional

import numpy as np
import onnx
from onnx import helper, numpy_helper

from qtool.graph.index import GraphIndex, body_reads, default_opset, keep_initializers, node_label, replace_nodes

MERGED_SUFFIX = "_merged"
SPLIT_INPUT_OPSET = 13  # Split takes its sizes as an input (older opsets are left alone: rare, and unmeasured)


@dataclass(frozen=True)
class _Member:
    matmul: onnx.NodeProto
    bias: Optional[onnx.NodeProto]  # the Add of a 1-D constant that alone reads the MatMul's output
    bias_input: str  # that constant's name ("" without bias)


def merge_shared_input_matmuls(model: onnx.ModelProto, keep: Collection[str] = ()) -> int:
    """Merge in place every group of two or more mergeable MatMuls of the main graph reading the
    same tensor; `keep`: node labels never merged. Returns the number of groups merged."""
    ctx = GraphIndex(model)
    in_bodies = set().union(*(body_reads(node) for node in model.graph.node))
    groups: dict[str, list[_Member]] = {}
    for node in model.graph.node:
        member = _member(node, ctx, keep, in_bodies)
        if member is not None:
            groups.setdefault(node.input[0], []).append(member)
    merged = [g for g in groups.values() if len(g) > 1]
    if not merged or default_opset(model) < SPLIT_INPUT_OPSET:
        return 0
    first_of = {id(g[0].matmul): g for g in merged}
    gone = {id(n) for g in merged for m in g for n in ((m.matmul, m.bias) if _biased(g) else (m.matmul,))}
    nodes: list[onnx.NodeProto] = []
    added: list[onnx.TensorProto] = []
    for node in model.graph.node:
        group = first_of.get(id(node))
        if group is not None:
            group_nodes, group_inits = _merge(group, ctx)
            nodes += group_nodes
            added += group_inits
        elif id(node) not in gone:
            nodes.append(node)
    replace_nodes(model.graph, nodes)
    replaced = {m.matmul.input[1] for g in merged for m in g}
    replaced |= {m.bias_input for g in merged if _biased(g) for m in g}
    keep_initializers(model.graph, lambda t: t.name not in replaced)
    model.graph.initializer.extend(added)
    return len(merged)


def _member(node: onnx.NodeProto, ctx: GraphIndex, keep: Collection[str],
            in_bodies: set[str]) -> Optional[_Member]:
    """`node` as a mergeable MatMul of a float activation by its own 2-D float weight, or None.
    `in_bodies`: names If/Loop/Scan bodies read, which must keep their producers."""
    if (node.op_type != "MatMul" or node.domain not in ("", "ai.onnx") or len(node.input) != 2
            or node_label(node) in keep):
        return None
    data, weight = node.input
    if (ctx.is_constant(data) or not ctx.is_float(data) or weight not in ctx.initializers
            or not ctx.is_float(weight) or ctx.rank(weight) != 2 or len(ctx.consumers.get(weight, [])) != 1
            or node.output[0] in ctx.outputs or {weight, node.output[0]} & in_bodies):
        return None
    add = ctx.only_consumer(node.output[0])
    if add is None or add.op_type != "Add" or add.domain not in ("", "ai.onnx") or len(add.input) != 2:
        return _Member(node, None, "")
    bias = add.input[1] if add.input[0] == node.output[0] else add.input[0]
    columns = ctx.initializers[weight].dims[1]
    if (bias in ctx.initializers and ctx.is_float(bias) and list(ctx.initializers[bias].dims) == [columns]
            and len(ctx.consumers.get(bias, [])) == 1 and bias not in in_bodies):
        return _Member(node, add, bias)
    return _Member(node, None, "")


def _biased(group: list[_Member]) -> bool:
    """The Adds merge too when every member has one; otherwise they stay, reading the Split."""
    return all(m.bias is not None for m in group)


def _merge(group: list[_Member], ctx: GraphIndex) -> tuple[list[onnx.NodeProto], list[onnx.TensorProto]]:
    """The nodes and initializers replacing `group`, named after its first MatMul."""
    first = group[0].matmul
    label = node_label(first)
    weights = [ctx.const(m.matmul.input[1]) for m in group]
    widths = [w.shape[1] for w in weights]
    weight = numpy_helper.from_array(np.concatenate(weights, axis=1), first.input[1] + MERGED_SUFFIX)
    product = first.output[0] + MERGED_SUFFIX
    nodes = [helper.make_node("MatMul", [first.input[0], weight.name], [product], name=label + MERGED_SUFFIX)]
    inits = [weight]
    if _biased(group):
        bias = numpy_helper.from_array(np.concatenate([ctx.const(m.bias_input) for m in group]),
                                       group[0].bias_input + MERGED_SUFFIX)
        summed = group[0].bias.output[0] + MERGED_SUFFIX
        nodes.append(helper.make_node("Add", [product, bias.name], [summed],
                                      name=node_label(group[0].bias) + MERGED_SUFFIX))
        inits.append(bias)
        product, outputs = summed, [m.bias.output[0] for m in group]
    else:
        outputs = [m.matmul.output[0] for m in group]
    sizes = numpy_helper.from_array(np.array(widths, np.int64), label + "_split_sizes")
    nodes.append(helper.make_node("Split", [product, sizes.name], outputs, name=label + "_split", axis=-1))
    return nodes, inits + [sizes]
