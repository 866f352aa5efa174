"""Quantizing small graphs: structure (axes, int8/int32 types, exact bias scale) and fidelity."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from qtool.calibration.calibrate import calibrate
from qtool.config import CalibrationConfig, PreprocessConfig, QuantizeConfig
from qtool.evaluation.metrics import sqnr_db
from qtool.quantization.quantize import quantize_model
from qtool.quantization.rewrite import DQ_SUFFIX

from tests import graphs


def _quantize(tmp_path, m, sample_shape, options=QuantizeConfig(), scale=1.0):
    rng = np.random.default_rng(0)
    path = tmp_path / "model.onnx"
    onnx.save(m, path)
    data = graphs.write_samples(tmp_path / "data", rng, sample_shape, count=16, scale=scale)
    table = calibrate(path, data, PreprocessConfig(), CalibrationConfig(batch_size=4), options, progress=False)
    result = quantize_model(path, table, options)
    onnx.checker.check_model(result.model, full_check=True)
    return path, result, table


def _run(model, x):
    src = model if isinstance(model, str) else model.SerializeToString()
    sess = ort.InferenceSession(src, providers=["CPUExecutionProvider"])
    return sess.run(None, {sess.get_inputs()[0].name: x})[0]


def _fidelity(path, qmodel, shape, scale=1.0):
    x = np.random.default_rng(1).normal(0, scale, (4, *shape)).astype(np.float32)
    ref, test = _run(str(path), x), _run(qmodel, x)
    return sqnr_db(float(np.sum(ref.astype(np.float64) ** 2)), float(np.sum((ref - test).astype(np.float64) ** 2)))


def _inits(model):
    return {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}


def _dq_node(model, output):
    return next(n for n in model.graph.node if n.op_type == "DequantizeLinear" and n.output[0] == output)


def _axis(node):
    return next((a.i for a in node.attribute if a.name == "axis"), 1)


def _check_weight_and_bias(qmodel, table_scale, weight, bias, axis, channels):
    inits = _inits(qmodel)
    wq = inits[weight + "_quantized"]
    assert wq.dtype == np.int8 and wq.min() >= -127
    ws = inits[weight + "_scale"]
    assert ws.shape == (channels,)
    assert np.all(inits[weight + "_zero_point"] == 0)
    assert _axis(_dq_node(qmodel, weight + DQ_SUFFIX)) == axis
    if bias is not None:
        bq = inits[bias + "_quantized"]
        assert bq.dtype == np.int32
        # the int32 bias scale is exactly s_input * s_weight[c], as float32
        expected = (np.float32(table_scale) * ws).astype(np.float32)
        assert np.array_equal(inits[bias + "_scale"], expected)
        assert np.all(inits[bias + "_zero_point"] == 0)
        assert _axis(_dq_node(qmodel, bias + DQ_SUFFIX)) == 0
    return ws


@pytest.mark.parametrize("group", [1, 8], ids=["dense", "depthwise"])
def test_conv_weights_per_output_channel_and_bias_scale(tmp_path, group):
    m = graphs.conv_model(np.random.default_rng(0), c_in=8, c_out=16 if group == 1 else 8, group=group)
    path, result, table = _quantize(tmp_path, m, (8, 12, 12))
    channels = 16 if group == 1 else 8
    ws = _check_weight_and_bias(result.model, table.tensors["x"].qparams.scale, "w", "b", axis=0, channels=channels)
    # each channel's scale is its own max|w| / 127
    w = numpy_helper.to_array(m.graph.initializer[0])
    np.testing.assert_allclose(ws, np.abs(w).reshape(channels, -1).max(axis=1) / 127, rtol=1e-6)
    assert _fidelity(path, result.model, (8, 12, 12)) > 25


@pytest.mark.parametrize("trans_b,axis", [(1, 0), (0, 1)])
def test_gemm_weight_axis_follows_transB(tmp_path, trans_b, axis):
    m = graphs.gemm_model(np.random.default_rng(0), trans_b=trans_b)
    path, result, table = _quantize(tmp_path, m, (32,))
    _check_weight_and_bias(result.model, table.tensors["x"].qparams.scale, "w", "b", axis=axis, channels=10)
    assert _fidelity(path, result.model, (32,)) > 25


def test_matmul_constant_weight_per_column(tmp_path):
    m = graphs.matmul_model(np.random.default_rng(0))
    path, result, _ = _quantize(tmp_path, m, (5, 32))
    _check_weight_and_bias(result.model, None, "w", None, axis=1, channels=24)
    # MatMul -> Relu is fused: no Q/DQ on the MatMul output, only after the Relu
    assert "mm" in result.plan.fused and "mm" not in result.plan.activations
    assert _fidelity(path, result.model, (5, 32)) > 25


@pytest.mark.parametrize("activation", ["Relu", "Clip"])
def test_conv_activation_fused_and_quantized_after(tmp_path, activation):
    m = graphs.conv_model(np.random.default_rng(0), activation=activation)
    path, result, table = _quantize(tmp_path, m, (8, 12, 12))
    names = {n.output[0] for n in result.model.graph.node if n.op_type == "QuantizeLinear"}
    assert "act_QuantizeLinear_Output" in names and "conv_QuantizeLinear_Output" not in names
    entry = table.tensors["act"]
    assert entry.range[0] == 0.0  # post-ReLU range starts at zero: zero point at the bottom of uint8
    assert entry.qparams.zero_point == 0
    if activation == "Clip":
        assert entry.range[1] <= 6.0
    assert _fidelity(path, result.model, (8, 12, 12)) > 25


def test_add_of_two_activations(tmp_path):
    m = graphs.add_model(np.random.default_rng(0))
    path, result, table = _quantize(tmp_path, m, (8, 6, 6))
    add = next(n for n in result.model.graph.node if n.op_type == "Add")
    assert list(add.input) == ["a" + DQ_SUFFIX, "b" + DQ_SUFFIX]
    assert "s" in result.plan.fused  # Add -> Relu: no Q/DQ in between
    assert _fidelity(path, result.model, (8, 6, 6)) > 25


@pytest.mark.parametrize("pool", ["MaxPool", "AveragePool", "GlobalAveragePool"])
def test_pooling(tmp_path, pool):
    m = graphs.conv_model(np.random.default_rng(0), activation="Relu", pool=pool)
    path, result, table = _quantize(tmp_path, m, (8, 12, 12))
    assert "pool" in table.tensors
    if pool == "MaxPool":
        # MaxPool only selects values: its output keeps the input's scale and zero point
        assert table.tensors["pool"].qparams == table.tensors["act"].qparams
    assert _fidelity(path, result.model, (8, 12, 12)) > 25


def test_int8_activations_option(tmp_path):
    m = graphs.conv_model(np.random.default_rng(0), activation="Relu")
    options = QuantizeConfig(activation_dtype="int8")
    path, result, table = _quantize(tmp_path, m, (8, 12, 12), options)
    assert table.tensors["act"].qparams.dtype == "int8"
    assert table.tensors["act"].qparams.zero_point == -128
    zp = _inits(result.model)["act_zero_point"]
    assert zp.dtype == np.int8
    assert _fidelity(path, result.model, (8, 12, 12)) > 25


def test_int8_model_runs_integer_kernels_in_onnxruntime(tmp_path):
    """onnxruntime must turn the QDQ Conv into QLinearConv, or the model is not faster."""
    m = graphs.conv_model(np.random.default_rng(0), activation="Relu", c_in=8, c_out=16)
    _, result, _ = _quantize(tmp_path, m, (8, 12, 12))
    optimized = tmp_path / "optimized.onnx"
    options = ort.SessionOptions()
    options.optimized_model_filepath = str(optimized)
    ort.InferenceSession(result.model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    ops = [n.op_type for n in onnx.load(optimized).graph.node]
    assert "QLinearConv" in ops and "Conv" not in ops


def _tail_model(rng):
    """x -> Conv -> Sigmoid -> ReduceMean -> Flatten -> y, and x -> Conv -> Flatten -> Gemm -> Reshape -> z:
    what a detector or VAD head and a classifier head hand to the graph's outputs."""
    w = rng.normal(0, 0.3, (8, 4, 3, 3)).astype(np.float32)
    g = rng.normal(0, 0.2, (6, 8 * 6 * 6)).astype(np.float32)
    nodes = [helper.make_node("Conv", ["x", "w"], ["c"], name="conv", pads=[1, 1, 1, 1]),
             helper.make_node("Sigmoid", ["c"], ["s"], name="sigmoid"),
             helper.make_node("ReduceMean", ["s"], ["r"], name="mean", axes=[2, 3], keepdims=0),
             helper.make_node("Flatten", ["r"], ["y"], name="flatten_y"),
             helper.make_node("Flatten", ["c"], ["f"], name="flatten_c"),
             helper.make_node("Gemm", ["f", "g"], ["m"], name="gemm", transB=1),
             helper.make_node("Reshape", ["m", "shape"], ["z"], name="reshape")]
    return graphs.model(nodes, [graphs.tensor("x", ["N", 4, 6, 6])],
                        [graphs.tensor("y", None), graphs.tensor("z", None)],
                        [graphs.init("w", w), graphs.init("g", g), graphs.init("shape", np.array([-1, 2, 3]))])


