"""Choosing a quantization range from a tensor's statistics.

A method maps one tensor's streaming summary to the (low, high) interval the int8 grid covers;
values outside are clipped, and a narrower range gives finer steps to the values that matter.
minmax takes the observed extremes (optionally averaged per batch, or symmetric) and never clips a
calibration value; percentile, entropy (TensorRT's KL recipe), mse (least expected clipping plus
rounding error) and aciq (Banner et al.'s Laplace/Gaussian fit) choose a threshold t on |x| from
the histogram and return the observed range cut to [-t, t], so a non-negative tensor keeps its
full uint8 grid on [0, t]. The registry is METHODS; figures: docs/accuracy.md, "Range methods".
"""

from __future__ import annotations

import math
from functools import lru_cache
from typing import Callable, Optional

import numpy as np

from qtool.calibration import histogram
from qtool.config import CalibrationConfig
from qtool.errors import QtoolError
from qtool.calibration.statistics import TensorStats

RangeMethod = Callable[[TensorStats, CalibrationConfig], tuple[float, float]]

BINS = 2048  # the linear |x| histogram of the TensorRT recipe
LEVELS = 128  # int8 magnitude levels: candidate thresholds start here
ENTROPY_COARSE, ENTROPY_FINE = 32, 4  # candidates every 32 bins, then every 4 bins around the best (0.2% of max)


def _abs_max(stats: TensorStats) -> float:
    return max(abs(stats.min), abs(stats.max))


def _clip_to(stats: TensorStats, threshold: float) -> tuple[float, float]:
    return max(stats.min, -threshold), min(stats.max, threshold)


def _symmetric(lo: float, hi: float) -> tuple[float, float]:
    t = max(abs(lo), abs(hi))
    return -t, t


def minmax(stats: TensorStats, calib: CalibrationConfig) -> tuple[float, float]:
    """The observed extremes: nothing is clipped, so outliers cost resolution.

    moving_average: the mean of each batch's extremes instead (TensorFlow's moving
    average min-max with the batches weighted equally, which, unlike an exponential
    average, merges exactly across shards)."""
    if calib.moving_average and stats.batches:
        lo, hi = stats.batch_min_sum / stats.batches, stats.batch_max_sum / stats.batches
    else:
        lo, hi = stats.min, stats.max
    return _symmetric(lo, hi) if calib.symmetric else (lo, hi)


def _hist(stats: TensorStats) -> tuple[np.ndarray, np.ndarray]:
    """The histogram's filled keys and their counts (histogram.sparse's form)."""
    stats.flush()
    if stats.hist_keys is None:
        raise ValueError("this range method needs a histogram; the statistics were collected without one")
    return stats.hist_keys, stats.hist_counts


def percentile(stats: TensorStats, calib: CalibrationConfig) -> tuple[float, float]:
    """Symmetric: the p-th percentile of |x|. Otherwise each tail cut at (100 - p)%."""
    hist = _hist(stats)
    q = calib.percentile / 100.0
    if calib.symmetric:
        t = histogram.abs_quantile(hist, q, _abs_max(stats))
        return -t, t
    low, high = histogram.signed_quantiles(hist, (1.0 - q, q), stats.min, stats.max)
    return low, high


def _kl(p: np.ndarray, q: np.ndarray) -> float:
    p = p / p.sum()
    q = q / q.sum()
    mask = p > 0
    return float(np.sum(p[mask] * np.log(p[mask] / q[mask])))


_EPS = 1e-4  # the mass _smooth gives an empty bin


def _smooth(dist: np.ndarray, eps: float = _EPS) -> Optional[np.ndarray]:
    """Give empty bins a little mass taken evenly from the others (so KL stays finite)."""
    zero = dist == 0
    n_zero, n_nonzero = int(zero.sum()), dist.size - int(zero.sum())
    if n_nonzero == 0:
        return None
    out = dist.astype(np.float64).copy()
    out[zero] = eps
    out[~zero] -= eps * n_zero / n_nonzero
    return out if (out > 0).all() else None


