"""Adaptive weight rounding (AdaRound, Nagel et al. 2020), optimised per layer with numpy.

Round-to-nearest minimises each weight's own error, not the layer's output error: errors of
weights that see correlated inputs add up. For y = W x the output error of a rounded W~ is
sum over output rows o of e_o C e_o^T with C = E[x x^T], so the K x K second moment of the layer's
fp32 input patches (per channel for a depthwise conv), accumulated batch by batch, is all the data
a layer needs. Each weight rounds down or up, W~ = s (floor(W / s) + h(V)), h a rectified sigmoid
optimised with Adam on that error plus AdaRound's regulariser (beta annealed 20 -> 2), then
rounded hard; a row not better than round-to-nearest keeps round-to-nearest, so no layer gets
worse on the calibration inputs. Usage and figures: docs/accuracy.md.
"""

from __future__ import annotations

import hashlib
import math
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Callable, Optional

import numpy as np
import onnx
from onnx import numpy_helper

from qtool.config import QuantizeConfig
from qtool.data.dataset import Batch
from qtool.graph.index import node_label
from qtool.graph.edit import with_outputs
from qtool.graph.index import attribute
from qtool.plan.planner import QuantPlan
from qtool.table.qparams import WEIGHT_QMAX
from qtool.graph.runtime import create_session, usable_cores
from qtool.targets import weight_qmax

PATCHES_PER_BATCH = 2048
PATCH_BYTES = 2**24  # a depthwise conv's patches gathered at most this many bytes at a time (per thread)
ITERATIONS = 200
LEARNING_RATE = 0.05
REG_WEIGHT = 0.01
ZETA, GAMMA = 1.1, -0.1
WARMUP = 0.2  # fraction of the steps without the regulariser
BLOCK_VALUES = 2**17  # weights per row block of a layer's optimisation (see _blocks)
SPLIT_VALUES = 2**15  # layers from this many weights on are split in at least two blocks
MAX_BLOCKS = 8
_MEMO: dict = {}  # the last model's layer statistics and roundings (see adaptive_rounding)


@dataclass
class _Layer:
    node: onnx.NodeProto
    kind: str  # "dense" (one C for all rows) | "depthwise" (one C per input channel)
    out_axis: int  # the weight axis of output channels
    kernel: tuple[int, ...] = ()  # a Conv's spatial kernel (the weight's shape after its two channel axes)
    second: Optional[np.ndarray] = None  # C accumulated (sum of x x^T)
    count: int = 0
    # a dense layer's input rows x themselves (float32) while they are fewer than half its K:
    # C then has rank <= rows, and e C = (e X^T) X costs 2 rows / K of the K x K product
    rows: Optional[list] = None


def _kind(node: onnx.NodeProto, weight: np.ndarray) -> Optional[tuple[str, int]]:
    if node.op_type == "Conv":
        group = attribute(node, "group", 1)
        if group == 1:
            return "dense", 0
        if weight.shape[1] == 1:
            return "depthwise", 0
        return None
    if node.op_type == "Gemm" and not attribute(node, "transA", 0) and weight.ndim == 2:
        return "dense", 0 if attribute(node, "transB", 0) else 1
    if node.op_type == "MatMul" and weight.ndim == 2:
        return "dense", 1
    return None


def _geometry(shape: tuple[int, ...], node: onnx.NodeProto, kernel: tuple[int, ...]) -> tuple:
    """(n, c, h, w, pads, strides, dilations, padded h, padded w, output h, output w) of a 2-D conv;
    ValueError for a layout whose patches we do not unfold (3-D conv, auto_pad)."""
    if len(shape) != 4 or len(kernel) != 2:
        raise ValueError("2-D convolutions only")
    n, c, h, w = shape
    kh, kw = kernel
    strides, dilations = attribute(node, "strides", [1, 1]), attribute(node, "dilations", [1, 1])
    pads = attribute(node, "pads", [0, 0, 0, 0])
    if attribute(node, "auto_pad", b"NOTSET") not in (b"NOTSET", "NOTSET"):
        raise ValueError("auto_pad")
    hp, wp = h + pads[0] + pads[2], w + pads[1] + pads[3]
    oh = (hp - dilations[0] * (kh - 1) - 1) // strides[0] + 1
    ow = (wp - dilations[1] * (kw - 1) - 1) // strides[1] + 1
    return n, c, h, w, pads, strides, dilations, hp, wp, oh, ow


