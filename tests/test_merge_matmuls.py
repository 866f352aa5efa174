"""MatMuls reading one activation merged into one MatMul + Split (qtool.prepare.merge_matmuls)."""

from __future__ import annotations

from collections import Counter

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import helper

from qtool.config import QuantizeConfig
from qtool.graph.modelio import load_model
from qtool.plan.planner import prepared_model
from qtool.prepare.graph_prep import prepare
from qtool.prepare.merge_matmuls import merge_shared_input_matmuls
from tests import graphs
from tests.conftest import kit_path

T, K = 5, 12
WIDTHS = {"q": 8, "k": 8, "v": 6}


def _projections(rng, bias=("left", "right", "right"), opset=graphs.OPSET, share_weight=False,
                 output_of=None, body_reads=None) -> onnx.ModelProto:
    """x -> three MatMuls (q, k, v); each Add of its bias with the product on the side `bias` says
    (None: no Add); `share_weight`: v reads q's weight; `output_of`: a product also a graph output;
    `body_reads`: a tensor an If's branches read too."""
    nodes, inits = [], []
    outputs = []
    for (name, n), side in zip(WIDTHS.items(), bias):
        weight = "wq" if share_weight and name == "v" else "w" + name
        if weight == "w" + name:
            inits.append(graphs.init(weight, rng.normal(0, 0.3, (K, n)).astype(np.float32)))
        nodes.append(helper.make_node("MatMul", ["x", weight], [name + "0"], name=name))
        if side is None:
            outputs.append(name + "0")
            continue
        inits.append(graphs.init("b" + name, rng.normal(0, 0.1, n).astype(np.float32)))
        pair = [name + "0", "b" + name] if side == "right" else ["b" + name, name + "0"]
        nodes.append(helper.make_node("Add", pair, [name + "1"], name=name + "_bias"))
        outputs.append(name + "1")
    nodes.append(helper.make_node("Concat", outputs, ["y"], name="concat", axis=-1))
    declared = [graphs.tensor("y", None)] + ([graphs.tensor(output_of, None)] if output_of else [])
    inputs = [graphs.tensor("x", [1, T, K])]
    if body_reads:
        branch = helper.make_graph([helper.make_node("Identity", [body_reads], ["z"])], "branch", [],
                                   [graphs.tensor("z", None)])
        nodes.append(helper.make_node("If", ["cond"], ["picked"], name="if", then_branch=branch, else_branch=branch))
        inputs.append(graphs.tensor("cond", [], onnx.TensorProto.BOOL))
        declared.append(graphs.tensor("picked", None))
    return graphs.model(nodes, inputs, declared, inits, opset=opset)


def _outputs(model: onnx.ModelProto, feeds: dict) -> list[np.ndarray]:
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return session.run(None, feeds)


def _merged(model: onnx.ModelProto, keep=()) -> tuple[onnx.ModelProto, int]:
    copy = onnx.ModelProto()
    copy.CopyFrom(model)
    count = merge_shared_input_matmuls(copy, keep)
    onnx.checker.check_model(copy, full_check=True)
    return copy, count


@pytest.mark.parametrize("bias", [("left", "right", "right"), ("right", "left", "left")])
def test_three_projections_become_one_matmul_one_add_and_a_split(bias):
    model = _projections(np.random.default_rng(0), bias)
    merged, count = _merged(model)
    assert count == 1
    ops = Counter(n.op_type for n in merged.graph.node)
    assert ops == Counter({"MatMul": 1, "Add": 1, "Split": 1, "Concat": 1})
    names = [n.name for n in merged.graph.node]
    assert names[:3] == ["q_merged", "q_bias_merged", "q_split"]
    inits = {t.name: t for t in merged.graph.initializer}
    assert set(inits) == {"wq_merged", "bq_merged", "q_split_sizes"}  # the old weights and biases are gone
    assert list(inits["wq_merged"].dims) == [K, sum(WIDTHS.values())]
    feeds = {"x": np.random.default_rng(1).normal(0, 1, (1, T, K)).astype(np.float32)}
    np.testing.assert_allclose(_outputs(merged, feeds)[0], _outputs(model, feeds)[0], atol=1e-5, rtol=0)


