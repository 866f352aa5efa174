"""SmoothQuant: exact in fp32, and the scales calibration measured are the ones quantization folds."""

from __future__ import annotations

import json
from dataclasses import replace

import numpy as np
import onnx
import pytest
from click.testing import CliRunner
from onnx import helper

from qtool import api
from qtool.cli import main
from qtool.config import CalibrationConfig, PreprocessConfig, QuantizeConfig
from qtool.calibration.smoothing import measured_smoothing
from qtool.data.dataset import batches, open_data
from qtool.errors import QtoolError
from qtool.graph.modelio import input_specs
from qtool.graph.runtime import create_session
from qtool.plan.planner import prepared_model
from qtool.plan.smooth_quant import find_sites
from tests.conftest import kit_path
from tests.graphs import init, model, tensor, write_samples

C, N, T = 16, 12, 6


def _outlier_gamma(rng) -> np.ndarray:
    gamma = rng.uniform(0.5, 1.5, C).astype(np.float32)
    gamma[[3, 11]] = 40.0  # the outlier channels SmoothQuant is for
    return gamma


def layer_norm_model(rng, residual: bool = False) -> onnx.ModelProto:
    """LayerNormalization -> two MatMuls (and a Shape, which reads no values); `residual`: also an Add."""
    nodes = [helper.make_node("LayerNormalization", ["x", "gamma", "beta"], ["h"], axis=-1),
             helper.make_node("MatMul", ["h", "w1"], ["y1"]),
             helper.make_node("MatMul", ["h", "w2"], ["y2"]),
             helper.make_node("Shape", ["h"], ["hs"])]
    outputs = [tensor("y1", [1, T, N]), tensor("y2", [1, T, N]), tensor("hs", [3], onnx.TensorProto.INT64)]
    if residual:
        nodes.append(helper.make_node("Add", ["h", "x"], ["r"]))
        outputs.append(tensor("r", [1, T, C]))
    inits = [init("gamma", _outlier_gamma(rng)), init("beta", rng.normal(0, 1, C).astype(np.float32)),
             init("w1", rng.normal(0, 0.2, (C, N)).astype(np.float32)),
             init("w2", rng.normal(0, 0.2, (C, N)).astype(np.float32))]
    return model(nodes, [tensor("x", [1, T, C])], outputs, inits)


def decomposed_model(rng) -> onnx.ModelProto:
    """The LayerNorm chain PyTorch/Paddle export -> Gemm(transB) + bias -> MatMul (a linear layer feeding one)."""
    nodes = [helper.make_node("ReduceMean", ["x"], ["m"], axes=[-1]),
             helper.make_node("Sub", ["x", "m"], ["d"]),
             helper.make_node("Pow", ["d", "two"], ["p"]),
             helper.make_node("ReduceMean", ["p"], ["v"], axes=[-1]),
             helper.make_node("Add", ["v", "eps"], ["ve"]),
             helper.make_node("Sqrt", ["ve"], ["sd"]),
             helper.make_node("Div", ["d", "sd"], ["n"]),
             helper.make_node("Mul", ["n", "gamma"], ["g"]),
             helper.make_node("Add", ["g", "beta"], ["h"]),
             helper.make_node("Gemm", ["h", "w1", "b1"], ["y1"], transB=1),
             helper.make_node("MatMul", ["y1", "w2"], ["z"]),
             helper.make_node("Add", ["z", "b2"], ["y2"]),
             helper.make_node("MatMul", ["y2", "w3"], ["y"])]
    inits = [init("two", np.float32(2.0)), init("eps", np.float32(1e-5)), init("gamma", _outlier_gamma(rng)),
             init("beta", rng.normal(0, 1, C).astype(np.float32)),
             init("w1", rng.normal(0, 0.2, (N, C)).astype(np.float32)), init("b1", rng.normal(0, 1, N).astype(np.float32)),
             init("w2", rng.normal(0, 0.2, (N, C)).astype(np.float32)), init("b2", rng.normal(0, 1, C).astype(np.float32)),
             init("w3", rng.normal(0, 0.2, (C, 4)).astype(np.float32))]
    return model(nodes, [tensor("x", [T, C])], [tensor("y", [T, 4])], inits)


