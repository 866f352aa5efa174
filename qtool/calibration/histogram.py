"""A fixed, exactly mergeable histogram of float32 values keyed on their top 16 bits.

The top 16 bits of a float32 (its truncated bfloat16) split the finite float line into 65,280 bins
no wider than 1/128 of the values they hold. So no range is needed in advance and nothing is
re-binned while streaming, two histograms merge by adding counts, exactly (sharded and
multi-process calibration rely on it), and a tensor costs at most 65,536 counts whatever the
number of samples (qtool.calibration.statistics keeps only the filled keys and their counts, the
form the functions here read). `abs_linear` re-bins into the range methods' linear histogram of
|x| (2048 bins up to max |x|, the TensorRT recipe) by interpolating the cumulative count, which
is flat between filled keys. NaN and +-Inf keys are ignored: the statistics count and exclude
them first. Design: docs/design/histogram.md.
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


def sparse(dense: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(keys, counts): the filled keys of a dense histogram, ascending, and their counts (the form
    TensorStats keeps and the functions below read)."""
    keys = np.flatnonzero(dense)
    return keys, dense[keys]


def _finite_halves(hist: tuple[np.ndarray, np.ndarray]) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(the positive keys, their counts, the negative keys' magnitude keys, their counts), each
    ascending; the non-finite keys left out."""
    keys, counts = hist
    keys = keys.astype(np.int64)
    positive = keys < _FINITE_KEYS
    negative = (keys >= 0x8000) & (keys < 0x8000 + _FINITE_KEYS)
    return keys[positive], counts[positive], keys[negative] - 0x8000, counts[negative]


def abs_counts(hist: tuple[np.ndarray, np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """(keys 0..0x7F7F of |x|, ascending, and their counts): positive and negative keys folded
    together, the non-finite ones left out."""
    pos, pos_counts, neg, neg_counts = _finite_halves(hist)
    # on the dense key line (a key in both halves once, its counts added): linear in the keys,
    # where sorting the filled keys costs a few ms a tensor
    present = np.zeros(_FINITE_KEYS, dtype=bool)
    present[pos] = True
    present[neg] = True
    counts = np.zeros(_FINITE_KEYS, dtype=np.result_type(pos_counts, neg_counts))
    counts[pos] = pos_counts
    counts[neg] += neg_counts
    folded = np.flatnonzero(present)
    return folded, counts[folded]


def abs_linear(hist: tuple[np.ndarray, np.ndarray], top: float, bins: int = 2048) -> np.ndarray:
    """The histogram of |x| on `bins` equal bins over [0, top], re-binned from the key histogram."""
    filled, counts = abs_counts(hist)
    if top <= 0 or not np.isfinite(top):
        out = np.zeros(bins)
        out[0] = counts.sum()
        return out
    # the cumulative count is flat between the filled keys' edges: interpolated at those edges
    # (and the last edge under `top`, where the clamped edges start) it gives what it gives at all
    below_top = max(int(np.searchsorted(_EDGES, top, side="left")) - 1, 0)
    edge = np.zeros(_FINITE_KEYS + 1, dtype=bool)  # the edges to interpolate at, ascending
    edge[[0, below_top, _FINITE_KEYS]] = True
    edge[filled] = True
    edge[filled + 1] = True
    at_edges = np.flatnonzero(edge)
    edges = np.minimum(_EDGES[at_edges], top)
    cdf = np.concatenate([[0.0], np.cumsum(counts, dtype=np.float64)])
    cdf = cdf[np.searchsorted(filled, at_edges, side="left")]  # the counts below each edge
    # np.interp needs increasing x; clamped edges repeat `top`: keep the last of equal edges
    keep = np.concatenate([edges[1:] > edges[:-1], [True]])
    points = np.linspace(0.0, top, bins + 1)
    at = np.interp(points, edges[keep], cdf[keep])
    at[-1] = cdf[-1]
    return np.diff(at)


def _signed(hist: tuple[np.ndarray, np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """(the finite bins' positions in ascending value order, their counts): the negative keys from
    the most negative (position 0) to -0, then the positive ones (position 0x7F80 + key)."""
    pos, pos_counts, neg, neg_counts = _finite_halves(hist)
    return (np.concatenate([_FINITE_KEYS - 1 - neg[::-1], _FINITE_KEYS + pos]),
            np.concatenate([neg_counts[::-1], pos_counts]))


def signed_values_and_counts(hist: tuple[np.ndarray, np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """Bin centres (ascending values) and counts of the finite bins, for moments."""
    at, counts = _signed(hist)
    values = 0.5 * (_SIGNED_EDGES[at] + _SIGNED_EDGES[at + 1])
    nonzero = counts > 0
    return values[nonzero], counts[nonzero].astype(np.float64)


def signed_quantiles(hist: tuple[np.ndarray, np.ndarray], qs: tuple[float, ...], lo: float, hi: float
                     ) -> list[float]:
    """The q-quantile (0..1) of the values for each q in `qs` (one cumulative count for all),
    interpolated within bins, clamped to the exact [lo, hi]."""
    at, counts = _signed(hist)
    cdf = np.cumsum(counts, dtype=np.float64)
    if not cdf.size or cdf[-1] <= 0:
        return [hi if q >= 0.5 else lo for q in qs]
    return [_interpolated(_SIGNED_EDGES, at, cdf, q, lambda e: np.clip(e, lo, hi)) for q in qs]


def abs_quantile(hist: tuple[np.ndarray, np.ndarray], q: float, top: float) -> float:
    """The q-quantile of |x|, clamped to the exact max |x| `top`."""
    filled, counts = abs_counts(hist)
    cdf = np.cumsum(counts, dtype=np.float64)
    if not cdf.size or cdf[-1] <= 0:
        return top
    return _interpolated(_EDGES, filled, cdf, q, lambda e: np.minimum(e, top))


def _interpolated(edges: np.ndarray, filled: np.ndarray, cdf: np.ndarray, q: float, clamp) -> float:
    """The value below which a fraction q of the counts lie, interpolated linearly within its bin
    (`edges`: every bin's edges; `filled`: the filled bins, ascending; `cdf`: the cumulative count
    after each; the total is positive; between filled bins the cumulative count is flat), the
    bin's edges clamped by `clamp`."""
    target = q * cdf[-1]
    if target <= 0:
        return float(clamp(edges[:1])[0])
    j = int(np.searchsorted(cdf, target, side="left"))
    if j >= len(cdf):
        return float(clamp(edges[-1:])[0])
    k = int(filled[j])  # the bin the fraction q falls in
    c0, c1 = (cdf[j - 1] if j else 0.0), cdf[j]
    frac = 0.0 if c1 == c0 else (target - c0) / (c1 - c0)
    low, high = clamp(edges[k:k + 2])
    return float(low + frac * (high - low))


_SIGNED_EDGES = np.concatenate([-_EDGES[::-1], _EDGES[1:]])  # edges[0] = -2**128 ... edges[-1] = 2**128