def test_the_ops_after_the_last_int8_output_compute_the_graph_outputs_in_float(tmp_path):
    """No Q/DQ between the last op whose integer kernel writes int8 (the Conv) and the graph's outputs:
    the Sigmoid and ReduceMean run in float on the Conv's dequantized output instead of rounding the
    probabilities to 1/256, and the Gemm's integer kernel writes float. LiteRT's spec quantizes them."""
    m = _tail_model(np.random.default_rng(0))
    path, result, table = _quantize(tmp_path, m, (4, 6, 6))
    quantized = {n.input[0] for n in result.model.graph.node if n.op_type == "QuantizeLinear"}
    assert quantized == {"x", "c", "f"}, quantized  # f: the Gemm's input, on the Conv's grid
    assert {"s", "r", "m"}.isdisjoint(table.tensors) and "g" in result.plan.weights
    x = np.random.default_rng(1).normal(0, 1, (4, 4, 6, 6)).astype(np.float32)
    probe = onnx.ModelProto()
    probe.CopyFrom(result.model)
    probe.graph.output.append(onnx.ValueInfoProto(name="c" + DQ_SUFFIX))
    sess = ort.InferenceSession(probe.SerializeToString(), providers=["CPUExecutionProvider"])
    y, z, c = sess.run(None, {"x": x})
    # y is the float Sigmoid and mean of the Conv's dequantized int8 output, unrounded
    np.testing.assert_allclose(y, (1 / (1 + np.exp(-c.astype(np.float64)))).mean(axis=(2, 3)), atol=1e-6)
    ref_z = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"]).run(None, {"x": x})[1]
    signal, noise = (float(np.sum(v.astype(np.float64) ** 2)) for v in (ref_z, ref_z - z))
    assert sqnr_db(signal, noise) > 25
    _, litert, _ = _quantize(tmp_path, m, (4, 6, 6), QuantizeConfig(target="litert", activation_dtype="int8"))
    quantized = {n.input[0] for n in litert.model.graph.node if n.op_type == "QuantizeLinear"}
    assert {"s", "r"} <= quantized, quantized


