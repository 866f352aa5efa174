"""Shapes: dynamic batch and spatial dimensions, variable-width OCR lines, batch fixed at 1."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from click.testing import CliRunner
from onnx import TensorProto, helper, numpy_helper

from qtool.calibration import ranges
from qtool.cli import main
from tests.conftest import kit_path


def _convnet(path: Path, input_shape: list) -> Path:
    rng = np.random.default_rng(0)
    inits = [numpy_helper.from_array(rng.normal(0, 0.3, (8, 3, 3, 3)).astype(np.float32), "W1"),
             numpy_helper.from_array(rng.normal(0, 0.1, (8,)).astype(np.float32), "B1"),
             numpy_helper.from_array(rng.normal(0, 0.3, (4, 8, 1, 1)).astype(np.float32), "W2")]
    nodes = [helper.make_node("Conv", ["x", "W1", "B1"], ["c1"], pads=[1, 1, 1, 1], strides=[2, 2]),
             helper.make_node("Sigmoid", ["c1"], ["s"]), helper.make_node("Mul", ["c1", "s"], ["silu"]),
             helper.make_node("Conv", ["silu", "W2"], ["c2"]), helper.make_node("MaxPool", ["c2"], ["y"],
                                                                              kernel_shape=[2, 2], strides=[2, 2])]
    graph = helper.make_graph(nodes, "dyn", [helper.make_tensor_value_info("x", TensorProto.FLOAT, input_shape)],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [input_shape[0], 4, "h", "w"])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.save(model, str(path))
    return path


def _calibrate(model: Path, data: Path, table: Path, *extra: str) -> dict:
    result = CliRunner().invoke(main, ["calibrate", str(model), "--data", str(data), *extra, "-o", str(table)])
    assert result.exit_code == 0, result.output + result.stderr
    return json.loads(table.read_text())


def _expected_extremes(model: Path, names: list[str], samples: list[np.ndarray]) -> dict[str, tuple[float, float]]:
    """min/max of each tensor over all samples, computed by running the fp32 model one sample at a time."""
    m = onnx.load(str(model))
    for name in names:
        m.graph.output.append(helper.make_tensor_value_info(name, TensorProto.FLOAT, None))
    session = ort.InferenceSession(m.SerializeToString())
    values = {name: [] for name in names}
    for x in samples:
        for name, out in zip(names, session.run(names, {"x": x})):
            values[name].append((float(out.min()), float(out.max())))
    return {n: (min(v[0] for v in values[n]), max(v[1] for v in values[n])) for n in names}


def test_dynamic_batch_and_spatial_dims(tmp_path):
    model = _convnet(tmp_path / "dyn.onnx", ["N", 3, "H", "W"])
    data = tmp_path / "data"
    data.mkdir()
    rng = np.random.default_rng(1)
    shapes = [(1, 3, 16, 16), (2, 3, 16, 16), (1, 3, 16, 16), (1, 3, 24, 40), (3, 3, 24, 40), (1, 3, 9, 13),
              (1, 3, 16, 16)]
    samples = [rng.normal(0, 1, s).astype(np.float32) for s in shapes]
    for i, x in enumerate(samples):
        np.save(data / f"{i:02d}.npy", x)
    table = _calibrate(model, data, tmp_path / "t.json", "--batch-size", "4")
    assert table["num_samples"] == len(samples)
    names = [n for n in ("x", "c1", "silu", "c2") if n in table["tensors"]]
    assert {"x", "c1", "silu"} <= set(names)
    expected = _expected_extremes(model, [n for n in names if n != "x"], samples)
    expected["x"] = (min(float(x.min()) for x in samples), max(float(x.max()) for x in samples))
    for name in names:
        got = (table["tensors"][name]["min"], table["tensors"][name]["max"])
        np.testing.assert_allclose(got, expected[name], rtol=1e-6, err_msg=name)


def test_batch_fixed_at_one_is_fed_one_sample_at_a_time(tmp_path):
    model = _convnet(tmp_path / "b1.onnx", [1, 3, 16, 16])
    data = tmp_path / "data"
    data.mkdir()
    samples = [np.random.default_rng(i).normal(size=(1, 3, 16, 16)).astype(np.float32) for i in range(5)]
    for i, x in enumerate(samples):
        np.save(data / f"{i}.npy", x)
    by8 = _calibrate(model, data, tmp_path / "t8.json", "--batch-size", "8")
    by1 = _calibrate(model, data, tmp_path / "t1.json", "--batch-size", "1")
    assert by8["num_samples"] == 5
    assert by8["tensors"] == by1["tensors"]


@pytest.mark.parametrize("method", sorted(ranges.METHODS))
def test_variable_width_ocr_recognizer_calibrates_with_every_method(tmp_path, method):
    model = kit_path("models", "rapidocr_v4_rec.onnx")
    data = kit_path("inputs", "rapidocr_v4_rec", "calib")
    widths = {np.load(p)["x"].shape[3] for p in sorted(data.glob("*.npz"))[:12]}
    assert len(widths) > 3  # the samples really vary in width
    table = _calibrate(model, data, tmp_path / "t.json", "--num-samples", "12",
                       "--method", method)
    assert table["method"] == method and table["num_samples"] == 12
    assert len(table["tensors"]) > 100
    for name, entry in table["tensors"].items():
        assert np.isfinite(entry["scale"]) and entry["scale"] > 0, name
        assert entry["range"][0] <= 0.0 <= entry["range"][1], name
