"""Integer-only reference check: the kernels against naive loops, small QDQ graphs and
EfficientNet-Lite0 against onnxruntime, and the CLI."""

from __future__ import annotations

import itertools
import json

import numpy as np
import onnx
import pytest
from onnx import helper

from qtool.calibration.calibrate import calibrate
from qtool.config import CalibrationConfig, PreprocessConfig, QuantizeConfig, load_config
from qtool.integer.int_kernels import conv_acc, matmul_acc
from qtool.graph.modelio import save_model
from qtool.quantization.quantize import quantize_model
from qtool.integer.verify_int import verify

from tests import graphs
from tests.conftest import CALIB_SAMPLES, EFFNET, EFFNET_CONFIG, run_qtool


def _naive_conv(x, zx, w, zw, strides, pads, dilations, group):
    """sum (x - zx)(w - zw) over each window, one output at a time, padding with zx."""
    n, c, h, wd = x.shape
    m, cg, kh, kw = w.shape
    xp = np.pad(x.astype(np.int64), [(0, 0), (0, 0), (pads[0], pads[2]), (pads[1], pads[3])], constant_values=zx)
    oh = (xp.shape[2] - (kh - 1) * dilations[0] - 1) // strides[0] + 1
    ow = (xp.shape[3] - (kw - 1) * dilations[1] - 1) // strides[1] + 1
    out = np.zeros((n, m, oh, ow), np.int64)
    for b, o, i, j in itertools.product(range(n), range(m), range(oh), range(ow)):
        g = o // (m // group)
        total = 0
        for ci, a, e in itertools.product(range(cg), range(kh), range(kw)):
            xv = xp[b, g * cg + ci, i * strides[0] + a * dilations[0], j * strides[1] + e * dilations[1]]
            total += (int(xv) - zx) * (int(w[o, ci, a, e]) - int(zw[o]))
        out[b, o, i, j] = total
    return out