def test_an_if_on_the_way_to_the_outputs_passes_the_float_tail_on(tmp_path):
    """silero's float16 export: x -> Conv -> Sigmoid -> If (a Squeeze or an Identity of it, chosen by
    its Shape) -> ReduceMean -> y. The probability reaches the output through the If in float: the
    Sigmoid's output gets no Q/DQ (it was rounded to 1/256, a small probability read as 0)."""
    rng = np.random.default_rng(0)
    vector = [1, 1, 1, 6]

    def branch(name, op):
        node = (helper.make_node("Squeeze", ["s", "one"], [f"{name}_out"], name=name) if op == "Squeeze" else
                helper.make_node("Identity", ["s"], [f"{name}_out"], name=name))
        shape = [1, 1, 6] if op == "Squeeze" else vector
        return helper.make_graph([node], name, [], [graphs.tensor(f"{name}_out", shape)])

    nodes = [helper.make_node("Conv", ["x", "w"], ["c"], name="conv"),
             helper.make_node("Sigmoid", ["c"], ["s"], name="sigmoid"),
             helper.make_node("Shape", ["s"], ["shape"], name="shape"),
             helper.make_node("Size", ["shape"], ["rank"], name="rank"),
             helper.make_node("Equal", ["rank", "four"], ["is4"], name="is4"),
             helper.make_node("If", ["is4"], ["chosen"], name="choose", then_branch=branch("drop", "Squeeze"),
                              else_branch=branch("keep", "Identity")),
             helper.make_node("ReduceMean", ["chosen"], ["y"], name="mean", keepdims=0)]
    inits = [graphs.init("w", rng.normal(0, 0.5, (1, 4, 1, 1)).astype(np.float32)),
             graphs.init("one", np.array([1])), graphs.init("four", np.array(4))]
    m = graphs.model(nodes, [graphs.tensor("x", [1, 4, 1, 6])], [graphs.tensor("y", [])], inits)
    path, result, table = _quantize(tmp_path, m, (4, 1, 6))
    quantized = {n.input[0] for n in result.model.graph.node if n.op_type == "QuantizeLinear"}
    assert quantized == {"x", "c"}, quantized
    x = np.random.default_rng(1).normal(0, 1, (1, 4, 1, 6)).astype(np.float32) * 3
    probe = onnx.ModelProto()
    probe.CopyFrom(result.model)
    probe.graph.output.append(onnx.ValueInfoProto(name="c" + DQ_SUFFIX))
    y, c = ort.InferenceSession(probe.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"x": x})
    np.testing.assert_allclose(y, (1 / (1 + np.exp(-c.astype(np.float64)))).mean(), rtol=1e-6)


