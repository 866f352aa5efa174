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


def openvino_weights() -> dict:
    """The quantization keys an OpenVINO comparison test adds: on an x86 CPU without VNNI OpenVINO's
    int8 kernels drop each weight's lowest bit (oneDNN halves int8 weights there against int16
    saturation; docs/targets.md), so its outputs match onnxruntime's only with 7-bit weights."""
    from qtool.graph.runtime import cpu_has_vnni

    return {"reduce_range": True} if cpu_has_vnni() is False else {}


def run_qtool(*args, cwd=None, timeout=900, env_vars=None) -> subprocess.CompletedProcess:
    """Run the CLI of this checkout (not whatever qtool is installed) in a subprocess; `env_vars`:
    variables to set in its environment (a None value: unset)."""
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    for name, value in (env_vars or {}).items():
        env.pop(name, None)
        if value is not None:
            env[name] = value
    return subprocess.run([sys.executable, "-m", "qtool", *map(str, args)], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=timeout)


@pytest.fixture(autouse=True, scope="session")
def exact_int8_products_in_tests():
    """The tests' own onnxruntime sessions compute int8 products as qtool's do: exactly. On an x86
    CPU without VNNI onnxruntime's default u8s8 kernels add pairs of products in saturating int16
    (qtool.graph.runtime.exact_int8_products); the figures the tests assert are then the same on
    any CPU; an int8 weight read by two layers gets a copy each, as in qtool's sessions. Where the
    defaults are exact already, nothing changes."""
    import onnxruntime as ort

    from qtool.graph.runtime import EXACT_PRODUCTS, exact_int8_products, untied_source

    if not exact_int8_products():
        yield
        return
    default = ort.InferenceSession

    class ExactSession(default):
        def __init__(self, path_or_bytes, sess_options=None, providers=None, provider_options=None, **kwargs):
            sess_options = sess_options or ort.SessionOptions()
            sess_options.add_session_config_entry(*EXACT_PRODUCTS)
            try:
                super().__init__(path_or_bytes, sess_options, providers, provider_options, **kwargs)
            except Exception:  # an int8 weight read by two layers: as qtool's sessions, a copy each
                source = path_or_bytes if isinstance(path_or_bytes, bytes) else str(path_or_bytes)
                untied = untied_source(source)
                if untied is None:
                    raise
                super().__init__(untied.SerializeToString(), sess_options, providers, provider_options, **kwargs)

    ort.InferenceSession = ExactSession
    yield
    ort.InferenceSession = default


@pytest.fixture
def qtool_cli():
    return run_qtool
