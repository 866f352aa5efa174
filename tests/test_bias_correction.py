"""Bias correction: the fast form applies a measured shift when the calibration samples agree on it
and leaves it alone when it is noise; the weights form takes back each layer's weight-rounding
shift from the calibration pass's channel means."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
import onnxruntime as ort
from onnx import helper, numpy_helper

import qtool
from qtool.calibration.calibrate import calibrate
from qtool.calibration.grid import MANTISSA_BITS
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


def test_auto_is_off_on_onnxruntime_cpu_and_says_so_without_keeping_the_channel_means(tmp_path):
    """The default `auto` on onnxruntime CPU: off, a decision that says why, and calibration keeps
    no channel means (their reductions would cost the job time for nothing)."""
    path, data, x = _model_and_data(tmp_path, pooled=True)
    result = qtool.quantize(path, data=data, config={"quantization": {"per_channel": False}}, progress=False)
    [decision] = [d for d in result.decisions if d.option == "quantization.bias_correction"]
    assert decision.value == "off" and "target ort-cpu" in decision.rule and not decision.measured
    assert result.settled.quantization.bias_correction == "off"
    assert result.table.channel_means is None
    asked = qtool.quantize(path, data=data, config={"quantization": {"per_channel": False,
                                                                     "bias_correction": "fast"}}, progress=False)
    assert _bias(asked.model)[0] != _bias(result.model)[0]  # asked for, it runs


def test_auto_on_openvino_measures_the_weights_form_and_keeps_it_where_closer_to_fp32(tmp_path):
    """On OpenVINO `auto` scores the model without and with the weights form as OpenVINO computes
    them and keeps it at MARGIN_DB closer: here the first channel's weight rounds far, so it is
    kept; the settled config replays it without measuring. Without data, off."""
    pytest.importorskip("openvino", reason="openvino is not installed (pip install \"qtool[openvino]\")")
    from qtool.choices.measure import MARGIN_DB

    path, data, x = _model_and_data(tmp_path)
    config = {"quantization": {"target": "openvino", "per_channel": False}}
    result = qtool.quantize(path, data=data, config=config, progress=False)
    [decision] = [d for d in result.decisions if d.option == "quantization.bias_correction"]
    figures = dict(decision.measured)
    assert list(figures) == ["off", "weights"] and decision.samples > 0
    assert figures["weights"]["cosine_db"] >= figures["off"]["cosine_db"] + MARGIN_DB
    assert decision.value == "weights" and result.settled.quantization.bias_correction == "weights"
    assert result.table.channel_means  # kept for the measurement
    replay = qtool.quantize(path, data=data, config=result.settled, progress=False)
    assert not [d for d in replay.decisions if d.measured]
    assert replay.model.SerializeToString() == result.model.SerializeToString()
    from_table = qtool.quantize(path, table=result.table, config=config, progress=False)
    [off] = [d for d in from_table.decisions if d.option == "quantization.bias_correction"]
    assert off.value == "off" and "no calibration data" in off.rule


def _weights_shift(path, qmodel, x) -> tuple[np.ndarray, np.ndarray]:
    """(what the weights form should add to the int32 bias: (W - W_q) . m over the bias scale,
    rounded; the int32 bias scale), from the float and written int8 weights and the data's means."""
    inits = {t.name: numpy_helper.to_array(t) for t in qmodel.graph.initializer}
    w = numpy_helper.to_array([t for t in onnx.load(path).graph.initializer if t.name == "w"][0]).astype(np.float64)
    dequantized = inits["w" + WEIGHT_SUFFIX].astype(np.float64) * inits["w_scale"].astype(np.float64)
    means = x.mean(axis=(2, 3), dtype=np.float64).mean(axis=0)
    shift = ((w - dequantized).reshape(3, 2) * means).sum(axis=1)
    scale = inits["b_scale"].astype(np.float64)
    return np.rint(shift / scale), scale


@pytest.mark.parametrize("pooled", [True, False], ids=["classifier", "per-position outputs"])
def test_the_weights_form_takes_back_each_channels_weight_rounding_shift_from_the_calibration_means(tmp_path,
                                                                                                   pooled):
    """The bias moves by (W - W_q) . m, m the channel means the calibration pass measured (no pass
    of its own; the table keeps them, with the input's spatial size), on any kind of output; a
    table read back builds the same bytes."""
    path, data, x = _model_and_data(tmp_path, pooled)
    mechanics = {"per_channel": False}
    result = qtool.quantize(path, data=data, config={"quantization": {**mechanics, "bias_correction": "weights"}},
                            progress=False)
    assert result.settled.quantization.bias_correction == "weights"
    assert result.table.channel_means["x"] == pytest.approx(x.mean(axis=(0, 2, 3)), rel=2.0**-MANTISSA_BITS)
    assert result.table.spatial_sizes["x"] == (6.0, 6.0)
    saved = tmp_path / "table.json"
    result.table.save(saved)
    again = qtool.quantize(path, table=str(saved), config=result.settled, progress=False)
    assert again.model.SerializeToString() == result.model.SerializeToString()
    off = qtool.quantize(path, data=data, config={"quantization": {**mechanics, "bias_correction": "off"}},
                         progress=False)
    expected, _ = _weights_shift(path, result.model, x)
    assert expected[0] != 0  # channel 0's weight rounds far: a shift of many bias steps
    assert np.array_equal(_bias(result.model) - _bias(off.model), expected)
    if not pooled:
        assert _shift(path, result.model, x)[0] < 0.2 * _shift(path, off.model, x)[0]


