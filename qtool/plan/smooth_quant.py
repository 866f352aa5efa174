"""SmoothQuant (Xiao et al. 2023): migrate activation outliers into the following weights.

A few channels 10-100x the others leave the rest of a per-tensor int8 range a handful of levels.
For a tensor X read only by MatMul/Gemm layers X @ W, dividing input channel j of X by s_j and
multiplying row j of every W by s_j leaves X @ W unchanged; s_j = max|X_j|^a / max|W_j|^(1-a)
(a = alpha) balances the two ranges (the weights are per-channel int8, so their rows absorb it).
The division is folded into the op that makes X (a LayerNorm's gamma and beta, a linear layer's
weight columns and bias) or, where that op cannot take it (a GELU; a LayerNorm the residual
stream reads too), X is read through an inserted Mul by 1/s (`insert`). The maxima come from
calibration (qtool.calibration.smoothing); this module finds the tensors and folds given scales,
so calibration and quantization apply the same scales to the same graph. Figures: docs/accuracy.md.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Optional

import numpy as np
import onnx
from onnx import numpy_helper

from qtool.errors import QtoolError
from qtool.graph.edit import mark_rescaled
from qtool.graph.index import GraphIndex, attribute, replace_nodes
from qtool.plan.ops.blocks import layer_norm_chains

SCALE_LIMITS = (1e-4, 1e4)  # keeps weights well inside float32 even for near-empty channels


@dataclass(frozen=True)
class Site:
    """A tensor that can be smoothed: `divide` are the (initializer, axis) pairs its producer
    divides by s along `axis`, `multiply` those of its consumers' weights multiplied by s."""

    tensor: str
    channels: int
    divide: tuple[tuple[str, int], ...]  # empty when `readers` read it through an inserted Mul
    multiply: tuple[tuple[str, int], ...]
    readers: tuple[str, ...] = ()  # with an inserted Mul: the MatMul/Gemm labels that read its output


def _own(index: GraphIndex, name: str) -> bool:
    """A float initializer read by one node only (rescaling it changes nothing else)."""
    init = index.initializers.get(name)
    return (init is not None and init.data_type == onnx.TensorProto.FLOAT
            and len(index.consumers.get(name, [])) == 1)


def _consumer_rows(index: GraphIndex, tensor: str) -> list[tuple[str, int]]:
    """(weight, axis of the input channels) of every reader of `tensor`; empty unless every
    reader is a MatMul/Gemm that multiplies `tensor` by a 2-D weight of its own (or a Shape,
    which reads no values: PaddlePaddle's exports take the attention's reshape target so)."""
    readers, rows = _matmul_readers(index, tensor)
    others = [n for n in index.consumers.get(tensor, []) if n.op_type != "Shape"]
    if len(readers) != len(others):
        return []
    return rows


def _channels(index: GraphIndex, constants: list[tuple[str, int]]) -> set[int]:
    return {index.initializers[name].dims[axis] for name, axis in constants}


def _per_channel(index: GraphIndex, name: str, channels: int) -> bool:
    """A gamma/beta that holds one value per channel of the last axis."""
    dims = list(index.initializers[name].dims)
    return bool(dims) and dims[-1] == channels and int(np.prod(dims)) == channels


def _producer_columns(index: GraphIndex, node: onnx.NodeProto, channels: int) -> list[tuple[str, int]] | None:
    """The constants to divide so that `node`'s output is divided by s, or None when it cannot be folded."""
    if node.op_type == "LayerNormalization":
        names = [n for n in node.input[1:3] if n]
        axis = attribute(node, "axis", -1)
        rank = len(index.shapes.get(node.input[0], ())) or None
        if axis != -1 and (rank is None or axis != rank - 1):
            return None
        if not all(_own(index, n) and _per_channel(index, n, channels) for n in names):
            return None
        return [(n, len(index.initializers[n].dims) - 1) for n in names]
    if node.op_type == "Gemm" and not attribute(node, "transA", 0) and len(node.input) >= 2:
        weight = node.input[1]
        bias = [node.input[2]] if len(node.input) > 2 and node.input[2] else []
        if not _own(index, weight) or not all(_own(index, b) and _per_channel(index, b, channels) for b in bias):
            return None
        return [(weight, 0 if attribute(node, "transB", 0) else 1)] + [(b, 0) for b in bias]
    return None


