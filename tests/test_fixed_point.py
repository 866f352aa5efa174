"""Fixed-point requantization: the published worked examples, properties, and export-params."""

from __future__ import annotations

import json

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from onnx import TensorProto, helper

from qtool.calibration.calibrate import calibrate
from qtool.config import CalibrationConfig, PreprocessConfig, QuantizeConfig
from qtool.integer.fixed_point import (INT16_MAX, export_params, multiply_by_quantized_multiplier, quantize_multiplier)
from qtool.quantization.quantize import quantize_model

from tests import graphs
from tests.conftest import run_qtool


def test_tpu_mlir_example_0_1234():
    """TPU-MLIR's quantization chapter: y = x * 0.1234 => (x * 2119995857) >> 34."""
    m0, n = quantize_multiplier(0.1234)
    assert (m0, 31 + n) == (2119995857, 34)
    assert 2**30 <= m0 < 2**31
    assert multiply_by_quantized_multiplier(10000, m0, n) == round(10000 * 0.1234)


def test_ruy_reference_rounding_examples():
    """ruy's MultiplyByQuantizedMultiplier reference: add 2^(s-1), shift right by s (exponent = -n)."""
    out = multiply_by_quantized_multiplier(np.array([3, 1, -7, -1]), 1 << 30, -0)
    assert out.tolist() == [2, 1, -3, 0]
    acc = np.array([[5, 11], [11, 25]])
    per_channel = multiply_by_quantized_multiplier(acc, np.array([[3 << 28], [5 << 28]]), np.array([[-1], [2]]))
    assert per_channel.tolist() == [[4, 8], [2, 4]]


@settings(max_examples=300, deadline=None)
@given(st.floats(min_value=1e-7, max_value=200.0), st.integers(min_value=-(2**31) + 1, max_value=2**31 - 1))
def test_multiplier_is_accurate_and_applied_with_round_half_up(real, x):
    m0, n = quantize_multiplier(real)
    assert 2**30 <= m0 < 2**31
    assert abs(m0 * 2.0 ** (-31 - n) - real) <= real * 2.0**-31
    s = 31 + n
    if s > 62:  # only multipliers below 2^-31 get there; TFLite makes them zero
        return
    expected = (x * m0 + (1 << (s - 1))) >> s  # Python integers: exact, floor division
    if abs(expected) < 2**31:
        assert int(multiply_by_quantized_multiplier(x, m0, n)) == expected


def _quantized(tmp_path, model, shape, options=QuantizeConfig()):
    path = tmp_path / "model.onnx"
    onnx.save(model, path)
    data = graphs.write_samples(tmp_path / "data", np.random.default_rng(3), shape, count=8)
    table = calibrate(path, data, PreprocessConfig(), CalibrationConfig(batch_size=4), options, progress=False)
    return quantize_model(path, table, options).model


def _layer(params, op_type):
    return next(item for item in params["layers"] if item["op_type"] == op_type)


def _codes(qmodel, tensors: list[str], x: np.ndarray) -> list[np.ndarray]:
    """The integer codes onnxruntime computes for `tensors` (QuantizeLinear outputs) of a QDQ model."""
    exposed = onnx.ModelProto()
    exposed.CopyFrom(qmodel)
    exposed.graph.output.extend(helper.make_empty_tensor_value_info(t) for t in tensors)
    session = ort.InferenceSession(exposed.SerializeToString(), providers=["CPUExecutionProvider"])
    return [c.astype(np.int64) for c in session.run(tensors, {"x": x})]


def _conv3x3(x: np.ndarray, w: np.ndarray, pad_value) -> np.ndarray:
    """Plain 3x3 convolution, pads 1: NCHW x OIHW, in x's dtype (int64 exact, float64)."""
    padded = np.pad(x, ((0, 0), (0, 0), (1, 1), (1, 1)), constant_values=pad_value)
    windows = np.lib.stride_tricks.sliding_window_view(padded, (3, 3), axis=(2, 3))
    return np.einsum("nchwij,ocij->nohw", windows, w)


def _assert_matches_float(ours: np.ndarray, exact: np.ndarray, lo: int, hi: int) -> None:
    """Integer results against the float value they stand for (in output steps, zero point added):
    equal to it rounded and clamped, except on a near tie where the 31-bit multiplier may go either way."""
    expected = np.clip(np.floor(exact + 0.5), lo, hi)
    on_tie = np.abs(exact - np.floor(exact) - 0.5) < 1e-6
    assert np.all((ours == expected) | on_tie), np.abs(ours - expected).max()


