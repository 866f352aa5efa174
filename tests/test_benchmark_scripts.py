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
