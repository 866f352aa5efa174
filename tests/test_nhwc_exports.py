"""TensorFlow/TFLite NHWC export forms: Pad nodes and layout Transposes around each Conv."""

from __future__ import annotations

from collections import Counter

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import helper

from qtool import api
from qtool.graph.kernels import optimized_ops
from qtool.prepare.graph_prep import prepare
from tests import graphs

SIZE, FEATURES = 40, 24


def _nhwc_model(rng, pad_value=0.0, pad_mode="constant", channel_pad=False) -> onnx.ModelProto:
    """x [1, SIZE, FEATURES] -> Reshape to NHWC -> 4 x (Pad in NHWC -> Transpose -> Conv -> Transpose
    -> Relu/Clip) -> Reshape, as tflite2onnx writes a small CNN; the last block's pad is uneven."""
    nodes = [helper.make_node("Reshape", ["x", "to_nhwc"], ["h0"])]
    inits = [graphs.init("to_nhwc", np.array([1, SIZE, FEATURES, 1], np.int64))]
    last, c_in = "h0", 1
    for i, (c_out, k) in enumerate([(16, 3), (16, 3), (24, 5), (8, 3)]):
        p = k // 2
        pads = [0, p, p, 0, 0, p, p + (i == 3), 1 if channel_pad and i == 1 else 0]
        inits += [graphs.init(f"pads{i}", np.array(pads, np.int64)),
                  graphs.init(f"value{i}", np.float32(pad_value)),
                  graphs.init(f"w{i}", (rng.normal(0, 1, (c_out, c_in + (channel_pad and i == 1), k, k))
                                        / np.sqrt(c_in * k * k)).astype(np.float32)),
                  graphs.init(f"b{i}", rng.normal(0, 0.1, c_out).astype(np.float32))]
        nodes += [helper.make_node("Pad", [last, f"pads{i}", f"value{i}"], [f"pad{i}"], mode=pad_mode),
                  helper.make_node("Transpose", [f"pad{i}"], [f"nchw{i}"], perm=[0, 3, 1, 2]),
                  helper.make_node("Conv", [f"nchw{i}", f"w{i}", f"b{i}"], [f"conv{i}"]),
                  helper.make_node("Transpose", [f"conv{i}"], [f"nhwc{i}"], perm=[0, 2, 3, 1])]
        if i == 2:
            inits += [graphs.init("lo", np.float32(0)), graphs.init("hi", np.float32(6))]
            nodes.append(helper.make_node("Clip", [f"nhwc{i}", "lo", "hi"], [f"act{i}"]))
        else:
            nodes.append(helper.make_node("Relu", [f"nhwc{i}"], [f"act{i}"]))
        last, c_in = f"act{i}", c_out
    inits.append(graphs.init("flat", np.array([1, SIZE, -1], np.int64)))
    nodes.append(helper.make_node("Reshape", [last, "flat"], ["y"]))
    return graphs.model(nodes, [graphs.tensor("x", [1, SIZE, FEATURES])], [graphs.tensor("y", [1, SIZE, (FEATURES + 1) * 8])], inits, opset=13)


def _conv1d_model(rng, blocks=4, channels=32, length=400) -> onnx.ModelProto:
    """x [1, channels, length] -> blocks x (Unsqueeze -> Conv 1x3 -> Squeeze -> Relu): a Conv1D as a
    TensorFlow export writes it, a Conv2D of height 1."""
    nodes, inits, last = [], [graphs.init("axis", np.array([2], np.int64))], "x"
    for i in range(blocks):
        inits += [graphs.init(f"w{i}", (rng.normal(0, 1, (channels, channels, 1, 3)) / np.sqrt(3 * channels))
                              .astype(np.float32)), graphs.init(f"b{i}", np.zeros(channels, np.float32))]
        nodes += [helper.make_node("Unsqueeze", [last, "axis"], [f"u{i}"]),
                  helper.make_node("Conv", [f"u{i}", f"w{i}", f"b{i}"], [f"c{i}"], pads=[0, 1, 0, 1]),
                  helper.make_node("Squeeze", [f"c{i}", "axis"], [f"s{i}"]),
                  helper.make_node("Relu", [f"s{i}"], [f"r{i}"])]
        last = f"r{i}"
    nodes.append(helper.make_node("Identity", [last], ["y"]))
    return graphs.model(nodes, [graphs.tensor("x", [1, channels, length])],
                        [graphs.tensor("y", [1, channels, length])], inits, opset=13)


def _run(model: onnx.ModelProto, x: np.ndarray) -> np.ndarray:
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return session.run(None, {"x": x})[0]


