"""Back end: put chosen layers of a finished int8 QDQ model back into float.

Mixed precision measures many variants of one quantized model that differ only in which layers
compute in float. Re-quantizing each is slow, and bias correction re-measured on a different graph
moves every later layer a little, so what a search step measured would not quite be the next
candidate. So the int8 model is kept and only the chosen layers change: `restore_float` gives a
layer its fp32 weights, `mixed_model` makes it float for real (as a block, without the activation
Q/DQ pairs no int8 node needs), turns a static MatMul/Gemm dynamic, or gives a layer 16-bit
activations. Design: docs/design/mixed-precision.md.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Collection, Optional

import numpy as np
import onnx
from onnx import numpy_helper

from qtool.graph.edit import drop_unread
from qtool.graph.index import GraphIndex, node_label, replace_nodes
from qtool.plan.ops import rule_for
from qtool.plan.dynamic import weighted_matmul
from qtool.plan.planner import QuantPlan
from qtool.quantization.dynamic_matmul import DYNAMIC_KERNELS, DynamicMatMuls, inner_tensors
from qtool.quantization.rewrite import DQ_SUFFIX, float_guard, qdq_domain
from qtool.quantization.ort_cpu.weight_only import MS_DOMAIN, use_kernel_domain
from qtool.table import qparams as qp

FLOAT_SUFFIX = "_fp32"


@dataclass(frozen=True)
class Restorable:
    """A layer of the int8 model whose constant weight (and bias) can go back to fp32."""

    node: str  # the compute node's label (name, or first output)
    slots: tuple[tuple[int, str], ...]  # (input index, fp32 initializer name in the prepared graph)
    # rewritten after quantization on a graph input (the SpaceToDepth stem, channel-padded first
    # convs): in float the prepared graph's node comes back whole, reading the unquantized input
    whole: bool = False


def restorable_layers(qmodel: onnx.ModelProto, prepared: onnx.ModelProto) -> dict[str, Restorable]:
    """The int8 layers whose weight comes out of a DequantizeLinear of a constant, with the
    same shape as the prepared graph's fp32 weight, or another one where the layer reads a
    graph input (rewritten after quantization: `Restorable.whole`). Products of two
    activations are left out (no constant to restore)."""
    fp32_nodes = {node_label(n): n for n in prepared.graph.node}
    fp32_inits = GraphIndex(prepared).initializers
    index = GraphIndex(qmodel)
    q_inits, producers = index.initializers, index.producer
    graph_inputs = {i.name for i in prepared.graph.input}
    found = {}
    for node in qmodel.graph.node:
        rule = rule_for(node.op_type, node.domain)
        label = node_label(node)
        source = fp32_nodes.get(label)
        if node.op_type in DYNAMIC_KERNELS and source is not None and source.op_type in ("MatMul", "Gemm", "Attention"):
            if len(source.input) > 1 and source.input[1] in fp32_inits:  # a dynamic int8 MatMul/Gemm/attention
                found[label] = Restorable(label, ((1, source.input[1]),))
            continue
        if rule is None or rule.weight is None or source is None or source.op_type != node.op_type:
            continue
        slots, reshaped = [], False
        for index in (rule.weight, rule.bias):
            if index is None or index >= len(node.input) or index >= len(source.input):
                continue
            dq = producers.get(node.input[index])
            fp32 = fp32_inits.get(source.input[index])
            if dq is None or dq.op_type != "DequantizeLinear" or fp32 is None or dq.input[0] not in q_inits:
                continue
            reshaped = reshaped or list(q_inits[dq.input[0]].dims) != list(fp32.dims)
            slots.append((index, fp32.name))
        if reshaped and source.input[0] not in graph_inputs:
            continue
        if slots and slots[0][0] == rule.weight:
            found[label] = Restorable(label, tuple(slots), reshaped)
    return found


def restore_float(qmodel: onnx.ModelProto, prepared: onnx.ModelProto, layers: list[Restorable]) -> onnx.ModelProto:
    """A copy of `qmodel` in which `layers` compute in float, on the same dequantized input:

        before:  DQ(x) ----------------> Conv(w: DQ(int8), b: DQ(int32)) -> [Clip] -> Q -> DQ
        after:   DQ(x) -> Max(., lowest) -> Conv(w: fp32,    b: fp32)      -> [Clip] -> Q -> DQ

    Its output is quantized as before for its int8 readers, so every other layer computes exactly
    as in the int8 model; the weight and bias are the prepared fp32 graph's own. A dynamic int8
    MatMul/Gemm (qtool.quantization.dynamic_matmul) becomes its fp32 node again, and its
    DynamicQuantizeLinear goes when no other layer reads it. The Max is the identity guard of
    qtool.quantization.rewrite.float_guard: without it onnxruntime's WeightBiasQuantization would
    quantize the float weight again behind our back."""
    out = onnx.ModelProto()
    out.CopyFrom(qmodel)
    _restore_float(out, prepared, layers, GraphIndex(prepared))
    return out


def _restore_float(out: onnx.ModelProto, prepared: onnx.ModelProto, layers: list[Restorable],
                   fp32_index: GraphIndex) -> None:
    """restore_float in place."""
    if not layers:
        return
    graph = out.graph
    fp32_inits = fp32_index.initializers
    by_label = {layer.node: layer for layer in layers}
    producers = GraphIndex(graph).producer
    existing = {t.name for t in graph.initializer}
    added: list[onnx.TensorProto] = []

    def add_init(array: np.ndarray, name: str) -> str:
        added.append(numpy_helper.from_array(array, name))
        return name

    fp32_nodes = {node_label(n): n for n in prepared.graph.node}
    q_ops = {node_label(n): n.op_type for n in graph.node}
    dynamic = {label: fp32_nodes[label] for label in by_label if q_ops.get(label) in DYNAMIC_KERNELS}
    whole = {label: fp32_nodes[label] for label, layer in by_label.items() if layer.whole}
    replaced = {name for label, source in dynamic.items() for name in (*inner_tensors(label), *source.output)}
    nodes = []
    made = set(producers) | {i.name for i in graph.input}
    for node in graph.node:
        label = node_label(node)
        if label in dynamic and node.op_type in DYNAMIC_KERNELS:
            # the DynamicQuantizeLinear -> MatMulInteger -> Cast -> Mul group (or QAttention) back to the fp32 node
            node = onnx.NodeProto()
            node.CopyFrom(dynamic[label])
            gather = fp32_index.producer.get(node.input[0])
            if node.input[0] not in made and gather is not None:  # rows it read as gathered codes: the float Gather
                nodes.append(gather)
                made.add(node.input[0])
                if gather.input[0] not in existing:
                    added.append(fp32_inits[gather.input[0]])
                    existing.add(gather.input[0])
        elif any(o in replaced for o in node.output):
            continue
        elif label in whole:
            node = onnx.NodeProto()
            node.CopyFrom(whole[label])
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
    replace_nodes(graph, nodes, added)
    drop_unread(graph)


def blocks(prepared: onnx.ModelProto, plan: QuantPlan, layers: Collection[str]) -> dict[str, tuple[str, ...]]:
    """Each of `layers` with the quantized non-weighted nodes that go float with it: the chain its
    output alone feeds, one sole reader after another (Conv -> HardSwish; HardSigmoid -> Mul), or
    several readers that join again into one tensor (an activation written out: x * Clip(x + 3)
    / 6, x * Sigmoid(x)), up to the next weighted layer, a branch or a graph output."""
    index = GraphIndex(prepared)
    quantized = set(plan.quantized_nodes)
    found = {}
    for node in prepared.graph.node:
        label = node_label(node)
        if label not in layers:
            continue
        members = [label]
        tensor = node.output[0] if node.output else ""
        while tensor:
            reader = index.only_consumer(tensor)
            if reader is not None:
                if node_label(reader) not in quantized or _weighted(reader):
                    break
                joined, tensor = [reader], (reader.output[0] if reader.output else "")
            else:
                joined, tensor = _joined_readers(index, tensor, quantized)
            members.extend(node_label(n) for n in joined)
        found[label] = tuple(members)
    return found


def _joined_readers(index: GraphIndex, start: str, quantized: set[str],
                    limit: int = 8) -> tuple[list[onnx.NodeProto], str]:
    """The quantized non-weighted nodes from the readers of `start` to the one tensor where they
    join again, and that tensor: ([], "") when they do not join within `limit` nodes, or one of
    them is weighted, not quantized, or reads a computed tensor from outside."""
    if start in index.outputs:
        return [], ""
    members: list[onnx.NodeProto] = []
    inside: set[tuple[str, ...]] = set()  # members by their outputs (unique in the graph)
    produced = {start: None}  # insertion-ordered, so the walk is the same on every run
    while len(members) < limit:
        ready = [n for t in produced for n in index.consumers.get(t, []) if tuple(n.output) not in inside
                 and all(not name or name in produced or index.is_constant(name) for name in n.input)]
        if not ready:
            return [], ""
        node = ready[0]
        if node_label(node) not in quantized or _weighted(node):
            return [], ""
        members.append(node)
        inside.add(tuple(node.output))
        produced.update((name, None) for name in node.output if name)
        open_ends = [t for t in produced if t in index.outputs
                     or any(tuple(n.output) not in inside for n in index.consumers.get(t, []))]
        if len(open_ends) == 1 and open_ends[0] != start:
            return members, open_ends[0]
    return [], ""


def _weighted(node: onnx.NodeProto) -> bool:
    rule = rule_for(node.op_type, node.domain)
    return rule is not None and rule.weight is not None


@dataclass(frozen=True)
class Precisions:
    """What changes from the all-int8 model: layers float (as blocks), MatMul/Gemm made dynamic int8,
    layers whose activations go to 16 bits."""

    floats: tuple[Restorable, ...] = ()
    dynamic: tuple[str, ...] = ()  # static MatMul/Gemm labels run as dynamic int8 MatMuls
    int16: tuple[str, ...] = ()  # layers whose block's input and output activations are 16-bit


def float_nodes(prepared: onnx.ModelProto, plan: QuantPlan, chains: dict[str, tuple[str, ...]],
                precisions: Precisions, index: Optional[GraphIndex] = None) -> set[str]:
    """The quantized nodes that compute in float: the float layers' blocks, the nodes after a
    dynamic MatMul in its block (its output is float), and any other non-weighted quantized node
    (a residual Add, an SE block's pooling, a Reshape) whose every quantized activation input
    comes out of a float node."""
    floats = {m for layer in precisions.floats for m in chains.get(layer.node, (layer.node,))}
    floats |= {m for label in precisions.dynamic for m in chains.get(label, (label,))[1:]}
    made_float = floats | set(precisions.dynamic)
    index = index or GraphIndex(prepared)
    quantized, activations = set(plan.quantized_nodes), set(plan.activations)
    for node in prepared.graph.node:
        label = node_label(node)
        if label not in quantized or label in made_float or _weighted(node):
            continue
        sources = [index.producer.get(name) for name in node.input if name in activations]
        if sources and all(s is not None and node_label(s) in made_float for s in sources):
            floats.add(label)
            made_float.add(label)
    return floats


def mixed_model(qmodel: onnx.ModelProto, prepared: onnx.ModelProto, plan: QuantPlan,
                chains: dict[str, tuple[str, ...]], precisions: Precisions, weight_qmax: int,
                fp32_index: Optional[GraphIndex] = None) -> onnx.ModelProto:
    """A copy of `qmodel` with `precisions` applied; `chains` from `blocks`.

    Float weights alone leave a layer's activations quantized, so a float layer goes float as a
    block, with the non-weighted ops its output alone feeds (Conv -> HardSwish, HardSigmoid -> Mul
    of an SE block) or whose readers join again into one tensor (x * Clip(x + 3, 0, 6) / 6,
    x * Sigmoid(x)), and an activation QuantizeLinear/DequantizeLinear pair stays only where an
    int8 node writes or reads the tensor. A layer with 16-bit activations has the Q/DQ pairs its
    block reads and writes in the 16-bit form of their parameters (qtool.table.qparams.sixteen_bit,
    as quantize --int16-activations writes them), its weights int8. Everything else (the int8
    weights' rounding, bias correction) stays as in the int8 model. `fp32_index`: `prepared`'s,
    when the caller has it (a search mixes hundreds of candidates from one prepared graph)."""
    fp32_index = fp32_index or GraphIndex(prepared)
    floats = float_nodes(prepared, plan, chains, precisions, fp32_index)
    int8 = set(plan.quantized_nodes) - floats - set(precisions.dynamic)
    out = onnx.ModelProto()
    out.CopyFrom(qmodel)
    _drop_float_qdq(out.graph, int8)
    _float_constants(out.graph, plan, floats, fp32_index.initializers)
    _restore_float(out, prepared, list(precisions.floats), fp32_index)
    if precisions.dynamic:
        _make_dynamic(out.graph, prepared, set(precisions.dynamic), weight_qmax)
    if precisions.int16:
        _sixteen_bit(out, int16_tensors(prepared, plan, chains, precisions.int16))
    drop_unread(out.graph)
    return out


def int16_tensors(prepared: onnx.ModelProto, plan: QuantPlan, chains: dict[str, tuple[str, ...]],
                  layers: Collection[str]) -> set[str]:
    """The quantized activations the blocks of `layers` read or write."""
    index = GraphIndex(prepared)
    by_label = {node_label(n): n for n in prepared.graph.node}
    activations = set(plan.activations)
    found = set()
    for layer in layers:
        members = chains.get(layer, (layer,))
        found |= {name for name in by_label[members[0]].input if name in activations}
        found |= {name for m in members for name in by_label[m].output if name in activations}
    return found - set(index.initializers)


def _sixteen_bit(model: onnx.ModelProto, tensors: set[str]) -> None:
    """The Q/DQ pairs of `tensors` still in the graph take the 16-bit form of their parameters."""
    graph = model.graph
    index = GraphIndex(graph)
    replaced = {}
    for q, dqs in _activation_pairs(graph, index):
        if q.input[0] not in tensors or len(q.input) < 3:
            continue
        scale, zero = (index.initializers[name] for name in q.input[1:3])
        zero_point = numpy_helper.to_array(zero)
        wide = qp.sixteen_bit(qp.QParams(float(numpy_helper.to_array(scale)), int(zero_point),
                                         str(zero_point.dtype)))
        replaced[scale.name] = numpy_helper.from_array(np.array(wide.scale, np.float32), scale.name)
        replaced[zero.name] = numpy_helper.from_array(np.array(wide.zero_point, wide.dtype), zero.name)
        if qdq_domain(model, wide.dtype) == MS_DOMAIN:
            for node in (q, *dqs):
                node.domain = MS_DOMAIN
            use_kernel_domain(model)
    for i, tensor in enumerate(graph.initializer):
        if tensor.name in replaced:
            graph.initializer[i].CopyFrom(replaced[tensor.name])


def _activation_pairs(graph: onnx.GraphProto, index: GraphIndex) -> list[tuple[onnx.NodeProto, list]]:
    """Each activation's QuantizeLinear with the DequantizeLinear nodes reading it; a tensor
    rearranged after its QuantizeLinear (SpaceToDepth stem, padded channels) is left out: it stays
    as the int8 rewrite wrote it."""
    pairs = []
    for q in graph.node:
        if q.op_type != "QuantizeLinear" or q.input[0] in index.initializers:
            continue
        dqs = index.consumers.get(q.output[0], [])
        if dqs and all(d.op_type == "DequantizeLinear" for d in dqs):
            pairs.append((q, dqs))
    return pairs


def _drop_float_qdq(graph: onnx.GraphProto, int8: set[str]) -> None:
    """Rewire float readers of an activation's DequantizeLinear to the unquantized tensor where no
    int8 node writes it; the pair goes when no int8 node reads it either (pruned later)."""
    index = GraphIndex(graph)
    for q, dqs in _activation_pairs(graph, index):
        tensor = q.input[0]
        producer = index.producer.get(tensor)
        if producer is not None and node_label(producer) in int8:
            continue  # an int8 kernel writes it quantized
        for dq in dqs:
            for reader in index.consumers.get(dq.output[0], []):
                if node_label(reader) not in int8:
                    reader.input[:] = [tensor if name == dq.output[0] else name for name in reader.input]


def _float_constants(graph: onnx.GraphProto, plan: QuantPlan, floats: set[str], fp32_inits: dict) -> None:
    """Float nodes read their constant operands (an Add's bias vector, HardSwish's "+ 3") in fp32
    (`fp32_inits`: the prepared graph's initializers)."""
    quantized = {name + DQ_SUFFIX: name for name in plan.constants}
    existing = {t.name for t in graph.initializer}
    for node in graph.node:
        if node_label(node) not in floats:
            continue
        for i, name in enumerate(node.input):
            if name in quantized:
                node.input[i] = quantized[name] + FLOAT_SUFFIX
                if node.input[i] not in existing:
                    tensor = onnx.TensorProto()
                    tensor.CopyFrom(fp32_inits[quantized[name]])
                    tensor.name = node.input[i]
                    graph.initializer.append(tensor)
                    existing.add(tensor.name)


def _make_dynamic(graph: onnx.GraphProto, prepared: onnx.ModelProto, labels: set[str], weight_qmax: int) -> None:
    """Static int8 MatMul/Gemm `labels` become dynamic int8 ones on the input they read now, with
    the prepared graph's fp32 weight (and a Gemm's fp32 bias)."""
    fp32_nodes = {node_label(n): n for n in prepared.graph.node}
    fp32_inits = GraphIndex(prepared).initializers
    added: list[onnx.TensorProto] = []

    def add_init(array: np.ndarray, name: str) -> str:
        added.append(numpy_helper.from_array(array, name))
        return name

    rewriter = DynamicMatMuls(add_init, weight_qmax)
    nodes = []
    for node in graph.node:
        label = node_label(node)
        if label not in labels:
            nodes.append(node)
            continue
        source = onnx.NodeProto()
        source.CopyFrom(fp32_nodes[label])
        source.input[0] = node.input[0]
        weight = numpy_helper.to_array(fp32_inits[source.input[1]])
        source.input[1] += FLOAT_SUFFIX  # the rewrite names its int8 weight after it: not the static one's names
        if source.op_type == "Gemm" and len(source.input) > 2 and source.input[2]:
            bias = fp32_inits[source.input[2]]
            source.input[2] = add_init(numpy_helper.to_array(bias), bias.name + FLOAT_SUFFIX)
        nodes.extend(rewriter.rewrite(source, weight))
    replace_nodes(graph, nodes, added)


def dynamic_candidates(qmodel: onnx.ModelProto, prepared: onnx.ModelProto, pool: Collection[str]) -> list[str]:
    """The static int8 layers of `pool` (restorable_layers) that can run as dynamic int8 MatMuls
    (qtool.plan.dynamic.weighted_matmul)."""
    index = GraphIndex(prepared)
    fp32_nodes = {node_label(n): n for n in prepared.graph.node}
    dynamic = {node_label(n) for n in qmodel.graph.node if n.op_type == "MatMulInteger"}
    return [label for label in pool if label not in dynamic and weighted_matmul(fp32_nodes[label], index)]
