"""Integer kernels in numpy: what an int8 accelerator computes, code for code.

Accumulation is exact integer arithmetic (int64 numpy, checked to fit int32): int8 x
int8 products summed over the window, with the zero points taken out by the row/column
sum identity

    sum_k (x_k - zx)(w_k - zw) = sum x w - zw sum x - zx sum w + K zx zw,

where padding is filled with zx (it stands for real 0). Requantization has two forms:
`requantize_fixed` applies an int32 multiplier and shift (qtool/integer/fixed_point.py), the
integer-only form; `requantize_float` reproduces onnxruntime's MLAS kernels, which
multiply the float32 accumulator by a float32 scale and round half to even.
"""

from __future__ import annotations

import numpy as np

from qtool.integer.fixed_point import multiply_by_quantized_multiplier, quantize_multipliers, rounding_shift_right

INT32_MIN, INT32_MAX = -(2**31), 2**31 - 1


class AccumulatorOverflow(ValueError):
    pass


def _check_int32(acc: np.ndarray) -> np.ndarray:
    if acc.size and (acc.min() < INT32_MIN or acc.max() > INT32_MAX):
        raise AccumulatorOverflow("int32 accumulator overflow")
    return acc


def _pad(x: np.ndarray, pads: list[int], value: int) -> np.ndarray:
    spatial = len(pads) // 2
    widths = [(0, 0), (0, 0)] + [(pads[i], pads[i + spatial]) for i in range(spatial)]
    return np.pad(x, widths, constant_values=value)


def conv_acc(x: np.ndarray, zx: int, w: np.ndarray, zw: np.ndarray, strides, pads, dilations, group: int) -> np.ndarray:
    """int32 accumulators of an N-d convolution (N, C, *spatial) * (M, C/group, *kernel)."""
    x = _pad(x.astype(np.int64), pads, zx)
    spatial = x.ndim - 2
    kernel = w.shape[2:]
    span = [(k - 1) * d + 1 for k, d in zip(kernel, dilations)]
    windows = np.lib.stride_tricks.sliding_window_view(x, span, axis=tuple(range(2, 2 + spatial)))
    index = (slice(None), slice(None)) + tuple(slice(None, None, s) for s in strides)
    windows = windows[index]  # (N, C, *out, *span)
    windows = windows[(Ellipsis,) + tuple(slice(None, None, d) for d in dilations)]  # (N, C, *out, *kernel)
    n, c = x.shape[:2]
    out_shape = windows.shape[2:2 + spatial]
    m = w.shape[0]
    cg, mg = c // group, m // group
    k = cg * int(np.prod(kernel))
    w = w.astype(np.int64)
    zw = np.broadcast_to(np.asarray(zw, np.int64).reshape(-1), (m,))
    if cg == 1 and mg == 1:  # depthwise: one filter per channel, no matmul needed
        taps = windows.reshape(windows.shape[:2 + spatial] + (-1,))
        wk = w.reshape(m, -1)
        acc = np.einsum("nc...k,ck->nc...", taps, wk)
        acc -= zx * wk.sum(axis=1).reshape((1, m) + (1,) * spatial)
        acc -= zw.reshape((1, m) + (1,) * spatial) * (taps.sum(axis=-1) - k * zx)
        return _check_int32(acc)
    acc = np.empty((n, m) + out_shape, np.int64)
    for g in range(group):
        cols = windows[:, g * cg:(g + 1) * cg]  # (N, cg, *out, *kernel)
        cols = np.moveaxis(cols, 1, 1 + spatial).reshape(n * int(np.prod(out_shape)), k)
        wg = w[g * mg:(g + 1) * mg].reshape(mg, k)
        part = cols @ wg.T  # (N*out, mg)
        zwg = zw[g * mg:(g + 1) * mg]
        part -= cols.sum(axis=1, keepdims=True) * zwg  # row sums x zero point of w
        part -= zx * wg.sum(axis=1)  # column sums x zero point of x
        part += k * zx * zwg
        acc[:, g * mg:(g + 1) * mg] = np.moveaxis(part.reshape((n,) + out_shape + (mg,)), -1, 1)
    return _check_int32(acc)


