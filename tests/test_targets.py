"""A target is data: one Target added to TARGETS is all a new runtime needs, and every stage follows
its traits (docs/architecture.md, "Where to add things: a target")."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import helper, numpy_helper

import qtool
from qtool.config import AdvancedConfig, PreprocessConfig, QuantizeConfig
from qtool.data.dataset import batches, open_data
from qtool.graph.modelio import input_specs, load_model
from qtool.targets import TARGETS, Target, describe
from tests import graphs
from tests.conftest import CALIB_SAMPLES, EFFNET
from tests.test_recurrent import INPUT, STEPS, _recurrent_model

# The one place the toy target is defined: int8 symmetric activations, per-tensor weights, no
# runtime-specific passes, no weight-only kernels, every other trait at its default.
TOY = Target("toy", "a toy runtime: int8 symmetric activations, per-tensor weights", "the toy runtime",
             activation_dtype="int8", symmetric_activations=True, per_channel=False)
CONFIG = {"calibration": {"method": "minmax"},
          "quantization": {"target": "toy", "bias_correction": "off", "weight_rounding": "nearest"}}


@pytest.fixture
def toy(monkeypatch):
    monkeypatch.setitem(TARGETS, "toy", TOY)


def _weight_scales(model: onnx.ModelProto) -> dict[str, np.ndarray]:
    """The scale of each weight a Conv/Gemm/MatMul reads through a DequantizeLinear."""
    inits = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}
    producer = {o: n for n in model.graph.node for o in n.output}
    found = {}
    for node in model.graph.node:
        if node.op_type in ("Conv", "Gemm", "MatMul") and len(node.input) > 1:
            dq = producer.get(node.input[1])
            if dq is not None and dq.op_type == "DequantizeLinear" and dq.input[0] in inits:
                found[node.name] = inits[dq.input[1]]
    return found


def _activation_zero_points(model: onnx.ModelProto) -> list[np.ndarray]:
    inits = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}
    return [inits[n.input[2]] for n in model.graph.node if n.op_type == "QuantizeLinear"]


def test_a_toy_target_quantizes_a_real_model_by_its_traits(toy):
    result = qtool.quantize(EFFNET, data=CALIB_SAMPLES, config=CONFIG, progress=False)
    model = result.model
    assert result.settled.quantization.target == "toy"
    # the preset: int8 symmetric activations, per-tensor weights
    zeros = _activation_zero_points(model)
    assert zeros and all(z.dtype == np.int8 and int(z) == 0 for z in zeros)
    scales = _weight_scales(model)
    assert len(scales) == result.int8_weights > 40 and all(s.ndim == 0 for s in scales.values())
    # no onnxruntime pass ran: the stride-2 RGB stem is neither space-to-depth nor padded, no
    # com.microsoft op, the inferred shapes kept (onnxruntime's written form drops them)
    ops = {n.op_type for n in model.graph.node}
    assert not ops & {"SpaceToDepth", "Pad"} and all(n.domain in ("", "ai.onnx") for n in model.graph.node)
    assert len(model.graph.value_info) > 0
    assert not any("SpaceToDepth" in n or "padded" in n or "onnxruntime" in n for n in result.notes)
    assert not result.decisions or all(d.option != "quantization.matmul" or d.value == "static"
                                       for d in result.decisions)
    assert describe(result.settled.quantization).startswith(
        "target toy: int8 symmetric activations, int8 symmetric per-tensor weights")
    # it runs in onnxruntime and computes the fp32 model's outputs roughly: per-tensor weights with
    # minmax ranges cost a depthwise network much (cosine 0.67-0.86 measured; the same preset as
    # option overrides of ort-cpu gives the same figures, per-channel weights 0.95-0.98)
    feeds = [b.feeds for b in batches(open_data(CALIB_SAMPLES, input_specs(load_model(EFFNET)), PreprocessConfig()),
                                      1, 4)]
    fp32 = ort.InferenceSession(str(EFFNET), providers=["CPUExecutionProvider"])
    int8 = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    for f in feeds:
        a, b = fp32.run(None, f)[0].ravel(), int8.run(None, f)[0].ravel()
        assert np.all(np.isfinite(b)) and float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b))) > 0.6


def test_a_toy_target_without_kernels_or_forms_keeps_them_float(toy, tmp_path):
    """HardSwish stays the ONNX op (no kernel form), an LSTM stays float (no weight-only kernel)."""
    rng = np.random.default_rng(0)
    nodes = [helper.make_node("Conv", ["x", "w1"], ["a"], name="conv1", pads=[1, 1, 1, 1]),
             helper.make_node("HardSwish", ["a"], ["h"], name="hswish"),
             helper.make_node("Conv", ["h", "w2"], ["y"], name="conv2", pads=[1, 1, 1, 1])]
    inits = [graphs.init("w1", rng.normal(0, 0.4, (8, 3, 3, 3)).astype(np.float32)),
             graphs.init("w2", rng.normal(0, 0.3, (8, 8, 3, 3)).astype(np.float32))]
    onnx.save(graphs.model(nodes, [graphs.tensor("x", ["N", 3, 8, 8])], [graphs.tensor("y", None)], inits),
              tmp_path / "hard.onnx")
    data = graphs.write_samples(tmp_path / "hard_data", rng, (3, 8, 8), count=8, scale=2.0)
    hard = qtool.quantize(tmp_path / "hard.onnx", data=data, config=CONFIG, progress=False)
    assert "HardSwish" in {n.op_type for n in hard.model.graph.node}
    [form] = [d for d in hard.decisions if d.option == "quantization.advanced.hard_activations"]
    assert form.value == "integer" and "no HardSigmoid/HardSwish written" in form.rule  # nothing measured
    ort.InferenceSession(hard.model.SerializeToString(), providers=["CPUExecutionProvider"]).run(
        None, {"x": np.load(sorted(data.glob("*.npy"))[0])})

    onnx.save(_recurrent_model("LSTM", rng), tmp_path / "lstm.onnx")
    (tmp_path / "lstm_data").mkdir()
    for i in range(4):
        np.save(tmp_path / "lstm_data" / f"s{i}.npy", rng.normal(0, 1, (STEPS, 1, INPUT)).astype(np.float32))
    lstm = qtool.quantize(tmp_path / "lstm.onnx", data=tmp_path / "lstm_data", config=CONFIG, progress=False)
    assert [n.op_type for n in lstm.model.graph.node] == ["LSTM"]
    assert "LSTM node 'rnn' kept float: the toy runtime has no int8 LSTM kernel" in lstm.notes


def test_the_known_targets_are_the_entries_of_TARGETS(toy):
    assert QuantizeConfig(target="toy").activation_dtype == "int8"  # the preset fills the options


def test_an_unknown_target_is_refused():
    with pytest.raises(ValueError, match="target must be one of ort-cpu, tensorrt, litert, openvino, got 'toy'"):
        QuantizeConfig(target="toy")


def _embed_layer_norm_model(rng) -> onnx.ModelProto:
    """onnxruntime's fused EmbedLayerNormalization (ids -> word + position rows -> LayerNorm) -> MatMul."""
    v, s, d = 20, 6, 8
    inits = [graphs.init("word", rng.normal(0, 1, (v, d)).astype(np.float32)),
             graphs.init("position", rng.normal(0, 1, (s, d)).astype(np.float32)),
             graphs.init("gamma", np.ones(d, np.float32)), graphs.init("beta", np.zeros(d, np.float32)),
             graphs.init("w", rng.normal(0, 0.3, (d, d)).astype(np.float32))]
    nodes = [helper.make_node("EmbedLayerNormalization", ["ids", "", "word", "position", "", "gamma", "beta"],
                              ["e"], name="embed", domain="com.microsoft", epsilon=1e-12),
             helper.make_node("MatMul", ["e", "w"], ["y"], name="proj")]
    ids = graphs.tensor("ids", ["N", s], onnx.TensorProto.INT32)
    model = helper.make_model(helper.make_graph(nodes, "embed", [ids], [graphs.tensor("y", ["N", s, d])], inits),
                              opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)])
    model.ir_version = 8
    return model


@pytest.mark.parametrize("target, embeddings, written", [("ort-cpu", "auto", True), ("ort-cpu", "float", False),
                                                         ("tensorrt", "auto", False), ("toy", "auto", True)])
def test_a_target_names_the_passes_run_before_planning(monkeypatch, tmp_path, target, embeddings, written):
    from dataclasses import replace

    from qtool.plan.planner import prepared_model

    monkeypatch.setitem(TARGETS, "toy", replace(TOY, prepare_passes=("embed_layer_norm",)))
    onnx.save(_embed_layer_norm_model(np.random.default_rng(0)), tmp_path / "m.onnx")
    model, _ = prepared_model(tmp_path / "m.onnx", QuantizeConfig(target=target, advanced=AdvancedConfig(embeddings=embeddings)))
    ops = {n.op_type for n in model.graph.node}
    assert ("EmbedLayerNormalization" not in ops and "LayerNormalization" in ops) == written
