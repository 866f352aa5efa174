"""Each output on its own scale (qtool.choices.heads): a head that int8 moves far from fp32 gets
its own tail kept float, on the plain path, recorded as a decision and replayed."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
from onnx import helper

from qtool import api
from qtool.choices.heads import LAGGING_DB, choose_head_tails, head_tails
from qtool.choices.measure import Scoring
from qtool.config import load_config
from qtool.evaluation.metrics import sqnr_db
from tests import graphs


def _two_heads(rng, second_head=True) -> onnx.ModelProto:
    """x [1,3,32,32] -> Conv 3x3 (32) -> Relu -> Conv 3x3 (32) -> Relu -> GlobalAveragePool -> Flatten ->
    `scores` = Gemm (10), and `offset` = Gemm(W) - Gemm(W + small): a head whose value is the small
    difference of two large ones, which uint8 ranges of the two Gemm outputs cannot hold."""
    w1 = rng.normal(0, 0.3, (32, 3, 3, 3)).astype(np.float32)
    w2 = rng.normal(0, 0.1, (32, 32, 3, 3)).astype(np.float32)
    wa = rng.normal(0, 0.3, (32, 10)).astype(np.float32)
    wb = rng.normal(0, 1.0, (32, 16)).astype(np.float32)
    wc = wb + rng.normal(0, 0.01, (32, 16)).astype(np.float32)
    inits = [graphs.init("w1", w1), graphs.init("w2", w2), graphs.init("wa", wa), graphs.init("wb", wb),
             graphs.init("wc", wc), graphs.init("b1", np.zeros(32, np.float32)),
             graphs.init("b2", np.zeros(32, np.float32))]
    nodes = [helper.make_node("Conv", ["x", "w1", "b1"], ["c1"], name="trunk1", pads=[1, 1, 1, 1]),
             helper.make_node("Relu", ["c1"], ["r1"], name="relu1"),
             helper.make_node("Conv", ["r1", "w2", "b2"], ["c2"], name="trunk2", pads=[1, 1, 1, 1]),
             helper.make_node("Relu", ["c2"], ["r2"], name="relu2"),
             helper.make_node("GlobalAveragePool", ["r2"], ["pool"], name="pool"),
             helper.make_node("Flatten", ["pool"], ["f"], name="flat"),
             helper.make_node("MatMul", ["f", "wa"], ["scores"], name="head_scores")]
    outputs = [graphs.tensor("scores", [1, 10])]
    if second_head:
        nodes += [helper.make_node("MatMul", ["f", "wb"], ["big"], name="head_big"),
                  helper.make_node("MatMul", ["f", "wc"], ["big2"], name="head_big2"),
                  helper.make_node("Sub", ["big", "big2"], ["offset"], name="head_offset")]
        outputs.append(graphs.tensor("offset", [1, 16]))
    return graphs.model(nodes, [graphs.tensor("x", [1, 3, 32, 32])], outputs, inits)


def _sqnr(source, quantized, samples, output) -> float:
    a = ort.InferenceSession(str(source), providers=["CPUExecutionProvider"])
    b = ort.InferenceSession(str(quantized), providers=["CPUExecutionProvider"])
    ref = np.concatenate([a.run([output], {"x": np.load(f)})[0] for f in samples])
    got = np.concatenate([b.run([output], {"x": np.load(f)})[0] for f in samples])
    return sqnr_db(float(np.sum(ref ** 2)), float(np.sum((ref - got) ** 2)))


def test_head_tails_are_the_nodes_no_other_output_reads():
    model = _two_heads(np.random.default_rng(0))
    assert [n.name for n in head_tails(model, {"offset"})] == ["head_big", "head_big2", "head_offset"]
    assert [n.name for n in head_tails(model, {"scores"})] == ["head_scores"]
    assert "trunk2" not in {n.name for n in head_tails(model, {"offset"}) + head_tails(model, {"scores"})}
    assert len(head_tails(model, {"scores", "offset"})) == len(model.graph.node)  # every output: the whole graph


def test_a_lagging_head_keeps_its_own_tail_float_and_the_choice_replays(tmp_path):
    rng = np.random.default_rng(1)
    source = tmp_path / "heads.onnx"
    onnx.save(_two_heads(rng), source)
    data = graphs.write_samples(tmp_path / "calib", rng, (3, 32, 32), count=24)
    samples = sorted(data.iterdir())
    rule_off = {"quantization": {"advanced": dict(graphs.RULE_OFF)}}  # toy-sized heads: float for speed otherwise
    plain = api.quantize(source, data=data, progress=False, config={"quantization": {"advanced": {
        **graphs.RULE_OFF, "head_tails": "off"}}})
    plain.save(tmp_path / "plain.onnx")
    assert _sqnr(source, tmp_path / "plain.onnx", samples, "offset") < LAGGING_DB  # the case this is about

    result = api.quantize(source, data=data, progress=False, config=rule_off)  # head_tails: its default
    result.save(tmp_path / "q.onnx")
    decision = next(d for d in result.decisions if d.option == "quantization.advanced.float_nodes"
                    and "offset" in d.rule)
    tail = {"head_big", "head_big2", "head_offset"}  # the Sub is in it where it is quantized
    assert {"head_big", "head_big2"} <= set(decision.value) <= tail
    before, after = (dict(m[1])["sqnr_db"] for m in decision.measured)
    assert after["offset"] >= before["offset"] + 0.5 and after["scores"] == before["scores"]
    assert _sqnr(source, tmp_path / "q.onnx", samples, "offset") > _sqnr(source, tmp_path / "plain.onnx",
                                                                       samples, "offset") + 3
    written = onnx.load(tmp_path / "q.onnx").graph
    made_by = {o: n.op_type for n in written.node for o in n.output}
    int8_weight = {n.name for n in written.node if len(n.input) > 1 and made_by.get(n.input[1]) == "DequantizeLinear"}
    assert {"trunk1", "trunk2", "head_scores"} <= int8_weight  # the trunk and the other head stay int8
    assert not {"head_big", "head_big2"} & int8_weight

    settled = result.settled.quantization.advanced
    assert settled.head_tails == "off" and set(decision.value) <= set(settled.float_nodes)
    replay = api.quantize(source, data=data, progress=False, config=result.settled)
    replay.save(tmp_path / "replay.onnx")
    assert (tmp_path / "replay.onnx").read_bytes() == (tmp_path / "q.onnx").read_bytes()
    assert not any(d.measured for d in replay.decisions if d.option == "quantization.advanced.float_nodes")


def test_a_model_with_one_output_has_no_head_decision(tmp_path, monkeypatch):
    rng = np.random.default_rng(2)
    model = _two_heads(rng, second_head=False)
    source = tmp_path / "one.onnx"
    onnx.save(model, source)
    data = graphs.write_samples(tmp_path / "calib", rng, (3, 32, 32), count=8)
    result = api.quantize(source, data=data, progress=False)
    assert not any("below" in d.rule and d.option == "quantization.advanced.float_nodes" for d in result.decisions)
    # and nothing is built or measured to find that out
    built = []
    monkeypatch.setattr(Scoring, "build", lambda self, table, options: built.append(options))
    cfg = load_config(None)
    options, decision = choose_head_tails(model, result.table, cfg, Scoring(source, data, cfg))
    assert decision is None and options == cfg.quantization and not built
