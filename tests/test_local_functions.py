"""Models whose layers are ONNX model-local functions (PyTorch's dynamo exporter without its
optimizer, onnxscript): the front end inlines the calls, so their nodes are calibrated and
quantized like any other and the table names tensors of the graph that is quantized."""

from __future__ import annotations

from collections import Counter

import numpy as np
import onnx
import onnxruntime as ort
from onnx import helper

from qtool import api
from qtool.calibration.calibrate import calibrate
from qtool.config import CalibrationConfig, Config, PreprocessConfig, QuantizeConfig
from tests import graphs

T, D = 8, 32


def _with_functions(nodes, inputs, outputs, inits, functions) -> onnx.ModelProto:
    graph = helper.make_graph(nodes, "test", inputs, outputs, inits)
    m = helper.make_model(graph, functions=functions,
                          opset_imports=[helper.make_opsetid("", graphs.OPSET), helper.make_opsetid("local", 1)])
    m.ir_version = 8
    onnx.checker.check_model(m, full_check=True)
    return m


def _conv_net(rng) -> onnx.ModelProto:
    """Two calls of a Conv-Relu function, the second through a function that calls the first."""
    conv_relu = helper.make_function("local", "ConvRelu", ["x", "w", "b"], ["y"], [
        helper.make_node("Conv", ["x", "w", "b"], ["c"], pads=[1, 1, 1, 1]),
        helper.make_node("Relu", ["c"], ["y"])], [helper.make_opsetid("", graphs.OPSET)])
    wrapped = helper.make_function("local", "Wrapped", ["x", "w", "b"], ["y"], [
        helper.make_node("ConvRelu", ["x", "w", "b"], ["y"], domain="local")],
        [helper.make_opsetid("", graphs.OPSET), helper.make_opsetid("local", 1)])
    inits = [graphs.init("w1", rng.normal(0, 0.3, (8, 3, 3, 3)).astype(np.float32)),
             graphs.init("b1", rng.normal(0, 0.1, 8).astype(np.float32)),
             graphs.init("w2", rng.normal(0, 0.3, (8, 8, 3, 3)).astype(np.float32)),
             graphs.init("b2", rng.normal(0, 0.1, 8).astype(np.float32))]
    nodes = [helper.make_node("ConvRelu", ["x", "w1", "b1"], ["h"], domain="local", name="block1"),
             helper.make_node("Wrapped", ["h", "w2", "b2"], ["y"], domain="local", name="block2")]
    return _with_functions(nodes, [graphs.tensor("x", [1, 3, 8, 8])], [graphs.tensor("y", [1, 8, 8, 8])],
                           inits, [conv_relu, wrapped])


def _attention_block(rng) -> onnx.ModelProto:
    """Two calls of a pre-LN attention block function."""
    block = helper.make_function("local", "Block", ["x", "g", "wq", "wk", "wo"], ["y"], [
        helper.make_node("LayerNormalization", ["x", "g"], ["n"], axis=-1),
        helper.make_node("MatMul", ["n", "wq"], ["q"]),
        helper.make_node("MatMul", ["n", "wk"], ["k"]),
        helper.make_node("Transpose", ["k"], ["kt"], perm=[0, 2, 1]),
        helper.make_node("MatMul", ["q", "kt"], ["s"]),
        helper.make_node("Softmax", ["s"], ["p"], axis=-1),
        helper.make_node("MatMul", ["p", "q"], ["a"]),
        helper.make_node("MatMul", ["a", "wo"], ["o"]),
        helper.make_node("Add", ["x", "o"], ["y"])], [helper.make_opsetid("", graphs.OPSET)])
    inits, nodes, current = [], [], "x"
    for i in range(2):
        inits.append(graphs.init(f"g{i}", np.ones(D, np.float32)))
        inits += [graphs.init(f"{w}{i}", rng.normal(0, D ** -0.5, (D, D)).astype(np.float32))
                  for w in ("wq", "wk", "wo")]
        nodes.append(helper.make_node("Block", [current, f"g{i}", f"wq{i}", f"wk{i}", f"wo{i}"], [f"h{i}"],
                                      domain="local", name=f"block{i}"))
        current = f"h{i}"
    nodes.append(helper.make_node("Identity", [current], ["y"]))
    return _with_functions(nodes, [graphs.tensor("x", [1, T, D])], [graphs.tensor("y", [1, T, D])],
                           inits, [block])


def _worst_cosine(path, qmodel, data) -> float:
    sessions = [ort.InferenceSession(m, providers=["CPUExecutionProvider"])
                for m in (str(path), qmodel.SerializeToString())]
    worst = 1.0
    for f in sorted(data.glob("*.npy")):
        a, b = (s.run(None, {"x": np.load(f)})[0].ravel().astype(np.float64) for s in sessions)
        worst = min(worst, float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b))))
    return worst


def test_static_conv_layers_inside_functions_are_calibrated_and_quantized(tmp_path):
    rng = np.random.default_rng(0)
    path = tmp_path / "m.onnx"
    onnx.save(_conv_net(rng), path)
    data = graphs.write_samples(tmp_path / "data", rng, (3, 8, 8), count=8)
    table = calibrate(path, data, PreprocessConfig(), CalibrationConfig(), QuantizeConfig(), progress=False)
    assert {"x", "h"} <= set(table.tensors)  # the Convs' inputs, read inside the functions
    result = api.quantize(path, table=table, progress=False, config=Config(quantization=graphs.mechanics()))
    onnx.checker.check_model(result.model, full_check=True)
    assert not result.model.functions
    assert result.int8_weights == 2 and result.activations >= 2
    assert Counter(n.op_type for n in result.model.graph.node)["Conv"] == 2
    assert any("inlined 2 call(s) of 2 model-local function(s)" in note for note in result.notes)
    assert _worst_cosine(path, result.model, data) > 0.99


def test_transformer_blocks_inside_functions_get_dynamic_matmuls(tmp_path):
    rng = np.random.default_rng(1)
    path = tmp_path / "m.onnx"
    onnx.save(_attention_block(rng), path)
    data = graphs.write_samples(tmp_path / "data", rng, (T, D), count=8)
    result = api.quantize(path, data=data, config=Config(quantization=graphs.mechanics()), progress=False)
    onnx.checker.check_model(result.model, full_check=True)
    ops = Counter(n.op_type for n in result.model.graph.node)
    assert ops["MatMulInteger"] == 4  # per block: q and k merged into one, o
    assert ops["LayerNormalization"] == 2 and ops["Softmax"] == 2
    assert any("inlined 2 call(s) of 1 model-local function(s) (local.Block)" in note for note in result.notes)
    assert _worst_cosine(path, result.model, data) > 0.99


def test_a_model_without_functions_gets_no_inlining_note(tmp_path):
    rng = np.random.default_rng(2)
    path, table = graphs.calibrated(tmp_path, rng, graphs.conv_model(rng), QuantizeConfig(), shape=(8, 12, 12))
    result = api.quantize(path, table=table, progress=False)
    assert not any("inlined" in note for note in result.notes)
