"""TensorFlow's NHWC export forms around a Conv, rewritten so the Conv's int8 form absorbs them.

TensorFlow and TFLite exports wrap each NCHW Conv in layout Transposes and pad with a separate
Pad node. onnxruntime folds both into a float Conv, but not into an integer one: in a QDQ model
a Pad keeps a DequantizeLinear/QuantizeLinear pair of its own, and an activation after the
Conv's output Transpose (or the Squeeze/Reshape of a Conv1D written as a Conv2D) cannot fuse
into the Conv (its own range, a requantization). So a zero Pad (constant mode, spatial axes,
read by nothing else) becomes the Conv's padding, and an elementwise activation read after a
Conv's only layout move (Transpose, Reshape, Squeeze, Unsqueeze, Flatten) moves in front of it.
"""

from __future__ import annotations

from typing import Optional

import onnx

from qtool.graph.index import GraphIndex, attribute, replace_nodes, set_attribute, topological_order

_STANDARD = ("", "ai.onnx")


def _pad_amounts(pad: onnx.NodeProto, index: GraphIndex) -> Optional[list[int]]:
    """The Pad's begins + ends per axis when it pads with zeros in constant mode, else None."""
    mode = attribute(pad, "mode", b"constant")
    if (mode.decode() if isinstance(mode, bytes) else mode) != "constant":
        return None
    if len(pad.input) == 1:  # opset < 11: attributes
        pads, value = attribute(pad, "pads"), attribute(pad, "value", 0.0)
        return list(pads) if pads is not None and value == 0.0 else None
    pads = index.const(pad.input[1])
    if pads is None or (len(pad.input) > 3 and pad.input[3]):  # computed pads, or explicit axes
        return None
    if len(pad.input) > 2 and pad.input[2]:
        value = index.const(pad.input[2])
        if value is None or value.size != 1 or float(value.reshape(-1)[0]) != 0.0:
            return None
    return [int(p) for p in pads.reshape(-1)]


def fold_pads_into_convs(model: onnx.ModelProto) -> int:
    """Fold each zero Pad [-> Transpose] -> Conv chain into the Conv's pads; returns how many."""
    graph = model.graph
    index = GraphIndex(model)
    dropped: set[str] = set()  # the folded Pads, by output name
    stale: set[str] = set()
    folded = 0
    for pad in graph.node:
        if pad.op_type != "Pad" or pad.domain not in _STANDARD or not index.is_float(pad.input[0]):
            continue
        amounts = _pad_amounts(pad, index)
        if amounts is None or any(a < 0 for a in amounts) or len(amounts) % 2:
            continue
        rank = len(amounts) // 2
        reader = index.only_consumer(pad.output[0])
        transpose = None
        if reader is not None and reader.op_type == "Transpose" and reader.domain in _STANDARD:
            transpose, reader = reader, index.only_consumer(reader.output[0])
        if reader is None or reader.op_type != "Conv" or reader.domain not in _STANDARD:
            continue
        if reader.input[0] != (transpose.output[0] if transpose is not None else pad.output[0]):
            continue
        auto_pad = attribute(reader, "auto_pad", b"NOTSET")
        if (auto_pad.decode() if isinstance(auto_pad, bytes) else auto_pad) != "NOTSET":
            continue
        perm = list(attribute(transpose, "perm", None) or range(rank)[::-1]) if transpose is not None \
            else list(range(rank))
        if len(perm) != rank:
            continue
        begins = [amounts[axis] for axis in perm]  # per axis of the Conv's input
        ends = [amounts[rank + axis] for axis in perm]
        if any(begins[:2]) or any(ends[:2]):  # batch or channel padding is not a Conv's to do
            continue
        spatial = rank - 2
        own = list(attribute(reader, "pads", None) or [0] * (2 * spatial))
        new = [own[i] + begins[2 + i] for i in range(spatial)] + \
              [own[spatial + i] + ends[2 + i] for i in range(spatial)]
        set_attribute(reader, "pads", new)
        if transpose is not None:
            transpose.input[0] = pad.input[0]
            stale.add(transpose.output[0])  # its shape loses the padding
        else:
            reader.input[0] = pad.input[0]
        dropped.add(pad.output[0])
        folded += 1
    if folded:
        replace_nodes(graph, [n for n in graph.node if not (n.op_type == "Pad" and n.output[0] in dropped)])
        kept = [v for v in graph.value_info if v.name not in stale]
        del graph.value_info[:]
        graph.value_info.extend(kept)
    return folded


# one input, elementwise: commutes with any Transpose (constant bounds only, for Clip)
_ELEMENTWISE = ("Relu", "LeakyRelu", "Clip", "Sigmoid", "HardSigmoid", "HardSwish", "Tanh", "Elu", "Selu",
                "Softplus", "Mish", "Gelu")


def _reads_only(index: GraphIndex, name: str, node: onnx.NodeProto) -> bool:
    reader = index.only_consumer(name)
    return reader is not None and list(reader.output) == list(node.output)


_LAYOUT = ("Transpose", "Reshape", "Squeeze", "Unsqueeze", "Flatten")  # move values, compute none


def activations_before_layout_moves(model: onnx.ModelProto) -> int:
    """Conv -> layout move -> activation becomes Conv -> activation -> layout move, where the move is
    the Conv's only reader and the activation the move's; returns how many moved. The activation
    reads one tensor elementwise, so the same values reach the same names."""
    graph = model.graph
    index = GraphIndex(model)
    moved = 0
    for act in graph.node:
        if act.op_type not in _ELEMENTWISE or act.domain not in _STANDARD:
            continue
        if any(name and not index.is_constant(name) for name in act.input[1:]):
            continue
        move = index.producer.get(act.input[0])
        if move is None or move.op_type not in _LAYOUT or move.domain not in _STANDARD:
            continue
        if not _reads_only(index, move.output[0], act):
            continue
        conv = index.producer.get(move.input[0])
        if conv is None or conv.op_type != "Conv" or not _reads_only(index, conv.output[0], move):
            continue
        inner = act.output[0] + "_before_move"
        act.input[0], act.output[0], move.input[0], move.output[0] = \
            conv.output[0], inner, inner, act.output[0]
        moved += 1
    if moved:  # each moved activation now precedes its move: restore a topological order
        order = topological_order(graph)
        if order is not None:
            replace_nodes(graph, [graph.node[k] for k in order])
    return moved
