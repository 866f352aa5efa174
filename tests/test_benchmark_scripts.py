"""The benchmark scripts stay runnable as the package changes: each one's --help imports it whole."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"


@pytest.mark.parametrize("script", sorted(p.name for p in BENCHMARKS.glob("*.py")))
def test_benchmark_script_starts(script):
    run = subprocess.run([sys.executable, str(BENCHMARKS / script), "--help"], capture_output=True, text=True,
                         timeout=120)
    assert run.returncode == 0, run.stderr[-800:]
    assert "usage:" in run.stdout


def test_timed_medians_give_a_fast_model_enough_runs_and_time_nothing_without_samples(tmp_path, monkeypatch):
    """benchmarks/models.py's timing: each sample gets at least SAMPLE_SECONDS of runs of the fastest
    model (ten runs of a fast model misreport an identical copy of it), and a run with no held-out
    samples times nothing instead of failing."""
    import numpy as np
    import onnx
    from onnx import helper

    from tests import graphs

    monkeypatch.syspath_prepend(str(BENCHMARKS))
    import models

    path = tmp_path / "relu.onnx"
    onnx.save(graphs.model([helper.make_node("Relu", ["x"], ["y"])], [graphs.tensor("x", [1, 4])],
                           [graphs.tensor("y", [1, 4])]), path)
    feeds = {"x": np.ones((1, 4), np.float32)}
    asked = []
    timed = models.time_models
    monkeypatch.setattr(models, "time_models",
                        lambda paths, sample, threads, warmup, runs: asked.append(runs)
                        or timed(paths, sample, threads=threads, warmup=warmup, runs=runs))
    medians = models.timed_medians({"relu": path}, [feeds, feeds])
    assert set(medians) == {"relu"} and medians["relu"] > 0
    # a probe of the first sample, then each sample's runs: far more than RUNS spread over 2 samples
    assert len(asked) == 3 and asked[1] == asked[2] > models.RUNS // 2
    assert models.timed_medians({}, []) == {}
