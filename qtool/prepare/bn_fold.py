"""Fold inference-mode BatchNormalization, and per-channel Mul/Add by constants, into the
Conv/ConvTranspose/Gemm before them (Mul/Add also into the embedding table a Gather reads).

y = gamma * (x - mean) / sqrt(var + eps) + beta is a per-channel affine map that merges into the
linear op's weight and bias (W'[c] = W[c] * s[c], b'[c] = (b[c] - mean[c]) * s[c] + beta[c],
s = gamma / sqrt(var + eps)). Unfolded, the BN would stay float between a DequantizeLinear and a
QuantizeLinear (a requantization, an extra rounding, a float kernel); folded, the layer is one
integer Conv. Computed in float64, rounded once to float32. `fold_affine` does the same for the
affine map some exporters write instead (Paddle's: Conv -> Mul by a [1, C, 1, 1] constant -> Add),
so each such block quantizes one tensor where it quantized three.
"""

from __future__ import annotations

from typing import Optional

import numpy as np
import onnx
from onnx import numpy_helper

from qtool.graph.index import GraphIndex, attribute, keep_initializers, names_read, replace_nodes, set_attribute

_FOLDABLE = ("Conv", "ConvTranspose", "Gemm")


def _array(inits: dict, name: str) -> Optional[np.ndarray]:
    tensor = inits.get(name) if name else None
    return None if tensor is None else numpy_helper.to_array(tensor).astype(np.float64)