def _pointwise(node: onnx.NodeProto, kernel: tuple[int, ...], shape: tuple[int, ...]) -> bool:
    """A 1x1 conv without pads: its patches are the input's columns (every stride-th position)."""
    return all(k == 1 for k in kernel) and not any(attribute(node, "pads", [0])) and len(shape) == 4


def _pick(node: onnx.NodeProto, shape: tuple[int, ...], kernel: tuple[int, ...], rng: np.random.Generator
          ) -> Optional[np.ndarray]:
    """The positions of the at most PATCHES_PER_BATCH input patches a conv's moments take from one
    batch of input `shape` (None: all of them). Drawn from the one generator in the layers' order,
    before any layer's sums, so that the sums can run on several threads and still be the same
    bytes on every machine."""
    if node.op_type != "Conv":
        return None
    if _pointwise(node, kernel, shape):
        sh, sw = attribute(node, "strides", [1, 1])
        total = shape[0] * len(range(0, shape[2], sh)) * len(range(0, shape[3], sw))  # _moments' x[..., ::sh, ::sw]
        return rng.choice(total, PATCHES_PER_BATCH, replace=False) if total > PATCHES_PER_BATCH else None
    n, *_, oh, ow = _geometry(shape, node, kernel)
    total = n * oh * ow
    return rng.choice(total, size=min(total, PATCHES_PER_BATCH), replace=False)


def _windows(x: np.ndarray, node: onnx.NodeProto, kernel: tuple[int, ...], pick: np.ndarray
             ) -> tuple[np.ndarray, np.ndarray, int]:
    """(planes, where, P) of the input patches at positions `pick` (see _pick) of a 2-D conv: each
    channel as one row of its n padded planes (padded and moved in one copy), and where each
    patch's kh x kw values sit in such a row ([P * kh * kw], patch by patch), so that one gather
    over any block of channels gives [channels, P, kh * kw]."""
    n, c, h, w, pads, (sh, sw), (dh, dw), hp, wp, oh, ow = _geometry(x.shape, node, kernel)
    kh, kw = kernel
    bi, rest = np.divmod(pick, oh * ow)
    oy, ox = np.divmod(rest, ow)
    ys = oy[:, None] * sh + np.arange(kh)[None, :] * dh  # [P, kh]
    xs = ox[:, None] * sw + np.arange(kw)[None, :] * dw  # [P, kw]
    padded = np.zeros((c, n, hp, wp), x.dtype)
    padded[:, :, pads[0]:pads[0] + h, pads[1]:pads[1] + w] = x.transpose(1, 0, 2, 3)
    where = ((bi[:, None, None] * hp + ys[:, :, None]) * wp + xs[:, None, :]).reshape(-1)
    return padded.reshape(c, -1), where, len(pick)


def _patches(x: np.ndarray, node: onnx.NodeProto, kernel: tuple[int, ...], pick: np.ndarray) -> np.ndarray:
    """The input patches at positions `pick` of a 2-D conv: [P, C, kh, kw]."""
    planes, where, count = _windows(x, node, kernel, pick)
    gathered = np.take(planes, where, axis=1).reshape(planes.shape[0], count, *kernel)
    return np.ascontiguousarray(gathered.transpose(1, 0, 2, 3))


