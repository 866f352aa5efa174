"""FidelityAccumulator's sums against their definitions, computed here row by row."""

from __future__ import annotations

import numpy as np
import pytest

from qtool.evaluation.metrics import FidelityAccumulator


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("shape,samples,rows", [((3, 5, 7), 3, 3), ((4, 1), 4, 4), ((), None, 1), ((2, 6), 5, 1)])
def test_fidelity_figures_follow_their_definitions(shape, samples, rows, dtype):
    """Per-row cosine (an all-zero row pair counts as identical), signal and noise power, absolute
    errors; float64 inputs are read in place and must come back unchanged."""
    rng = np.random.default_rng(0)
    ref = rng.normal(0, 1, shape).astype(dtype)
    test = (ref + rng.normal(0, 0.1, shape)).astype(dtype)
    if len(shape) == 2 and rows > 1:
        ref[1], test[1] = 0.0, 0.0
    kept = ref.copy(), test.copy()
    acc = FidelityAccumulator()
    cosines = acc.update(ref, test, samples)
    r, t = ref.astype(np.float64).reshape(rows, -1), test.astype(np.float64).reshape(rows, -1)
    expected = [1.0 if not a.any() and not b.any() else a @ b / np.linalg.norm(a) / np.linalg.norm(b)
                for a, b in zip(r, t)]
    assert np.allclose(cosines, expected, rtol=1e-12, atol=0)
    assert acc.signal == pytest.approx(float((r * r).sum()), rel=1e-12)
    assert acc.noise == pytest.approx(float(((t - r) ** 2).sum()), rel=1e-12)
    assert acc.abs_sum == pytest.approx(float(np.abs(t - r).sum()), rel=1e-12)
    assert acc.abs_max == float(np.abs(t - r).max()) and acc.values == r.size
    assert np.array_equal(ref, kept[0]) and np.array_equal(test, kept[1])