def test_conv_parameters_compute_the_float_conv_on_the_integer_grid(tmp_path):
    qmodel = _quantized(tmp_path, graphs.conv_model(np.random.default_rng(0), activation="Clip"), (8, 12, 12))
    conv = _layer(export_params(qmodel), "Conv")
    inits = {t.name: onnx.numpy_helper.to_array(t) for t in qmodel.graph.initializer}
    x = np.random.default_rng(5).normal(0, 1, (2, 8, 12, 12)).astype(np.float32)
    q_x, q_y = _codes(qmodel, ["x_QuantizeLinear_Output", "act_QuantizeLinear_Output"], x)
    # integer only, from the exported parameters: the padding is the input's zero point (real 0)
    w = inits[conv["weight"]["tensor"]].astype(np.int64)
    w = w - np.array(conv["weight"]["zero_point"]).reshape(-1, 1, 1, 1)
    acc = _conv3x3(q_x, w, conv["inputs"][0]["zero_point"]) + np.array(conv["bias_with_input_zero_point"]
                                                                         ).reshape(1, -1, 1, 1)
    channel = conv["per_channel"]
    m0, n = (np.array(channel[k]).reshape(1, -1, 1, 1) for k in ("multiplier", "shift"))
    ours = np.clip(multiply_by_quantized_multiplier(acc, m0, n) + conv["output"]["zero_point"], *conv["clamp"])
    # plain float: what the QDQ graph means, Conv on the dequantized values, Clip(0, 6), then the output grid
    x_real = (q_x - inits["x_zero_point"].astype(np.int64)) * float(inits["x_scale"])
    w_real = inits["w_quantized"] * inits["w_scale"].astype(np.float64).reshape(-1, 1, 1, 1)
    b_real = inits["b_quantized"] * inits["b_scale"].astype(np.float64)
    y_real = np.clip(_conv3x3(x_real, w_real, 0.0) + b_real.reshape(1, -1, 1, 1), 0.0, 6.0)
    zero = int(inits["act_zero_point"])
    _assert_matches_float(ours, y_real / float(inits["act_scale"]) + zero, 0, 255)
    # and onnxruntime's own integer kernel (float32 requantization, ties to even) within one step
    assert np.abs(ours - q_y).max() <= 1 and np.mean(ours == q_y) > 0.99


def test_add_parameters_int16_and_int32_forms(tmp_path):
    qmodel = _quantized(tmp_path, graphs.add_model(np.random.default_rng(0)), (8, 6, 6),
                        QuantizeConfig(activation_dtype="int8", symmetric_activations=True))
    add = _layer(export_params(qmodel), "Add")
    ratios = [t["scale"] / add["output"]["scale"] for t in add["inputs"]]
    int16 = add["int16"]
    assert int16["representable"] and max(int16["multipliers"]) <= 127
    assert sum(m * 128 for m in int16["multipliers"]) <= INT16_MAX  # symmetric int8 codes: |q| <= 128
    for m, r in zip(int16["multipliers"], ratios):
        assert abs(m / 2 ** int16["shift"] - r) <= 2 ** -(int16["shift"] + 1)
    int32 = add["int32"]
    total = [p["real"] * int32["output"]["real"] * 2 ** int32["left_shift"] for p in int32["inputs"]]
    assert total == pytest.approx(ratios, rel=1e-12)


def _qdq_unary(op_type, x_qp, y_qp, extra_inputs=(), inits=(), **attrs):
    """x -> Q -> DQ -> op -> Q(y): a hand-built QDQ graph, as a quantizer would write it."""
    nodes = [helper.make_node("QuantizeLinear", ["x", "xs", "xz"], ["xq"]),
             helper.make_node("DequantizeLinear", ["xq", "xs", "xz"], ["xd"]),
             helper.make_node(op_type, ["xd", *extra_inputs], ["y"], name="op", **attrs),
             helper.make_node("QuantizeLinear", ["y", "ys", "yz"], ["yq"])]
    qparams = [graphs.init("xs", np.float32(x_qp[0])), graphs.init("xz", np.uint8(x_qp[1])),
               graphs.init("ys", np.float32(y_qp[0])), graphs.init("yz", np.uint8(y_qp[1]))]
    return graphs.model(nodes, [graphs.tensor("x", [1, 4, 8, 8])],
                        [graphs.tensor(name, [1, 4, 8, 8], TensorProto.UINT8) for name in ("xq", "yq")],
                        qparams + list(inits))