def _outputs(graph: onnx.ModelProto, feeds_list) -> list[np.ndarray]:
    session = create_session(graph)
    return [o for feeds in feeds_list for o in session.run(None, feeds)]


def _smoothed(path, data, calib: CalibrationConfig, options: QuantizeConfig) -> QuantizeConfig:
    """The options with the smoothing scales calibration measures on `data`."""
    return measured_smoothing(path, *prepared_model(path, options), data, PreprocessConfig(), calib, options)


def _assert_same_fp32(path, data, alpha=0.5, options=QuantizeConfig(), samples=8) -> QuantizeConfig:
    """The smoothed prepared graph computes what the plain one does; the options with the scales."""
    options = replace(options, smooth_quant=alpha)
    plain, _ = prepared_model(path, options)
    smoothed_options = _smoothed(path, data, CalibrationConfig(num_samples=16), options)
    smoothed, _ = prepared_model(path, smoothed_options)
    feeds = [b.feeds for b in batches(open_data(data, input_specs(plain), PreprocessConfig()), 1, samples)]
    for before, after in zip(_outputs(plain, feeds), _outputs(smoothed, feeds)):
        scale = max(1.0, float(np.abs(before).max()))  # relative where the values are large
        assert np.abs(before.astype(np.float64) - after).max() <= 1e-5 * scale
    return smoothed_options


@pytest.mark.parametrize("build, sites", [(layer_norm_model, {"h"}), (decomposed_model, {"h", "y1", "y2"})])
def test_smoothing_is_exact_in_fp32(tmp_path, build, sites):
    rng = np.random.default_rng(0)
    path = tmp_path / "m.onnx"
    onnx.save(build(rng), path)
    data = write_samples(tmp_path / "data", rng, [T, C] if build is layer_norm_model else [C], count=8)
    if build is decomposed_model:  # rank-2 input: one sample is [T, C]
        for f in data.iterdir():
            np.save(f, rng.normal(0, 1, (T, C)).astype(np.float32))
    options = _assert_same_fp32(path, data)
    scales = dict(options.smooth_scales)
    assert set(scales) == sites
    assert len(scales["h"]) == C
    h = np.array(scales["h"])
    assert h[3] > 2 * np.median(h) and h[11] > 2 * np.median(h)  # the outlier channels are divided most


def test_a_tensor_read_by_another_op_is_not_smoothed(tmp_path):
    assert find_sites(layer_norm_model(np.random.default_rng(0), residual=True)) == []
    assert [s.tensor for s in find_sites(layer_norm_model(np.random.default_rng(0)))] == ["h"]


def test_kit_minilm_fp32_unchanged():
    """MiniLM is post-LN: every LayerNorm output also feeds the residual Add, so nothing is smoothed."""
    path = kit_path("models", "minilm_l6_v2_sentence.onnx")
    options = _assert_same_fp32(path, kit_path("inputs", "minilm_l6_v2_sentence", "calib"),
                                options=QuantizeConfig(matmul="static"), samples=4)
    assert options.smooth_scales == ()


@pytest.mark.slow
def test_kit_ppocr_rec_fp32_unchanged():
    """The SVTR blocks of the PP-OCR v4 recognizer are pre-LN: their LayerNorms feed the qkv and fc1 MatMuls."""
    path = kit_path("models", "rapidocr_v4_rec.onnx")
    options = _assert_same_fp32(path, kit_path("inputs", "rapidocr_v4_rec", "calib"), samples=4)
    from qtool.prepare.equalize import activation_sites
    # beside the activation equalization of its backbone's chains (exact too: the same check holds)
    sites = activation_sites(prepared_model(path, QuantizeConfig())[0])
    equalized = {site.tensor for site in sites} | {site.output for site in sites if site.tail}
    assert len(sites) == 14 and len([t for t, _ in options.smooth_scales if t not in equalized]) == 4


