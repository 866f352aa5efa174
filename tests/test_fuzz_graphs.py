"""Fuzzing: random small valid graphs of the supported ops quantize, pass the checker,
run in onnxruntime and stay close to fp32.

Deterministic by default (derandomize) so CI is stable; QTOOL_FUZZ_EXAMPLES=500 and
QTOOL_FUZZ_RANDOM=1 explore more.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
from click.testing import CliRunner
from hypothesis import HealthCheck, given, settings
from onnx import numpy_helper

from qtool.cli import main
from qtool.plan.ops import RULES
from qtool.prepare.graph_prep import prepare
from tests import graphs
from tests.fuzz_graphs import HEAD_OPS, TRUNK_OPS, VOCABULARY, baked_batch_model, random_model

EXAMPLES = int(os.environ.get("QTOOL_FUZZ_EXAMPLES", "40"))
# Relative L2 error of the int8 output against fp32 on the calibration samples. Measured over
# 300 random graphs (output channels of each weight 10x apart at most): median 0.7%, worst 4.9%;
# the bound leaves 2x room. A wrong bias scale of a layer onnxruntime runs as an integer kernel
# (Conv, Gemm) shows up here as tens of percent; for ConvTranspose, which onnxruntime runs in
# float on the dequantized weight and bias, a wrong weight axis or bias scale costs only
# rounding, so _assert_integer_contract checks the stored integers directly.
MAX_RELATIVE_ERROR = 0.10
# Where each weighted op has its output channels: (op, transB) -> weight axis.
_OUT_AXIS = {("Conv", 0): 0, ("ConvTranspose", 0): 1, ("Gemm", 0): 1, ("Gemm", 1): 0, ("MatMul", 0): 1}


def test_the_generator_covers_the_supported_ops():
    generated = set(TRUNK_OPS) | set(HEAD_OPS) | {"GlobalAveragePool", "Flatten", "Squeeze", "Slice"}
    # the recurrent rules (weight-only LSTM, never-int8 GRU) are tested in tests/test_recurrent.py
    qdq_ops = {op for op, rule in RULES.items() if rule.kernel is None}
    uncovered = qdq_ops - generated
    assert not uncovered, f"ops with a rule that the fuzzer never builds: {sorted(uncovered)}"


def _dequantized(inits: dict, dq: onnx.NodeProto, ndim: int) -> tuple[np.ndarray, np.ndarray]:
    """ONNX DequantizeLinear of a constant: the values and the scale broadcast to their shape."""
    q, scale, zero = (inits[name] for name in dq.input[:3])
    axis = next((a.i for a in dq.attribute if a.name == "axis"), 1)  # the operator's default axis is 1
    shape = [1] * ndim
    if scale.ndim:
        shape[axis] = -1
    scale = np.broadcast_to(scale.astype(np.float64).reshape(shape), q.shape)
    return (q.astype(np.float64) - zero.astype(np.float64).reshape(shape)) * scale, scale


def _assert_integer_contract(model: onnx.ModelProto, quantized: onnx.ModelProto) -> None:
    """What an integer kernel needs of each weighted layer, checked against the fp32 weights of the
    graph as the front end prepares it (a bias Add folded into its layer, a Dense layer's MatMul
    written as a Gemm): one scale per output channel on a grid fitted to that channel (|error| <=
    its max / 254), and the int32 bias in the accumulator's unit s_in * s_w[channel] (within half a
    unit)."""
    model = prepare(model).model
    fp32 = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}
    inits = {t.name: numpy_helper.to_array(t) for t in quantized.graph.initializer}
    dq = {n.output[0]: n for n in quantized.graph.node if n.op_type == "DequantizeLinear"}
    original = {n.name: n for n in model.graph.node}
    for node in quantized.graph.node:
        trans_b = next((a.i for a in node.attribute if a.name == "transB"), 0)
        weight_dq = dq.get(node.input[1]) if len(node.input) > 1 else None
        if (node.op_type, trans_b) not in _OUT_AXIS or weight_dq is None or weight_dq.input[0] not in inits:
            continue
        weight = fp32[original[node.name].input[1]].astype(np.float64)
        axis = _OUT_AXIS[node.op_type, trans_b]
        values, scale = _dequantized(inits, weight_dq, weight.ndim)
        w, got, s = (np.moveaxis(a, axis, 0).reshape(weight.shape[axis], -1) for a in (weight, values, scale))
        assert np.all(s == s[:, :1]), f"{node.name}: the weight of one output channel has several scales"
        bound = np.abs(w).max(axis=1, keepdims=True) / 254 * (1 + 1e-5) + 1e-12
        assert np.all(np.abs(got - w) <= bound), f"{node.name}: weight error beyond half its channel's step"
        if len(node.input) < 3 or node.input[2] not in dq or dq[node.input[2]].input[0] not in inits:
            continue
        bias = fp32[original[node.name].input[2]].astype(np.float64)
        s_in = float(inits[dq[node.input[0]].input[1]])
        unit = s_in * s[np.arange(bias.size) % s.shape[0], 0]  # ConvTranspose groups repeat the columns
        b_q = inits[dq[node.input[2]].input[0]].astype(np.float64)
        assert np.all(np.abs(b_q * unit - bias) <= unit / 2 + 1e-6 * np.abs(bias)), \
            f"{node.name}: int32 bias not in units of s_in * s_w"


@settings(max_examples=EXAMPLES, deadline=None, derandomize=not os.environ.get("QTOOL_FUZZ_RANDOM"),
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(random_model())
def test_random_graphs_quantize(drawn):
    _quantizes_close_to_fp32(*drawn)


# Drawn often enough to be sure they are in the graphs CI runs: an If whose branches read the trunk
# from the outer scope (it stays float; the ops around it are quantized), and int64 token ids.
CONTROL_FLOW_AND_IDS = ("If", "IdsInput", "Conv", "Relu", "Add", "Mul", "Softmax")


@settings(max_examples=max(EXAMPLES // 4, 5), deadline=None, derandomize=not os.environ.get("QTOOL_FUZZ_RANDOM"),
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(random_model(CONTROL_FLOW_AND_IDS))
def test_random_graphs_with_if_and_token_ids_quantize(drawn):
    _quantizes_close_to_fp32(*drawn)


# If/Loop/Scan whose bodies output a Constant's value, an initializer, an outer-scope value or their
# own input, nested up to three deep, added to the trunk. No Conv in the trunk and no Add in the head:
# _assert_integer_contract compares with the fp32 weights, which equalization and the folding of a
# constant Add into the bias before it legitimately change.
CONSTANT_BODIES = ("ControlFlow", "Relu", "Sigmoid", "Add", "Mul")


@settings(max_examples=max(EXAMPLES // 2, 5), deadline=None, derandomize=not os.environ.get("QTOOL_FUZZ_RANDOM"),
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(random_model(CONSTANT_BODIES, tuple(op for op in HEAD_OPS if op != "Add")))
def test_random_graphs_with_constant_body_outputs_quantize(drawn):
    _quantizes_close_to_fp32(*drawn)


@settings(max_examples=max(EXAMPLES // 4, 5), deadline=None, derandomize=not os.environ.get("QTOOL_FUZZ_RANDOM"),
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(baked_batch_model())
def test_graphs_that_do_not_honour_their_dynamic_batch_quantize_and_evaluate(drawn):
    """The plain command (default batch size) on a graph with batch 1 baked in (Reshape to a
    constant shape, Expand, Tile) and several samples of one shape: calibrated one sample at a
    time with one note, the written model runs, and evaluate goes through."""
    model, (c, h, w), form = drawn
    onnx.checker.check_model(model, full_check=True)
    rng = np.random.default_rng(0)
    samples = [rng.normal(0, 1, (1, c, h, w)).astype(np.float32) for _ in range(6)]
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        onnx.save(model, str(tmp / "m.onnx"))
        (tmp / "data").mkdir()
        for i, x in enumerate(samples):
            np.save(tmp / "data" / f"{i}.npy", x)
        runner = CliRunner()
        result = runner.invoke(main, ["quantize", str(tmp / "m.onnx"), "--data", str(tmp / "data"),
                                      "-o", str(tmp / "q.onnx")])
        assert result.exit_code == 0, f"{form}: {result.output}{result.stderr}"
        fp32 = ort.InferenceSession(str(tmp / "m.onnx"), providers=["CPUExecutionProvider"])
        try:  # a fold of the batch into one channel still holds it: then no note is due
            fp32.run(None, {"x": np.concatenate(samples)})
            refused = False
        except Exception:
            refused = True
        notes = result.stderr.count("note: calibration.batch_size = 1")
        assert notes == 1 if refused else notes <= 1, f"{form}: {result.stderr}"
        ref = fp32.run(None, {"x": samples[0]})
        got = ort.InferenceSession(str(tmp / "q.onnx"), providers=["CPUExecutionProvider"]).run(None, {"x": samples[0]})
        assert got[0].shape == ref[0].shape and np.all(np.isfinite(got[0]))
        result = runner.invoke(main, ["evaluate", str(tmp / "m.onnx"), str(tmp / "q.onnx"), "--data", str(tmp / "data"),
                                      "--runs", "1"])
        assert result.exit_code == 0, f"{form}: {result.output}{result.stderr}"


def _quantizes_close_to_fp32(model: onnx.ModelProto, shape: tuple[int, int, int]) -> None:
    c, h, w = shape
    onnx.checker.check_model(model, full_check=True)
    rng = np.random.default_rng(0)
    ids = next((i for i in model.graph.input if i.name == "ids"), None)
    samples = [{"x": rng.normal(0, 1, (1, c, h, w)).astype(np.float32)} for _ in range(6)]
    if ids is not None:  # token ids [1, C], a different draw per sample
        for sample in samples:
            sample["ids"] = rng.integers(0, VOCABULARY, (1, ids.type.tensor_type.shape.dim[1].dim_value), np.int64)
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        onnx.save(model, str(tmp / "m.onnx"))
        (tmp / "data").mkdir()
        for i, sample in enumerate(samples):
            np.savez(tmp / "data" / f"{i}.npz", **sample)
        result = CliRunner().invoke(main, ["quantize", str(tmp / "m.onnx"), "--data", str(tmp / "data"),
                                           "--batch-size", "4", "--config", str(graphs.mechanics_yaml(tmp)),
                                           "-o", str(tmp / "q.onnx")])  # every planned node int8
        assert result.exit_code == 0, result.output + result.stderr
        quantized = onnx.load(str(tmp / "q.onnx"))
        onnx.checker.check_model(quantized, full_check=True)
        _assert_integer_contract(model, quantized)
        fp32 = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
        int8 = ort.InferenceSession(quantized.SerializeToString(), providers=["CPUExecutionProvider"])
        batch = {name: np.concatenate([sample[name] for sample in samples]) for name in samples[0]}
        ref = fp32.run(None, batch)[0].astype(np.float64)
        got = int8.run(None, batch)[0].astype(np.float64)
    assert got.shape == ref.shape and np.all(np.isfinite(got))
    error = np.linalg.norm(got - ref) / max(np.linalg.norm(ref), 1e-6)
    assert error <= MAX_RELATIVE_ERROR, f"relative error {error:.3f}; nodes: {[n.op_type for n in model.graph.node]}"


def test_found_by_fuzzing_concat_of_a_fixed_range_tensor_and_a_wider_one(tmp_path):
    """Concat(x * sigmoid(x), sigmoid(x)): the tie group used to impose sigmoid's fixed [0, 1)
    on x * sigmoid(x) too, clipping it (relative error 17%)."""
    from onnx import TensorProto, helper

    nodes = [helper.make_node("Sigmoid", ["x"], ["s"]), helper.make_node("Mul", ["x", "s"], ["m"]),
             helper.make_node("Concat", ["m", "s"], ["c"], axis=1), helper.make_node("Flatten", ["c"], ["f"]),
             helper.make_node("Relu", ["f"], ["y"])]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 1, 3, 3])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 18])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.save(model, str(tmp_path / "m.onnx"))
    (tmp_path / "data").mkdir()
    rng = np.random.default_rng(0)
    samples = [rng.normal(0, 1, (1, 1, 3, 3)).astype(np.float32) for _ in range(6)]
    for i, x in enumerate(samples):
        np.save(tmp_path / "data" / f"{i}.npy", x)
    result = CliRunner().invoke(main, ["quantize", str(tmp_path / "m.onnx"), "--data", str(tmp_path / "data"),
                                       "-o", str(tmp_path / "q.onnx")])
    assert result.exit_code == 0, result.stderr
    batch = np.concatenate(samples)
    ref = ort.InferenceSession(str(tmp_path / "m.onnx")).run(None, {"x": batch})[0]
    got = ort.InferenceSession(str(tmp_path / "q.onnx")).run(None, {"x": batch})[0]
    assert got.max() > 1.0  # not clipped to sigmoid's range
    assert np.linalg.norm(got - ref) / np.linalg.norm(ref) < 0.02
