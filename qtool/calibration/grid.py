"""Measured values on a coarse grid, so that another CPU's float kernels do not reach the written bytes.

onnxruntime's fp32 kernels differ between x86 and ARM in the activations' last bits, and every range,
mean or channel maximum measured from them, and each scale, zero point and int32 bias computed from
those, would inherit that. A measured value is therefore kept to MANTISSA_BITS bits of mantissa,
rounded outward (a range only widens, by less than 0.4%): a few-ulp difference then changes a byte
only where it straddles one of 256 steps per octave. Channel maxima, thousands per model, only set
equalization and SmoothQuant factors: they take CHANNEL_BITS (steps of at most 3%), so that one of
them straddles a step 8 times less often. Bit arithmetic on float64, the same on every CPU; grid
values map to themselves (a table read back)."""

from __future__ import annotations

import numpy as np

MANTISSA_BITS = 8
CHANNEL_BITS = 5


def _low(bits: int) -> np.uint64:
    return np.uint64((1 << (52 - bits)) - 1)


def away_from_zero(values: np.ndarray | float, bits: int = MANTISSA_BITS) -> np.ndarray:
    """`values` (float64) with their magnitudes rounded up to the grid of `bits` mantissa bits;
    zero, inf and nan stay."""
    x = np.array(values, dtype=np.float64)
    raw, low = x.view(np.uint64), _low(bits)
    finite = np.isfinite(x) & ((raw & low) != 0)
    rounded = (raw & ~low) + (low + np.uint64(1))  # a carry into the exponent is the next octave
    return np.where(finite, rounded, raw).view(np.float64)


def toward_zero(values: np.ndarray | float, bits: int = MANTISSA_BITS) -> np.ndarray:
    """`values` (float64) with their magnitudes truncated to the grid of `bits` mantissa bits."""
    x = np.array(values, dtype=np.float64)
    raw = x.view(np.uint64)
    return np.where(np.isfinite(x), raw & ~_low(bits), raw).view(np.float64)


def outward(lo: float, hi: float) -> tuple[float, float]:
    """The smallest grid interval holding [lo, hi]."""
    low = away_from_zero(lo) if lo < 0 else toward_zero(lo)
    high = away_from_zero(hi) if hi > 0 else toward_zero(hi)
    return float(low), float(high)