@pytest.mark.parametrize("reader", ["threshold", "argmax"])
def test_a_reader_that_writes_no_float_passes_the_float_tail_on(tmp_path, reader):
    """x -> Conv -> Sigmoid -> s, returned by the model, and s also read by an op that writes no
    float tensor: a GreaterOrEqual with a threshold choosing an If's branch (a wake-word detector
    runs its verifier above the threshold, else returns s), or an ArgMax. That reader takes the
    float value as it is, so s gets no Q/DQ (a probability below 1/512 was read as 0)."""
    rng = np.random.default_rng(0)
    channels, width = (1, 1) if reader == "threshold" else (3, 6)
    nodes = [helper.make_node("Conv", ["x", "w"], ["c"], name="conv"),
             helper.make_node("Sigmoid", ["c"], ["s"], name="sigmoid")]
    inits = [graphs.init("w", rng.normal(0, 0.5, (channels, 4, 1, 1)).astype(np.float32) - 1)]
    if reader == "threshold":
        def branch(name, op):
            body = [helper.make_node(op, ["s"], [f"{name}_out"], name=name)]
            return helper.make_graph(body, name, [], [graphs.tensor(f"{name}_out", None)])
        nodes += [helper.make_node("GreaterOrEqual", ["s", "threshold"], ["hit"], name="hit"),
                  helper.make_node("If", ["hit"], ["y"], name="verify", then_branch=branch("verified", "Sqrt"),
                                   else_branch=branch("passed", "Identity"))]
        inits.append(graphs.init("threshold", np.float32(0.5)))
        outputs = [graphs.tensor("y", None)]
    else:
        nodes += [helper.make_node("Flatten", ["s"], ["y"], name="flatten"),
                  helper.make_node("ArgMax", ["s"], ["z"], name="argmax", axis=1)]
        outputs = [graphs.tensor("y", None), graphs.tensor("z", [1, 1, 1, width], TensorProto.INT64)]
    m = graphs.model(nodes, [graphs.tensor("x", [1, 4, 1, width])], outputs, inits)
    path, result, _ = _quantize(tmp_path, m, (4, 1, width))
    quantized = {n.input[0] for n in result.model.graph.node if n.op_type == "QuantizeLinear"}
    assert quantized == {"x", "c"}, quantized
    x = np.random.default_rng(1).normal(0, 1, (1, 4, 1, width)).astype(np.float32)
    probe = onnx.ModelProto()
    probe.CopyFrom(result.model)
    probe.graph.output.append(onnx.ValueInfoProto(name="c" + DQ_SUFFIX))
    got = ort.InferenceSession(probe.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"x": x})
    np.testing.assert_allclose(got[0].reshape(-1), 1 / (1 + np.exp(-got[-1].astype(np.float64).reshape(-1))),
                               rtol=1e-6)


def test_a_movement_op_behind_an_int8_output_stays_int8_before_the_float_tail(tmp_path):
    """x -> Conv -> Resize (x2) -> Sigmoid -> y: the Resize only copies the Conv's codes, so it stays
    int8 (a float Resize of the full-size map would cost time for no precision); the Sigmoid computes
    the output in float from its dequantized output."""
    rng = np.random.default_rng(0)
    nodes = [helper.make_node("Conv", ["x", "w"], ["c"], name="conv", pads=[1, 1, 1, 1]),
             helper.make_node("Resize", ["c", "", "scales"], ["r"], name="resize", mode="nearest"),
             helper.make_node("Sigmoid", ["r"], ["y"], name="sigmoid")]
    inits = [graphs.init("w", rng.normal(0, 0.3, (2, 4, 3, 3)).astype(np.float32)),
             graphs.init("scales", np.array([1, 1, 2, 2], np.float32))]
    m = graphs.model(nodes, [graphs.tensor("x", ["N", 4, 6, 6])], [graphs.tensor("y", None)], inits)
    path, result, table = _quantize(tmp_path, m, (4, 6, 6))
    quantized = {n.input[0] for n in result.model.graph.node if n.op_type == "QuantizeLinear"}
    assert quantized == {"x", "c", "r"}, quantized
    assert table.tensors["r"].qparams == table.tensors["c"].qparams
    sigmoid = next(n for n in result.model.graph.node if n.op_type == "Sigmoid")
    assert sigmoid.input[0] == "r" + DQ_SUFFIX and sigmoid.output[0] == "y"


def test_a_model_output_that_is_a_constant(tmp_path):
    """A Constant node as a model output: the front end makes it an initializer, which the rewrite
    dropped as unread (the checker then refused the int8 model); an Identity keeps it made by a node."""
    rng = np.random.default_rng(0)
    built = graphs.conv_model(rng)
    built.graph.node.append(helper.make_node("Constant", [], ["k"], name="k",
                                             value=numpy_helper.from_array(np.arange(6, dtype=np.float32))))
    built.graph.output.append(helper.make_tensor_value_info("k", TensorProto.FLOAT, [6]))
    _, result, _ = _quantize(tmp_path, built, (8, 12, 12))
    session = ort.InferenceSession(result.model.SerializeToString(), providers=["CPUExecutionProvider"])
    outputs = session.run(None, {"x": np.zeros((1, 8, 12, 12), np.float32)})
    assert [o.name for o in session.get_outputs()] == ["y", "k"]
    assert np.array_equal(outputs[1], np.arange(6, dtype=np.float32))