def test_adds_stay_when_one_projection_has_no_bias():
    model = _projections(np.random.default_rng(0), ("right", None, "left"))
    merged, count = _merged(model)
    assert count == 1
    ops = Counter(n.op_type for n in merged.graph.node)
    assert ops["MatMul"] == 1 and ops["Split"] == 1 and ops["Add"] == 2  # q's and v's own Adds read the Split
    assert {"bq", "bv"} <= {t.name for t in merged.graph.initializer}
    feeds = {"x": np.random.default_rng(1).normal(0, 1, (1, T, K)).astype(np.float32)}
    np.testing.assert_allclose(_outputs(merged, feeds)[0], _outputs(model, feeds)[0], atol=1e-5, rtol=0)


@pytest.mark.parametrize("case", ["shared weight", "graph output", "read in a body", "kept", "opset 12"])
def test_what_is_left_alone(case):
    rng = np.random.default_rng(0)
    model = {"shared weight": lambda: _projections(rng, ("left", "right", None), share_weight=True),
             "graph output": lambda: _projections(rng, output_of="k0"),
             "read in a body": lambda: _projections(rng, body_reads="wk"),
             "kept": lambda: _projections(rng),
             "opset 12": lambda: _projections(rng, opset=12)}[case]()
    merged, count = _merged(model, keep={"k"} if case == "kept" else ())
    names = {n.name for n in merged.graph.node}
    if case in ("opset 12", "shared weight"):  # opset 12: Split's sizes are an attribute; q, v share a weight
        assert count == 0 and merged.SerializeToString() == model.SerializeToString()
        return
    untouched = {"graph output": {"k"}, "read in a body": {"k"}, "kept": {"k"}}[case]
    assert count == 1 and untouched <= names  # the other two still merge
    assert Counter(n.op_type for n in merged.graph.node)["MatMul"] == 1 + len(untouched)


def test_static_strategy_keeps_the_projections_apart(tmp_path):
    path = tmp_path / "m.onnx"
    block = _projections(np.random.default_rng(0))
    block.graph.node.insert(0, helper.make_node("LayerNormalization", ["x0", "g", "b"], ["x"], name="ln", axis=-1))
    block.graph.input[0].name = "x0"
    block.graph.initializer.extend([graphs.init("g", np.ones(K, np.float32)), graphs.init("b", np.zeros(K, np.float32))])
    onnx.save(block, path)
    dynamic, _ = prepared_model(path, QuantizeConfig(matmul="dynamic"))
    static, _ = prepared_model(path, QuantizeConfig(matmul="static"))
    assert [n.op_type for n in dynamic.graph.node].count("MatMul") == 1
    assert [n.op_type for n in static.graph.node].count("MatMul") == 3
    excluded, _ = prepared_model(path, QuantizeConfig(matmul="dynamic", exclude_nodes=("v",)))
    assert {"q_merged", "v"} <= {n.name for n in excluded.graph.node}  # an excluded node keeps its own MatMul


def test_kit_minilm_merges_each_layers_query_key_value_exactly():
    path = kit_path("models", "minilm_l6_v2_sentence.onnx")
    sample = sorted(kit_path("inputs", "minilm_l6_v2_sentence", "eval").glob("*.npz"))[0]
    feeds = dict(np.load(sample))
    model = prepare(load_model(path), divisions=False).model
    merged, count = _merged(model)
    assert count == 6  # one Q/K/V group per layer; the FFN and output projections read other tensors
    ops = Counter(n.op_type for n in merged.graph.node)
    assert ops["Split"] == 6 and ops["MatMul"] == 48 - 12
    for before, after in zip(_outputs(model, feeds), _outputs(merged, feeds)):
        assert np.max(np.abs(before - after)) <= 1e-4
