"""Adaptive weight rounding: each weight rounds down or up so that its layer's output error, not
the weight's own, is small.

For y = W x the output error of a row's rounding error e (in units of the row's scale) is e C e^T
with C = E[x x^T], so the K x K second moment of the layer's fp32 input patches (per channel for a
depthwise conv), accumulated batch by batch, is all the data a layer needs. The rows are rounded
one column at a time, as GPTQ/OPTQ does (Frantar et al. 2022), and each weight only to one of its
two grid neighbours, as in AdaRound (Nagel et al. 2020): a column's rounding error is compensated
on the columns not yet rounded, through the upper Cholesky factor U of (C + damping)^-1, which
gives the least-squares compensation in one product per column. The most active inputs (largest
diagonal of C) go first, so that the most columns are left to take their error. The damping, 1%
of C's mean diagonal, keeps the inverse finite where C was seen on fewer rows than K. A row not
better than round-to-nearest keeps round-to-nearest, so no layer gets worse on the calibration
inputs. Usage and figures: docs/accuracy.md.
"""

from __future__ import annotations

import hashlib
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
from qtool.graph.shapes import samples_within
from qtool.targets import weight_qmax

PATCHES_PER_BATCH = 2048
PATCH_BYTES = 2**24  # a depthwise conv's patches gathered at most this many bytes at a time (per thread)
# The pass fetches every layer's input at once, which with a whole batch of photos set the job's
# peak memory: a calibration batch runs in parts whose float tensors hold at most this many bytes
# (qtool.graph.shapes.samples_within; figures in benchmarks/README.md).
FETCHED_BYTES = 2**25
DAMPING = 0.01  # of C's mean diagonal, added to its diagonal
COLUMN_BLOCK = 32  # columns compensated lazily as one block (one product for the columns after it)
_MEMO: dict = {}  # the last model's layer statistics and roundings (see adaptive_rounding)


@dataclass
class _Layer:
    node: onnx.NodeProto
    kind: str  # "dense" (one C for all rows) | "depthwise" (one C per input channel)
    out_axis: int  # the weight axis of output channels
    kernel: tuple[int, ...] = ()  # a Conv's spatial kernel (the weight's shape after its two channel axes)
    second: Optional[np.ndarray] = None  # C accumulated (sum of x x^T)
    count: int = 0


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