def test_pads_fold_into_convs_and_activations_move_before_transposes_with_the_same_outputs():
    rng = np.random.default_rng(0)
    model = _nhwc_model(rng)
    prepared = prepare(model).model
    ops = Counter(n.op_type for n in prepared.graph.node)
    assert ops["Pad"] == 0 and ops["Conv"] == 4
    for node in prepared.graph.node:  # each activation reads its Conv's output directly
        if node.op_type in ("Relu", "Clip"):
            assert next(n for n in prepared.graph.node if node.input[0] in n.output).op_type == "Conv"
    x = rng.normal(0, 1, (1, SIZE, FEATURES)).astype(np.float32)
    np.testing.assert_allclose(_run(prepared, x), _run(model, x), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kind", ["nonzero_value", "reflect", "channel_axis"])
def test_a_pad_that_is_not_the_convs_to_do_stays(kind):
    rng = np.random.default_rng(1)
    model = _nhwc_model(rng, pad_value=0.5 if kind == "nonzero_value" else 0.0,
                        pad_mode="reflect" if kind == "reflect" else "constant", channel_pad=kind == "channel_axis")
    prepared = prepare(model).model
    pads = Counter(n.op_type for n in prepared.graph.node)["Pad"]
    assert pads == (1 if kind == "channel_axis" else 4)
    x = rng.normal(0, 1, (1, SIZE, FEATURES)).astype(np.float32)
    np.testing.assert_allclose(_run(prepared, x), _run(model, x), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("form", ["nhwc", "conv1d"])
def test_the_int8_convs_of_an_nhwc_export_meet_no_requantization(tmp_path, form):
    """The plain command: onnxruntime's int8 graph keeps one QuantizeLinear (the input) and one
    DequantizeLinear (the output); every Conv, its Pad and its activation run as one QLinearConv."""
    rng = np.random.default_rng(2)
    source = tmp_path / "nhwc.onnx"
    onnx.save(_nhwc_model(rng) if form == "nhwc" else _conv1d_model(rng), source)
    shape = (SIZE, FEATURES) if form == "nhwc" else (32, 400)
    data = graphs.write_samples(tmp_path / "calib", rng, shape, count=8)
    out = tmp_path / "q.onnx"
    api.quantize(source, data=data, progress=False).save(out)
    ops = optimized_ops(out, ort.GraphOptimizationLevel.ORT_ENABLE_ALL)
    assert ops["QLinearConv"] == 4
    assert ops["QuantizeLinear"] == 1 and ops["DequantizeLinear"] == 1 and ops["Pad"] == 0


def _rgb_nhwc_stem(rng, stride: int, outputs: int) -> onnx.ModelProto:
    """x [1, 32, 32, 3] (channels last, as a Keras export takes images) -> Transpose to NCHW -> 3x3
    stem Conv -> Relu -> 1x1 Conv -> Relu -> GlobalAveragePool -> Flatten."""
    inits = [graphs.init("w0", (rng.normal(0, 1, (outputs, 3, 3, 3)) / np.sqrt(27)).astype(np.float32)),
             graphs.init("b0", rng.normal(0, 0.1, outputs).astype(np.float32)),
             graphs.init("w1", (rng.normal(0, 1, (64, outputs, 1, 1)) / np.sqrt(outputs)).astype(np.float32)),
             graphs.init("b1", rng.normal(0, 0.1, 64).astype(np.float32))]
    nodes = [helper.make_node("Transpose", ["x"], ["nchw"], perm=[0, 3, 1, 2], name="to_nchw"),
             helper.make_node("Conv", ["nchw", "w0", "b0"], ["c0"], kernel_shape=[3, 3], strides=[stride] * 2,
                              pads=[1, 1, 1, 1], name="stem"),
             helper.make_node("Relu", ["c0"], ["r0"]),
             helper.make_node("Conv", ["r0", "w1", "b1"], ["c1"], kernel_shape=[1, 1], name="pointwise"),
             helper.make_node("Relu", ["c1"], ["r1"]),
             helper.make_node("GlobalAveragePool", ["r1"], ["g"]),
             helper.make_node("Flatten", ["g"], ["y"])]
    return graphs.model(nodes, [graphs.tensor("x", [1, 32, 32, 3])], [graphs.tensor("y", [1, 64])], inits, opset=13)


@pytest.mark.parametrize("stride,outputs,rewrite", [(2, 16, "SpaceToDepth"), (1, 20, "Pad")])
def test_an_rgb_stem_behind_the_inputs_layout_transpose_gets_the_fast_int8_kernel(tmp_path, stride, outputs, rewrite):
    """A channels-last export's stem reads the input through a Transpose: the stem rewrites see
    through it (space-to-depth for a stride-2 3x3 stem, channel padding otherwise), every Conv runs
    integer, and the per-layer error still compares the rewritten tensor with fp32's."""
    from qtool.data.dataset import Batch
    from qtool.evaluation.layer_error import layer_errors

    rng = np.random.default_rng(3)
    source = tmp_path / "rgb.onnx"
    onnx.save(_rgb_nhwc_stem(rng, stride, outputs), source)
    data = graphs.write_samples(tmp_path / "calib", rng, (32, 32, 3), count=8)
    out = tmp_path / "q.onnx"
    result = api.quantize(source, data=data, progress=False)
    result.save(out)
    assert [n.op_type for n in result.model.graph.node if n.op_type in ("SpaceToDepth", "Pad")] == [rewrite]
    ops = optimized_ops(out, ort.GraphOptimizationLevel.ORT_ENABLE_ALL)
    assert ops["QLinearConv"] == 2 and ops.get("Conv", 0) == 0
    batches = [Batch([str(i)], {"x": rng.normal(0, 1, (1, 32, 32, 3)).astype(np.float32)}) for i in range(2)]
    errors = {e.tensor: e for e in layer_errors(onnx.load(source), result.model, batches)}
    assert errors["nchw"].sqnr_db > 30  # the transposed input, compared in its own layout