def test_option_flows_from_calibrate_to_quantize(tmp_path):
    rng = np.random.default_rng(1)
    path = tmp_path / "m.onnx"
    onnx.save(layer_norm_model(rng), path)
    data = write_samples(tmp_path / "data", rng, [T, C], count=8)
    table_path = tmp_path / "t.json"
    runner = CliRunner()
    result = runner.invoke(main, ["calibrate", str(path), "--data", str(data), "--matmul", "static",
                                  "--smooth-quant", "0.5", "-o", str(table_path)])
    assert result.exit_code == 0, result.output
    document = json.loads(table_path.read_text())
    assert document["settings"]["smooth_quant"] == 0.5 and set(document["smoothing"]) == {"h"}
    out = tmp_path / "q.onnx"
    args = ["quantize", str(path), "--table", str(table_path), "--matmul", "static",
            "-o", str(out)]
    result = runner.invoke(main, [*args, "--smooth-quant", "0.5"])
    assert result.exit_code == 0, result.output
    # the int8 model carries the smoothed weights: gamma divided by the table's scales
    gamma = {t.name: onnx.numpy_helper.to_array(t) for t in onnx.load(out).graph.initializer}["gamma"]
    original = {t.name: onnx.numpy_helper.to_array(t) for t in onnx.load(path).graph.initializer}["gamma"]
    np.testing.assert_allclose(gamma, original / np.array(document["smoothing"]["h"]), rtol=1e-6)
    from qtool.graph.edit import rescaled_tensors
    assert rescaled_tensors(onnx.load(out)) == {"h"}  # h / s under h's name: no per-layer twin
    # the alpha the table records is the default: the same model without asking again
    again = tmp_path / "again.onnx"
    result = runner.invoke(main, [*args[:-1], str(again)])
    assert result.exit_code == 0, result.output
    assert again.read_bytes() == out.read_bytes()
    # the table's ranges are of the smoothed graph: another alpha is an error naming both
    result = runner.invoke(main, [*args, "--smooth-quant", "0.8"])
    assert result.exit_code != 0 and "alpha 0.5, not the 0.8 asked for" in result.output
    plain = api.calibrate(path, data, {"quantization": {"matmul": "static"}})
    assert "smoothing" not in plain.to_json_text() and "smooth_quant" not in plain.settings
    with pytest.raises(QtoolError, match="calibrate with --smooth-quant"):
        api.quantize(path, table=plain, config={"quantization": {"matmul": "static", "smooth_quant": 0.5}})


def test_nothing_to_smooth_still_flows(tmp_path):
    """A model with no smoothable tensor: the table records the alpha, quantization with it runs."""
    rng = np.random.default_rng(2)
    path = tmp_path / "m.onnx"
    onnx.save(layer_norm_model(rng, residual=True), path)
    data = write_samples(tmp_path / "data", rng, [T, C], count=4)
    config = {"quantization": {"matmul": "static", "smooth_quant": 0.8}}
    table = api.calibrate(path, data, config)
    assert table.smoothing == {} and table.settings["smooth_quant"] == 0.8
    result = api.quantize(path, table=table, config=config)
    assert any("smoothed nothing" in note for note in result.notes)


def test_the_measured_scales_are_not_a_config_key():
    """The scales travel with the options from the table to every prepared graph, but a user's
    config cannot set them: only calibration measures them."""
    from qtool.config import load_config
    from qtool.errors import QtoolError

    with pytest.raises(QtoolError, match="unknown key .quantization.smooth_scales"):
        load_config({"quantization": {"smooth_scales": [["x", [1.0]]]}})
    assert load_config({"quantization": {"smooth_quant": 0.5}}).quantization.smooth_quant == 0.5