def test_a_node_kept_float_leaves_the_float_tail_before_it_as_it_was(tmp_path):
    """x -> Conv -> Sin -> Tanh -> Reshape -> Add(+ the Conv's output) -> y: the Tanh reaches the output
    through float ops, so the all-int8 plan computes it in float and calibration measures no range
    for it. With the Reshape after it settled float (as the speed rule settles nodes), the Tanh
    stays in that tail: it needs no range the job's table lacks (was exit 2, "calibration table
    has no entry for ... Tanh"), and the model is the all-int8 one's but for the Reshape."""
    from click.testing import CliRunner

    from qtool.cli import main
    from qtool.plan.planner import prepared_model

    rng = np.random.default_rng(0)
    nodes = [helper.make_node("Conv", ["x", "w"], ["c"], name="conv", pads=[1, 1, 1, 1]),
             helper.make_node("Sin", ["c"], ["s"], name="sin"),
             helper.make_node("Tanh", ["s"], ["t"], name="tanh"),
             helper.make_node("Reshape", ["t", "shape"], ["r"], name="reshape"),
             helper.make_node("Reshape", ["c", "shape"], ["r2"], name="reshape_c"),
             helper.make_node("Add", ["r", "r2"], ["y"], name="add")]
    inits = [graphs.init("w", rng.normal(0, 0.3, (4, 4, 3, 3)).astype(np.float32)),
             graphs.init("shape", np.array([-1, 4 * 36], np.int64))]
    m = graphs.model(nodes, [graphs.tensor("x", ["N", 4, 6, 6])], [graphs.tensor("y", None)], inits)
    path = tmp_path / "model.onnx"
    onnx.save(m, path)
    plain = QuantizeConfig()
    from qtool.config import with_options

    kept = with_options(plain, float_nodes=("reshape",))
    _, all_int8 = prepared_model(path, plain)
    _, with_kept = prepared_model(path, kept)
    assert "t" not in all_int8.activations and "s" not in all_int8.activations
    assert set(with_kept.activations) <= set(all_int8.activations)

    data = graphs.write_samples(tmp_path / "data", rng, (4, 6, 6), count=8)
    config = graphs.mechanics_yaml(tmp_path, "    float_nodes: [reshape]\n")
    out = tmp_path / "int8.onnx"
    result = CliRunner().invoke(main, ["quantize", str(path), "--data", str(data), "--config", str(config),
                                       "-o", str(out)])
    assert result.exit_code == 0, result.output
    written = onnx.load(out)
    assert {n.input[0] for n in written.graph.node if n.op_type == "QuantizeLinear"} <= set(all_int8.activations)
    assert any(n.op_type == "Tanh" and n.output[0] == "t" for n in written.graph.node)


def test_a_range_missing_from_the_jobs_own_table_is_qtools_bug_and_from_a_given_table_the_users(tmp_path,
                                                                                               monkeypatch):
    """A table the user gives may lack a range the plan needs (exit 2, "calibrate this model again");
    the table the job calibrated itself never should: that is an InternalError (exit 3), not a
    message sending the user to calibrate again."""
    from dataclasses import replace

    from qtool import api
    from qtool.config import load_config
    from qtool.errors import InternalError, MissingRanges

    rng = np.random.default_rng(0)
    path = tmp_path / "model.onnx"
    onnx.save(graphs.conv_model(rng), path)
    data = graphs.write_samples(tmp_path / "data", rng, (8, 12, 12), count=8)
    config = graphs.mechanics_yaml(tmp_path)
    calibrated = api._calibrated

    def lacking(*args, **kwargs):
        table, measured, ranges = calibrated(*args, **kwargs)
        return replace(table, tensors={k: v for k, v in table.tensors.items() if k != "x"}), measured, ranges

    monkeypatch.setattr(api, "_calibrated", lacking)
    with pytest.raises(InternalError, match="own calibration"):
        api.quantize(path, data=data, config=config, progress=False)
    given, _, _ = lacking(path, data, load_config(config), False, None)
    with pytest.raises(MissingRanges, match="calibrate this model again"):
        api.quantize(path, table=given, data=data, config=config, progress=False)