def _pick(node: onnx.NodeProto, shape: tuple[int, ...], kernel: tuple[int, ...], rng: np.random.Generator,
          limit: int = PATCHES_PER_BATCH) -> Optional[np.ndarray]:
    """The positions of the at most `limit` input patches a conv's moments take from one run of
    input `shape` (None: all of them). Drawn from the one generator in the layers' order,
    before any layer's sums, so that the sums can run on several threads and still be the same
    bytes on every machine."""
    if node.op_type != "Conv":
        return None
    if _pointwise(node, kernel, shape):
        sh, sw = attribute(node, "strides", [1, 1])
        total = shape[0] * len(range(0, shape[2], sh)) * len(range(0, shape[3], sw))  # _moments' x[..., ::sh, ::sw]
        return rng.choice(total, limit, replace=False) if total > limit else None
    n, *_, oh, ow = _geometry(shape, node, kernel)
    total = n * oh * ow
    return rng.choice(total, size=min(total, limit), replace=False)


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
    step = max(1, PATCH_BYTES // (8 * k * count))
    parts = []
    for lo in range(0, c, step):
        flat = np.take(planes[lo:lo + step], where, axis=1).reshape(-1, count, k).astype(np.float64, copy=False)
        parts.append(flat.transpose(0, 2, 1) @ flat)
    return np.concatenate(parts), count


def _moments(layer: _Layer, x: np.ndarray, pick: Optional[np.ndarray]) -> tuple[np.ndarray, int]:
    """(sum of x x^T over the batch's sampled input rows, their number) for one layer and batch,
    in float64: float32 sums differ in their last bits with the BLAS kernel the CPU picks, and the
    rounding's near-ties follow them (the written bytes did). Runs on a worker thread; the layer's
    sums are not added to while it runs. An inf input gives inf or NaN, silently: collect_inputs
    drops such a layer."""
    with np.errstate(over="ignore", invalid="ignore"):
        return _sums(layer, x, pick)


def _sums(layer: _Layer, x: np.ndarray, pick: Optional[np.ndarray]) -> tuple[np.ndarray, int]:
    node = layer.node
    if node.op_type == "Conv":
        kernel = layer.kernel
        if _pointwise(node, kernel, x.shape):
            sh, sw = attribute(node, "strides", [1, 1])
            cols = np.moveaxis(x[:, :, ::sh, ::sw], 1, -1).reshape(-1, x.shape[1])
            if pick is not None:
                cols = cols[pick]
            patches = cols.reshape(cols.shape[0], x.shape[1], 1, 1)
        elif layer.kind == "depthwise":
            return _depthwise_second(x, node, kernel, pick)
        else:
            patches = _patches(x, node, kernel, pick)
        patches = patches.astype(np.float64, copy=False)
        if layer.kind == "depthwise":
            flat = np.ascontiguousarray(patches.reshape(patches.shape[0], patches.shape[1], -1).transpose(1, 2, 0))
            return flat @ flat.transpose(0, 2, 1), patches.shape[0]  # [C, k, k]: batched BLAS, not einsum
        flat = patches.reshape(patches.shape[0], -1)
        return flat.T @ flat, patches.shape[0]
    flat = x.reshape(-1, x.shape[-1]).astype(np.float64)
    return flat.T @ flat, flat.shape[0]


def _add(layer: _Layer, part: np.ndarray, rows: int) -> None:
    """Add one batch's moments to the layer's running sums (in the batches' order)."""
    layer.second = part if layer.second is None else layer.second + part
    layer.count += rows


def collect_inputs(model: onnx.ModelProto, plan: QuantPlan, data: list[Batch], threads: int = 0,
                   seed: int = 0) -> dict[str, _Layer]:
    """Weight name -> its layer with the input second moments C, from one fp32 pass.

    Each batch runs in parts of at most FETCHED_BYTES of tensors, which share its PATCHES_PER_BATCH
    patches by their samples. Per part, the patch positions are drawn in the layers' order (_pick),
    then the layers' sums run on one thread per allowed core (_one_blas_thread), and are added in
    the layers' order: the same bytes as one thread. A layer whose C is not finite (inputs with inf or NaN) is
    left out, so it rounds to nearest."""
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
    size = samples_within(model, max((len(batch) for batch in data), default=1), FETCHED_BYTES)
    runs = [(run, max(1, PATCHES_PER_BATCH * len(run) // len(batch))) for batch in data for run in batch.parts(size)]
    with ThreadPoolExecutor(usable_cores()) as pool, _one_blas_thread():
        for run, limit in runs:
            arrays = dict(zip(fetched, session.run(fetched, run.feeds)))
            arrays.update({n: run.feeds[n] for n in names if n in graph_inputs})
            jobs = []
            for name, layer in layers.items():
                if name in failed:
                    continue
                x = arrays[layer.node.input[0]]
                try:
                    pick = _pick(layer.node, x.shape, layer.kernel, rng, limit)
                except ValueError:
                    failed.add(name)  # a layout we do not unfold (3-D conv, auto_pad): round to nearest
                    continue
                jobs.append((name, pool.submit(_moments, layer, x, pick)))
            for name, job in jobs:
                try:
                    _add(layers[name], *job.result())
                except ValueError:
                    failed.add(name)
    return {name: layer for name, layer in layers.items()
            if name not in failed and layer.count and np.all(np.isfinite(layer.second))}


def _one_blas_thread():
    """BLAS held to one thread while the rounding's own threads (one layer each) run: every
    layer's products are then the same single-threaded ones on any machine, and OpenBLAS's own
    threads would only spin between the small products. threadpoolctl is imported here, by a job
    that rounds adaptively, and by no other."""
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


def _compensation(second: np.ndarray) -> np.ndarray:
    """U, the upper Cholesky factor of (C + damping)^-1 (batched for [..., k, k]): row j of U over
    U[j, j] is how a unit error in column j is best compensated on the columns after it."""
    diagonal = np.diagonal(second, axis1=-2, axis2=-1)
    damping = DAMPING * diagonal.mean(axis=-1) + 1e-12  # + a floor for a layer that saw only zeros
    damped = second + damping[..., None, None] * np.eye(second.shape[-1])
    return np.swapaxes(np.linalg.cholesky(np.linalg.inv(damped)), -1, -2)


def _round_dense(z: np.ndarray, low: np.ndarray, u: np.ndarray) -> np.ndarray:
    """Each column of z (rows x K, in scale units) rounded to low or low + 1, in order, its error
    compensated on the columns after it: in blocks of COLUMN_BLOCK, within a block column by
    column, then on the later columns as one product."""
    z = z.copy()
    q = np.empty_like(z)
    k = z.shape[1]
    for start in range(0, k, COLUMN_BLOCK):
        end = min(start + COLUMN_BLOCK, k)
        block = z[:, start:end]  # a view: compensated in place
        errors = np.empty_like(block)
        for j in range(end - start):
            col = start + j
            q[:, col] = np.clip(np.rint(block[:, j]), low[:, col], low[:, col] + 1)
            errors[:, j] = (block[:, j] - q[:, col]) / u[col, col]
            block[:, j + 1:] -= np.outer(errors[:, j], u[col, col + 1:end])
        z[:, end:] -= errors @ u[start:end, end:]
    return q


def _round_depthwise(z: np.ndarray, low: np.ndarray, u: np.ndarray) -> np.ndarray:
    """_round_dense for rows that each have their own U ([rows, k, k]), in the kernel's order."""
    z = z.copy()
    q = np.empty_like(z)
    for col in range(z.shape[1]):
        q[:, col] = np.clip(np.rint(z[:, col]), low[:, col], low[:, col] + 1)
        error = (z[:, col] - q[:, col]) / u[:, col, col]
        z[:, col + 1:] -= error[:, None] * u[:, col, col + 1:]
    return q


def round_layer(weight: np.ndarray, scales: np.ndarray, layer: _Layer, qmax: int = WEIGHT_QMAX) -> np.ndarray:
    """int8 values in [-qmax, qmax] of `weight` with adaptive rounding (same shape as `weight`)."""
    axis = layer.out_axis
    rows = _rows(weight, axis)
    out = rows.shape[0]
    s = np.broadcast_to(np.asarray(scales, np.float64).reshape(-1), (out,)) if np.ndim(scales) else \
        np.full(out, float(scales))
    scaled = rows / s[:, None]
    low = np.clip(np.floor(scaled), -qmax, qmax - 1)  # each weight becomes low or low + 1
    second = layer.second / layer.count
    if layer.kind == "depthwise":
        multiplier = out // second.shape[0]  # row o reads input channel o // multiplier
        adaptive = _round_depthwise(scaled, low, np.repeat(_compensation(second), multiplier, axis=0))
    else:
        multiplier = 1
        order = np.argsort(-np.diagonal(second), kind="stable")  # the most active inputs first
        adaptive = np.empty_like(scaled)
        adaptive[:, order] = _round_dense(scaled[:, order], low[:, order],
                                          _compensation(second[np.ix_(order, order)]))
    nearest = np.clip(np.rint(scaled), -qmax, qmax)
    worse = _row_errors(adaptive - scaled, second, layer.kind, multiplier) >= \
        _row_errors(nearest - scaled, second, layer.kind, multiplier)
    chosen = np.where(worse[:, None], nearest, adaptive)
    moved = np.moveaxis(weight, axis, 0).shape
    return np.moveaxis(chosen.reshape(moved), 0, axis).astype(np.int8)


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

    def rounding(weights: dict[str, tuple[np.ndarray, np.ndarray]]) -> dict[str, np.ndarray]:
        """name -> int8 values of the weights (name -> (weight, its final scales)) it rounds:
        the layers on one thread per allowed core, each layer's arithmetic on one (_one_blas_thread),
        so the values do not depend on the machine's cores."""
        todo = {(name, np.asarray(scales).tobytes()): (name, weight, scales)
                for name, (weight, scales) in weights.items() if name in layers}
        missing = sorted((memo for memo in todo if memo not in rounded), key=lambda m: -todo[m][1].size)
        if missing:
            with ThreadPoolExecutor(usable_cores()) as pool, _one_blas_thread():
                done = pool.map(lambda m: round_layer(todo[m][1], todo[m][2], layers[todo[m][0]], qmax), missing)
                rounded.update(zip(missing, done))
        return {name: rounded[memo] for memo, (name, _, _) in todo.items()}

    return rounding
