"""Inputs that are wrong but recoverable: a warning (with a count), or a documented fallback."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import cv2
import numpy as np
import onnx
import onnxruntime as ort

from tests.conftest import run_qtool

CORPUS = Path(__file__).resolve().parent / "bad_inputs"
TINY = CORPUS / "models" / "tiny.onnx"
OK_DATA = CORPUS / "data" / "ok"


def _dequantize_linear_count(path: Path) -> int:
    return sum(n.op_type == "DequantizeLinear" for n in onnx.load(str(path)).graph.node)


def test_corrupt_images_are_skipped_with_a_count(tmp_path):
    data = tmp_path / "images"
    data.mkdir()
    rng = np.random.default_rng(0)
    for i in range(3):
        cv2.imwrite(str(data / f"good{i}.png"), rng.integers(0, 255, (12, 10, 3), dtype=np.uint8))
    (data / "bad_text.jpg").write_text("not an image")
    (data / "bad_empty.png").write_bytes(b"")
    good = (data / "good0.png").read_bytes()
    (data / "bad_truncated.png").write_bytes(good[: len(good) // 2])
    table = tmp_path / "t.json"
    proc = run_qtool("calibrate", TINY, "--data", data, "-o", table)
    assert proc.returncode == 0, proc.stderr
    lines = [part for line in proc.stderr.splitlines() for part in line.split("\r")]  # \r: progress bars
    warnings = [line for line in lines if line.startswith("warning:")]
    assert warnings == [f"warning: {data}: skipped 3 unreadable image file(s), e.g. bad_empty.png"]
    assert "Traceback" not in proc.stderr and "WARN" not in proc.stderr  # OpenCV's own chatter is off
    assert json.loads(table.read_text())["num_samples"] == 3


def test_table_for_another_model_warns_on_sha256(tmp_path):
    table = tmp_path / "t.json"
    assert run_qtool("calibrate", TINY, "--data", OK_DATA, "-o", table).returncode == 0
    other = tmp_path / "other.onnx"
    model = onnx.load(str(TINY))
    model.producer_name = "someone else"  # same graph, different file
    onnx.save(model, str(other))
    proc = run_qtool("quantize", other, "--table", table, "-o", tmp_path / "q.onnx")
    assert proc.returncode == 0, proc.stderr
    assert f"warning: {table}: calibration table was made for a different model file (tiny.onnx, sha256" \
        in proc.stderr
    assert (tmp_path / "q.onnx").exists()


def test_allow_missing_keeps_untabled_tensors_float(tmp_path):
    table = CORPUS / "tables" / "missing_tensors.json"  # has no entry for the model's input 'x'
    out = tmp_path / "q.onnx"
    proc = run_qtool("quantize", TINY, "--table", table, "--allow-missing", "-o", out)
    assert proc.returncode == 0, proc.stderr
    model = onnx.load(str(out))
    onnx.checker.check_model(model, full_check=True)
    quantized_inputs = [n.input[0] for n in model.graph.node if n.op_type == "QuantizeLinear"]
    assert "x" not in quantized_inputs  # x stayed float
    # The weight is still int8 (it needs no calibration); the bias stays float because its
    # int32 scale needs the missing input scale.
    assert any(n.input[0] == "W_quantized" for n in model.graph.node if n.op_type == "DequantizeLinear")
    assert not any(n.input[0] == "B_quantized" for n in model.graph.node if n.op_type == "DequantizeLinear")
    x = np.load(OK_DATA / "x.npy")
    ref = ort.InferenceSession(str(TINY)).run(None, {"x": x})[0]
    got = ort.InferenceSession(str(out)).run(None, {"x": x})[0]
    assert np.abs(ref - got).max() < 0.05 * np.abs(ref).max()


def test_old_opsets_are_converted_by_default(tmp_path):
    for name, opset in (("opset9.onnx", 9), ("opset12.onnx", 12)):
        out = tmp_path / f"q_{name}"
        proc = run_qtool("quantize", CORPUS / "models" / name, "--data", OK_DATA, "-o", out)
        assert proc.returncode == 0, proc.stderr
        assert f"note: converted opset {opset} -> 13 with onnx's version converter" in proc.stderr
        model = onnx.load(str(out))
        assert [o.version for o in model.opset_import if o.domain in ("", "ai.onnx")] == [13]
        assert _dequantize_linear_count(out) >= 3


def test_per_tensor_weights_need_only_opset_10(tmp_path):
    config = tmp_path / "c.yaml"
    config.write_text("quantization:\n  per_channel: false\n")
    out = tmp_path / "q.onnx"
    proc = run_qtool("quantize", CORPUS / "models" / "opset12.onnx", "--data", OK_DATA, "--config", config, "-o", out)
    assert proc.returncode == 0, proc.stderr
    model = onnx.load(str(out))
    onnx.checker.check_model(model, full_check=True)
    assert [o.version for o in model.opset_import if o.domain in ("", "ai.onnx")] == [12]
    x = np.load(OK_DATA / "x.npy")
    ort.InferenceSession(str(out)).run(None, {"x": x})


def test_data_outside_a_folder_single_file(tmp_path):
    """--data may name one sample file."""
    shutil.copy(OK_DATA / "x.npy", tmp_path / "one.npy")
    proc = run_qtool("calibrate", TINY, "--data", tmp_path / "one.npy", "-o", tmp_path / "t.json")
    assert proc.returncode == 0, proc.stderr
    assert json.loads((tmp_path / "t.json").read_text())["num_samples"] == 1