def test_a_cast_to_the_type_its_input_has_goes_like_an_identity(tmp_path):
    """TensorFlow exports leave a Cast to float after many float ops: a copy of the tensor that, kept,
    would sit between Q/DQ pairs in float and split the Conv -> Relu -> Conv chain. It goes in
    prepare; a Cast that changes the type stays."""
    rng = np.random.default_rng(0)
    nodes = [helper.make_node("Conv", ["x", "w1"], ["c1"], name="conv1", pads=[1, 1, 1, 1]),
             helper.make_node("Cast", ["c1"], ["c1f"], name="same", to=TensorProto.FLOAT),
             helper.make_node("Relu", ["c1f"], ["r"], name="relu"),
             helper.make_node("Conv", ["r", "w2"], ["c2"], name="conv2", pads=[1, 1, 1, 1]),
             helper.make_node("Cast", ["c2"], ["c2i"], name="whole", to=TensorProto.INT32),
             helper.make_node("Cast", ["c2i"], ["y"], name="back", to=TensorProto.FLOAT)]
    inits = [graphs.init("w1", rng.normal(0, 0.3, (4, 4, 3, 3)).astype(np.float32)),
             graphs.init("w2", rng.normal(0, 0.3, (4, 4, 3, 3)).astype(np.float32))]
    m = graphs.model(nodes, [graphs.tensor("x", ["N", 4, 6, 6])], [graphs.tensor("y", None)], inits)
    path, result, _ = _quantize(tmp_path, m, (4, 6, 6))
    casts = [n.name for n in result.model.graph.node if n.op_type == "Cast"]
    assert "same" not in casts and {"whole", "back"} <= set(casts)
    quantized = {n.input[0] for n in result.model.graph.node if n.op_type == "QuantizeLinear"}
    assert "c1" not in quantized and "c1f" not in quantized  # the Relu fuses into conv1: one int8 chain
    x = np.random.default_rng(1).normal(0, 1, (2, 4, 6, 6)).astype(np.float32)
    assert _run(result.model, x).shape == _run(str(path), x).shape


def test_a_model_of_no_op_qtool_quantizes_is_written_unchanged_before_anything_runs(tmp_path, monkeypatch):
    """A float model whose ops have no int8 form (a scikit-learn scaler; a 194 MB tree ensemble took
    100 s of calibration and choices to write a copy of itself, without a word) is written unchanged
    with a note naming its ops, from the model as given: no onnxruntime session, no calibration."""
    from qtool import api
    from qtool.graph import runtime

    nodes = [helper.make_node("Scaler", ["x"], ["s"], domain="ai.onnx.ml", offset=[0.5] * 4, scale=[2.0] * 4),
             helper.make_node("Cast", ["s"], ["y"], to=TensorProto.FLOAT)]
    graph = helper.make_graph(nodes, "scaler", [graphs.tensor("x", ["N", 4])], [graphs.tensor("y", ["N", 4])])
    m = helper.make_model(graph,
                          opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("ai.onnx.ml", 3)])
    m.ir_version = 8
    path = tmp_path / "scaler.onnx"
    onnx.save(m, path)
    data = tmp_path / "data"
    data.mkdir()
    for i in range(4):
        np.save(data / f"s{i}.npy", np.random.default_rng(i).normal(0, 1, (1, 4)).astype(np.float32))
    sessions = []
    made = runtime._session
    monkeypatch.setattr(runtime, "_session", lambda source, options, label: sessions.append(label)
                        or made(source, options, label))
    result = api.quantize(path, data=data, progress=False)
    assert sessions == []
    assert result.quantized_nodes == 0 and result.model.SerializeToString() == onnx.load(path).SerializeToString()
    assert result.notes == ("nothing quantized: no node of the model is of an op qtool quantizes (ops: Cast, "
                            "Scaler); written unchanged",)