def _linear_with_bias(index: GraphIndex, add: onnx.NodeProto, channels: int) -> list[tuple[str, int]] | None:
    """MatMul(x, W) + b: W's columns and b."""
    for position, bias in enumerate(add.input[:2]):
        matmul = index.producer.get(add.input[1 - position])
        if (matmul is None or matmul.op_type != "MatMul" or index.only_consumer(matmul.output[0]) is not add
                or not _own(index, bias) or not _per_channel(index, bias, channels)):
            continue
        weight = matmul.input[1]
        if _own(index, weight) and len(index.initializers[weight].dims) == 2:
            return [(weight, 1), (bias, 0)]
    return None


def _matmul_readers(index: GraphIndex, tensor: str) -> tuple[list[onnx.NodeProto], list[tuple[str, int]]]:
    """The MatMul/Gemm (and com.microsoft Attention) readers of `tensor` that multiply it by a 2-D
    weight of their own, and (weight, input-channel axis) of each; other readers are left out."""
    nodes, rows = [], []
    for node in index.consumers.get(tensor, []):
        linear = node.op_type in ("MatMul", "Gemm") and node.domain in ("", "ai.onnx")
        fused = node.op_type == "Attention" and node.domain == "com.microsoft"  # Q/K/V weight [hidden, 3 x hidden]
        if not (linear or fused) or node.input[0] != tensor:
            continue
        weight = node.input[1]
        if not _own(index, weight) or len(index.initializers[weight].dims) != 2:
            continue
        if node.op_type == "Gemm" and attribute(node, "transA", 0):
            continue
        nodes.append(node)
        rows.append((weight, 1 if node.op_type == "Gemm" and attribute(node, "transB", 0) else 0))
    return nodes, rows


def find_sites(model: onnx.ModelProto, insert: bool = False) -> list[Site]:
    """The tensors of `model`'s main graph that can be smoothed, in graph order. `insert`: also
    a tensor whose producer cannot take the division (a GELU, a LayerNorm whose output the
    residual stream reads too): its MatMul/Gemm readers then read it through an inserted Mul
    by 1/s (one elementwise op: what the dynamic int8 MatMuls of a transformer use)."""
    index = GraphIndex(model)
    chain_tails = {}
    for chain in layer_norm_chains(index):
        tails = chain[7:]  # the Mul (gamma) and Add (beta) after the normalizing Div
        if tails and tails[0].op_type == "Mul":
            chain_tails[tails[-1].output[0]] = tails
    sites = []
    for node in model.graph.node:
        if not node.output or node.output[0] in index.outputs:
            continue
        tensor = node.output[0]
        rows = _consumer_rows(index, tensor)
        channels = _channels(index, rows)
        if not rows or len(channels) != 1:
            continue
        (count,) = channels
        if tensor in chain_tails:
            divide = []
            for tail in chain_tails[tensor]:
                constant = next(i for i in tail.input if index.is_constant(i))
                if not _own(index, constant) or not _per_channel(index, constant, count):
                    divide = None
                    break
                divide.append((constant, len(index.initializers[constant].dims) - 1))
        elif node.op_type == "Add":
            divide = _linear_with_bias(index, node, count)
        else:
            divide = _producer_columns(index, node, count)
        if divide:
            sites.append(Site(tensor, count, tuple(divide), tuple(rows)))
    if insert:
        found = {site.tensor for site in sites}
        for node in model.graph.node:
            for tensor in node.output:
                if not tensor or tensor in found or tensor in index.outputs or not index.is_float(tensor):
                    continue
                readers, rows = _matmul_readers(index, tensor)
                channels = _channels(index, rows)
                if readers and len(channels) == 1:
                    sites.append(Site(tensor, channels.pop(), (), tuple(rows),
                                      tuple(r.name or r.output[0] for r in readers)))
    return sites


def smoothing_alpha(options, dynamic: bool) -> Optional[float]:
    """The alpha smoothing runs with: the one asked for, else the dynamic MatMuls' default
    (`dynamic`: the graph's MatMul/Gemm are dynamic int8), else None (off)."""
    if options.smooth_quant is not None:
        return options.smooth_quant
    return options.advanced.smooth_dynamic if dynamic else None


