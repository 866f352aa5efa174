"""One layer at a time: the ranking finds the layer that really costs accuracy."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import helper

from qtool.calibrate import calibrate
from qtool.config import CalibrationConfig, PreprocessConfig, QuantizeConfig
from qtool.dataset import Batch
from qtool.errors import QtoolError
from qtool.metrics import FidelityAccumulator
from qtool.quantize import quantize_model
from qtool.sensitivity import layer_sensitivity

from tests import graphs

# per-tensor weights: conv_b's single huge weight crushes the rest of its weights to zero
OPTIONS = QuantizeConfig(per_channel=False)


def _two_conv_model(rng) -> onnx.ModelProto:
    """x -> conv_a -> relu -> conv_b -> add(conv_b, relu) -> y"""
    wa = rng.normal(0, 0.3, (6, 3, 3, 3)).astype(np.float32)
    wb = rng.normal(0, 0.3, (6, 6, 1, 1)).astype(np.float32)
    ba = np.zeros(6, np.float32)
    ba[0] = -100.0  # relu zeroes channel 0 ...
    wb[0, 0, 0, 0] = 40.0  # ... so this outlier adds nothing, but sets conv_b's per-tensor weight scale
    nodes = [helper.make_node("Conv", ["x", "wa", "ba"], ["a"], name="conv_a", pads=[1, 1, 1, 1]),
             helper.make_node("Relu", ["a"], ["r"], name="relu"),
             helper.make_node("Conv", ["r", "wb"], ["b"], name="conv_b"),
             helper.make_node("Add", ["b", "r"], ["y"], name="add")]
    return graphs.model(nodes, [graphs.tensor("x", ["N", 3, 8, 8])], [graphs.tensor("y", None)],
                        [graphs.init("wa", wa), graphs.init("ba", ba), graphs.init("wb", wb)])


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("sensitivity")
    rng = np.random.default_rng(0)
    path = tmp / "m.onnx"
    onnx.save(_two_conv_model(rng), path)
    data = graphs.write_samples(tmp / "data", rng, (3, 8, 8), count=8)
    table = calibrate(path, data, PreprocessConfig(), CalibrationConfig(), OPTIONS, progress=False)
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