def _apply_prelu(codes, item, x_zp, channel_axis=1):
    y_zp = item["output"]["zero_point"]
    centred = codes.astype(np.int64) - x_zp
    pos = multiply_by_quantized_multiplier(centred, item["positive"]["multiplier"], item["positive"]["shift"])
    neg_m = np.array([n["multiplier"] for n in item["negative"]])
    neg_s = np.array([n["shift"] for n in item["negative"]])
    shape = [1] * codes.ndim
    shape[channel_axis] = -1
    neg = multiply_by_quantized_multiplier(centred, neg_m.reshape(shape), neg_s.reshape(shape))
    return np.clip(np.where(centred >= 0, pos, neg) + y_zp, *item["clamp"])


@pytest.mark.parametrize("op", ["LeakyRelu", "PRelu"])
def test_leaky_relu_and_prelu_parameters_match_onnxruntime(op):
    x_qp, y_qp = (0.05, 100), (0.04, 60)
    if op == "LeakyRelu":
        model = _qdq_unary("LeakyRelu", x_qp, y_qp, alpha=0.2)
    else:
        slope = np.array([0.1, 0.25, -0.5, 0.75], np.float32).reshape(4, 1, 1)
        model = _qdq_unary("PRelu", x_qp, y_qp, ["slope"], [graphs.init("slope", slope)])
    item = _layer(export_params(model), op)
    expected_slopes = [0.2] if op == "LeakyRelu" else [0.1, 0.25, -0.5, 0.75]
    assert item["slope"] == pytest.approx(expected_slopes)
    assert item["negative"][0]["real"] == pytest.approx(expected_slopes[0] * x_qp[0] / y_qp[0])
    x = np.random.default_rng(0).uniform(-6, 8, (1, 4, 8, 8)).astype(np.float32)
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    codes, theirs = session.run(["xq", "yq"], {"x": x})
    ours = _apply_prelu(codes, item, x_qp[1])
    diff = np.abs(ours - theirs.astype(np.int64))
    # onnxruntime rounds half to even, the fixed-point form half up: they may differ only on ties
    centred = codes.astype(np.float64) - x_qp[1]
    negative = np.array([n["real"] for n in item["negative"]]).reshape(1, -1, 1, 1)
    exact = np.where(centred >= 0, centred * item["positive"]["real"], centred * negative)
    on_tie = np.abs(np.abs(exact - np.floor(exact)) - 0.5) < 1e-3
    assert diff.max() <= 1 and not np.any((diff > 0) & ~on_tie)
    assert np.array_equal(ours - item["output"]["zero_point"], np.clip(np.floor(exact + 0.5), -60, 195))


def test_average_pool_parameters_compute_the_float_mean_on_the_integer_grid(tmp_path):
    qmodel = _quantized(tmp_path, graphs.conv_model(np.random.default_rng(0), pool="AveragePool"), (8, 12, 12))
    pool = _layer(export_params(qmodel), "AveragePool")
    assert pool["window_area"] == 4  # the graph's 2x2 kernel
    inits = {t.name: onnx.numpy_helper.to_array(t) for t in qmodel.graph.initializer}
    x = np.random.default_rng(5).normal(0, 1, (2, 8, 12, 12)).astype(np.float32)
    q_in, q_out = _codes(qmodel, ["conv_QuantizeLinear_Output", "pool_QuantizeLinear_Output"], x)
    windows = (q_in - pool["inputs"][0]["zero_point"]).reshape(2, 16, 6, 2, 6, 2)
    m = pool["per_window"]
    ours = np.clip(multiply_by_quantized_multiplier(windows.sum(axis=(3, 5)), m["multiplier"], m["shift"])
                   + pool["output"]["zero_point"], *pool["clamp"])
    real = ((q_in - inits["conv_zero_point"].astype(np.int64)) * float(inits["conv_scale"])).reshape(2, 16, 6, 2, 6, 2)
    _assert_matches_float(ours, real.mean(axis=(3, 5)) / float(inits["pool_scale"]) + int(inits["pool_zero_point"]),
                          0, 255)
    assert np.abs(ours - q_out).max() <= 1


def test_cli_export_params(tmp_path):
    qmodel = _quantized(tmp_path, graphs.gemm_model(np.random.default_rng(0)), (32,))
    # a float graph output after the Gemm keeps its output quantized
    onnx.save(qmodel, tmp_path / "gemm.int8.onnx")
    r = run_qtool("export-params", tmp_path / "gemm.int8.onnx", "-o", tmp_path / "params.json")
    assert r.returncode == 0, r.stderr
    params = json.loads((tmp_path / "params.json").read_text())
    assert params["format"] == "qtool-fixed-point"
    assert params["float_output"] == ["gemm (Gemm)"]  # the graph output stays float: no requantization
    r = run_qtool("export-params", tmp_path / "params.json", "-o", tmp_path / "again.json")
    assert r.returncode == 2 and r.stderr.startswith("error: ") and "Traceback" not in r.stderr