def smooths_static(model: onnx.ModelProto, options) -> bool:
    """Whether the dynamic MatMuls' default alpha (smooth_dynamic) also smooths the static int8
    MatMuls of `model`: on a target whose runtime folds an inserted Mul into the quantizer after
    it (Target.smooth_inserts), in a graph with a LayerNorm (a transformer's residual stream,
    whose outlier channels one static range cannot hold)."""
    from qtool.plan.ops.blocks import NORM_OPS
    from qtool.targets import target_of

    if not target_of(options).smooth_inserts:
        return False
    return (any(n.op_type in NORM_OPS for n in model.graph.node)
            or bool(list(layer_norm_chains(GraphIndex(model)))))


def weight_maxima(inits: Mapping[str, onnx.TensorProto], site: Site) -> np.ndarray:
    """max over the consumers' weights (`inits`: the graph's initializers by name) of |W| per input channel."""
    ranges = [np.abs(np.moveaxis(numpy_helper.to_array(inits[name]), axis, 0)).max(axis=1)
              for name, axis in site.multiply]
    return np.max(ranges, axis=0)


def smoothing_scales(activation_max: np.ndarray, weight_max: np.ndarray, alpha: float) -> np.ndarray:
    """s_j = max|X_j|^alpha / max|W_j|^(1-alpha); 1 where either range is empty."""
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        s = np.power(activation_max.astype(np.float64), alpha) / np.power(weight_max.astype(np.float64), 1 - alpha)
    s = np.where(np.isfinite(s) & (s > 0), s, 1.0)
    return np.clip(s, *SCALE_LIMITS)


def smooth(model: onnx.ModelProto, scales: Mapping[str, tuple[float, ...]], insert: bool = False) -> None:
    """Fold the scales of each named tensor into `model` in place (`insert` as for find_sites).
    A tensor that is no longer a site (the table was made for another graph) is an error."""
    sites = {site.tensor: site for site in find_sites(model, insert)}
    inits = {t.name: t for t in model.graph.initializer}
    inserted: dict[str, onnx.NodeProto] = {}
    for tensor, values in scales.items():
        site = sites.get(tensor)
        if site is None or site.channels != len(values):
            raise QtoolError(f"the calibration table smooths tensor '{tensor}', which this graph cannot smooth "
                             "(the table was made for another model or other options)")
        s = np.asarray(values, dtype=np.float64)
        for name, axis in site.divide:
            _scale(inits[name], 1.0 / s, axis)
        for name, axis in site.multiply:
            _scale(inits[name], s, axis)
        if site.readers:
            inserted[tensor] = _divide_for(model, site, s)
    mark_rescaled(model, [tensor for tensor in scales if tensor not in inserted])  # the inserted Mul's is new
    if inserted:
        _insert(model, inserted)


def _divide_for(model: onnx.ModelProto, site: Site, s: np.ndarray) -> onnx.NodeProto:
    """The Mul by 1/s along the last axis that `site`'s readers read instead of its tensor."""
    factors = numpy_helper.from_array((1.0 / s).astype(np.float32), f"{site.tensor}_smooth_inverse")
    model.graph.initializer.append(factors)
    smoothed = f"{site.tensor}_smoothed"
    for node in model.graph.node:
        if (node.name or node.output[0]) in site.readers:
            node.input[0] = smoothed
    return onnx.helper.make_node("Mul", [site.tensor, factors.name], [smoothed], name=f"{site.tensor}_smooth")


def _insert(model: onnx.ModelProto, inserted: Mapping[str, onnx.NodeProto]) -> None:
    """Each inserted Mul right after the node that makes its input (graph inputs: first)."""
    nodes = [inserted[name] for name in (i.name for i in model.graph.input) if name in inserted]
    for node in model.graph.node:
        nodes.append(node)
        nodes.extend(inserted[name] for name in node.output if name in inserted)
    replace_nodes(model.graph, nodes)


def _scale(tensor: onnx.TensorProto, factors: np.ndarray, axis: int) -> None:
    values = numpy_helper.to_array(tensor).astype(np.float64)
    shape = [1] * values.ndim
    shape[axis] = -1
    tensor.CopyFrom(numpy_helper.from_array((values * factors.reshape(shape)).astype(np.float32), tensor.name))