@pytest.mark.parametrize("group, strides, pads, dilations, multiplier", [
    (1, [1, 1], [1, 1, 1, 1], [1, 1], 2),
    (2, [2, 1], [0, 1, 2, 0], [1, 2], 2),  # grouped, strided, asymmetric pads, dilated
    (4, [1, 2], [1, 0, 1, 1], [1, 1], 1),  # depthwise
    (4, [1, 1], [1, 1, 1, 1], [1, 1], 2),  # depthwise with a channel multiplier
])
def test_conv_accumulators_match_naive_loops(group, strides, pads, dilations, multiplier):
    rng = np.random.default_rng(0)
    x = rng.integers(0, 256, (2, 4, 7, 6)).astype(np.uint8)
    w = rng.integers(-127, 128, (group * multiplier, 4 // group, 3, 2)).astype(np.int8)
    zw = rng.integers(-3, 4, w.shape[0])  # non-zero weight zero points exercise the row sums
    ours = conv_acc(x, 121, w, zw, strides, pads, dilations, group)
    assert np.array_equal(ours, _naive_conv(x, 121, w, zw, strides, pads, dilations, group))


def test_matmul_accumulators_match_naive_sums():
    rng = np.random.default_rng(1)
    a = rng.integers(-128, 128, (3, 5, 16)).astype(np.int8)
    b = rng.integers(-127, 128, (16, 7)).astype(np.int8)
    zb = rng.integers(-2, 3, 7)
    expected = np.einsum("bik,kj->bij", a.astype(np.int64) + 9, b.astype(np.int64) - zb)
    assert np.array_equal(matmul_acc(a, -9, b, zb), expected)


def _head_model(op_type, rng):
    """x -> Gemm/MatMul -> Relu -> Sigmoid: the float Sigmoid keeps the layer's output quantized."""
    k, n = 24, 10
    if op_type == "Gemm":
        nodes = [helper.make_node("Gemm", ["x", "w", "b"], ["mm"], name="gemm", transB=1)]
        inits = [graphs.init("w", rng.normal(0, 0.3, (n, k)).astype(np.float32)),
                 graphs.init("b", rng.normal(0, 0.1, n).astype(np.float32))]
        shape = ["N", k]
    else:
        nodes = [helper.make_node("MatMul", ["x", "w"], ["mm"], name="matmul")]
        inits = [graphs.init("w", rng.normal(0, 0.3, (k, n)).astype(np.float32))]
        shape = ["N", 3, k]
    nodes += [helper.make_node("Relu", ["mm"], ["r"], name="relu"), helper.make_node("Sigmoid", ["r"], ["y"])]
    return graphs.model(nodes, [graphs.tensor("x", shape)], [graphs.tensor("y", None)], inits), shape[1:]


def _same_upper_model(rng):
    """x -> 2x2 Conv and 2x2 MaxPool with auto_pad SAME_UPPER at stride 1 (PP-OCRv6's detectors)."""
    nodes = [helper.make_node("Conv", ["x", "w", "b"], ["conv"], name="conv", auto_pad="SAME_UPPER"),
             helper.make_node("MaxPool", ["conv"], ["pool"], name="pool", kernel_shape=[2, 2], auto_pad="SAME_UPPER"),
             helper.make_node("Sigmoid", ["pool"], ["y"])]
    inits = [graphs.init("w", rng.normal(0, 0.3, (8, 8, 2, 2)).astype(np.float32)),
             graphs.init("b", rng.normal(0, 0.1, 8).astype(np.float32))]
    return graphs.model(nodes, [graphs.tensor("x", ["N", 8, 12, 12])], [graphs.tensor("y", None)], inits), [8, 12, 12]


CASES = {  # builder, the layer types verify-int must check
    "conv-clip-maxpool": (lambda rng: (graphs.conv_model(rng, activation="Clip", pool="MaxPool"), [8, 12, 12]),
                          {"Conv", "MaxPool"}),
    "depthwise-relu-avgpool": (lambda rng: (graphs.conv_model(rng, group=8, c_out=8, activation="Relu",
                                                              pool="AveragePool"), [8, 12, 12]),
                               {"Conv", "AveragePool"}),
    "conv-globalavgpool": (lambda rng: (graphs.conv_model(rng, pool="GlobalAveragePool"), [8, 12, 12]),
                           {"Conv", "GlobalAveragePool"}),
    "add": (lambda rng: (graphs.add_model(rng), [8, 6, 6]), {"Conv", "Add"}),
    "same-upper-conv-maxpool": (_same_upper_model, {"Conv", "MaxPool"}),
    "gemm": (lambda rng: _head_model("Gemm", rng), {"Gemm"}),
    "matmul": (lambda rng: _head_model("MatMul", rng), {"MatMul"}),
}


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("options", [QuantizeConfig(), QuantizeConfig(activation_dtype="int8")], ids=["u8", "s8"])
def test_small_graphs_integer_layers_match_onnxruntime(tmp_path, case, options):
    rng = np.random.default_rng(0)
    build, expected = CASES[case]
    model, shape = build(rng)
    path = tmp_path / "model.onnx"
    onnx.save(model, path)
    data = graphs.write_samples(tmp_path / "data", rng, shape, count=6)
    table = calibrate(path, data, PreprocessConfig(), CalibrationConfig(batch_size=2), options, progress=False)
    qpath = tmp_path / "model.int8.onnx"
    save_model(quantize_model(path, table, options).model, qpath)
    report = verify(qpath, data, PreprocessConfig(), num_samples=4)
    assert report["samples"] == 4
    assert {row["op_type"] for row in report["layers"]} == expected
    for row in report["layers"]:
        assert row["fixed"]["max_lsb"] <= 1, row
        assert row["fixed"]["fraction_exact"] >= 0.99, row
        assert row["ort"]["max_lsb"] <= 1, row
        if options.activation_dtype == "uint8":  # every layer runs in an onnxruntime integer kernel
            assert row["ort"]["fraction_exact"] == 1.0, row
    if options.activation_dtype == "uint8":
        assert sum(report["ort_kernels"].values()) >= len(report["layers"]) - ("MaxPool" in expected)


def test_efficientnet_lite0_is_bit_exact_in_integer_arithmetic(tmp_path):
    """The issue's target: >= 99% of outputs bit-exact, none off by more than 1 LSB."""
    cfg = load_config(EFFNET_CONFIG)
    table = calibrate(EFFNET, CALIB_SAMPLES, cfg.preprocess, CalibrationConfig(num_samples=4, batch_size=4),
                      cfg.quantization, progress=False)
    qpath = tmp_path / "effnet.int8.onnx"
    save_model(quantize_model(EFFNET, table, cfg.quantization).model, qpath)
    report = verify(qpath, CALIB_SAMPLES, cfg.preprocess, num_samples=1)
    assert report["ort_kernels"]["QLinearConv"] == 49 and report["ort_kernels"]["QLinearAdd"] == 9
    assert len(report["layers"]) == 58  # 49 Conv + 9 Add; the final Gemm's output is the float logits
    fixed, ort = report["totals"]["fixed"], report["totals"]["ort"]
    assert fixed["outputs"] == ort["outputs"] > 6_000_000
    assert fixed["fraction_exact"] >= 0.99 and fixed["max_lsb"] <= 1
    assert ort["fraction_exact"] == 1.0  # the layer mapping and onnxruntime's rounding reproduced exactly
    assert report["totals"]["int16"]["max_lsb"] <= 2
    r = run_qtool("verify-int", qpath, "--data", CALIB_SAMPLES, "--config", EFFNET_CONFIG, "--num-samples", 1,
                  "--min-exact", 1.0, "--json", tmp_path / "verify.json")
    assert r.returncode == 1 and "bit-exact (< 100.0%)" in r.stderr  # a threshold it cannot meet fails
    saved = json.loads((tmp_path / "verify.json").read_text())
    assert saved["totals"]["fixed"] == report["totals"]["fixed"]


def test_adds_of_a_quantized_constant_are_checked(tmp_path):
    """An Add whose second operand is a constant stored like an activation (a bias vector; the
    "+ 3" of a HardSwish run as integer kernels) is checked too, against its QLinearAdd."""
    rng = np.random.default_rng(3)
    inits = [graphs.init("w1", rng.normal(0, 0.4, (8, 3, 3, 3)).astype(np.float32)),
             graphs.init("bias", rng.normal(0, 0.5, (8, 1, 1)).astype(np.float32)),
             graphs.init("w2", rng.normal(0, 0.3, (8, 8, 3, 3)).astype(np.float32))]
    nodes = [helper.make_node("Conv", ["x", "w1"], ["a0"], name="conv1", pads=[1, 1, 1, 1]),
             helper.make_node("MaxPool", ["a0"], ["a"], name="pool", kernel_shape=[2, 2]),  # no bias folding
             helper.make_node("Add", ["a", "bias"], ["b"], name="bias_add"),
             helper.make_node("HardSwish", ["b"], ["h"], name="hswish"),
             helper.make_node("Conv", ["h", "w2"], ["c"], name="conv2", pads=[1, 1, 1, 1]),
             helper.make_node("Sigmoid", ["c"], ["y"], name="out")]
    path = tmp_path / "model.onnx"
    onnx.save(graphs.model(nodes, [graphs.tensor("x", ["N", 3, 8, 8])], [graphs.tensor("y", None)], inits), path)
    data = graphs.write_samples(tmp_path / "data", rng, (3, 8, 8), count=6, scale=2.0)
    options = QuantizeConfig()
    table = calibrate(path, data, PreprocessConfig(), CalibrationConfig(batch_size=2), options, progress=False)
    qpath = tmp_path / "model.int8.onnx"
    save_model(quantize_model(path, table, options).model, qpath)
    report = verify(qpath, data, PreprocessConfig(), num_samples=4)
    adds = {row["name"]: row for row in report["layers"] if row["op_type"] == "Add"}
    assert set(adds) == {"bias_add", "hswish_int8_offset"}, report.get("not_checked")
    for row in adds.values():
        assert row["ort"]["fraction_exact"] == 1.0 and row["fixed"]["max_lsb"] <= 1, row
    assert report["ort_kernels"]["QLinearAdd"] == 2
