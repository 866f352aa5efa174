"""HardSigmoid and HardSwish written out in elementwise ops, back to HardSigmoid.

Paddle's exporter writes hard-swish as x * clip(x + 3, 0, 6) / 6 (Add, Clip, Mul, Div: the PP-OCR
detector, recognizer and line classifier have 18 to 28 of them) and some exporters write
hard-sigmoid as clip(x + 3, 0, 6) / 6. Quantized as written, each of those ops requantizes its
output: the product x * clip(x + 3, 0, 6) is rounded on a grid six times the output's before the
division, a second rounding of the output's size. As x * HardSigmoid(x) (alpha 1/h, beta c/h for
clip(x + c, 0, h) / h) the block is two ops: HardSigmoid, whose output is the gate in [0, 1], and
the Mul, which onnxruntime runs as QLinearAdd and QLinearMul (qtool.quantization.hard_activations).
Exact up to float32 rounding: clip(x + c, 0, h) / h = clip(x / h + c / h, 0, 1).
"""

from __future__ import annotations

from typing import Optional

import numpy as np
import onnx
from onnx import helper

from qtool.graph.index import GraphIndex, attribute, names_read, node_label

GATE_SUFFIX = "_hardsigmoid"
TOLERANCE = 1e-6  # relative: a divisor (or reciprocal factor) that matches the clip's upper bound


def _scalar(index: GraphIndex, name: str) -> Optional[float]:
    """The value of a constant whose elements are all equal, else None."""
    values = index.const(name) if name else None
    if values is None or values.size == 0 or values.dtype.kind != "f" or not np.all(values == values.flat[0]):
        return None
    return float(values.flat[0])


def _clip_bounds(index: GraphIndex, clip: onnx.NodeProto) -> tuple[Optional[float], Optional[float]]:
    if len(clip.input) > 1:  # opset 11+: bounds are inputs
        bounds = [_scalar(index, clip.input[i]) if len(clip.input) > i and clip.input[i] else None for i in (1, 2)]
        return bounds[0], bounds[1]
    return attribute(clip, "min"), attribute(clip, "max")


def _scaled_by(index: GraphIndex, node: Optional[onnx.NodeProto], tensor: str, divisor: float) -> bool:
    """`node` divides `tensor` by `divisor` (Div by it, or Mul by its reciprocal)."""
    if node is None or node.domain not in ("", "ai.onnx") or len(node.input) != 2:
        return False
    if node.op_type == "Div" and node.input[0] == tensor:
        value = _scalar(index, node.input[1])
        return value is not None and abs(value - divisor) <= TOLERANCE * divisor
    if node.op_type == "Mul" and tensor in node.input:
        value = _scalar(index, node.input[1] if node.input[0] == tensor else node.input[0])
        return value is not None and abs(value * divisor - 1.0) <= TOLERANCE
    return False


def hard_sigmoids(model: onnx.ModelProto) -> int:
    """Rewrite in place every main-graph clip(x + c, 0, h) / h as HardSigmoid(x) and every
    x * clip(x + c, 0, h) / h as x * HardSigmoid(x); the number of blocks rewritten."""
    graph = model.graph
    index = GraphIndex(model)
    replaced: dict[int, list[onnx.NodeProto]] = {}  # id of a block's last node -> its new nodes
    gone: set[int] = set()
    for clip in graph.node:
        if clip.op_type != "Clip" or clip.domain not in ("", "ai.onnx"):
            continue
        low, high = _clip_bounds(index, clip)
        add = index.producer.get(clip.input[0])
        if low != 0.0 or high is None or high <= 0 or add is None or add.op_type != "Add" or len(add.input) != 2:
            continue
        if index.only_consumer(add.output[0]) is not clip or index.only_consumer(clip.output[0]) is None:
            continue
        offsets = [_scalar(index, name) for name in add.input]
        if (offsets[0] is None) == (offsets[1] is None):
            continue  # one operand must be the constant c, the other the activation x
        x, offset = (add.input[1], offsets[0]) if offsets[0] is not None else (add.input[0], offsets[1])
        after = index.only_consumer(clip.output[0])
        gate = helper.make_node("HardSigmoid", [x], [clip.output[0] + GATE_SUFFIX], name=node_label(clip),
                                alpha=1.0 / high, beta=offset / high)
        if _scaled_by(index, after, clip.output[0], high):  # clip(x + c, 0, h) / h
            gate.output[0] = after.output[0]
            block, new = [add, clip, after], [gate]
        elif after.op_type == "Mul" and set(after.input) == {x, clip.output[0]}:  # x * clip(x + c, 0, h) / h
            last = index.only_consumer(after.output[0])
            if not _scaled_by(index, last, after.output[0], high):
                continue
            block = [add, clip, after, last]
            new = [gate, helper.make_node("Mul", [x, gate.output[0]], [last.output[0]], name=node_label(after))]
        else:
            continue
        if any(id(node) in gone for node in block):
            continue
        gone |= {id(node) for node in block}
        replaced[id(block[-1])] = new
    if not replaced:
        return 0
    constants = {name for node in graph.node if id(node) in gone for name in node.input if name in index.initializers}
    nodes = []
    for node in graph.node:
        nodes.extend(replaced.get(id(node), [] if id(node) in gone else [node]))
    del graph.node[:]
    graph.node.extend(nodes)
    read = {name for node in graph.node for name in names_read(node)} | {o.name for o in graph.output}
    kept = [t for t in graph.initializer if t.name not in constants or t.name in read]
    del graph.initializer[:]
    graph.initializer.extend(kept)
    return len(replaced)