class _Candidates:
    """The KL of TensorRT's recipe for candidate numbers of bins kept, on one histogram.

    `exact(i)` is the reference computation of one candidate. `fast(cands)` evaluates many at
    once with the same formulas rearranged: the reference Q is constant over each level's
    non-empty bins, and empty bins (below the last) have eps in both smoothed P and Q, so

        KL = (sum_j P_j log P_j - sum_levels log Q_k * (P's mass in level k)) / sum P + log(sum Q / sum P)

    over the smoothed P, Q, with the last bin (the folded tail) apart; only sum P_j log P_j
    needs every bin. The smoothing's validity tests are the reference's comparisons, exactly.
    Only rounding differs from `exact` (sums taken in another order, terms regrouped), by far
    less than the returned bound (1e-9 of the magnitudes involved), and `best` recomputes
    exactly the candidates within the bounds of the fast minimum, so the choice is exactly
    the reference computation's, ties included."""

    def __init__(self, hist: np.ndarray, levels: int):
        self.hist, self.levels = hist, levels
        self.suffix = np.concatenate([np.cumsum(hist[::-1])[::-1], [0.0]])
        self.nonzero = (hist != 0).astype(np.float64)
        # prefix sums: a level's mass and its non-empty bins
        self.mass = np.concatenate([[0.0], np.cumsum(hist)])
        self.filled = np.concatenate([[0.0], np.cumsum(self.nonzero)])
        self.grid = np.arange(levels + 1)
        self.known: dict[int, float] = {}  # exact KLs computed
        self.estimated: dict[int, tuple[float, float]] = {}  # fast KLs and their bounds
        # the rearranged sums assume counts >= 0 (a non-empty bin is positive), as histograms have
        self.rearranged = bool(hist.size >= 2 and (hist >= 0).all() and np.isfinite(hist).all())
        if self.rearranged:
            self.zeros = np.concatenate([[0], np.cumsum(hist == 0)])  # empty bins among the first i
            self.min_positive = np.concatenate([[math.inf], np.minimum.accumulate(np.where(hist > 0, hist, math.inf))])

    def exact(self, i: int) -> float:
        if i not in self.known:
            p = self.hist[:i].copy()
            p[-1] += self.suffix[i]
            # `levels` chunks of (nearly) equal numbers of bins, as np.array_split makes them
            edges = (self.grid * i) // self.levels
            sums = self.mass[edges[1:]] - self.mass[edges[:-1]]
            nz_per = self.filled[edges[1:]] - self.filled[edges[:-1]]
            per_bin = np.divide(sums, nz_per, out=np.zeros(self.levels), where=nz_per > 0)
            q = np.repeat(per_bin, np.diff(edges)) * self.nonzero[:i]
            ps, qs = _smooth(p), _smooth(q)
            self.known[i] = math.inf if ps is None or qs is None else _kl(ps, qs)
        return self.known[i]

    def fast(self, cands: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(KL, bound on its difference from `exact`) per candidate i >= 2 (inf: no finite KL)."""
        hist, levels, eps = self.hist, self.levels, _EPS
        # P: hist[:i - 1], then the last bin with the tail folded in; a = P's smoothing shift
        last = hist[cands - 1] + self.suffix[cands]
        zeros_p = self.zeros[cands - 1] + (last == 0)
        nonzero_p = cands - zeros_p
        a = eps * zeros_p / np.maximum(nonzero_p, 1)
        ok = (nonzero_p > 0) & (self.min_positive[cands - 1] > a) & ((last == 0) | (last > a))
        # Q: per level, the level's mass spread over its non-empty bins; b = Q's smoothing shift
        edges = (self.grid[None, :] * cands[:, None]) // levels
        sums = self.mass[edges[:, 1:]] - self.mass[edges[:, :-1]]
        nz_per = self.filled[edges[:, 1:]] - self.filled[edges[:, :-1]]
        filled = nz_per > 0
        per_bin = np.divide(sums, nz_per, out=np.zeros(sums.shape), where=filled)
        zeros_q = self.zeros[cands]  # Q is 0 exactly on the empty bins
        nonzero_q = cands - zeros_q
        b = eps * zeros_q / np.maximum(nonzero_q, 1)
        ok &= (nonzero_q > 0) & (np.where(filled, per_bin, math.inf).min(axis=1) > b)
        with np.errstate(divide="ignore", invalid="ignore"):
            ps_last = np.where(last == 0, eps, last - a)
            qs_last = np.where(hist[cands - 1] == 0, eps, per_bin[:, -1] - b)
            # sum over the non-empty bins below the last of ps log ps (every bin: a ragged array)
            lens = cands - 1
            starts = np.concatenate([[0], np.cumsum(lens)[:-1]])
            h = hist[np.arange(int(lens.sum())) - np.repeat(starts, lens)]
            d = h - np.repeat(a, lens)
            t = np.where(h > 0, d * np.log(d), 0.0)
            plogp = np.add.reduceat(t, starts)
            plogp_mag = np.add.reduceat(np.abs(t), starts)
            # P's mass per level over the non-empty bins below the last (bin i - 1 is in the last level)
            top = np.minimum(edges[:, 1:], (cands - 1)[:, None])
            level_mass = (self.mass[top] - self.mass[edges[:, :-1]]) - a[:, None] * (
                self.filled[top] - self.filled[edges[:, :-1]])
            plogq_terms = np.where(filled, np.log(np.where(filled, per_bin - b[:, None], 1.0)) * level_mass, 0.0)
            plogq = plogq_terms.sum(axis=1)
            last_term = ps_last * (np.log(ps_last) - np.log(qs_last))
            total_p = self.mass[cands] + self.suffix[cands] - a * nonzero_p + eps * zeros_p
            total_q = self.mass[cands] - b * nonzero_q + eps * zeros_q
            kl = (plogp - plogq + last_term) / total_p + np.log(total_q / total_p)
            bound = 1e-9 * ((plogp_mag + np.abs(plogq_terms).sum(axis=1) + np.abs(last_term)) / total_p
                            + np.abs(np.log(total_q)) + np.abs(np.log(total_p))) + 1e-12
        return np.where(ok, kl, math.inf), bound

    def best(self, cands: list[int]) -> int:
        """The candidate of smallest exact KL (the smaller one on a tie)."""
        if not self.rearranged or min(cands) < 2:
            return min(cands, key=lambda i: (self.exact(i), i))
        new = np.asarray([i for i in cands if i not in self.estimated], dtype=np.int64)
        if new.size:
            self.estimated.update(zip(new.tolist(), zip(*self.fast(new))))
        cands_arr = np.asarray(cands, dtype=np.int64)
        kl = np.array([self.estimated[i][0] for i in cands])
        bound = np.array([self.estimated[i][1] for i in cands])
        if not np.isfinite(kl).any():
            return int(cands_arr.min())  # every KL is inf, exactly
        k = int(np.argmin(kl))
        near = cands_arr[kl - bound <= kl[k] + bound[k]]
        if near.size == 1:
            return int(near[0])
        return min((int(i) for i in near), key=lambda i: (self.exact(i), i))


def entropy_threshold(hist: np.ndarray, levels: int = LEVELS) -> int:
    """TensorRT's recipe on a linear histogram of |x|: the number of bins to keep.

    For each candidate i (from LEVELS bins up): the reference P is the first i bins with
    the mass beyond folded into bin i-1; Q quantizes those i bins into `levels` levels
    (each level's mass spread evenly over its non-empty bins). The smallest KL(P||Q)
    wins (searched coarse to fine). Folding the tail makes clipping costly only in
    proportion to its mass, so a heavy rare tail is clipped and a uniform distribution
    keeps its whole range. As in NVIDIA's own implementation (pytorch-quantization), the
    first bin takes the count of the second: the exact zeros of a ReLU are a spike that
    no threshold represents better or worse, but it would dominate the KL and drive the
    threshold down to where the spike's level is narrowest (0.7 of 6 on ReLU6 outputs)."""
    hist = hist.astype(np.float64).copy()
    if hist.size > 1:
        hist[0] = hist[1]
    total = hist.sum()
    if total <= 0:
        return hist.size
    kl = _Candidates(hist, levels)
    # coarse to fine: every 32 bins from LEVELS (and the full range), then every 4 bins around the best
    coarse = sorted(set(range(LEVELS, hist.size + 1, ENTROPY_COARSE)) | {hist.size})
    best = kl.best(coarse)
    fine = range(max(LEVELS, best - ENTROPY_COARSE), min(hist.size, best + ENTROPY_COARSE) + 1, ENTROPY_FINE)
    return kl.best(sorted(set(coarse) | set(fine)))


def entropy(stats: TensorStats, calib: CalibrationConfig) -> tuple[float, float]:
    top = _abs_max(stats)
    if top <= 0:
        return stats.min, stats.max
    lin = histogram.abs_linear(_hist(stats), top, BINS)
    # Q has 128 levels per side for a signed tensor, 256 for a non-negative one (its uint8 grid)
    t = entropy_threshold(lin, LEVELS if stats.min < 0 else 2 * LEVELS) * top / BINS
    return _symmetric(*_clip_to(stats, t)) if calib.symmetric else _clip_to(stats, t)


def mse_threshold(hist: np.ndarray, top: float, steps: int) -> float:
    """The threshold t (a bin edge) minimizing sum n_c * err(c, t) over bin centres c:
    (c - t)^2 beyond t (clipping), delta^2 / 12 within (rounding, delta = t / steps)."""
    width = top / hist.size
    centres = (np.arange(hist.size) + 0.5) * width
    n = hist.astype(np.float64)
    # suffix sums over bins beyond candidate t = edge k: sum n, sum n c, sum n c^2
    s0 = np.concatenate([np.cumsum(n[::-1])[::-1], [0.0]])
    s1 = np.concatenate([np.cumsum((n * centres)[::-1])[::-1], [0.0]])
    s2 = np.concatenate([np.cumsum((n * centres ** 2)[::-1])[::-1], [0.0]])
    k = np.arange(1, hist.size + 1)
    t = k * width
    clipping = s2[k] - 2 * t * s1[k] + t ** 2 * s0[k]
    rounding = (t / steps) ** 2 / 12.0 * (s0[0] - s0[k])
    return float(t[int(np.argmin(clipping + rounding))])


def mse(stats: TensorStats, calib: CalibrationConfig) -> tuple[float, float]:
    top = _abs_max(stats)
    if top <= 0:
        return stats.min, stats.max
    lin = histogram.abs_linear(_hist(stats), top, BINS)
    # 255 steps over [-t, t] for a signed tensor (127.5 per side), over [0, t] for a non-negative one
    steps = 127.5 if stats.min < 0 else 255.0
    t = mse_threshold(lin, top, steps)
    return _symmetric(*_clip_to(stats, t)) if calib.symmetric else _clip_to(stats, t)


@lru_cache(maxsize=None)
def aciq_alpha(distribution: str, bits: int = 8) -> float:
    """Banner et al. (ACIQ): the clipping value, in units of b (Laplace) or sigma (Gaussian), that
    minimizes clipping noise + rounding noise alpha^2 / (3 * 4^bits), solved numerically:
    Laplace clipping noise 2 b^2 exp(-alpha / b); Gaussian (alpha^2 + s^2)(1 - erf(alpha/(s sqrt 2)))
    - sqrt(2/pi) alpha s exp(-alpha^2 / (2 s^2)). For 8 bits: 9.89 b and 3.92 sigma."""
    alphas = np.linspace(0.5, 20.0, 195001)
    rounding = alphas ** 2 / (3.0 * 4.0 ** bits)
    if distribution == "laplace":
        clipping = 2.0 * np.exp(-alphas)
    else:
        erf = np.vectorize(math.erf)
        clipping = (alphas ** 2 + 1) * (1 - erf(alphas / math.sqrt(2))) \
            - math.sqrt(2 / math.pi) * alphas * np.exp(-alphas ** 2 / 2)
    return float(alphas[int(np.argmin(clipping + rounding))])


def aciq(stats: TensorStats, calib: CalibrationConfig) -> tuple[float, float]:
    """Fit the distribution by its moments (from the histogram), clip at mean +- alpha."""
    values, counts = histogram.signed_values_and_counts(_hist(stats))
    if counts.sum() <= 0:
        return stats.min, stats.max
    mean = float(np.average(values, weights=counts))
    if calib.aciq_distribution == "laplace":
        spread = float(np.average(np.abs(values - mean), weights=counts))  # b = E|x - mean|
    else:
        spread = float(np.sqrt(np.average((values - mean) ** 2, weights=counts)))
    alpha = aciq_alpha(calib.aciq_distribution) * spread
    if calib.symmetric:
        t = min(abs(mean) + alpha, _abs_max(stats))
        return -t, t
    return max(stats.min, mean - alpha), min(stats.max, mean + alpha)


METHODS: dict[str, RangeMethod] = {"minmax": minmax, "percentile": percentile, "entropy": entropy, "mse": mse,
                                   "aciq": aciq}
HISTOGRAM_METHODS = frozenset(METHODS) - {"minmax"}


AUTO = "auto"  # chosen by measurement where a model can be quantized (qtool.choices.ranges), else minmax


def check_method(method: str) -> str:
    if method not in METHODS:
        raise QtoolError(f"unknown calibration method '{method}'; known: {', '.join(METHODS)}")
    return method


def resolve_method(method: str) -> str:
    """`method` as a table is built with it: `auto` where nothing measures the candidates is minmax."""
    return "minmax" if method == AUTO else check_method(method)


def choose_range(stats: TensorStats, method: str, calib: Optional[CalibrationConfig] = None) -> tuple[float, float]:
    chooser = METHODS[check_method(method)]
    if not stats.seen:
        return 0.0, 0.0
    return chooser(stats, calib or CalibrationConfig(method=method))
