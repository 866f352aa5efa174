"""Shared fixtures: paths to the repo's own data and to the bench kit beside the repo."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
KIT = ROOT.parent / "shared" / "bench"
KIT_REASON = f"the benchmark kit is not at {KIT} (a user's fresh clone); CI has it"

EFFNET = ROOT / "models" / "efficientnet_lite0_dyn.onnx"
EFFNET_CONFIG = ROOT / "configs" / "efficientnet_lite0.yaml"
CALIB_SAMPLES = ROOT / "calib_samples"
# The EfficientNet config turns on bias correction and adaptive rounding whenever quantize has
# --data (seconds of work each time); tests about other things quantize from the ranges alone.
RANGES_ONLY = ("--bias-correction", "off", "--weight-rounding", "nearest")


def kit_path(*parts: str) -> Path:
    """A path inside the bench kit. No kit at all (a user's fresh clone) skips the test; a kit
    that is there but lacks the file is a broken kit, which must fail rather than hide as a skip."""
    if not KIT.is_dir():
        pytest.skip(KIT_REASON)
    path = KIT.joinpath(*parts)
    if not path.exists():
        pytest.fail(f"the benchmark kit at {KIT} has no {path}")
    return path


def kit_samples(model: str, count: int, folder: Path) -> list[Path]:
    """The first `count` calibration samples of a kit model, copied into `folder` (a calibration
    folder of their own); the copies."""
    folder.mkdir(parents=True, exist_ok=True)
    copies = []
    for sample in sorted(kit_path("inputs", model, "calib").glob("*.np*"))[:count]:
        copies.append(folder / sample.name)
        copies[-1].write_bytes(sample.read_bytes())
    return copies


def run_qtool(*args, cwd=None, timeout=900) -> subprocess.CompletedProcess:
    """Run the CLI of this checkout (not whatever qtool is installed) in a subprocess."""
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.run([sys.executable, "-m", "qtool", *map(str, args)], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=timeout)


@pytest.fixture
def qtool_cli():
    return run_qtool