def _channel_scaled(node: onnx.NodeProto, weight: np.ndarray, s: np.ndarray) -> Optional[np.ndarray]:
    """The weight with every output channel c multiplied by s[c]; None if shapes do not fit."""
    if node.op_type == "Conv":
        if weight.shape[0] != s.size:
            return None
        return weight * s.reshape(-1, *[1] * (weight.ndim - 1))
    if node.op_type == "ConvTranspose":
        # (C_in, C_out/group, k...): output channel g * (C_out/group) + j sits at [g-th block of C_in, j]
        group = attribute(node, "group", 1)
        per_group = weight.shape[1]
        if per_group * group != s.size or weight.shape[0] % group:
            return None
        blocks = weight.reshape(group, weight.shape[0] // group, per_group, *weight.shape[2:])
        scaled = blocks * s.reshape(group, 1, per_group, *[1] * (weight.ndim - 2))
        return scaled.reshape(weight.shape)
    # Gemm: B is (N, K) with transB, else (K, N); channels are N
    if weight.ndim != 2 or attribute(node, "transA", 0):
        return None
    if attribute(node, "transB", 0):
        return weight * s.reshape(-1, 1) if weight.shape[0] == s.size else None
    return weight * s.reshape(1, -1) if weight.shape[1] == s.size else None


def fold_batchnorm(model: onnx.ModelProto) -> int:
    """Fold every foldable BN in place; returns how many were folded."""
    graph = model.graph
    index = GraphIndex(graph)
    inits, producer, outputs = index.initializers, index.producer, index.outputs
    drop: set[int] = set()
    for bn in graph.node:
        if bn.op_type != "BatchNormalization" or bn.domain not in ("", "ai.onnx"):
            continue
        if len([o for o in bn.output if o]) != 1 or attribute(bn, "training_mode", 0):
            continue
        prev = producer.get(bn.input[0])
        if (prev is None or prev.op_type not in _FOLDABLE or prev.domain not in ("", "ai.onnx")
                or index.only_consumer(bn.input[0]) is None):
            continue
        gamma, beta, mean, var = (_array(inits, n) for n in bn.input[1:5])
        weight = _array(inits, prev.input[1]) if len(prev.input) > 1 else None
        if any(a is None for a in (gamma, beta, mean, var, weight)):
            continue
        s = gamma / np.sqrt(var + attribute(bn, "epsilon", 1e-5))
        new_weight = _channel_scaled(prev, weight, s)
        if new_weight is None:
            continue
        bias = _folded_bias(prev, inits, s, beta, mean)
        if bias is None:
            continue
        _install(graph, inits, prev, new_weight, bias, "_bnfold", bn.output[0])
        drop.add(id(bn))
    if drop:
        keep = [n for n in graph.node if id(n) not in drop]
        replace_nodes(graph, keep)
        used = {name for node in graph.node for name in names_read(node)}
        keep_initializers(graph, lambda t: t.name in used or t.name in outputs)
    return len(drop)


def _install(graph: onnx.GraphProto, inits: dict, layer: onnx.NodeProto, weight: np.ndarray, bias: np.ndarray,
             suffix: str, output: str) -> None:
    """`layer` takes the folded weight and bias (new initializers) and the output name of the op
    folded into it (it may be a graph output)."""
    w_name, b_name = _unique(inits, layer.input[1] + suffix), _unique(inits, output + suffix + "_bias")
    for name, array in ((w_name, weight), (b_name, bias)):
        tensor = numpy_helper.from_array(array.astype(np.float32), name)
        graph.initializer.append(tensor)
        inits[name] = tensor
    layer.input[1] = w_name
    if len(layer.input) > 2:
        layer.input[2] = b_name
    else:
        layer.input.append(b_name)
    if layer.op_type == "Gemm":
        set_attribute(layer, "beta", 1.0)
    layer.output[0] = output


def _folded_bias(node, inits, s, beta, mean) -> Optional[np.ndarray]:
    old = _array(inits, node.input[2]) if len(node.input) > 2 and node.input[2] else np.zeros_like(s)
    if old is None:
        return None  # a computed bias: cannot fold
    if node.op_type == "Gemm":
        # Y = alpha * A B + beta_g * C: with beta_g set to 1, C' must hold beta_g * C
        old = old * attribute(node, "beta", 1.0)
        if old.ndim > 1 and old.shape[:-1] != (1,) * (old.ndim - 1):
            return None  # a C that varies per row is not a per-channel bias
        old = old.reshape(-1)
    old = np.broadcast_to(old.reshape(-1), s.shape) if old.size in (1, s.size) else None
    if old is None:
        return None
    return (old - mean) * s + beta


def _unique(inits: dict, name: str) -> str:
    base, i = name, 0
    while name in inits:
        i += 1
        name = f"{base}_{i}"
    return name


def fold_affine(model: onnx.ModelProto) -> int:
    """Fold every Mul or Add of a per-channel (or scalar) constant that alone reads the output of
    a Conv/ConvTranspose/Gemm with constant weight (and bias) into that layer, in place; returns
    how many were folded (module doc). One at a time, the first in graph order each time; the index
    follows each fold (the layer takes over the folded op's output, which no longer reads its own),
    rather than being rebuilt (a recognizer can have dozens of such folds)."""
    graph = model.graph
    folded = 0
    index = GraphIndex(graph)
    inits, producer, consumers = index.initializers, index.producer, index.consumers
    while True:
        done = None
        for node in graph.node:
            if node.op_type not in ("Mul", "Add") or node.domain not in ("", "ai.onnx") or len(node.input) != 2:
                continue
            constant = [i for i, name in enumerate(node.input) if name in inits]
            if len(constant) != 1:
                continue
            data = node.input[1 - constant[0]]
            prev = producer.get(data)
            if prev is not None and prev.op_type == "Gather" and index.only_consumer(data) is node:
                table = _table_folded(index, prev, node, node.input[constant[0]])
                if table is not None:
                    before = [name for name in prev.input if name]
                    name = _unique(inits, prev.input[0] + "_affine")
                    inits[name] = numpy_helper.from_array(table, name)
                    graph.initializer.append(inits[name])
                    prev.input[0] = name
                    prev.output[0] = node.output[0]
                    done = node
                    break
            if (prev is None or prev.op_type not in _FOLDABLE or prev.domain not in ("", "ai.onnx")
                    or len(prev.input) < 2 or index.only_consumer(data) is not node):
                continue
            weight = _array(inits, prev.input[1])
            if weight is None:
                continue
            channels = _out_channels(prev, weight)
            value = _per_channel(_array(inits, node.input[constant[0]]), weight.ndim, channels)
            if channels is None or value is None:
                continue
            scale = value if node.op_type == "Mul" else np.ones(channels)
            shift = value if node.op_type == "Add" else np.zeros(channels)
            new_weight = _channel_scaled(prev, weight, scale)
            bias = _folded_bias(prev, inits, scale, shift, np.zeros(channels))
            if new_weight is None or bias is None:
                continue
            before = [name for name in prev.input if name]
            _install(graph, inits, prev, new_weight, bias, "_affine", node.output[0])
            done = node
            break
        if done is None:
            break
        # the index as GraphIndex(graph) would now be: `prev` reads its new constants and makes the
        # folded op's output; the folded op reads nothing
        for name in before:
            consumers[name] = [n for n in consumers.get(name, []) if n is not prev]
        for name in prev.input:
            if name:
                consumers.setdefault(name, []).append(prev)
        for name in done.input:
            consumers[name] = [n for n in consumers.get(name, []) if n is not done]
        del producer[data]
        producer[done.output[0]] = prev
        graph.node.remove(done)
        folded += 1
    if folded:
        used = {name for node in graph.node for name in names_read(node)} | {o.name for o in graph.output}
        keep_initializers(graph, lambda t: t.name in used)
    return folded


def _table_folded(index: GraphIndex, gather: onnx.NodeProto, node: onnx.NodeProto,
                  constant: str) -> Optional[np.ndarray]:
    """The embedding table of `gather` (rows of a constant float32 table picked along axis 0) with
    `node`'s Mul or Add by `constant` applied to every row: exact, as each output element is one
    table element times or plus the constant's value at its position, when that value varies along
    the table's trailing axes only; None otherwise."""
    table = index.const(gather.input[0]) if gather.domain in ("", "ai.onnx") else None
    value = index.const(constant)
    if table is None or value is None or table.dtype != np.float32 or value.dtype != np.float32 \
            or attribute(gather, "axis", 0) != 0 or table.ndim < 2:
        return None
    row = table.ndim - 1  # the rank of one gathered row
    indices = index.shapes.get(gather.input[1])
    out_rank = len(indices) + row if indices is not None else row
    if value.ndim > out_rank:
        return None  # the op would broadcast the gathered rows to a higher rank
    trailing = value.reshape(value.shape[max(0, value.ndim - row):]) if value.ndim >= row else value
    if value.ndim > row and any(d != 1 for d in value.shape[:value.ndim - row]):
        return None  # varies along the indices' axes
    try:
        folded = table * trailing if node.op_type == "Mul" else table + trailing
    except ValueError:
        return None
    return folded.astype(np.float32) if folded.shape == table.shape else None


def _out_channels(node: onnx.NodeProto, weight: np.ndarray) -> Optional[int]:
    """The layer's output channels (axis 1 of its output)."""
    if node.op_type == "Conv":
        return weight.shape[0]
    if node.op_type == "ConvTranspose":
        return weight.shape[1] * attribute(node, "group", 1)
    if weight.ndim != 2:
        return None
    return weight.shape[0] if attribute(node, "transB", 0) else weight.shape[1]


def _per_channel(value: Optional[np.ndarray], rank: int, channels: Optional[int]) -> Optional[np.ndarray]:
    """`value` as one number per output channel (axis 1 of a rank-`rank` output), or None when it
    varies along another axis or would broadcast the output to a larger shape."""
    if value is None or channels is None or value.ndim > rank:
        return None
    if value.size == 1:
        return np.full(channels, float(value.reshape(-1)[0]))
    shape = (1,) * (rank - value.ndim) + value.shape
    if shape[1] != channels or any(d != 1 for i, d in enumerate(shape) if i != 1):
        return None
    return value.reshape(-1)
