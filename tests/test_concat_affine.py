"""A per-channel affine after a Concat moves onto its inputs: exact in fp32, and the int8 model keeps
the narrow inputs (an embedding beside features a thousand times wider) that one shared scale at
the Concat would flatten."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

import qtool
from qtool.graph.index import GraphIndex
from qtool.prepare.graph_prep import prepare

VOCAB, STEPS, EMB, FEAT = 20, 8, 6, 5


def _model(shift_axis: int = 2) -> onnx.ModelProto:
    """ids -> embedding (range about 1), features -> MatMul -> Relu (range about 10^3), Concat on the
    last axis, then Mul and Add by constants along `shift_axis` (2: per channel, as a BatchNormalization
    written out; 1: per step), then a MatMul."""
    rng = np.random.default_rng(0)
    table = rng.normal(0, 1, (VOCAB, EMB)).astype(np.float32)
    w1 = rng.normal(0, 300, (4, FEAT)).astype(np.float32)
    w2 = rng.normal(0, 1, (EMB + FEAT, 3)).astype(np.float32)
    width = EMB + FEAT if shift_axis == 2 else STEPS
    scale = np.concatenate([np.full(EMB, 1.0), np.full(FEAT, 1 / 300)]) if shift_axis == 2 \
        else np.linspace(0.5, 1.5, STEPS)
    shape = (width,) if shift_axis == 2 else (STEPS, 1)
    inits = [numpy_helper.from_array(table, "table"), numpy_helper.from_array(w1, "w1"),
             numpy_helper.from_array(w2, "w2"),
             numpy_helper.from_array(scale.astype(np.float32).reshape(shape), "s"),
             numpy_helper.from_array(rng.normal(0, 0.1, shape).astype(np.float32), "t")]
    nodes = [helper.make_node("Gather", ["table", "ids"], ["emb"]),
             helper.make_node("MatMul", ["features", "w1"], ["pre"]),
             helper.make_node("Relu", ["pre"], ["feat"]),
             helper.make_node("Concat", ["emb", "feat"], ["cat"], axis=2),
             helper.make_node("Mul", ["cat", "s"], ["scaled"]),
             helper.make_node("Add", ["scaled", "t"], ["normed"]),
             helper.make_node("MatMul", ["normed", "w2"], ["out"])]
    graph = helper.make_graph(
        nodes, "concat_affine",
        [helper.make_tensor_value_info("ids", TensorProto.INT64, ["n", STEPS]),
         helper.make_tensor_value_info("features", TensorProto.FLOAT, ["n", STEPS, 4])],
        [helper.make_tensor_value_info("out", TensorProto.FLOAT, ["n", STEPS, 3])], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def _samples(folder, count: int, seed: int) -> list[dict]:
    rng = np.random.default_rng(seed)
    folder.mkdir(parents=True, exist_ok=True)
    samples = []
    for i in range(count):
        feeds = {"ids": rng.integers(0, VOCAB, (1, STEPS)).astype(np.int64),
                 "features": np.abs(rng.normal(0, 1, (1, STEPS, 4))).astype(np.float32)}
        np.savez(folder / f"{i:02d}.npz", **feeds)
        samples.append(feeds)
    return samples


def _run(model, feeds: dict) -> np.ndarray:
    source = model if isinstance(model, (str, bytes)) else model.SerializeToString()
    return ort.InferenceSession(source, providers=["CPUExecutionProvider"]).run(None, feeds)[0]


def test_the_affine_moves_onto_the_inputs_and_folds_into_the_table_exactly(tmp_path):
    model = _model()
    prepared = prepare(model).model
    index = GraphIndex(prepared.graph)
    concat = next(n for n in prepared.graph.node if n.op_type == "Concat")
    made = [index.producer[name].op_type for name in concat.input]
    assert made == ["Gather", "Add"]  # the embedding's slice folded into its table; the features' an op
    assert not any(n.op_type in ("Mul", "Add") and "cat" in n.input for n in prepared.graph.node)
    for feeds in _samples(tmp_path / "x", 4, 1):
        np.testing.assert_array_equal(_run(prepared, feeds), _run(model, feeds))


def test_a_constant_varying_along_another_axis_stays_after_the_concat():
    prepared = prepare(_model(shift_axis=1)).model
    index = GraphIndex(prepared.graph)
    concat = next(n for n in prepared.graph.node if n.op_type == "Concat")
    assert [index.producer[name].op_type for name in concat.input] == ["Gather", "Relu"]
    assert index.only_consumer(concat.output[0]).op_type == "Mul"


def test_the_int8_model_keeps_the_embedding_beside_wide_features(tmp_path):
    path = tmp_path / "model.onnx"
    onnx.save(_model(), path)
    _samples(tmp_path / "calib", 16, 2)
    result = qtool.quantize(str(path), data=str(tmp_path / "calib"))
    cosines = []
    for feeds in _samples(tmp_path / "held", 8, 3):
        ref, got = _run(str(path), feeds).ravel(), _run(result.model, feeds).ravel()
        cosines.append(float(ref @ got / (np.linalg.norm(ref) * np.linalg.norm(got))))
    # one scale over the Concat's inputs leaves the embedding about 2 of 256 levels: 0.2-0.8 here
    assert min(cosines) > 0.995, cosines
