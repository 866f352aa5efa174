"""Scale and zero point: real = scale * (q - zero_point) (arXiv:1712.05877).

Activations: per tensor, asymmetric by default. Weights: int8 symmetric per output
channel in [-127, 127] with zero point 0 (the -128 code is left unused so that the
int8 x int8 products of some kernels cannot overflow int16 accumulators, and so the
grid is symmetric around zero). Biases: int32 with scale s_input * s_weight and zero
point 0, so the bias adds directly into the int32 accumulator.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import numpy as np

from qtool.targets import SYMMETRIC_HALF_GRID

INT_RANGES = {"uint8": (0, 255), "int8": (-128, 127), "uint16": (0, 65535), "int16": (-32768, 32767)}
SIXTEEN_BITS = {"uint8": "uint16", "int8": "int16"}  # an 8-bit activation type's 16-bit counterpart
INT16_QMAX = 32767
WEIGHT_QMAX = 127
INT32_MAX = 2**31 - 1

# Scale used when a range is empty (an all-zero tensor or weight channel): any positive
# finite scale represents zero exactly; 1.0 keeps the int32 bias of such a channel small.
EMPTY_RANGE_SCALE = 1.0
# Smallest scale qtool writes. A bias scale is s_input * s_weight; with both factors at
# least 2^-60 the product (>= 2^-120) stays a normal float32 instead of flushing to zero.
# A tensor whose whole range is below 255 * 2^-60 is zero for every practical purpose.
MIN_SCALE = 2.0**-60
FLOAT32_MAX = float(np.finfo(np.float32).max)


@dataclass(frozen=True)
class QParams:
    scale: float  # a float32 value, kept as a Python float
    zero_point: int
    dtype: str  # "uint8" | "int8", or "uint16" | "int16" (qparams.sixteen_bit)

    @property
    def range(self) -> tuple[float, float]:
        qmin, qmax = INT_RANGES[self.dtype]
        s = np.float32(self.scale)
        return float(s * np.float32(qmin - self.zero_point)), float(s * np.float32(qmax - self.zero_point))


def include_zero(lo: float, hi: float) -> tuple[float, float]:
    """Zero must be exactly representable (padding, ReLU), so the range always contains it."""
    return min(float(lo), 0.0), max(float(hi), 0.0)


def activation_qparams(lo: float, hi: float, dtype: str, symmetric: bool = False,
                       symmetric_qmax: float = SYMMETRIC_HALF_GRID) -> QParams:
    """symmetric_qmax: the code amax maps to (the target's convention, qtool.targets)."""
    lo, hi = include_zero(lo, hi)
    qmin, qmax = INT_RANGES[dtype]
    if symmetric:
        amax = max(-lo, hi)
        scale = amax / symmetric_qmax
        zero_point = 0 if dtype in ("int8", "int16") else (qmax + 1) // 2
    else:
        scale = (hi - lo) / (qmax - qmin)
        zero_point = None
    scale32 = np.float32(scale)
    if not (math.isfinite(float(scale32)) and scale32 > 0):
        scale32 = np.float32(EMPTY_RANGE_SCALE)
    scale32 = max(scale32, np.float32(MIN_SCALE))
    if zero_point is None:
        zero_point = int(np.clip(np.rint(qmin - lo / float(scale32)), qmin, qmax))
    return QParams(float(scale32), zero_point, dtype)


def sixteen_bit(params: QParams) -> QParams:
    """The 16-bit form of 8-bit activation parameters: the same calibrated range on a grid about
    256 times finer. The 8-bit range, widened by half an 8-bit step at each end (where rounding
    the zero point may have moved it from the calibrated range: a calibrated maximum can lie up
    to half a step outside it), on the 16-bit type of the same signedness; symmetric (int8 with
    zero point 0) stays symmetric: int16, zero point 0, scale max|range| / 32767."""
    lo, hi = params.range
    half = 0.5 * params.scale
    wide = SIXTEEN_BITS[params.dtype]
    if params.dtype == "int8" and params.zero_point == 0:
        return activation_qparams(lo - half, hi + half, wide, symmetric=True, symmetric_qmax=INT16_QMAX)
    return activation_qparams(lo - half, hi + half, wide)


def weight_scales(weight: np.ndarray, axis: Optional[int], qmax: int = WEIGHT_QMAX) -> np.ndarray:
    """Symmetric int8 scales: max|w| / 127 per channel along `axis` (a scalar array if None).
    qmax 63: 7-bit weights (reduce_range)."""
    w = np.abs(weight.astype(np.float64))
    if axis is None:
        amax = np.asarray(w.max() if w.size else 0.0)
    else:
        amax = w.max(axis=tuple(i for i in range(w.ndim) if i != axis))
    scales = (amax / qmax).astype(np.float32)
    bad = ~np.isfinite(scales) | (scales <= 0)
    scales = np.where(bad, np.float32(EMPTY_RANGE_SCALE), scales)
    return np.maximum(scales, np.float32(MIN_SCALE)).astype(np.float32)


def quantize_weight(weight: np.ndarray, scales: np.ndarray, axis: Optional[int], qmax: int = WEIGHT_QMAX) -> np.ndarray:
    shape = [1] * weight.ndim
    if axis is not None:
        shape[axis] = -1
    q = np.rint(weight.astype(np.float64) / scales.astype(np.float64).reshape(shape))
    return np.clip(q, -qmax, qmax).astype(np.int8)


def bias_scale(input_scale: float, weight_scales_: np.ndarray) -> np.ndarray:
    """Exactly s_input * s_weight[c], computed in float32 as the runtime will."""
    return (np.float32(input_scale) * weight_scales_.astype(np.float32)).astype(np.float32)


def quantize_bias(bias: np.ndarray, scales: np.ndarray) -> np.ndarray:
    q = np.rint(bias.astype(np.float64) / scales.astype(np.float64))
    return np.clip(q, -INT32_MAX, INT32_MAX).astype(np.int32)


def fit_weight_scales_to_bias(bias: np.ndarray, input_scale: float, scales: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Raise the weight scale of channels whose int32 bias would overflow.

    Returns the new scales and the indices of the channels changed. A tiny input scale
    times a tiny weight scale can put |bias / (s_in * s_w)| above 2^31 - 1; a larger
    weight scale for that channel keeps the bias exact at the cost of weight resolution.
    """
    limit = INT32_MAX * 0.999  # margin for float32 rounding of the product
    needed = np.abs(bias.astype(np.float64)) / (np.float64(np.float32(input_scale)) * limit)
    over = np.nonzero(needed > scales.astype(np.float64))[0]
    if over.size == 0:
        return scales, over
    fixed = scales.copy()
    # A bias too large for any finite float32 weight scale saturates in quantize_bias instead.
    fixed[over] = np.nextafter(np.minimum(needed[over], FLOAT32_MAX / 2).astype(np.float32), np.float32(np.inf))
    return fixed, over