def matmul_acc(a: np.ndarray, za: int, b: np.ndarray, zb: np.ndarray) -> np.ndarray:
    """int32 accumulators of a (..., K) @ (K, N) with per-column zero points of b."""
    a = a.astype(np.int64)
    b = b.astype(np.int64)
    zb = np.broadcast_to(np.asarray(zb, np.int64).reshape(-1), (b.shape[-1],))
    acc = a @ b - a.sum(axis=-1, keepdims=True) * zb - za * b.sum(axis=0) + a.shape[-1] * za * zb
    return _check_int32(acc)


def _channel_shape(ndim: int, axis: int) -> list[int]:
    shape = [1] * ndim
    shape[axis] = -1
    return shape


def requantize_fixed(acc: np.ndarray, reals: np.ndarray, zero_point: int, qmin: int, qmax: int,
                     axis: int = 1) -> np.ndarray:
    """y = clamp(MultiplyByQuantizedMultiplier(acc, M0, n) + zp): the integer-only path."""
    m0, n = quantize_multipliers(np.atleast_1d(reals))
    shape = _channel_shape(acc.ndim, axis) if m0.size > 1 else [1] * acc.ndim
    y = multiply_by_quantized_multiplier(acc, m0.reshape(shape), n.reshape(shape)) + zero_point
    return np.clip(y, qmin, qmax)


def requantize_float(acc: np.ndarray, scales32: np.ndarray, zero_point: int, qmin: int, qmax: int,
                     axis: int = 1) -> np.ndarray:
    """onnxruntime's MLAS: rint(float32(acc) * scale32) + zp, round half to even, saturate."""
    scales32 = np.atleast_1d(np.asarray(scales32, np.float32))
    shape = _channel_shape(acc.ndim, axis) if scales32.size > 1 else [1] * acc.ndim
    y = np.rint(acc.astype(np.float32) * scales32.reshape(shape)).astype(np.int64) + zero_point
    return np.clip(y, qmin, qmax)


def add_int32(qa, za, qb, zb, params: dict, zero_point: int, qmin: int, qmax: int) -> np.ndarray:
    """TFLite-style Add: both inputs scaled up by 2^left_shift and rescaled with 31-bit multipliers."""
    shifted = [(np.asarray(q, np.int64) - z) << params["left_shift"] for q, z in ((qa, za), (qb, zb))]
    scaled = [multiply_by_quantized_multiplier(v, p["multiplier"], p["shift"])
              for v, p in zip(shifted, params["inputs"])]
    out = params["output"]
    y = multiply_by_quantized_multiplier(scaled[0] + scaled[1], out["multiplier"], out["shift"]) + zero_point
    return np.clip(y, qmin, qmax)


def add_int16(qa, za, qb, zb, params: dict, zero_point: int, qmin: int, qmax: int) -> np.ndarray:
    """TPU-MLIR's Add: int8 multipliers, an int16 intermediate, one rounding right shift."""
    ma, mb = params["multipliers"]
    t = (np.asarray(qa, np.int64) - za) * ma + (np.asarray(qb, np.int64) - zb) * mb
    assert np.abs(t).max(initial=0) <= 2**15 - 1, "int16 intermediate overflow"
    return np.clip(rounding_shift_right(t, params["shift"]) + zero_point, qmin, qmax)


def _fma32(a: np.ndarray, b: np.float32, c: np.ndarray) -> np.ndarray:
    # a*b+c rounded once to float32: exact in float64 for int8 codes times a float32
    return (a.astype(np.float64) * np.float64(b) + c.astype(np.float64)).astype(np.float32)


