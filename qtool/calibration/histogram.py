"""A fixed, exactly mergeable histogram of float32 values keyed on their top 16 bits.

The top 16 bits of a float32 (its truncated bfloat16) split the finite float line into 65,280 bins
no wider than 1/128 of the values they hold. So no range is needed in advance and nothing is
re-binned while streaming, two histograms merge by adding counts, exactly (sharded and
multi-process calibration rely on it), and a tensor costs at most 65,536 counts whatever the
number of samples (qtool.calibration.statistics keeps only the filled ones). `abs_linear` re-bins
into the range methods' linear histogram of |x| (2048 bins up to max |x|, the TensorRT recipe)
by interpolating the cumulative count. NaN and +-Inf keys are ignored: the statistics count and
exclude them first. Design: docs/design/histogram.md.
"""

from __future__ import annotations

import sys

import numpy as np

NUM_KEYS = 1 << 16
_FINITE_KEYS = 0x7F80  # keys 0x0000..0x7F7F: finite non-negative (sign bit clear); 0x7F80.. are Inf/NaN


_HIGH_HALF = 1 if sys.byteorder == "little" else 0  # the uint16 holding a float32's top 16 bits


def keys(values: np.ndarray) -> np.ndarray:
    """The histogram key (top 16 bits) of each value, as uint16 (one strided copy of the high halves)."""
    halves = np.ascontiguousarray(values, dtype=np.float32).reshape(-1).view(np.uint16)
    return halves[_HIGH_HALF::2].copy()


def count(key_array: np.ndarray) -> np.ndarray:
    # np.bincount converts small integer types itself, more slowly than an explicit cast
    return np.bincount(key_array.astype(np.intp), minlength=NUM_KEYS).astype(np.int64, copy=False)


def _edges() -> np.ndarray:
    """|x| at the lower edge of keys 0..0x7F80 (the last is the upper edge of the largest finite bin)."""
    bits = (np.arange(_FINITE_KEYS + 1, dtype=np.uint32) << 16)
    edges = bits.view(np.float32).astype(np.float64)
    edges[-1] = 2.0 * edges[-2]  # key 0x7F80 is +Inf: use the bin's real upper edge 2**128
    return edges


_EDGES = _edges()


def abs_counts(hist: np.ndarray) -> np.ndarray:
    """Counts of |x| per key 0..0x7F7F (positive and negative keys folded together)."""
    return hist[:_FINITE_KEYS] + hist[0x8000:0x8000 + _FINITE_KEYS]


def _clamped_cdf(counts: np.ndarray, top: float) -> tuple[np.ndarray, np.ndarray]:
    """(edges, cumulative counts at the edges) of |x|, edges clamped to [0, top] (the exact max |x|)."""
    cdf = np.concatenate([[0.0], np.cumsum(counts, dtype=np.float64)])
    edges = np.minimum(_EDGES, top)
    return edges, cdf


def abs_linear(hist: np.ndarray, top: float, bins: int = 2048) -> np.ndarray:
    """The histogram of |x| on `bins` equal bins over [0, top], re-binned from the key histogram."""
    counts = abs_counts(hist)
    if top <= 0 or not np.isfinite(top):
        out = np.zeros(bins)
        out[0] = counts.sum()
        return out
    edges, cdf = _clamped_cdf(counts, top)
    # np.interp needs increasing x; clamped edges repeat `top`: keep the last of equal edges
    keep = np.concatenate([edges[1:] > edges[:-1], [True]])
    points = np.linspace(0.0, top, bins + 1)
    at = np.interp(points, edges[keep], cdf[keep])
    at[-1] = cdf[-1]
    return np.diff(at)


def signed_values_and_counts(hist: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Bin centres (ascending values) and counts of the finite bins, for moments."""
    pos = hist[:_FINITE_KEYS]
    neg = hist[0x8000:0x8000 + _FINITE_KEYS]
    centres = 0.5 * (_EDGES[:-1] + _EDGES[1:])
    values = np.concatenate([-centres[::-1], centres])
    counts = np.concatenate([neg[::-1], pos])
    nonzero = counts > 0
    return values[nonzero], counts[nonzero].astype(np.float64)


def signed_quantiles(hist: np.ndarray, qs: tuple[float, ...], lo: float, hi: float) -> list[float]:
    """The q-quantile (0..1) of the values for each q in `qs` (one cumulative count for all),
    interpolated within bins, clamped to the exact [lo, hi]."""
    pos = hist[:_FINITE_KEYS].astype(np.float64)
    neg = hist[0x8000:0x8000 + _FINITE_KEYS].astype(np.float64)
    # ascending value order: negative bins from the most negative, then positive bins
    edges = np.concatenate([-_EDGES[::-1], _EDGES[1:]])  # edges[0] = -2**128 ... edges[-1] = 2**128
    counts = np.concatenate([neg[::-1], pos])
    edges = np.clip(edges, lo, hi)
    cdf = np.concatenate([[0.0], np.cumsum(counts)])
    if cdf[-1] <= 0:
        return [hi if q >= 0.5 else lo for q in qs]
    return [_interpolated(edges, cdf, q) for q in qs]


def abs_quantile(hist: np.ndarray, q: float, top: float) -> float:
    """The q-quantile of |x|, clamped to the exact max |x| `top`."""
    counts = abs_counts(hist).astype(np.float64)
    edges, cdf = _clamped_cdf(counts, top)
    if cdf[-1] <= 0:
        return top
    return _interpolated(edges, cdf, q)


def _interpolated(edges: np.ndarray, cdf: np.ndarray, q: float) -> float:
    """The value below which a fraction q of the counts lie, interpolated linearly within its
    bin (`cdf[k]`: the counts below `edges[k]`; the total is positive)."""
    target = q * cdf[-1]
    i = int(np.searchsorted(cdf, target, side="left"))
    if i <= 0:
        return float(edges[0])
    if i >= len(cdf):
        return float(edges[-1])
    c0, c1 = cdf[i - 1], cdf[i]
    frac = 0.0 if c1 == c0 else (target - c0) / (c1 - c0)
    return float(edges[i - 1] + frac * (edges[i] - edges[i - 1]))