@pytest.mark.parametrize("bias_correction", ["off", "weights"])
@pytest.mark.parametrize("zero", [False, True])
def test_a_bias_two_layers_share_is_quantized_for_each(tmp_path, zero, bias_correction):
    """Exporters share equal constants: one bias initializer read by two Convs whose inputs have
    different ranges (here conv_b reads 20 x). Each int32 bias must be at its own layer's input
    scale times its weight scales, since onnxruntime's QLinearConv adds the int32 values as they
    are (qtool.quantization.checks.check_bias_scales). An all-zero bias is zero at any scale: it
    stays shared (and bias correction leaves it so: each layer's shift differs)."""
    import qtool

    rng = np.random.default_rng(0)
    c = 8
    inits = [graphs.init("w1", rng.normal(0, 0.3, (c, c, 3, 3)).astype(np.float32)),
             graphs.init("w2", rng.normal(0, 0.3, (c, c, 3, 3)).astype(np.float32)),
             graphs.init("b", np.zeros(c, np.float32) if zero else rng.normal(0, 0.5, c).astype(np.float32)),
             graphs.init("k", np.float32(20.0))]
    # conv_a writes a graph output (float, not fused); conv_b writes int8 for the float Softsign (fused)
    nodes = [helper.make_node("Conv", ["x", "w1", "b"], ["ya"], name="conv_a", pads=[1, 1, 1, 1]),
             helper.make_node("Mul", ["x", "k"], ["m"], name="scale_up"),
             helper.make_node("Conv", ["m", "w2", "b"], ["z"], name="conv_b", pads=[1, 1, 1, 1]),
             helper.make_node("Softsign", ["z"], ["y"], name="out")]
    built = graphs.model(nodes, [graphs.tensor("x", ["N", c, 12, 12])],
                         [graphs.tensor("ya", None), graphs.tensor("y", None)], inits)
    path = tmp_path / "shared_bias.onnx"
    onnx.save(built, path)
    data = graphs.write_samples(tmp_path / "data", rng, (c, 12, 12), count=8)
    result = qtool.quantize(str(path), data=str(data), progress=False,
                            config={"calibration": {"method": "minmax"},
                                    "quantization": {"advanced": graphs.RULE_OFF, "bias_correction": bias_correction}})
    written = {n.name: n for n in result.model.graph.node}
    # each reads its own int32 bias, but for a zero one
    assert (written["conv_a"].input[2] == written["conv_b"].input[2]) == zero
    inits = {t.name: numpy_helper.to_array(t) for t in result.model.graph.initializer}
    dq = {n.output[0]: n for n in result.model.graph.node if n.op_type == "DequantizeLinear"}
    for conv in ("conv_a", "conv_b")[:1 if zero else 2]:
        s_in, s_w, s_b = (inits[dq[name].input[1]] for name in written[conv].input)
        np.testing.assert_allclose(s_b, s_in * s_w, rtol=1e-6)
    x = np.random.default_rng(1).normal(0, 1, (4, c, 12, 12)).astype(np.float32)
    for want, got in zip(_outputs(str(path), x), _outputs(result.model, x)):
        assert sqnr_db(float(np.sum(want.astype(np.float64) ** 2)),
                       float(np.sum((want - got).astype(np.float64) ** 2))) > 25


def _outputs(model, x):
    src = model if isinstance(model, str) else model.SerializeToString()
    return ort.InferenceSession(src, providers=["CPUExecutionProvider"]).run(None, {"x": x})


@pytest.mark.parametrize("exact", [True, False], ids=["ort-cpu", "openvino"])
def test_a_float_reader_of_a_quantized_output_reads_its_exact_values(tmp_path, exact):
    """A float op's output (Softsign, values in (-1, 1)) feeds a graph output through a Reshape and an
    int8 Concat beside a tensor 50 times wider, whose grid it takes: the output's Reshape reads the
    Softsign's exact values (qtool.quantization.rewrite._exact_reads), not those on the Concat's grid.
    A target that fuses each quantizer into the op before it (openvino) keeps every reader on the
    DequantizeLinear."""
    import qtool

    rng = np.random.default_rng(0)
    c = 8
    inits = [graphs.init("w1", rng.normal(0, 0.3, (c, c, 3, 3)).astype(np.float32)),
             graphs.init("w2", rng.normal(0, 0.3, (c, 2 * c, 1, 1)).astype(np.float32)),
             graphs.init("k", np.float32(50.0)), graphs.init("flat", np.array([0, -1], np.int64))]
    nodes = [helper.make_node("Softsign", ["x"], ["soft"], name="soft"),
             helper.make_node("Reshape", ["soft", "flat"], ["ya"], name="flatten_out"),
             helper.make_node("Conv", ["x", "w1"], ["c1"], name="conv_a", pads=[1, 1, 1, 1]),
             helper.make_node("Mul", ["c1", "k"], ["wide"], name="widen"),
             helper.make_node("Concat", ["soft", "wide"], ["cat"], name="concat", axis=1),
             helper.make_node("Conv", ["cat", "w2"], ["y"], name="conv_b")]
    built = graphs.model(nodes, [graphs.tensor("x", ["N", c, 12, 12])],
                         [graphs.tensor("ya", None), graphs.tensor("y", None)], inits)
    path = tmp_path / "float_reader.onnx"
    onnx.save(built, path)
    data = graphs.write_samples(tmp_path / "data", rng, (c, 12, 12), count=8)
    # head tails and bias correction off: no choice scored on OpenVINO
    target = {} if exact else {"target": "openvino", "bias_correction": "off"}
    result = qtool.quantize(str(path), data=str(data), progress=False,
                            config={"calibration": {"method": "minmax"},
                                    "quantization": {**target, "advanced": {"head_tails": "off", **graphs.RULE_OFF}}})
    written = {n.name: n for n in result.model.graph.node}
    assert "soft" in {n.input[0] for n in result.model.graph.node if n.op_type == "QuantizeLinear"}
    assert (written["flatten_out"].input[0] == "soft") == exact
    x = np.random.default_rng(1).normal(0, 1, (4, c, 12, 12)).astype(np.float32)
    want, got = _outputs(str(path), x)[0], _outputs(result.model, x)[0]
    if exact:
        np.testing.assert_allclose(got, want, atol=1e-6)
    else:
        assert np.abs(got - want).max() > 1e-3  # on the Concat's grid


