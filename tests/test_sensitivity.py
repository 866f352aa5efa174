"""One layer at a time: the ranking finds the layer that really costs accuracy."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import helper

from qtool.calibration.calibrate import calibrate
from qtool.config import CalibrationConfig, PreprocessConfig, QuantizeConfig
from qtool.data.dataset import Batch
from qtool.errors import QtoolError
from qtool.evaluation.metrics import FidelityAccumulator
from qtool.quantization.quantize import quantize_model
from qtool.evaluation.sensitivity import layer_sensitivity

from tests import graphs

# per-tensor weights: conv_b's single huge weight crushes the rest of its weights to zero
OPTIONS = QuantizeConfig(per_channel=False)


def _two_conv_model(rng) -> onnx.ModelProto:
    """x -> conv_a -> relu -> conv_b -> add(conv_b, relu) -> Softsign -> y (a float op after the Add, as
    the rest of a model would be: otherwise the Add computes the output in float and is no layer)"""
    return graphs.crushed_conv_pair(rng, [helper.make_node("Add", ["b", "r"], ["s"], name="add"),
                                          helper.make_node("Softsign", ["s"], ["y"], name="next")])


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("sensitivity")
    rng = np.random.default_rng(0)
    path, table = graphs.calibrated(tmp, rng, _two_conv_model(rng), OPTIONS)
    x = np.random.default_rng(1).normal(0, 1, (4, 3, 8, 8)).astype(np.float32)
    batches = [Batch(["a", "b"], {"x": x[:2]}), Batch(["c", "d"], {"x": x[2:]})]
    return path, table, batches


def test_ranking_puts_the_crushed_layer_first(setup):
    path, table, batches = setup
    ranking = layer_sensitivity(path, table, OPTIONS, batches)
    assert [r.node for r in ranking][0] == "conv_b"
    assert {r.node for r in ranking} == {"conv_a", "conv_b", "add"}
    assert [r.sqnr_db for r in ranking] == sorted(r.sqnr_db for r in ranking)
    by_node = {r.node: r for r in ranking}
    # the Relu runs fused into conv_a, so it belongs to conv_a's layer
    assert by_node["conv_a"].nodes == ("conv_a", "relu")
    assert by_node["conv_a"].macs == 6 * 8 * 8 * 3 * 9 and by_node["add"].macs == 0
    assert by_node["conv_b"].sqnr_db < by_node["conv_a"].sqnr_db - 10


def test_sensitivity_equals_quantizing_with_everything_else_excluded(setup):
    """The figure for conv_b is the output SQNR of a model where only conv_b is int8."""
    path, table, batches = setup
    got = {r.node: r for r in layer_sensitivity(path, table, OPTIONS, batches, nodes=["conv_b", "add"])}
    assert set(got) == {"conv_b", "add"}
    for node, others in [("conv_b", ("conv_a", "relu", "add")), ("add", ("conv_a", "relu", "conv_b"))]:
        only = quantize_model(path, table, QuantizeConfig(per_channel=False, exclude_nodes=others)).model
        ref = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
        test = ort.InferenceSession(only.SerializeToString(), providers=["CPUExecutionProvider"])
        acc = FidelityAccumulator()
        for batch in batches:
            acc.update(ref.run(None, batch.feeds)[0], test.run(None, batch.feeds)[0])
        assert got[node].sqnr_db == pytest.approx(acc.result()["sqnr_db"], abs=1e-6)
        assert got[node].cosine == pytest.approx(acc.result()["cosine"], abs=1e-9)


def test_unknown_layer_is_a_user_error(setup):
    path, table, batches = setup
    with pytest.raises(QtoolError, match="relu"):
        layer_sensitivity(path, table, OPTIONS, batches, nodes=["relu"])


def _two_input_two_output_model(rng) -> onnx.ModelProto:
    """a -> conv_a -> c -> sigmoid -> y1 (an output made early); add(c, b) -> conv_d -> gap -> y2"""
    wa = rng.normal(0, 0.4, (4, 4, 3, 3)).astype(np.float32)
    wd = rng.normal(0, 0.4, (4, 4, 1, 1)).astype(np.float32)
    nodes = [helper.make_node("Conv", ["a", "wa"], ["c"], name="conv_a", pads=[1, 1, 1, 1]),
             helper.make_node("Sigmoid", ["c"], ["y1"], name="sigmoid"),
             helper.make_node("Add", ["c", "b"], ["s"], name="add"),
             helper.make_node("Conv", ["s", "wd"], ["d"], name="conv_d"),
             helper.make_node("GlobalAveragePool", ["d"], ["y2"], name="gap")]
    shape = ["N", 4, 6, 6]
    return graphs.model(nodes, [graphs.tensor("a", shape), graphs.tensor("b", shape)],
                        [graphs.tensor("y1", None), graphs.tensor("y2", None)],
                        [graphs.init("wa", wa), graphs.init("wd", wd)])


def test_layers_after_an_early_output_and_a_second_input(tmp_path):
    """Runs that start mid-graph (fed fp32 tensors) give the figures of whole-model runs."""
    rng = np.random.default_rng(0)
    path = tmp_path / "m.onnx"
    onnx.save(_two_input_two_output_model(rng), path)
    data = tmp_path / "data"
    data.mkdir()
    for i in range(8):
        np.savez(data / f"s{i}.npz", a=rng.normal(0, 1, (1, 4, 6, 6)).astype(np.float32),
                 b=rng.normal(0, 1, (1, 4, 6, 6)).astype(np.float32))
    options = QuantizeConfig()
    table = calibrate(path, data, PreprocessConfig(), CalibrationConfig(), options, progress=False)
    feeds = {k: np.random.default_rng(1).normal(0, 1, (4, 4, 6, 6)).astype(np.float32) for k in ("a", "b")}
    batches = [Batch(list("abcd"), feeds)]
    ranking = layer_sensitivity(path, table, options, batches)
    # the Sigmoid and the pool compute the outputs in float from the Convs' int8 outputs: no layers
    assert {r.node for r in ranking} == {"conv_a", "add", "conv_d"}
    ref = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"]).run(None, feeds)
    every = ("conv_a", "add", "conv_d")
    for result in ranking:
        others = tuple(n for n in every if n != result.node)
        only = quantize_model(path, table, QuantizeConfig(exclude_nodes=others)).model
        test = ort.InferenceSession(only.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feeds)
        figures = []
        for r, t in zip(ref, test):
            acc = FidelityAccumulator()
            acc.update(r, t)
            figures.append(acc.result())
        assert result.sqnr_db == pytest.approx(min(f["sqnr_db"] for f in figures), abs=1e-3), result.node
        assert result.cosine == pytest.approx(min(f["cosine"] for f in figures), abs=1e-6), result.node