def add_float(qa, sa, za, qb, sb, zb, sy, zy, qmin, qmax) -> np.ndarray:
    """onnxruntime's AVX2 QLinearAdd: fma(a, ra, fma(b, rb, zy - (ra za + rb zb))), ri = si/sy in float32.

    The compiler contracts ra*za + rb*zb into fma(ra, za, rb*zb); matching that is what
    makes the emulation bit-exact on the last few ties.
    """
    ra, rb = np.float32(np.float32(sa) / np.float32(sy)), np.float32(np.float32(sb) / np.float32(sy))
    offset = _fma32(np.asarray(np.float32(za)), ra, np.asarray(np.float32(rb * np.float32(zb))))
    fixed = np.float32(np.float32(zy) - offset)
    t = _fma32(np.asarray(qb, np.float32), rb, np.full(np.shape(qb), fixed, np.float32))
    y = _fma32(np.asarray(qa, np.float32), ra, t)
    return np.clip(np.rint(y).astype(np.int64), qmin, qmax)


def pool_sums(x: np.ndarray, zx: int, kernel, strides, pads, count_include_pad: bool) -> tuple[np.ndarray, np.ndarray]:
    """Window sums of (x - zx) and the element count of each window (AveragePool)."""
    centred = x.astype(np.int64) - zx
    ones = np.ones((1, 1) + x.shape[2:], np.int64)
    spatial = x.ndim - 2
    sums = _window_sum(_pad(centred, pads, 0), kernel, strides, spatial)
    if count_include_pad:
        counts = np.full(sums.shape[2:], int(np.prod(kernel)), np.int64)
    else:
        counts = _window_sum(_pad(ones, pads, 0), kernel, strides, spatial)[0, 0]
    return sums, counts


def _window_sum(x: np.ndarray, kernel, strides, spatial: int) -> np.ndarray:
    windows = np.lib.stride_tricks.sliding_window_view(x, kernel, axis=tuple(range(2, 2 + spatial)))
    windows = windows[(slice(None), slice(None)) + tuple(slice(None, None, s) for s in strides)]
    return windows.sum(axis=tuple(range(-spatial, 0)))


def max_pool(x: np.ndarray, kernel, strides, pads) -> np.ndarray:
    qmin = np.iinfo(x.dtype).min
    padded = _pad(x.astype(np.int64), pads, qmin)
    spatial = x.ndim - 2
    windows = np.lib.stride_tricks.sliding_window_view(padded, kernel, axis=tuple(range(2, 2 + spatial)))
    windows = windows[(slice(None), slice(None)) + tuple(slice(None, None, s) for s in strides)]
    return windows.max(axis=tuple(range(-spatial, 0)))


def avg_pool_float(x, sx, zx, sy, zy, kernel, strides, pads, count_include_pad, qmin, qmax) -> np.ndarray:
    """onnxruntime's QLinearAveragePool: dequantize to float32, sum taps in order, divide, quantize."""
    real = (np.float32(sx) * (x.astype(np.float32) - np.float32(zx))).astype(np.float32)
    padded = _pad(real, pads, 0)  # adding 0.0 leaves a float32 sum unchanged, as skipping the tap does
    spatial = x.ndim - 2
    windows = np.lib.stride_tricks.sliding_window_view(padded, kernel, axis=tuple(range(2, 2 + spatial)))
    windows = windows[(slice(None), slice(None)) + tuple(slice(None, None, s) for s in strides)]
    taps = windows.reshape(windows.shape[:2 + spatial] + (-1,))
    total = np.zeros(taps.shape[:-1], np.float32)
    for t in range(taps.shape[-1]):
        total = (total + taps[..., t]).astype(np.float32)
    _, counts = pool_sums(x, zx, kernel, strides, pads, count_include_pad)
    mean = (total / counts.astype(np.float32)).astype(np.float32)
    y = np.rint((mean / np.float32(sy) + np.float32(zy)).astype(np.float32))
    return np.clip(y.astype(np.int64), qmin, qmax)