def _fidelity(path, qmodel, data) -> float:
    """The worst cosine over outputs and samples of `qmodel` against the fp32 model at `path`."""
    plain, quantized = create_session(str(path)), create_session(qmodel)
    worst = 1.0
    for batch in batches(open_data(data, input_specs(onnx.load(path)), PreprocessConfig()), 1, None):
        for a, b in zip(plain.run(None, batch.feeds), quantized.run(None, batch.feeds)):
            if a.dtype.kind == "f":
                a, b = a.reshape(-1).astype(np.float64), b.reshape(-1).astype(np.float64)
                worst = min(worst, float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b))))
    return worst


def test_dynamic_matmuls_read_an_outlier_input_through_an_inserted_mul(tmp_path):
    """Post-LN: the LayerNorm output also feeds the residual Add, so nothing can fold the division;
    the dynamic MatMuls read it through a Mul by 1/s (smooth_dynamic, on by default). Exact in
    fp32 (the residual reads the tensor itself), and closer to fp32 once quantized."""
    rng = np.random.default_rng(0)
    path = tmp_path / "m.onnx"
    onnx.save(layer_norm_model(rng, residual=True), path)
    data = write_samples(tmp_path / "data", rng, [T, C], count=8)
    options = QuantizeConfig(matmul="dynamic")
    assert find_sites(onnx.load(path)) == [] and [s.tensor for s in find_sites(onnx.load(path), insert=True)] == ["h"]
    smoothed_options = _smoothed(path, data, CalibrationConfig(), options)
    assert [name for name, _ in smoothed_options.smooth_scales] == ["h"]
    plain, _ = prepared_model(path, options)
    smoothed, _ = prepared_model(path, smoothed_options)
    assert [n.op_type for n in smoothed.graph.node if n.output[0] == "h_smoothed"] == ["Mul"]
    from qtool.graph.edit import rescaled_tensors
    assert rescaled_tensors(smoothed) == set()  # h keeps its values; h_smoothed is new
    feeds = [b.feeds for b in batches(open_data(data, input_specs(plain), PreprocessConfig()), 1, None)]
    for before, after in zip(_outputs(plain, feeds), _outputs(smoothed, feeds)):
        if before.dtype.kind == "f":
            assert np.abs(before.astype(np.float64) - after).max() <= 1e-5 * max(1.0, float(np.abs(before).max()))
    column = {"matmul": "dynamic", "advanced": {"dynamic_weights": "column"}}  # the same weight grid on and off
    on = api.quantize(path, data=data, config={"quantization": column}, progress=False)
    off = api.quantize(path, data=data, config={"quantization": {**column, "advanced": {"dynamic_weights": "column", "smooth_dynamic": None}}},
                       progress=False)
    assert any(n.startswith("SmoothQuant (alpha 0.8)") for n in on.notes) and on.table.smoothing
    assert not off.table.smoothing
    assert 1 - _fidelity(path, on.model, data) < 0.5 * (1 - _fidelity(path, off.model, data))


def test_dynamic_smoothing_skips_inputs_without_outlier_channels(tmp_path):
    rng = np.random.default_rng(1)
    built = layer_norm_model(rng, residual=True)
    gamma = next(t for t in built.graph.initializer if t.name == "gamma")
    gamma.CopyFrom(init("gamma", rng.uniform(0.8, 1.2, C).astype(np.float32)))  # no channel stands out
    path = tmp_path / "m.onnx"
    onnx.save(built, path)
    data = write_samples(tmp_path / "data", rng, [T, C], count=8)
    options = QuantizeConfig(matmul="dynamic")
    assert _smoothed(path, data, CalibrationConfig(), options) == options


def test_a_linear_layer_whose_product_is_a_graph_output_is_not_divided():
    """MatMul -> bias Add feeding a MatMul: dividing the first MatMul's columns would change its
    product, which the graph also returns; the Add's output is then no site."""
    built = decomposed_model(np.random.default_rng(0))
    assert "y2" in {s.tensor for s in find_sites(built)}
    built.graph.output.append(tensor("z", [T, C]))
    assert "y2" not in {s.tensor for s in find_sites(built)}
