"""A per-channel affine after a Concat, moved onto the Concat's inputs.

Concat(a, b, ...) followed by constant Mul/Add ops (a BatchNormalization written out) that vary
only along the Concat axis computes what Concat(a * s_a + t_a, b * s_b + t_b, ...) computes,
element for element. Quantized, the two differ where the inputs' ranges do: a Concat's inputs
share one scale so that it copies codes, and beside features of range 10^3 an embedding of range
1 keeps a few levels, although the affine after the Concat brings every channel to one range.
Applied before the Concat, each input arrives at that range, and its slice of the affine folds
into the layer or embedding table that makes it (bn_fold.fold_affine) where the Concat alone reads
it, or stays an elementwise op of its own: the same multiply-adds as before, on the inputs' slices.
"""

from __future__ import annotations

from typing import Optional

import numpy as np
import onnx
from onnx import helper, numpy_helper

from qtool.graph.index import GraphIndex, attribute, keep_initializers, names_read
from qtool.graph.shapes import inferred_shapes


def _affine_after(index: GraphIndex, tensor: str, rank: int, axis: int) -> list[tuple[onnx.NodeProto, int]]:
    """The constant Mul/Add ops that alone read `tensor`, then each other's output, in order, with
    the position of each one's constant operand; constants that vary along `axis` only."""
    chain = []
    while True:
        node = index.only_consumer(tensor)
        if node is None or node.op_type not in ("Mul", "Add") or node.domain not in ("", "ai.onnx") \
                or len(node.input) != 2 or node.input[0] == node.input[1]:
            return chain
        constant = [i for i, name in enumerate(node.input) if index.is_constant(name)]
        if len(constant) != 1 or not _along(index.const(node.input[constant[0]]), rank, axis):
            return chain
        chain.append((node, constant[0]))
        tensor = node.output[0]


def _along(value: Optional[np.ndarray], rank: int, axis: int) -> bool:
    """A float constant that, broadcast to rank `rank`, varies along `axis` alone (or not at all)
    and broadcasts to no larger shape."""
    if value is None or value.dtype != np.float32 or value.ndim > rank:
        return False
    shape = (1,) * (rank - value.ndim) + value.shape
    return all(d == 1 for i, d in enumerate(shape) if i != axis)


def _slice(value: np.ndarray, rank: int, axis: int, start: int, width: int) -> np.ndarray:
    """The part of the constant that applies to channels [start, start + width) on `axis`."""
    shaped = value.reshape((1,) * (rank - value.ndim) + value.shape)
    if shaped.shape[axis] == 1:
        return value
    part = np.take(shaped, np.arange(start, start + width), axis=axis)
    return part.reshape(part.shape[rank - value.ndim:])  # the constant's own rank


def _unique(taken: set[str], name: str) -> str:
    base, i = name, 0
    while name in taken:
        i += 1
        name = f"{base}_{i}"
    taken.add(name)
    return name


def affine_over_concat(model: onnx.ModelProto) -> int:
    """Move each such affine onto its Concat's inputs, in place (module doc); returns how many
    Concats were rewritten."""
    graph = model.graph
    index = GraphIndex(graph)
    found = []
    for concat in graph.node:
        if concat.op_type != "Concat" or concat.domain not in ("", "ai.onnx") or len(concat.input) < 2:
            continue
        follower = index.only_consumer(concat.output[0])
        if any(index.is_constant(n) for n in concat.input) or follower is None \
                or follower.op_type not in ("Mul", "Add") or sum(map(index.is_constant, follower.input)) != 1:
            continue
        found.append(concat)  # shapes are inferred only where some Concat may qualify
    if not found:
        return 0
    shapes = inferred_shapes(model, [n for c in found for n in (*c.input, c.output[0])])
    rewritten = 0
    taken = {*index.initializers, *index.producer, *index.consumers}  # every name in use
    for concat in found:
        out = shapes.get(concat.output[0])
        if not out:
            continue
        rank = len(out)
        axis = attribute(concat, "axis", 0) % rank
        widths = [(shapes.get(n) or [None] * rank)[axis] if len(shapes.get(n) or []) == rank else None
                  for n in concat.input]
        chain = _affine_after(index, concat.output[0], rank, axis)
        if not chain or any(w is None for w in widths) or (out[axis] is not None and sum(widths) != out[axis]):
            continue
        last = chain[-1][0].output[0]
        new_nodes, start = [], 0
        for i, (name, width) in enumerate(zip(list(concat.input), widths)):
            tensor = name
            for step, (node, position) in enumerate(chain):
                part = _slice(index.const(node.input[position]), rank, axis, start, width)
                const_name = _unique(taken, f"{node.input[position]}_concat{i}")
                graph.initializer.append(numpy_helper.from_array(np.ascontiguousarray(part), const_name))
                made = _unique(taken, f"{last}_concat{i}_{step}")
                operands = [tensor, const_name] if position == 1 else [const_name, tensor]
                new_nodes.append(helper.make_node(node.op_type, operands, [made], name=made))
                tensor = made
            concat.input[i] = tensor
            start += width
        position = list(graph.node).index(concat)
        for node, _ in chain:
            graph.node.remove(node)
        concat.output[0] = last
        for k, node in enumerate(new_nodes):
            graph.node.insert(position + k, node)
        rewritten += 1
    if rewritten:
        used = {name for node in graph.node for name in names_read(node)} | {o.name for o in graph.output}
        keep_initializers(graph, lambda t: t.name in used)
    return rewritten