@pytest.mark.parametrize("op", ["MatMul", "Gemm"])
def test_an_int8_layer_read_only_by_float_ops_writes_float(tmp_path, op):
    """x -> Conv -> Flatten -> MatMul/Gemm -> Softsign (no int8 rule) -> y: onnxruntime's integer
    MatMul and Gemm can write float (MatMulIntegerToFloat, QGemm), so the layer's output gets no
    Q/DQ pair, which would only round what the float Softsign reads (plan/planner._written_float)."""
    from qtool.graph.kernels import optimized_ops

    rng = np.random.default_rng(3)
    inits = [graphs.init("wc", rng.normal(0, 0.3, (8, 4, 3, 3)).astype(np.float32)),
             graphs.init("wd", rng.normal(0, 0.3, (8 * 8 * 8, 16)).astype(np.float32))]
    dense = (helper.make_node("MatMul", ["f", "wd"], ["d"], name="dense") if op == "MatMul" else
             helper.make_node("Gemm", ["f", "wd"], ["d"], name="dense"))
    nodes = [helper.make_node("Conv", ["x", "wc"], ["c"], name="conv", pads=[1, 1, 1, 1]),
             helper.make_node("Flatten", ["c"], ["f"], name="flatten"), dense,
             helper.make_node("Softsign", ["d"], ["y"], name="out")]
    path, result, _ = _quantize(tmp_path, graphs.model(nodes, [graphs.tensor("x", ["N", 4, 8, 8])],
                                                       [graphs.tensor("y", None)], inits), (4, 8, 8))
    assert "d" not in {n.input[0] for n in result.model.graph.node if n.op_type == "QuantizeLinear"}
    assert "dense" in result.plan.quantized_nodes
    ops = optimized_ops(result.model)
    assert ops["MatMulIntegerToFloat" if op == "MatMul" else "QGemm"] == 1 and not ops["MatMul"] + ops["Gemm"]
    assert _fidelity(path, result.model, (4, 8, 8)) > 25


@pytest.mark.parametrize("rank", [2, 3])
def test_a_dense_layer_as_matmul_and_bias_add_is_one_integer_gemm(tmp_path, rank):
    """A Keras Dense exported as MatMul + Add(bias) after a Flatten (rank 2) is prepared as a Gemm
    with the bias folded in: one integer Gemm with an int32 bias. On a rank-3 input (a sequence), where
    a Gemm cannot take it, it stays a MatMul and an Add (qtool/prepare/graph_prep.py matmuls_as_gemms)."""
    from qtool.graph.kernels import optimized_ops

    rng = np.random.default_rng(4)
    inits = [graphs.init("wc", rng.normal(0, 0.3, (8, 4, 3, 3)).astype(np.float32)),
             graphs.init("wd", rng.normal(0, 0.3, (8 * 8 * 8 if rank == 2 else 8, 16)).astype(np.float32)),
             graphs.init("bd", rng.normal(0, 0.3, 16).astype(np.float32)),
             graphs.init("to3", np.array([-1, 64, 8], np.int64))]
    shaped = (helper.make_node("Flatten", ["c"], ["f"], name="flatten") if rank == 2 else
              helper.make_node("Reshape", ["c", "to3"], ["f"], name="to_sequence"))
    nodes = [helper.make_node("Conv", ["x", "wc"], ["c"], name="conv", pads=[1, 1, 1, 1]), shaped,
             helper.make_node("MatMul", ["f", "wd"], ["d"], name="dense"),
             helper.make_node("Add", ["d", "bd"], ["b"], name="bias"),
             helper.make_node("Softsign", ["b"], ["y"], name="out")]
    path, result, _ = _quantize(tmp_path, graphs.model(nodes, [graphs.tensor("x", ["N", 4, 8, 8])],
                                                       [graphs.tensor("y", None)], inits), (4, 8, 8))
    ops = [n.op_type for n in result.model.graph.node]
    if rank == 2:
        assert "Gemm" in ops and "MatMul" not in ops and "Add" not in ops
        gemm = next(n for n in result.model.graph.node if n.op_type == "Gemm")
        bias = _dq_node(result.model, gemm.input[2])
        assert _inits(result.model)[bias.input[0]].dtype == np.int32
        assert optimized_ops(result.model)["QGemm"] == 1
    else:
        assert "MatMul" in ops and "Add" in ops and "Gemm" not in ops
    assert _fidelity(path, result.model, (4, 8, 8)) > 25
