"""Back end: put chosen layers of a finished int8 QDQ model back into float.

Mixed precision needs many variants of one quantized model that differ only in which
layers compute in float. Re-running the whole quantization for each (calibration table
lookup, adaptive rounding, bias correction of every later layer) is slow, and bias
correction re-measured on a different graph moves every later layer a little, so what a
search step measured would not quite be the next candidate. Instead the int8 model is
kept and only the chosen layers change:

    before:  DQ(x) ----------------> Conv(w: DQ(int8), b: DQ(int32)) -> [Clip] -> Q -> DQ
    after:   DQ(x) -> Max(., lowest) -> Conv(w: fp32,    b: fp32)      -> [Clip] -> Q -> DQ

The layer reads the same dequantized input and its output is quantized as before for
its int8 consumers, so every other layer computes exactly as in the int8 model; the
weight and bias are the prepared fp32 graph's own. A dynamic int8 MatMul/Gemm
(qtool.quantization.dynamic_matmul) becomes its fp32 node again, and its
DynamicQuantizeLinear goes when no other layer reads it. The Max is the identity guard of
qtool.rewrite.float_guard: without it onnxruntime's WeightBiasQuantization would
quantize the float weight again behind our back.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import onnx
from onnx import numpy_helper

from qtool.graph.index import GraphIndex, names_read, node_label
from qtool.plan.ops import rule_for
from qtool.quantization.dynamic_matmul import inner_tensors
from qtool.quantization.rewrite import float_guard

FLOAT_SUFFIX = "_fp32"


@dataclass(frozen=True)
class Restorable:
    """A layer of the int8 model whose constant weight (and bias) can go back to fp32."""

    node: str  # the compute node's label (name, or first output)
    slots: tuple[tuple[int, str], ...]  # (input index, fp32 initializer name in the prepared graph)


def restorable_layers(qmodel: onnx.ModelProto, prepared: onnx.ModelProto) -> dict[str, Restorable]:
    """The int8 layers whose weight comes out of a DequantizeLinear of a constant with the
    same shape as the prepared graph's fp32 weight. Layers rewritten after quantization
    (the SpaceToDepth stem, channel-padded first convs) have another weight shape and are
    left out, as are products of two activations (no constant to restore)."""
    fp32_nodes = {node_label(n): n for n in prepared.graph.node}
    fp32_inits = GraphIndex(prepared).initializers
    index = GraphIndex(qmodel)
    q_inits, producers = index.initializers, index.producer
    found = {}
    for node in qmodel.graph.node:
        rule = rule_for(node.op_type, node.domain)
        label = node_label(node)
        source = fp32_nodes.get(label)
        if node.op_type == "MatMulInteger" and source is not None and source.op_type in ("MatMul", "Gemm"):
            if len(source.input) > 1 and source.input[1] in fp32_inits:  # a dynamic int8 MatMul/Gemm
                found[label] = Restorable(label, ((1, source.input[1]),))
            continue
        if rule is None or rule.weight is None or source is None or source.op_type != node.op_type:
            continue
        slots = []
        for index in (rule.weight, rule.bias):
            if index is None or index >= len(node.input) or index >= len(source.input):
                continue
            dq = producers.get(node.input[index])
            fp32 = fp32_inits.get(source.input[index])
            if dq is None or dq.op_type != "DequantizeLinear" or fp32 is None or dq.input[0] not in q_inits:
                continue
            if list(q_inits[dq.input[0]].dims) != list(fp32.dims):
                continue
            slots.append((index, fp32.name))
        if slots and slots[0][0] == rule.weight:
            found[label] = Restorable(label, tuple(slots))
    return found


def restore_float(qmodel: onnx.ModelProto, prepared: onnx.ModelProto, layers: list[Restorable]) -> onnx.ModelProto:
    """A copy of `qmodel` in which `layers` compute in float (see the module doc)."""
    out = onnx.ModelProto()
    out.CopyFrom(qmodel)
    if not layers:
        return out
    graph = out.graph
    fp32_inits = GraphIndex(prepared).initializers
    by_label = {layer.node: layer for layer in layers}
    producers = GraphIndex(graph).producer
    existing = {t.name for t in graph.initializer}
    added: list[onnx.TensorProto] = []

    def add_init(array: np.ndarray, name: str) -> str:
        added.append(numpy_helper.from_array(array, name))
        return name

    fp32_nodes = {node_label(n): n for n in prepared.graph.node}
    q_ops = {node_label(n): n.op_type for n in graph.node}
    dynamic = {label: fp32_nodes[label] for label in by_label if q_ops.get(label) == "MatMulInteger"}
    replaced = {name for label, source in dynamic.items() for name in (*inner_tensors(label), *source.output)}
    nodes = []
    for node in graph.node:
        label = node_label(node)
        if label in dynamic and node.op_type == "MatMulInteger":
            # the DynamicQuantizeLinear -> MatMulInteger -> Cast -> Mul group back to the fp32 node
            node = onnx.NodeProto()
            node.CopyFrom(dynamic[label])
        elif any(o in replaced for o in node.output):
            continue
        layer = by_label.get(label)
        if layer is not None:
            for index, fp32_name in layer.slots:
                name = fp32_name + FLOAT_SUFFIX
                if name not in existing:
                    tensor = onnx.TensorProto()
                    tensor.CopyFrom(fp32_inits[fp32_name])
                    tensor.name = name
                    added.append(tensor)
                    existing.add(name)
                node.input[index] = name
            source = producers.get(node.input[0]) if node.input else None
            if source is not None and source.op_type == "DequantizeLinear":
                nodes.append(float_guard(node, add_init))
        nodes.append(node)
    del graph.node[:]
    graph.node.extend(nodes)
    graph.initializer.extend(added)
    _prune(graph)
    return out


def _prune(graph: onnx.GraphProto) -> None:
    """Drop the (Dynamic)DequantizeLinear nodes nothing reads any more, then unread initializers."""
    outputs = {o.name for o in graph.output}
    while True:
        read = {name for node in graph.node for name in names_read(node)} | outputs
        kept = [n for n in graph.node if n.op_type not in ("DequantizeLinear", "DynamicQuantizeLinear")
                or any(o in read for o in n.output)]
        if len(kept) == len(graph.node):
            break
        del graph.node[:]
        graph.node.extend(kept)
    read = {name for node in graph.node for name in names_read(node)}
    kept_inits = [t for t in graph.initializer if t.name in read]
    del graph.initializer[:]
    graph.initializer.extend(kept_inits)