def test_weights_asked_for_with_a_table_without_channel_means_is_a_user_error(tmp_path):
    """Calibration keeps the channel means only when its config asks for the weights form (their
    reductions cost every other job time), and a table of another format holds none: `weights`
    with such a table names what it needs (exit 2)."""
    from click.testing import CliRunner

    from qtool.cli import main

    path, data, x = _model_and_data(tmp_path, pooled=True)
    assert qtool.calibrate(path, data, config={"quantization": {"bias_correction": "weights"}},
                           progress=False).channel_means
    table = qtool.calibrate(path, data, progress=False)
    assert not table.channel_means and not table.spatial_sizes
    saved = tmp_path / "no_means.json"
    table.save(saved)
    out = tmp_path / "q.onnx"
    run = CliRunner().invoke(main, ["quantize", str(path), "--table", str(saved), "--bias-correction", "weights",
                                    "-o", str(out)])
    assert run.exit_code == 2, run.output
    assert "channel means" in run.output + run.stderr and not out.exists()
    # a model without a layer that has a bias: the means were kept (none), nothing to correct, no error
    rng = np.random.default_rng(2)
    matmul = graphs.model([helper.make_node("MatMul", ["v", "m"], ["y"], name="mm")],
                          [graphs.tensor("v", ["N", 8])], [graphs.tensor("y", None)],
                          [graphs.init("m", rng.normal(0, 1, (8, 4)).astype(np.float32))])
    onnx.save(matmul, tmp_path / "mm.onnx")
    vectors = tmp_path / "vectors"
    vectors.mkdir()
    for i in range(4):
        np.save(vectors / f"{i}.npy", rng.normal(0, 1, (1, 8)).astype(np.float32))
    done = qtool.quantize(tmp_path / "mm.onnx", data=vectors, progress=False,
                          config={"quantization": {"bias_correction": "weights"}})
    assert done.table.channel_means == {} and done.settled.quantization.bias_correction == "weights"
    # where `auto` measures the form (OpenVINO), a model with nothing to correct is off without
    # building a candidate (so without OpenVINO, every other choice named)
    auto = qtool.quantize(tmp_path / "mm.onnx", data=vectors, progress=False,
                          config={"calibration": {"method": "minmax"},
                                  "quantization": {"target": "openvino", "matmul": "static"}})
    [decision] = [d for d in auto.decisions if d.option == "quantization.bias_correction"]
    assert decision.value == "off" and not decision.measured and "no layer with a bias" in decision.rule


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


@pytest.mark.parametrize("length,stride,pads", [(3, 2, [1, 1]), (1, 1, [1, 1]), (9, 1, [0, 2]), (5, 3, [2, 0])])
def test_the_weights_shift_counts_each_tap_where_it_reads_the_input_not_the_padding(length, stride, pads):
    """On an input whose channels are constant, the mean output difference of a Conv with W and
    with W_q over its output positions is what weight_shift gives: a tap that lands on padding at
    a border adds nothing there (on a map of a few positions most taps do)."""
    from qtool.quantization.bias_correction import weight_shift

    rng = np.random.default_rng(5)
    w = rng.normal(0, 1, (4, 3, 3)).astype(np.float32)
    dequantized = (np.round(w * 3) / 3).astype(np.float32)
    means = rng.normal(1, 1, 3)
    x = np.broadcast_to(means[None, :, None], (1, 3, length)).astype(np.float32)
    node = helper.make_node("Conv", ["x", "w"], ["y"], name="conv", strides=[stride], pads=pads)
    outputs = []
    for weight in (w, dequantized):
        model = graphs.model([node], [graphs.tensor("x", [1, 3, length])], [graphs.tensor("y", None)],
                             [graphs.init("w", weight)])
        session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
        outputs.append(session.run(None, {"x": x})[0].astype(np.float64).mean(axis=(0, 2)))
    got = weight_shift(node, w, dequantized.astype(np.float64), means.astype(np.float32).astype(np.float64),
                       (float(length),))
    np.testing.assert_allclose(got, outputs[0] - outputs[1], atol=1e-5)