def _depthwise_second(x: np.ndarray, node: onnx.NodeProto, kernel: tuple[int, ...],
                      pick: np.ndarray) -> tuple[np.ndarray, int]:
    """(sum of x x^T per input channel [C, k, k], patches) of a depthwise conv's patches at
    positions `pick`, gathered a few channels at a time: all channels' patches at once are
    P x C x k floats (236 MB for 1152 channels of 5x5), the per-channel sums C x k x k."""
    planes, where, count = _windows(x, node, kernel, pick)
    c, k = planes.shape[0], kernel[0] * kernel[1]
    step = max(1, PATCH_BYTES // (4 * k * count))
    parts = []
    for lo in range(0, c, step):
        flat = np.take(planes[lo:lo + step], where, axis=1).reshape(-1, count, k).astype(np.float32, copy=False)
        parts.append(flat.transpose(0, 2, 1) @ flat)
    return np.concatenate(parts), count


def _moments(layer: _Layer, x: np.ndarray, pick: Optional[np.ndarray]
             ) -> tuple[np.ndarray, int, Optional[np.ndarray]]:
    """(sum of x x^T over the batch's sampled input rows in float32, their number, the rows
    themselves [rows, K] where a dense layer keeps them (see _Layer.rows), else None) for one layer
    and batch. Runs on a worker thread; the layer's sums are not added to while it runs."""
    node = layer.node
    flat = None
    if node.op_type == "Conv":
        kernel = layer.kernel
        if _pointwise(node, kernel, x.shape):
            sh, sw = attribute(node, "strides", [1, 1])
            cols = np.moveaxis(x[:, :, ::sh, ::sw], 1, -1).reshape(-1, x.shape[1])
            if pick is not None:
                cols = cols[pick]
            patches = cols.reshape(cols.shape[0], x.shape[1], 1, 1)
        elif layer.kind == "depthwise":
            patches = None
            part, rows = _depthwise_second(x, node, kernel, pick)
        else:
            patches = _patches(x, node, kernel, pick)
        if patches is not None:
            patches = patches.astype(np.float32, copy=False)
            if layer.kind == "depthwise":
                flat = np.ascontiguousarray(patches.reshape(patches.shape[0], patches.shape[1], -1).transpose(1, 2, 0))
                part = flat @ flat.transpose(0, 2, 1)  # [C, k, k]: batched BLAS, not einsum
            else:
                flat = patches.reshape(patches.shape[0], -1)
                part = flat.T @ flat
            rows = patches.shape[0]
    else:
        flat = x.reshape(-1, x.shape[-1]).astype(np.float32)
        part, rows = flat.T @ flat, flat.shape[0]
    few = layer.kind == "dense" and 2 * (layer.count + rows) <= part.shape[0] and \
        (layer.count == 0 or layer.rows is not None)  # its rows kept while they stay few
    return part, rows, flat.reshape(rows, -1) if few else None


def _add(layer: _Layer, part: np.ndarray, rows: int, kept: Optional[np.ndarray]) -> None:
    """Add one batch's moments to the layer's running sums (in the batches' order)."""
    if layer.kind == "dense":
        layer.rows = [*(layer.rows or []), kept] if kept is not None else None
    part = part.astype(np.float64)  # per-batch sums in float32, the running total in float64
    layer.second = part if layer.second is None else layer.second + part
    layer.count += rows


def collect_inputs(model: onnx.ModelProto, plan: QuantPlan, data: list[Batch], threads: int = 0,
                   seed: int = 0) -> dict[str, _Layer]:
    """Weight name -> its layer with the input second moments C, from one fp32 pass.

    Per batch, the patch positions are drawn in the layers' order (_pick), then the layers' sums
    run on one thread per allowed core (_one_blas_thread), and are added in the layers' order: the
    same bytes as one thread."""
    inits = {t.name: t for t in model.graph.initializer}
    by_label = {node_label(n): n for n in model.graph.node}
    layers: dict[str, _Layer] = {}
    for name, wplan in plan.weights.items():
        node = by_label.get(wplan.node)
        if node is None or name not in inits:
            continue
        weight = numpy_helper.to_array(inits[name])
        kind = _kind(node, weight)
        if kind is None or node.input[1] != name:
            continue
        layers[name] = _Layer(node, *kind, tuple(weight.shape[2:]))
    names = list(dict.fromkeys(layer.node.input[0] for layer in layers.values()))
    graph_inputs = {i.name for i in model.graph.input}
    fetched = [n for n in names if n not in graph_inputs]
    session = create_session(with_outputs(model, fetched), threads, "fp32 model", batch_pass=True)
    rng = np.random.default_rng(seed)
    failed = set()
    with ThreadPoolExecutor(usable_cores()) as pool, _one_blas_thread():
        for batch in data:
            arrays = dict(zip(fetched, session.run(fetched, batch.feeds)))
            arrays.update({n: batch.feeds[n] for n in names if n in graph_inputs})
            jobs = []
            for name, layer in layers.items():
                if name in failed:
                    continue
                x = arrays[layer.node.input[0]]
                try:
                    pick = _pick(layer.node, x.shape, layer.kernel, rng)
                except ValueError:
                    failed.add(name)  # a layout we do not unfold (3-D conv, auto_pad): round to nearest
                    continue
                jobs.append((name, pool.submit(_moments, layer, x, pick)))
            for name, job in jobs:
                try:
                    _add(layers[name], *job.result())
                except ValueError:
                    failed.add(name)
    return {name: layer for name, layer in layers.items() if name not in failed and layer.count}


def _one_blas_thread():
    """BLAS held to one thread while adaptive rounding's own threads run its small products:
    OpenBLAS's own threads on them spin between calls (about 3x the CPU time of one thread in the
    Adam steps) for no gain in wall time. threadpoolctl is imported here, by a job that rounds
    adaptively, and by no other."""
    from threadpoolctl import threadpool_limits

    return threadpool_limits(limits=1, user_api="blas")


def _rows(weight: np.ndarray, axis: int) -> np.ndarray:
    return np.moveaxis(weight, axis, 0).reshape(weight.shape[axis], -1).astype(np.float64)


def _row_errors(err: np.ndarray, second: np.ndarray, kind: str, multiplier: int) -> np.ndarray:
    """e_o C e_o^T per row (err in weight units)."""
    if kind == "depthwise":
        c = np.repeat(second, multiplier, axis=0)  # row o reads input channel o // multiplier
        return (err[:, None, :] @ c @ err[:, :, None])[:, 0, 0]
    return ((err @ second) * err).sum(axis=1)  # BLAS: einsum's three-operand loop took seconds


def _h(v: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    sig = 1.0 / (1.0 + np.exp(-v))
    sig = sig.astype(v.dtype, copy=False)
    raw = sig * (ZETA - GAMMA) + GAMMA
    h = np.clip(raw, 0.0, 1.0)
    grad = np.where((raw > 0) & (raw < 1), sig * (1 - sig) * (ZETA - GAMMA), 0.0)
    return h, grad


def round_layer(weight: np.ndarray, scales: np.ndarray, layer: _Layer, iterations: int = ITERATIONS,
                qmax: int = WEIGHT_QMAX) -> np.ndarray:
    """int8 values in [-qmax, qmax] of `weight` with adaptive rounding (same shape as `weight`)."""
    axis = layer.out_axis
    rows = _rows(weight, axis)
    out, k = rows.shape
    s = np.broadcast_to(np.asarray(scales, np.float64).reshape(-1), (out,)) if np.ndim(scales) else \
        np.full(out, float(scales))
    scaled = rows / s[:, None]
    low = np.floor(scaled)
    rest = scaled - low
    second = layer.second / layer.count
    multiplier = out // second.shape[0] if layer.kind == "depthwise" else 1
    # normalise C so the regulariser's weight does not depend on the input's magnitude
    trace = np.trace(second, axis1=-2, axis2=-1)
    norm = (np.mean(trace) / k) if np.mean(trace) > 0 else 1.0
    c = second / norm
    # the optimisation runs in float32 (twice the BLAS speed); the final comparison in float64
    if layer.rows is not None:  # C = X^T X / (count norm): the product through the few input rows
        c_rows = np.concatenate(layer.rows) * np.float32(1.0 / np.sqrt(layer.count * norm))
    else:
        c_rows = (np.repeat(c, multiplier, axis=0) if layer.kind == "depthwise" else c).astype(np.float32)
    low32, scaled32 = low.astype(np.float32), scaled.astype(np.float32)

    p = np.clip((rest - GAMMA) / (ZETA - GAMMA), 1e-4, 1 - 1e-4)
    v = np.log(p / (1 - p)).astype(np.float32)
    v = _optimise_rows(v, low32, scaled32, c_rows, layer.kind == "depthwise", iterations, layer.rows is not None)

    h, _ = _h(v.astype(np.float64))
    adaptive = np.clip(low + (h >= 0.5), -qmax, qmax)
    nearest = np.clip(np.rint(scaled), -qmax, qmax)
    worse = _row_errors(adaptive - scaled, c, layer.kind, multiplier) >= \
        _row_errors(nearest - scaled, c, layer.kind, multiplier)
    chosen = np.where(worse[:, None], nearest, adaptive)
    moved = np.moveaxis(weight, axis, 0).shape
    return np.moveaxis(chosen.reshape(moved), 0, axis).astype(np.int8)


def _blocks(out: int, k: int) -> list[slice]:
    """The row blocks a layer's optimisation is split into: the rows are independent (each row's
    error and Adam state are its own), so blocks run on separate threads. About BLOCK_VALUES
    values each, a power of two of them (even work on 2, 4 or 8 cores), at least two from
    SPLIT_VALUES on: larger blocks make larger products, which BLAS runs faster per value (a few
    dozen rows of e C run well below its speed on a hundred), and fewer numpy calls per value.
    From the layer's shape alone, never from the machine, so every machine computes the same
    products and writes the same bytes."""
    values = out * k
    count = 1 << max(0, math.ceil(math.log2(max(1, values) / BLOCK_VALUES)))
    if values >= SPLIT_VALUES:
        count = max(count, 2)
    count = max(1, min(MAX_BLOCKS, count, out))
    edges = np.linspace(0, out, count + 1).round().astype(int)
    return [slice(a, b) for a, b in zip(edges[:-1], edges[1:])]


def _optimise_rows(v: np.ndarray, low: np.ndarray, scaled: np.ndarray, c_rows: np.ndarray, depthwise: bool,
                   iterations: int, factored: bool = False) -> np.ndarray:
    """`_optimise` on row blocks, one thread per allowed core (_one_blas_thread)."""
    blocks = _blocks(*v.shape)
    workers = min(len(blocks), usable_cores())
    with _one_blas_thread():
        if workers == 1:
            return _optimise(v, low, scaled, c_rows, depthwise, iterations, factored)
        with ThreadPoolExecutor(workers) as pool:
            parts = pool.map(lambda b: _optimise(v[b], low[b], scaled[b], c_rows[b] if depthwise else c_rows,
                                                 depthwise, iterations, factored), blocks)
            return np.concatenate(list(parts))


def _optimise(v: np.ndarray, low32: np.ndarray, scaled32: np.ndarray, c_rows: np.ndarray, depthwise: bool,
              iterations: int, factored: bool = False) -> np.ndarray:
    """Adam on the rows' relaxed roundings v (float32): their output error plus the annealed
    regulariser. The arithmetic of `_h` and of the plain expressions, in place in a few buffers.
    `factored`: c_rows is X with C = X^T X (fewer rows than K), and e C is (e X^T) X."""
    k = v.shape[1]
    v = v.copy()
    m1, m2 = np.zeros_like(v), np.zeros_like(v)
    sig, h, dh, err, a, b = (np.empty_like(v) for _ in range(6))
    inside = np.empty(v.shape, bool)
    gain = ZETA - GAMMA
    warm = int(WARMUP * iterations)
    for step in range(iterations):
        # h, dh = _h(v)
        np.negative(v, out=sig)
        np.exp(sig, out=sig)
        sig += 1.0
        np.divide(1.0, sig, out=sig)
        np.multiply(sig, gain, out=a)
        a += GAMMA  # the stretched sigmoid
        np.clip(a, 0.0, 1.0, out=h)
        np.greater(a, 0, out=inside)
        inside &= a < 1
        np.subtract(1, sig, out=dh)
        dh *= sig
        dh *= gain
        dh *= inside  # where the stretched sigmoid is clipped, no gradient
        np.add(low32, h, out=err)
        err -= scaled32  # in units of s: the scale is a per-row constant factor
        if depthwise:
            grad = (c_rows @ err[:, :, None])[:, :, 0]
        elif factored:
            grad = (err @ c_rows.T) @ c_rows
        else:
            grad = err @ c_rows
        grad *= 2.0
        grad /= k
        if step >= warm:
            beta = 20.0 + (2.0 - 20.0) * (step - warm) / max(1, iterations - warm)
            np.multiply(h, 2.0, out=a)
            a -= 1.0  # t = 2 h - 1
            np.sign(a, out=b)
            b *= REG_WEIGHT * beta
            np.abs(a, out=a)
            np.power(a, beta - 1, out=a)
            b *= a
            b *= 2.0
            grad -= b
        grad *= dh
        m1 *= 0.9
        np.multiply(grad, 0.1, out=a)
        m1 += a
        m2 *= 0.999
        np.multiply(grad, 0.001, out=a)
        a *= grad
        m2 += a
        np.divide(m1, 1 - 0.9 ** (step + 1), out=a)
        a *= LEARNING_RATE
        np.divide(m2, 1 - 0.999 ** (step + 1), out=b)
        np.sqrt(b, out=b)
        b += 1e-8
        a /= b
        v -= a
    return v


def output_error(weight: np.ndarray, q: np.ndarray, scales: np.ndarray, layer: _Layer) -> float:
    """E ||(W~ - W) x||^2 summed over output channels, on the layer's calibration inputs."""
    rows = _rows(weight, layer.out_axis)
    out = rows.shape[0]
    s = np.broadcast_to(np.asarray(scales, np.float64).reshape(-1), (out,)) if np.ndim(scales) else \
        np.full(out, float(scales))
    err = _rows(q.astype(np.float64), layer.out_axis) * s[:, None] - rows
    second = layer.second / layer.count
    multiplier = out // second.shape[0] if layer.kind == "depthwise" else 1
    return float(_row_errors(err, second, layer.kind, multiplier).sum())


def adaptive_rounding(model: onnx.ModelProto, plan: QuantPlan, params, data: list[Batch],
                      options: QuantizeConfig, threads: int = 0) -> Callable:
    """The `rounding` callback of quantize_graph: adaptive for every layer we could observe.

    Results are memoised for the process: the mixed-precision search quantizes the same
    model many times with different layers left float, and a layer's inputs (fp32) and
    rounding do not depend on which other layers are float."""
    key = (hashlib.sha256(model.SerializeToString()).hexdigest(), tuple(k for b in data for k in b.keys))
    if _MEMO.get("key") != key:
        _MEMO.clear()
        _MEMO.update(key=key, layers=collect_inputs(model, plan, data, threads), rounded={})
    layers, rounded = _MEMO["layers"], _MEMO["rounded"]
    qmax = weight_qmax(options.reduce_range)  # 7-bit weights with --reduce-range

    def rounding(name: str, weight: np.ndarray, scales: np.ndarray, axis) -> Optional[np.ndarray]:
        layer = layers.get(name)
        if layer is None:
            return None
        memo = (name, np.asarray(scales).tobytes())
        if memo not in rounded:
            rounded[memo] = round_layer(weight, scales, layer, qmax=qmax)
        return rounded[memo]

    return rounding
