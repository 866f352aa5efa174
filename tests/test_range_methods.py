"""Known answers of every range method on synthetic distributions, and the histogram it rests on.

The data go through the same streaming summaries as a real calibration (TensorStats fed
batch by batch); each test states the value a method must find and fails if a method
falls back to the observed extremes (min-max) where it must clip.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from qtool.calibration import histogram

from qtool.calibration import ranges
from qtool.config import CalibrationConfig
from qtool.calibration.statistics import TensorStats

N = 1_000_000


def _stats(values: np.ndarray, batches: int = 10) -> TensorStats:
    stats = TensorStats.with_histogram()
    stats.sample_limit = values.size  # every value feeds the histogram
    for chunk in np.array_split(values.astype(np.float32), batches):
        stats.update(chunk)
    stats.flush()
    return stats


def _range(stats, method, **options):
    return ranges.choose_range(stats, method, CalibrationConfig(method=method, **options))


@pytest.fixture(scope="module")
def outliers():
    """Standard Gaussian with one value at +50 sigma and one at -50 (one in a million each)."""
    x = np.random.default_rng(1).normal(size=N)
    x[[1000, 500_000]] = [50.0, -50.0]
    return _stats(x)


@pytest.mark.parametrize("method", sorted(ranges.METHODS))
def test_uniform_data_every_method_keeps_about_the_whole_range(method):
    stats = _stats(np.random.default_rng(0).uniform(-1, 1, N))
    lo, hi = _range(stats, method)
    assert -1.0 <= lo <= -0.97 and 0.97 <= hi <= 1.0, (lo, hi)


def test_minmax_keeps_the_outlier(outliers):
    assert _range(outliers, "minmax") == (-50.0, 50.0)


@pytest.mark.parametrize("method,low,high", [("percentile", 3.5, 4.2),  # 99.99% per tail of N(0,1): 3.72
                                             ("entropy", 3.0, 10.0),
                                             # 2 (50 - t)^2 clipped + 1e6 (t / 127.5)^2 / 12 rounded: t = 14.0
                                             ("mse", 13.0, 15.0),
                                             ("aciq", 7.5, 8.5)])  # 9.89 * E|x| = 9.89 * 0.798
def test_histogram_methods_clip_far_below_a_rare_outlier(outliers, method, low, high):
    lo, hi = _range(outliers, method)
    assert low <= hi <= high and -high <= lo <= -low, (method, lo, hi)
    assert hi < 0.3 * _range(outliers, "minmax")[1]  # really not min-max


def test_percentile_symmetric_uses_abs_and_asymmetric_each_tail():
    rng = np.random.default_rng(2)
    x = np.concatenate([rng.exponential(1.0, N), -rng.exponential(0.1, N)])  # long right tail, short left
    stats = _stats(x)
    lo, hi = _range(stats, "percentile", percentile=99.9)
    np.testing.assert_allclose(hi, np.quantile(x, 0.999), rtol=0.02)
    np.testing.assert_allclose(lo, np.quantile(x, 0.001), rtol=0.02)
    slo, shi = _range(stats, "percentile", percentile=99.9, symmetric=True)
    np.testing.assert_allclose(shi, np.quantile(np.abs(x), 0.999), rtol=0.02)
    assert slo == -shi


@pytest.mark.parametrize("b", [0.5, 3.0])
def test_aciq_laplace_closed_form(b):
    # Banner et al.: for 8 bits the MSE-optimal clipping of Laplace(0, b) is 9.89 b
    assert ranges.aciq_alpha("laplace") == pytest.approx(9.89, abs=0.01)
    assert ranges.aciq_alpha("gaussian") == pytest.approx(3.92, abs=0.01)
    x = np.random.default_rng(3).laplace(0.0, b, 4 * N)  # max |x| ~ 15 b: the clip is below it
    lo, hi = _range(_stats(x), "aciq")
    assert hi == pytest.approx(9.89 * b, rel=0.02) and lo == pytest.approx(-9.89 * b, rel=0.02)
    assert hi < 0.85 * np.abs(x).max()


def test_aciq_gaussian_fit():
    x = np.random.default_rng(4).normal(0.0, 2.0, N)
    lo, hi = _range(_stats(x), "aciq", aciq_distribution="gaussian")
    assert hi == pytest.approx(3.92 * 2.0, rel=0.02) and lo == pytest.approx(-3.92 * 2.0, rel=0.02)


def test_entropy_is_the_tensorrt_recipe_on_a_known_histogram():
    # an exponentially decaying bulk (scale 40 bins) and a sparse tail of single counts out to
    # bin 2047: clipping near the bulk's end loses less information than 16-bin levels do
    bins = np.arange(2048)
    hist = np.floor(1e5 * np.exp(-bins / 40.0))
    hist[bins % 7 == 0] += 1.0
    kept = ranges.entropy_threshold(hist)
    assert 128 <= kept <= 700, kept
    # but a histogram whose bins are all needed is kept whole (KL of quantizing it is 0 at 2048)
    sparse = np.zeros(2048)
    sparse[::16] = 5.0
    assert ranges.entropy_threshold(sparse) > 2032  # the last non-empty bin is kept
    flat = np.full(2048, 10.0)  # uniform: every clip moves mass into the last bin
    assert ranges.entropy_threshold(flat) == 2048


def _entropy_threshold_reference(hist: np.ndarray, levels: int = 128) -> int:
    """TensorRT's recipe one candidate at a time: qtool's code before the KL evaluation was vectorized."""
    hist = hist.astype(np.float64).copy()
    if hist.size > 1:
        hist[0] = hist[1]
    if hist.sum() <= 0:
        return hist.size
    suffix = np.concatenate([np.cumsum(hist[::-1])[::-1], [0.0]])
    nonzero = (hist != 0).astype(np.float64)
    mass = np.concatenate([[0.0], np.cumsum(hist)])
    filled = np.concatenate([[0.0], np.cumsum(nonzero)])

    def smooth(dist, eps=1e-4):
        zero = dist == 0
        n_zero, n_nonzero = int(zero.sum()), dist.size - int(zero.sum())
        if n_nonzero == 0:
            return None
        out = dist.copy()
        out[zero] = eps
        out[~zero] -= eps * n_zero / n_nonzero
        return out if (out > 0).all() else None

    def kl_at(i):
        p = hist[:i].copy()
        p[-1] += suffix[i]
        edges = (np.arange(levels + 1) * i) // levels
        sums = mass[edges[1:]] - mass[edges[:-1]]
        nz_per = filled[edges[1:]] - filled[edges[:-1]]
        per_bin = np.divide(sums, nz_per, out=np.zeros(levels), where=nz_per > 0)
        ps, qs = smooth(p), smooth(np.repeat(per_bin, np.diff(edges)) * nonzero[:i])
        if ps is None or qs is None:
            return math.inf
        ps, qs = ps / ps.sum(), qs / qs.sum()
        return float(np.sum(ps * np.log(ps / qs)))

    coarse = sorted(set(range(128, hist.size + 1, 32)) | {hist.size})
    kls = {i: kl_at(i) for i in coarse}
    best = min(kls, key=lambda i: (kls[i], i))
    kls.update({i: kl_at(i) for i in range(max(128, best - 32), min(hist.size, best + 32) + 1, 4) if i not in kls})
    return min(kls, key=lambda i: (kls[i], i))


@pytest.mark.parametrize("levels", [128, 256])
def test_entropy_fast_path_chooses_the_reference_threshold(levels):
    """The vectorized KL evaluation picks exactly the threshold of the one-candidate-at-a-time recipe."""
    rng = np.random.default_rng(7)
    shapes = [lambda n: np.abs(rng.normal(size=n)), lambda n: np.abs(rng.laplace(size=n)),
              lambda n: np.abs(rng.standard_cauchy(size=n)), lambda n: np.minimum(np.abs(rng.normal(2, 2, n)), 6),
              lambda n: rng.uniform(0, 1, n),
              lambda n: np.concatenate([np.abs(rng.normal(size=n)), rng.uniform(5, 50, 5)])]
    for k in range(60):
        x = shapes[k % len(shapes)](int(rng.integers(3, 60_000)))
        hist = np.histogram(x, bins=2048, range=(0, x.max()))[0].astype(np.float64)
        if k % 4 == 0:
            hist *= rng.uniform(0.01, 3.0)  # fractional counts, as re-binned histograms have
        assert ranges.entropy_threshold(hist, levels) == _entropy_threshold_reference(hist, levels), k
    for hist in (np.full(2048, 10.0), np.zeros(2048), np.r_[np.zeros(2047), 3.0], np.r_[5.0, np.zeros(2047)],
                 np.array([1.0, 2.0, 0.0, 4.0]), np.array([2.0])):
        assert ranges.entropy_threshold(hist, levels) == _entropy_threshold_reference(hist, levels), hist[:4]


def test_entropy_quantizes_a_non_negative_tensor_to_256_levels_and_a_signed_one_to_128():
    """Q in the KL recipe is the grid the tensor gets: uint8's 256 steps over [0, t] for a
    non-negative tensor, int8's 128 per side for a signed one. |Laplace| is where the two
    differ (reference recipe on numpy's linear histogram: t = 12.7 b with 256 levels, 10.9 b
    with 128); the signed tensor +-x has the same |x| histogram."""
    x = np.abs(np.random.default_rng(8).laplace(0.0, 1.0, N))
    hist = np.histogram(x, bins=ranges.BINS, range=(0, x.max()))[0].astype(np.float64)
    t256, t128 = (_entropy_threshold_reference(hist, levels) * x.max() / ranges.BINS for levels in (256, 128))
    assert t256 > 1.1 * t128  # the data tell the two apart
    lo, hi = _range(_stats(x), "entropy")
    assert lo == float(np.float32(x.min())) and hi == pytest.approx(t256, rel=0.01)
    lo, hi = _range(_stats(np.concatenate([x, -x])), "entropy")
    assert hi == pytest.approx(t128, rel=0.01) and lo == -hi


def test_mse_threshold_balances_clipping_against_rounding():
    # uniform on [0, 1], 255 steps: error(t) = t^3 / (12 * 255^2) + (1 - t)^3 / 3, minimum near t = 0.998
    hist = np.full(2048, 100.0)
    assert ranges.mse_threshold(hist, 1.0, 255.0) == pytest.approx(0.998, abs=0.002)
    # against brute force over every candidate edge on a lumpy histogram
    rng = np.random.default_rng(7)
    lumpy = rng.exponential(1.0, 2048) * np.exp(-np.arange(2048) / 100.0)
    lumpy[-1] = 3.0
    centres = (np.arange(2048) + 0.5) / 2048
    errors = [np.sum(lumpy * np.where(centres > t, (centres - t) ** 2, (t / 127.5) ** 2 / 12))
              for t in np.arange(1, 2049) / 2048]
    assert ranges.mse_threshold(lumpy, 1.0, 127.5) == pytest.approx((np.argmin(errors) + 1) / 2048)


def test_moving_average_and_symmetric_minmax():
    stats = TensorStats()
    for lo, hi in [(-1.0, 2.0), (-3.0, 4.0)]:
        stats.update(np.array([lo, 0.5, hi], np.float32))
    assert _range(stats, "minmax") == (-3.0, 4.0)
    assert _range(stats, "minmax", moving_average=True) == (-2.0, 3.0)
    assert _range(stats, "minmax", symmetric=True) == (-4.0, 4.0)


def test_histogram_covers_every_finite_float_and_merges_by_addition():
    rng = np.random.default_rng(5)
    a = (rng.standard_cauchy(100_000) * 1e3).astype(np.float32)  # spans many decades
    b = np.array([3e38, -3e38, 1e-40, 0.0, -0.0, np.inf, np.nan], np.float32)
    ha, hb = histogram.count(histogram.keys(a)), histogram.count(histogram.keys(b))
    np.testing.assert_array_equal(ha + hb, histogram.count(histogram.keys(np.concatenate([a, b]))))
    # every finite value lands in a bin whose span holds it, within 1/128 relative width
    k = histogram.keys(a).astype(np.uint32)
    low = (k << 16).view(np.float32)
    high = ((k + 1) << 16).view(np.float32)
    mag = np.abs(a)
    assert np.all((np.abs(low) <= mag) & (mag <= np.abs(high)))
    assert np.all(np.abs(high - low) <= mag / 128 + 1e-38)
    # re-binned to linear |x| bins: the counts of numpy's own histogram, within the bf16 resolution
    x = rng.normal(size=N).astype(np.float32)
    top = float(np.abs(x).max())
    lin = histogram.abs_linear(histogram.sparse(histogram.count(histogram.keys(x))), top, 256)
    ref, _ = np.histogram(np.abs(x), 256, (0, top))
    assert lin.sum() == pytest.approx(N)
    np.testing.assert_allclose(lin, ref, atol=0.03 * ref.max())


def test_statistics_merge_equals_one_pass():
    rng = np.random.default_rng(6)
    parts = [rng.normal(size=50_000).astype(np.float32) * s for s in (1.0, 3.0, 0.5)]
    whole = TensorStats.with_histogram()
    for p in parts:
        whole.update(p)
    merged = None
    for p in parts:
        s = TensorStats.with_histogram()
        s.update(p)
        merged = s if merged is None else merged.merge(s)
    whole.flush()
    assert (merged.min, merged.max, merged.count, merged.batches) == (whole.min, whole.max, whole.count,
                                                                       whole.batches)
    np.testing.assert_array_equal(merged.hist, whole.hist)
    for method in ranges.METHODS:
        assert _range(merged, method) == _range(whole, method)


def test_unknown_method_is_a_clear_error():
    from qtool.errors import QtoolError
    with pytest.raises(QtoolError, match="unknown calibration method 'kl'.*entropy"):
        ranges.choose_range(TensorStats(), "kl")
    assert math.isfinite(ranges.aciq_alpha("laplace"))


def _dense_cdf_reference(hist: np.ndarray):
    """The range methods' cumulative-count figures computed over all 65,536 dense keys: what reading
    only the filled keys must reproduce bit for bit."""
    f = 0x7F80
    edges = histogram._EDGES

    def interpolated(e, cdf, q):
        target = q * cdf[-1]
        i = int(np.searchsorted(cdf, target, side="left"))
        if i <= 0:
            return float(e[0])
        if i >= len(cdf):
            return float(e[-1])
        c0, c1 = cdf[i - 1], cdf[i]
        frac = 0.0 if c1 == c0 else (target - c0) / (c1 - c0)
        return float(e[i - 1] + frac * (e[i] - e[i - 1]))

    def abs_linear(top, bins):
        counts = hist[:f] + hist[0x8000:0x8000 + f]
        cdf = np.concatenate([[0.0], np.cumsum(counts, dtype=np.float64)])
        clamped = np.minimum(edges, top)
        keep = np.concatenate([clamped[1:] > clamped[:-1], [True]])
        at = np.interp(np.linspace(0.0, top, bins + 1), clamped[keep], cdf[keep])
        at[-1] = cdf[-1]
        return np.diff(at)

    def signed_quantile(q, lo, hi):
        counts = np.concatenate([hist[0x8000:0x8000 + f][::-1], hist[:f]]).astype(np.float64)
        cdf = np.concatenate([[0.0], np.cumsum(counts)])
        return interpolated(np.clip(np.concatenate([-edges[::-1], edges[1:]]), lo, hi), cdf, q)

    def abs_quantile(q, top):
        counts = (hist[:f] + hist[0x8000:0x8000 + f]).astype(np.float64)
        return interpolated(np.minimum(edges, top), np.concatenate([[0.0], np.cumsum(counts)]), q)

    return abs_linear, signed_quantile, abs_quantile


@pytest.mark.parametrize("kind", ["normal", "relu", "hard_sigmoid", "wide", "one_value"])
def test_the_filled_keys_give_the_dense_cumulative_counts_figures_bit_for_bit(kind):
    """percentile, mse and entropy read only the filled keys of a histogram; between them the
    cumulative count is flat, so their figures equal those computed over every key exactly. The
    hard-sigmoid case (values piled at exactly 0 and 1 = the max) needs the last edge under the max,
    where the clamped edges start."""
    rng = np.random.default_rng(7)
    x = {"normal": rng.normal(0, 1, 20000),
         "relu": np.maximum(rng.normal(0, 1, 20000), 0),
         "hard_sigmoid": np.clip(rng.normal(0.5, 0.4, 20000), 0, 1),
         "wide": rng.lognormal(0, 3, 20000) * rng.choice([-1, 1], 20000),
         "one_value": np.full(100, 0.25)}[kind].astype(np.float32)
    dense = histogram.count(histogram.keys(x))
    filled = histogram.sparse(dense)
    lo, hi = float(x.min()), float(x.max())
    top = max(abs(lo), abs(hi))
    abs_linear, signed_quantile, abs_quantile = _dense_cdf_reference(dense)
    for bins in (2048, 100):
        assert np.array_equal(histogram.abs_linear(filled, top, bins), abs_linear(top, bins))
    for q in (0.0, 0.001, 0.5, 0.99, 0.9999, 1.0):
        assert histogram.signed_quantiles(filled, (q,), lo, hi) == [signed_quantile(q, lo, hi)]
        assert histogram.abs_quantile(filled, q, top) == abs_quantile(q, top)
