"""Numerical hazards: NaN/Inf activations, constant tensors, all-zero weight channels,
int32 bias overflow and vanishing scales never produce a NaN, Inf, zero or subnormal scale."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
from click.testing import CliRunner
from onnx import TensorProto, helper, numpy_helper

from qtool.cli import main

FLOAT32_TINY = float(np.finfo(np.float32).tiny)  # smallest normal float32


def _model(nodes, inputs, outputs, inits, path: Path) -> Path:
    graph = helper.make_graph(nodes, path.stem, inputs, outputs, inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.checker.check_model(model, full_check=True)
    onnx.save(model, str(path))
    return path


def _samples(folder: Path, arrays: list[np.ndarray]) -> Path:
    folder.mkdir()
    for i, array in enumerate(arrays):
        np.save(folder / f"{i:02d}.npy", array.astype(np.float32))
    return folder


def _quantize(model: Path, data: Path, tmp: Path) -> tuple[object, Path, dict]:
    out, table = tmp / "q.onnx", tmp / "t.json"
    result = CliRunner().invoke(main, ["quantize", str(model), "--data", str(data), "--save-table", str(table),
                                       "-o", str(out)])
    assert result.exit_code == 0, result.output + result.stderr
    return result, out, json.loads(table.read_text())


def _check_scales(path: Path) -> dict[str, np.ndarray]:
    """Every scale in the model is a finite, normal, positive float32."""
    scales = {t.name: numpy_helper.to_array(t) for t in onnx.load(str(path)).graph.initializer
              if t.name.endswith("_scale")}
    assert scales
    for name, value in scales.items():
        assert value.dtype == np.float32, name
        assert np.all(np.isfinite(value)) and np.all(value >= FLOAT32_TINY), (name, value)
    return scales


def _run(path: Path, x: np.ndarray) -> np.ndarray:
    return ort.InferenceSession(str(path)).run(None, {"x": x.astype(np.float32)})[0]


def _conv(name_in: str, name_out: str, weight: np.ndarray, bias: np.ndarray, prefix: str) -> tuple[list, list]:
    inits = [numpy_helper.from_array(weight.astype(np.float32), prefix + "W"),
             numpy_helper.from_array(bias.astype(np.float32), prefix + "B")]
    return [helper.make_node("Conv", [name_in, prefix + "W", prefix + "B"], [name_out])], inits


def test_nan_and_inf_activations_are_reported_and_excluded(tmp_path):
    # log(x) is -inf at 0 and NaN below; 1/x is +-inf at 0. Both feed quantized ops. (A float op
    # reads the sum, as the rest of a model would: otherwise the Add computes the output in float.)
    weight = np.ones((2, 2, 1, 1), np.float32)
    conv, inits = _conv("log", "c", weight, np.zeros(2), "")
    nodes = [helper.make_node("Log", ["x"], ["log"]), *conv,
             helper.make_node("Div", ["one", "x"], ["inv"]), helper.make_node("Relu", ["inv"], ["r"]),
             helper.make_node("Add", ["c", "r"], ["s"]), helper.make_node("Softsign", ["s"], ["y"])]
    inits.append(numpy_helper.from_array(np.array(1.0, np.float32), "one"))
    x_info = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 2, 4, 4])
    model = _model(nodes, [x_info], [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 2, 4, 4])],
                   inits, tmp_path / "hazard.onnx")
    rng = np.random.default_rng(0)
    arrays = [rng.uniform(0.5, 2.0, (1, 2, 4, 4)) for _ in range(4)]
    arrays[1][0, 0, 0, :3] = 0.0  # log -> -inf (3), 1/x -> inf (3)
    arrays[2][0, 1, 2, :2] = -1.0  # log -> NaN (2)
    data = _samples(tmp_path / "data", arrays)
    result, out, table = _quantize(model, data, tmp_path)

    stacked = np.concatenate(arrays).astype(np.float32)
    with np.errstate(divide="ignore", invalid="ignore"):
        log, inv = np.log(stacked), np.float32(1.0) / stacked
    assert f"warning: tensor 'log': 5 NaN/Inf values excluded from its statistics" in result.stderr
    # the Relu after the float Div runs in float with it: its output r = max(1/x, 0) is the quantized one
    assert f"warning: tensor 'r': 3 NaN/Inf values excluded from its statistics" in result.stderr
    for name, values in (("log", log), ("r", np.maximum(inv, 0))):
        finite = values[np.isfinite(values)]
        assert table["tensors"][name]["min"] == float(finite.min())
        assert table["tensors"][name]["max"] == float(finite.max())
        assert np.isfinite(table["tensors"][name]["scale"])
    _check_scales(out)
    x = arrays[0]  # finite sample: the int8 model tracks the fp32 one
    ref = ort.InferenceSession(str(model)).run(None, {"x": x.astype(np.float32)})[0]
    assert np.abs(_run(out, x) - ref).max() < 0.05 * np.abs(ref).max()


def test_constant_activations_get_valid_scales(tmp_path):
    # z = x * 0 is all zeros (min = max = 0); k = 0 * x + 3 is constant 3 (min = max = 3).
    weight = np.random.default_rng(1).normal(size=(3, 2, 1, 1))
    conv_z, inits_z = _conv("z", "cz", weight, np.array([0.5, -0.5, 1.0]), "z")
    conv_k, inits_k = _conv("k", "ck", weight, np.zeros(3), "k")
    nodes = [helper.make_node("Mul", ["x", "zero"], ["z"]), helper.make_node("Mul", ["x", "zero"], ["z0"]),
             helper.make_node("Add", ["z0", "three"], ["k"]), *conv_z, *conv_k,
             helper.make_node("Add", ["cz", "ck"], ["y"])]
    inits = inits_z + inits_k + [numpy_helper.from_array(np.zeros((1, 2, 1, 1), np.float32), "zero"),
                                 numpy_helper.from_array(np.full((1, 2, 1, 1), 3.0, np.float32), "three")]
    model = _model(nodes, [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 2, 4, 4])],
                   [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 3, 4, 4])], inits,
                   tmp_path / "constant.onnx")
    arrays = [np.random.default_rng(i).normal(size=(1, 2, 4, 4)) for i in range(3)]
    _, out, table = _quantize(model, _samples(tmp_path / "data", arrays), tmp_path)
    assert table["tensors"]["z"]["min"] == table["tensors"]["z"]["max"] == 0.0
    assert table["tensors"]["k"]["min"] == table["tensors"]["k"]["max"] == 3.0
    for name in ("z", "k"):
        assert np.isfinite(table["tensors"][name]["scale"]) and table["tensors"][name]["scale"] > 0
    _check_scales(out)
    x = arrays[0]
    ref = ort.InferenceSession(str(model)).run(None, {"x": x.astype(np.float32)})[0]
    assert np.abs(_run(out, x) - ref).max() < 0.05 * np.abs(ref).max()


def test_all_zero_weight_channels_and_int32_bias_overflow(tmp_path):
    rng = np.random.default_rng(2)
    weight = rng.normal(0, 0.5, (4, 3, 3, 3))
    weight[0] = 0.0  # an all-zero output channel with a non-zero bias
    weight[1] = rng.normal(0, 1e-9, (3, 3, 3))  # near-zero channel: bias / (s_in * s_w) overflows int32
    bias = np.array([0.7, 12.0, -0.2, 0.1])
    conv, inits = _conv("x", "y", weight, bias, "")
    model = _model(conv, [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 3, 6, 6])],
                   [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 4, 4, 4])], inits,
                   tmp_path / "bias.onnx")
    # Small inputs make the input scale small (~1e-5), so 12 / (1e-5 * 1e-11) would be ~1e17.
    arrays = [rng.uniform(-1e-3, 1e-3, (1, 3, 6, 6)) for _ in range(3)]
    result, out, _ = _quantize(model, _samples(tmp_path / "data", arrays), tmp_path)
    assert "note: int32 bias would overflow" in result.stderr
    assert "1 layer(s): y (1)" in result.stderr  # names the layer (its output: the node is unnamed) and the count
    scales = _check_scales(out)
    assert scales["W_scale"][0] == 1.0  # the all-zero channel: any positive scale represents it exactly
    q = {t.name: numpy_helper.to_array(t) for t in onnx.load(str(out)).graph.initializer}
    assert np.all(np.abs(q["B_quantized"].astype(np.int64)) < 2**31 - 1)  # nothing saturated
    x = arrays[0]
    got, ref = _run(out, x), ort.InferenceSession(str(model)).run(None, {"x": x.astype(np.float32)})[0]
    # The biases come through to within half an int32 step: channel 0 is its bias alone,
    # channel 1 is its bias plus a ~1e-9 contribution (a clipped bias would be off by ~12).
    step = scales["B_scale"]
    assert np.abs(got[0, 0] - 0.7).max() <= step[0] / 2 + 1e-7
    assert np.abs(got[0, 1] - ref[0, 1]).max() <= step[1] / 2 + 1e-6
    assert np.abs(got - ref).max() < 0.05 * np.abs(ref).max()


def test_vanishing_ranges_never_give_subnormal_or_zero_scales(tmp_path):
    """Activations of ~1e-30 and weights of ~1e-25: s_in * s_w would underflow float32 to zero."""
    rng = np.random.default_rng(3)
    conv, inits = _conv("x", "y", rng.normal(0, 1e-25, (2, 2, 1, 1)), np.zeros(2), "")
    nodes = [*conv, helper.make_node("Relu", ["y"], ["r"]), helper.make_node("Add", ["r", "x"], ["out"])]
    model = _model(nodes, [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 2, 3, 3])],
                   [helper.make_tensor_value_info("out", TensorProto.FLOAT, ["N", 2, 3, 3])], inits,
                   tmp_path / "tiny.onnx")
    arrays = [rng.normal(0, 1e-30, (1, 2, 3, 3)) for _ in range(2)]
    _, out, table = _quantize(model, _samples(tmp_path / "data", arrays), tmp_path)
    assert all(entry["scale"] >= 2.0**-60 for entry in table["tensors"].values())
    _check_scales(out)
    got = _run(out, arrays[0])
    assert np.all(np.isfinite(got)) and np.abs(got).max() < 1e-15  # values this small quantize to ~0


def test_a_foreign_tables_subnormal_scale_is_raised(tmp_path):
    conv, inits = _conv("x", "y", np.ones((2, 2, 1, 1)), np.full(2, 0.5), "")
    model = _model(conv, [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 2, 3, 3])],
                   [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 2, 3, 3])], inits,
                   tmp_path / "m.onnx")
    table = {"format": "qtool-calibration", "version": 1, "model": {"file": "m.onnx", "sha256": ""},
             "method": "minmax", "settings": {}, "num_samples": 1,
             "tensors": {"x": {"min": 0.0, "max": 0.0, "range": [0.0, 0.0], "dtype": "uint8", "scale": 1e-44,
                               "zero_point": 0}}}
    (tmp_path / "t.json").write_text(json.dumps(table))
    result = CliRunner().invoke(main, ["quantize", str(model), "--table", str(tmp_path / "t.json"), "-o",
                                       str(tmp_path / "q.onnx")])
    assert result.exit_code == 0, result.stderr
    scales = _check_scales(tmp_path / "q.onnx")
    assert scales["x_scale"] == np.float32(2.0**-60)
