"""Control flow: tensors inside If/Loop/Scan bodies are observed during calibration (each If branch
on the samples that take it) and quantized in place; a branch the data never reached stays float
with a note. Ranges are checked against an fp32 computation that does not go through qtool. A
Loop's values leave it through a sequence (opset 13+) or a growing tensor, one sample per run; a
step counter kept in float inside a Loop is never quantized."""

from __future__ import annotations

import re

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from click.testing import CliRunner
from onnx import TensorProto, helper, numpy_helper

from qtool import api
from qtool.calibration.observer import Observer
from qtool.graph.edit import with_body_outputs
from qtool.graph.index import bodies, scoped_nodes
from qtool.cli import main
from tests.conftest import kit_path, run_qtool

IMAGE = (1, 3, 16, 16)


def _model(graph: onnx.GraphProto, check: bool = True) -> onnx.ModelProto:
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    if check:
        onnx.checker.check_model(model, full_check=True)
    return model


def _branch_nets(rng) -> tuple[onnx.GraphProto, onnx.GraphProto, list[onnx.TensorProto]]:
    """Two different Conv networks on the outer-scope x: then = Conv-Relu-Conv with its weights in the
    main graph, else = Conv-Sigmoid-Conv with its weights in the branch itself."""
    def w(name, *shape):
        return numpy_helper.from_array(rng.normal(0, 0.3, shape).astype(np.float32), name)

    then = helper.make_graph([
        helper.make_node("Conv", ["x", "W1", "B1"], ["t1"], name="then_conv1", pads=[1, 1, 1, 1]),
        helper.make_node("Relu", ["t1"], ["t2"], name="then_relu"),
        helper.make_node("Conv", ["t2", "W2", "B2"], ["t3"], name="then_conv2", pads=[1, 1, 1, 1])],
        "then", [], [helper.make_tensor_value_info("t3", TensorProto.FLOAT, [1, 4, 16, 16])])
    other = helper.make_graph([
        helper.make_node("Conv", ["x", "W3", "B3"], ["e1"], name="else_conv1", pads=[1, 1, 1, 1]),
        helper.make_node("Sigmoid", ["e1"], ["e2"], name="else_sigmoid"),
        helper.make_node("Conv", ["e2", "W4", "B4"], ["e3"], name="else_conv2", pads=[1, 1, 1, 1])],
        "else", [], [helper.make_tensor_value_info("e3", TensorProto.FLOAT, [1, 4, 16, 16])],
        [w("W3", 6, 3, 3, 3), w("B3", 6), w("W4", 4, 6, 3, 3), w("B4", 4)])
    return then, other, [w("W1", 8, 3, 3, 3), w("B1", 8), w("W2", 4, 8, 3, 3), w("B2", 4)]


def _conv_if(rng, chosen_by_input: bool) -> onnx.ModelProto:
    """The whole network inside an If: chosen by a bool input `sel` (the main graph is the If alone),
    or by the data (mean(x) > 0)."""
    then, other, weights = _branch_nets(rng)
    inputs = [helper.make_tensor_value_info("x", TensorProto.FLOAT, list(IMAGE))]
    nodes = [helper.make_node("If", ["c"], ["y"], name="branch", then_branch=then, else_branch=other)]
    if chosen_by_input:
        inputs.append(helper.make_tensor_value_info("c", TensorProto.BOOL, []))
    else:
        weights.append(numpy_helper.from_array(np.array(0, np.float32), "zero"))
        nodes[:0] = [helper.make_node("ReduceMean", ["x"], ["m"], name="mean", keepdims=0),
                     helper.make_node("Greater", ["m", "zero"], ["c"], name="greater")]
    return _model(helper.make_graph(nodes, "conv_if", inputs,
                                    [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4, 16, 16])], weights))


def _flat_branch(model: onnx.ModelProto, attr: str) -> onnx.ModelProto:
    """The fp32 reference: one branch's nodes in a main graph of their own, every tensor an output."""
    node = next(n for n in model.graph.node if n.op_type == "If")
    branch = dict(bodies(node))[attr]
    outputs = [helper.make_tensor_value_info(o, TensorProto.FLOAT, None) for n in branch.node for o in n.output]
    return _model(helper.make_graph(list(branch.node), "flat", [helper.make_tensor_value_info("x", TensorProto.FLOAT,
                                                                                            list(IMAGE))],
                                    outputs, [*model.graph.initializer, *branch.initializer]), check=False)


def _images(rng, n: int, shifts=(0.5, -0.5)) -> list[dict]:
    return [{"x": (rng.normal(0, 1, IMAGE) + shifts[i % len(shifts)]).astype(np.float32)} for i in range(n)]


def _run(model: onnx.ModelProto, feeds: dict) -> list[np.ndarray]:
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return session.run(None, feeds)


def _body_ops(model: onnx.ModelProto) -> dict[str, list[str]]:
    node = next(n for n in model.graph.node if bodies(n))
    return {attr: [n.op_type for n in scoped_nodes(body)] for attr, body in bodies(node)}


def _body_initializers(model: onnx.ModelProto, attr: str) -> dict[str, np.ndarray]:
    node = next(n for n in model.graph.node if bodies(n))
    return {t.name: numpy_helper.to_array(t) for t in dict(bodies(node))[attr].initializer}


def _close(fp32: onnx.ModelProto, int8: onnx.ModelProto, feeds: dict, tolerance: float) -> None:
    for ref, got in zip(_run(fp32, feeds), _run(int8, feeds)):
        assert np.abs(ref - got).max() <= tolerance * np.abs(ref).max(), (np.abs(ref - got).max(), np.abs(ref).max())


def test_both_if_branches_are_observed_on_the_samples_that_take_them(tmp_path):
    model = _conv_if(np.random.default_rng(0), chosen_by_input=False)
    onnx.save(model, tmp_path / "if.onnx")
    data = _images(np.random.default_rng(1), 12)
    table = api.calibrate(tmp_path / "if.onnx", data, progress=False)
    expected: dict[str, list[float]] = {}
    for attr, positive in (("then_branch", True), ("else_branch", False)):
        flat = _flat_branch(model, attr)
        names = [o.name for o in flat.graph.output]
        taken = [d for d in data if (d["x"].mean() > 0) == positive]
        assert taken  # the data reaches both branches
        for feeds in taken:
            for name, value in zip(names, _run(flat, feeds)):
                lo, hi = expected.get(name, [np.inf, -np.inf])
                expected[name] = [min(lo, float(value.min())), max(hi, float(value.max()))]
    observed = {name: table.tensors[name] for name in ("t2", "e1", "e2")}  # t1 is fused into the Relu
    for name, entry in observed.items():
        low = 0.0 if name == "t2" else expected[name][0]  # a Relu output's range starts at 0
        assert entry.min == pytest.approx(low, abs=1e-6) and entry.max == pytest.approx(expected[name][1], rel=1e-6), name
    assert not table.notes


def test_whole_network_inside_if_is_quantized_in_its_branches(tmp_path):
    """The main graph is the If alone: before, nothing was quantized ("quantized 0 nodes")."""
    rng = np.random.default_rng(2)
    model = _conv_if(rng, chosen_by_input=True)
    onnx.save(model, tmp_path / "if.onnx")
    data = tmp_path / "data"
    data.mkdir()
    for i, feeds in enumerate(_images(rng, 12)):
        np.savez(data / f"s{i:02d}.npz", x=feeds["x"], c=np.array(i % 2 == 0))
    result = run_qtool("quantize", tmp_path / "if.onnx", "--data", data, "-o", tmp_path / "if.int8.onnx")
    assert result.returncode == 0, result.stderr
    count = int(re.search(r"quantized (\d+) nodes", result.stdout).group(1))
    assert count == 6, result.stdout  # then: Conv, Relu, Conv; else: Conv, Sigmoid, Conv
    qmodel = onnx.load(tmp_path / "if.int8.onnx")
    ops = _body_ops(qmodel)
    for attr in ("then_branch", "else_branch"):
        assert "QuantizeLinear" in ops[attr] and "DequantizeLinear" in ops[attr], ops[attr]
        assert "Conv" in ops[attr]
    assert _body_initializers(qmodel, "else_branch")["W3_quantized"].dtype == np.int8  # a branch's own weight
    assert _body_initializers(qmodel, "then_branch")["W1_quantized"].dtype == np.int8  # an outer-scope weight
    assert not any(t.name in ("W1", "W3") for t in qmodel.graph.initializer)  # no float copy left
    for choice in (True, False):
        feeds = {**_images(np.random.default_rng(3), 1)[0], "c": np.array(choice)}
        _close(model, qmodel, feeds, 0.05)


def test_a_branch_the_data_never_reached_stays_float_with_a_note(tmp_path):
    model = _conv_if(np.random.default_rng(4), chosen_by_input=False)
    onnx.save(model, tmp_path / "if.onnx")
    data = _images(np.random.default_rng(5), 8, shifts=(0.5,))  # mean > 0: the then-branch only
    table = api.calibrate(tmp_path / "if.onnx", data, progress=False)
    result = api.quantize(tmp_path / "if.onnx", table=table, data=data, progress=False)
    for notes in (table.notes, result.notes):
        assert any("'branch'" in note and "else_branch never ran" in note for note in notes), notes
    ops = _body_ops(result.model)
    assert "QuantizeLinear" in ops["then_branch"]
    assert "QuantizeLinear" not in ops["else_branch"] and ops["else_branch"].count("Conv") == 2
    assert _body_initializers(result.model, "else_branch")["W3"].dtype == np.float32
    _close(model, result.model, _images(np.random.default_rng(6), 1, shifts=(-0.5,))[0], 0.05)  # the float branch runs


def _zeros_branch(kind: str, name: str, depth: int) -> onnx.GraphProto:
    """A branch that outputs zeros of the image's Conv output shape: a Constant node's output or an
    initializer (`kind`), or, below depth 1, an If (on the outer-scope `c`) of two such branches."""
    out = helper.make_tensor_value_info(name, TensorProto.FLOAT, [1, 4, 16, 16])
    if depth > 1:
        inner = helper.make_node("If", ["c"], [name], name=f"{name}_if",
                                 then_branch=_zeros_branch(kind, f"{name}t", depth - 1),
                                 else_branch=_zeros_branch(kind, f"{name}e", depth - 1))
        return helper.make_graph([inner], name, [], [out])
    zeros = numpy_helper.from_array(np.zeros((1, 4, 16, 16), np.float32), name)
    if kind == "constant":
        return helper.make_graph([helper.make_node("Constant", [], [name], name=name, value=zeros)], name, [], [out])
    return helper.make_graph([], name, [], [out], [zeros])


@pytest.mark.parametrize("kind", ["constant", "initializer"])
@pytest.mark.parametrize("depth", [1, 3])
def test_a_branch_that_returns_a_constant_calibrates_quantizes_and_runs(tmp_path, kind, depth):
    """`relu(conv(x)) if mean(x) > 0 else 0`, the 0 a Constant node's output or an initializer, in
    an If `depth` deep. The front end makes body Constants initializers, and the passes that drop
    unread initializers then left the body output made by nothing (the checker refused the int8
    model: exit 3)."""
    rng = np.random.default_rng(16)
    then = helper.make_graph([helper.make_node("Conv", ["x", "W", "B"], ["t1"], name="then_conv", pads=[1, 1, 1, 1]),
                              helper.make_node("Relu", ["t1"], ["t2"], name="then_relu")], "then", [],
                             [helper.make_tensor_value_info("t2", TensorProto.FLOAT, [1, 4, 16, 16])])
    nodes = [helper.make_node("ReduceMean", ["x"], ["m"], name="mean", keepdims=0),
             helper.make_node("Greater", ["m", "zero"], ["c"], name="greater"),
             helper.make_node("If", ["c"], ["y"], name="branch", then_branch=then,
                              else_branch=_zeros_branch(kind, "e_out", depth))]
    weights = [numpy_helper.from_array(rng.normal(0, 0.3, (4, 3, 3, 3)).astype(np.float32), "W"),
               numpy_helper.from_array(rng.normal(0, 0.1, 4).astype(np.float32), "B"),
               numpy_helper.from_array(np.array(0, np.float32), "zero")]
    model = _model(helper.make_graph(nodes, "constant_branch", [helper.make_tensor_value_info("x", TensorProto.FLOAT,
                                                                                             list(IMAGE))],
                                     [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4, 16, 16])],
                                     weights))
    onnx.save(model, tmp_path / "m.onnx")
    data = tmp_path / "data"
    data.mkdir()
    for i, feeds in enumerate(_images(rng, 8)):  # both branches
        np.save(data / f"{i}.npy", feeds["x"])
    runner = CliRunner()
    calibrated = runner.invoke(main, ["calibrate", str(tmp_path / "m.onnx"), "--data", str(data), "-o",
                                      str(tmp_path / "t.json")])
    assert calibrated.exit_code == 0, calibrated.output
    quantized = runner.invoke(main, ["quantize", str(tmp_path / "m.onnx"), "--table", str(tmp_path / "t.json"),
                                     "-o", str(tmp_path / "q.onnx")])
    assert quantized.exit_code == 0, quantized.output
    qmodel = onnx.load(tmp_path / "q.onnx")
    onnx.checker.check_model(qmodel, full_check=True)
    assert "DequantizeLinear" in _body_ops(qmodel)["then_branch"]  # the Conv in it is int8
    negative, positive = (_images(np.random.default_rng(17), 1, shifts=(shift,))[0] for shift in (-0.5, 0.5))
    assert np.array_equal(_run(qmodel, negative)[0], _run(model, negative)[0])  # the constant branch: exactly
    _close(model, qmodel, positive, 0.05)


def test_a_scan_state_passed_through_unchanged_keeps_its_value(tmp_path):
    """A Scan body that outputs its state input as it is: onnxruntime returns zeros for that state,
    so the int8 model's body makes it with an Identity and gives the ONNX reference's value."""
    from onnx.reference import ReferenceEvaluator

    rng = np.random.default_rng(18)
    body = helper.make_graph([], "body", [helper.make_tensor_value_info("s_in", TensorProto.FLOAT, [8]),
                                          helper.make_tensor_value_info("x_t", TensorProto.FLOAT, [8])],
                             [helper.make_tensor_value_info("s_in", TensorProto.FLOAT, [8])])
    nodes = [helper.make_node("Scan", ["s0", "x"], ["s"], name="scan", body=body, num_scan_inputs=1),
             helper.make_node("MatMul", ["x", "W"], ["m"], name="matmul"),
             helper.make_node("Add", ["m", "s"], ["y"], name="add")]
    model = _model(helper.make_graph(nodes, "scan_state",
                                     [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4, 8])],
                                     [helper.make_tensor_value_info("y", TensorProto.FLOAT, [4, 8])],
                                     [numpy_helper.from_array(rng.uniform(2, 4, 8).astype(np.float32), "s0"),
                                      numpy_helper.from_array(rng.normal(0, 0.3, (8, 8)).astype(np.float32), "W")]))
    data = [{"x": rng.normal(0, 1, (4, 8)).astype(np.float32)} for _ in range(4)]
    onnx.save(model, tmp_path / "scan.onnx")
    result = api.quantize(tmp_path / "scan.onnx", data=data, progress=False)
    feeds = data[0]
    reference = ReferenceEvaluator(model).run(None, feeds)[0]
    got = _run(result.model, feeds)[0]
    assert np.abs(got - reference).max() <= 0.05 * np.abs(reference).max()


STEPS, WIDTH = 3, 8


def _loop(rng) -> tuple[onnx.ModelProto, np.ndarray, np.ndarray]:
    """x [1,8] -> Loop of STEPS iterations carrying h: h = Relu(MatMul(h, W) + b); final h and every h stacked."""
    w = rng.normal(0, 0.5, (WIDTH, WIDTH)).astype(np.float32)
    b = rng.normal(0, 0.1, WIDTH).astype(np.float32)
    body = helper.make_graph([
        helper.make_node("MatMul", ["h_in", "W"], ["mm"], name="loop_matmul"),
        helper.make_node("Add", ["mm", "b"], ["pre"], name="loop_add"),
        helper.make_node("Relu", ["pre"], ["h_out"], name="loop_relu"),
        helper.make_node("Identity", ["cond_in"], ["cond_out"], name="loop_cond"),
        helper.make_node("Identity", ["h_out"], ["h_scan"], name="loop_scan")],
        "body", [helper.make_tensor_value_info("i", TensorProto.INT64, []),
                 helper.make_tensor_value_info("cond_in", TensorProto.BOOL, []),
                 helper.make_tensor_value_info("h_in", TensorProto.FLOAT, [1, WIDTH])],
        [helper.make_tensor_value_info("cond_out", TensorProto.BOOL, []),
         helper.make_tensor_value_info("h_out", TensorProto.FLOAT, [1, WIDTH]),
         helper.make_tensor_value_info("h_scan", TensorProto.FLOAT, [1, WIDTH])])
    graph = helper.make_graph(
        [helper.make_node("Loop", ["M", "", "x"], ["h", "hs"], name="loop", body=body)], "loop",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, WIDTH])],
        [helper.make_tensor_value_info("h", TensorProto.FLOAT, [1, WIDTH]),
         helper.make_tensor_value_info("hs", TensorProto.FLOAT, [STEPS, 1, WIDTH])],
        [numpy_helper.from_array(np.array(STEPS, np.int64), "M"), numpy_helper.from_array(w, "W"),
         numpy_helper.from_array(b, "b")])
    return _model(graph), w, b


def _scan(rng) -> tuple[onnx.ModelProto, np.ndarray, np.ndarray]:
    """x [STEPS, 4] scanned with state s: s = Tanh(MatMul(x_t, Wx) + MatMul(s, Ws)); final s and every s."""
    wx = rng.normal(0, 0.5, (4, 4)).astype(np.float32)
    ws = rng.normal(0, 0.5, (4, 4)).astype(np.float32)
    body = helper.make_graph([
        helper.make_node("MatMul", ["x_t", "Wx"], ["ax"], name="scan_mx"),
        helper.make_node("MatMul", ["s_in", "Ws"], ["as"], name="scan_ms"),
        helper.make_node("Add", ["ax", "as"], ["pre"], name="scan_add"),
        helper.make_node("Tanh", ["pre"], ["s_out"], name="scan_tanh"),
        helper.make_node("Identity", ["s_out"], ["y_t"], name="scan_y")],
        "body", [helper.make_tensor_value_info("s_in", TensorProto.FLOAT, [4]),
                 helper.make_tensor_value_info("x_t", TensorProto.FLOAT, [4])],
        [helper.make_tensor_value_info("s_out", TensorProto.FLOAT, [4]),
         helper.make_tensor_value_info("y_t", TensorProto.FLOAT, [4])],
        [numpy_helper.from_array(ws, "Ws")])
    graph = helper.make_graph(
        [helper.make_node("Scan", ["s0", "x"], ["s", "y"], name="scan", body=body, num_scan_inputs=1,
                          scan_input_axes=[0], scan_output_axes=[0])], "scan",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [STEPS, 4])],
        [helper.make_tensor_value_info("s", TensorProto.FLOAT, [4]),
         helper.make_tensor_value_info("y", TensorProto.FLOAT, [STEPS, 4])],
        [numpy_helper.from_array(np.zeros(4, np.float32), "s0"), numpy_helper.from_array(wx, "Wx")])
    return _model(graph), wx, ws


def _extremes(values: dict[str, list[np.ndarray]]) -> dict[str, tuple[float, float]]:
    return {name: (float(min(v.min() for v in arrays)), float(max(v.max() for v in arrays)))
            for name, arrays in values.items()}


def _check_ranges(table, expected: dict[str, tuple[float, float]]) -> None:
    for name, (lo, hi) in expected.items():
        entry = table.tensors[name]
        assert (entry.min, entry.max) == (pytest.approx(lo, rel=1e-5, abs=1e-6), pytest.approx(hi, rel=1e-5)), name


def test_loop_body_is_observed_over_every_iteration_and_quantized(tmp_path):
    model, w, b = _loop(np.random.default_rng(7))
    onnx.save(model, tmp_path / "loop.onnx")
    rng = np.random.default_rng(8)
    data = [{"x": rng.normal(0, 1, (1, WIDTH)).astype(np.float32)} for _ in range(8)]
    table = api.calibrate(tmp_path / "loop.onnx", data, progress=False)
    # h_in, the int8 MatMul's input, is observed; MatMul -> Add -> Relu compute the body's outputs
    # in float (the MatMul's integer kernel writes float)
    values: dict[str, list[np.ndarray]] = {"h_in": []}
    for feeds in data:  # the same iterations in numpy
        h = feeds["x"].astype(np.float64)
        for _ in range(STEPS):
            values["h_in"].append(h)
            h = np.maximum(h @ w + b, 0)
    _check_ranges(table, _extremes(values))
    result = api.quantize(tmp_path / "loop.onnx", table=table, progress=False)
    ops = _body_ops(result.model)["body"]
    assert {"QuantizeLinear", "DequantizeLinear", "MatMul"} <= set(ops), ops
    assert _body_initializers(result.model, "body")["W_quantized"].dtype == np.int8
    _close(model, result.model, data[0], 0.05)


@pytest.mark.parametrize("opset", [17, 12])
@pytest.mark.parametrize("steps", [STEPS, 0])
def test_a_loop_body_tensor_is_routed_out_with_every_iteration_s_values(opset, steps):
    """From opset 13 a Loop carries a sequence: each iteration appends its values and one
    ConcatFromSequence joins them after the loop; before it a carried tensor grows by Concat. Both
    give every iteration's values in order (none when the loop does not run), and the routed model
    keeps the original outputs. The Loop is also nested in an outer Loop of two iterations."""
    inner, w, b = _loop(np.random.default_rng(9))
    for model, runs in ((inner, 1), (_nested(inner), 2)):
        model.opset_import[0].version = opset
        model.graph.initializer[0].CopyFrom(numpy_helper.from_array(np.array(steps, np.int64), "M"))
        routed, routes = with_body_outputs(model, ["pre"])
        ops = [n.op_type for n in scoped_nodes(routed.graph)]
        assert ("SequenceInsert" in ops, "ConcatFromSequence" in ops) == ((opset >= 13,) * 2), ops
        assert ("Concat" in ops) == (opset < 13), ops
        x = np.random.default_rng(10).normal(0, 1, (1, WIDTH)).astype(np.float32)
        session = ort.InferenceSession(routed.SerializeToString(), providers=["CPUExecutionProvider"])
        got = dict(zip([o.name for o in session.get_outputs()], session.run(None, {"x": x})))
        expected = []
        for _ in range(runs):  # the outer loop runs the inner one twice, from x each time
            h = x.astype(np.float64)
            for _ in range(steps):
                expected.append(h @ w + b)
                h = np.maximum(expected[-1], 0)
        flat = np.concatenate([e.ravel() for e in expected]) if expected else np.zeros(0)
        np.testing.assert_allclose(got[routes["pre"]], flat, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(got["h"], _run(model, {"x": x})[0], rtol=1e-6)


def test_a_loop_body_tensor_is_observed_one_sample_per_run(tmp_path, monkeypatch):
    """The values of every iteration leave a Loop together: observing them for a batch would hold
    them for all its samples at once, so such tensors are observed one sample per run."""
    model, _, _ = _loop(np.random.default_rng(9))
    assert Observer(model, ["h_in"]).batch_size(8) == 1
    assert Observer(_nested(model), ["pre"]).batch_size(8) == 1
    assert Observer(model, ["h"]).batch_size(8) == 8  # the Loop's own output: made outside the body
    # and calibration feeds it so: the batched model's 8 samples reach the observer one by one
    batched = onnx.ModelProto()
    batched.CopyFrom(model)
    body = dict(bodies(batched.graph.node[0]))["body"]
    for value in [*batched.graph.input, batched.graph.output[0], *body.input[2:], *body.output[1:]]:
        value.type.tensor_type.shape.dim[0].dim_param = "N"  # the batch axis
    batched.graph.output[1].type.tensor_type.shape.dim[1].dim_param = "N"  # the steps stacked before it
    seen = []
    run = Observer.run
    monkeypatch.setattr(Observer, "run", lambda self, batches, on_batch=None: run(
        self, (seen.append(len(b)) or b for b in batches), on_batch))
    rng = np.random.default_rng(15)
    data = [{"x": rng.normal(0, 1, (1, WIDTH)).astype(np.float32)} for _ in range(8)]
    onnx.save(batched, tmp_path / "batched.onnx")
    api.calibrate(tmp_path / "batched.onnx", data, {"calibration": {"method": "minmax", "batch_size": 8}},
                  progress=False)
    assert seen == [1] * 8, seen


def _nested(inner: onnx.ModelProto) -> onnx.ModelProto:
    """`inner`'s Loop run twice, from x each time, by an outer Loop that carries nothing."""
    loop = inner.graph.node[0]
    body = helper.make_graph(
        [helper.make_node("Identity", ["go_in"], ["go_out"], name="outer_cond"),
         helper.make_node("Loop", list(loop.input), ["h_i", "hs_i"], name="inner", body=dict(bodies(loop))["body"])],
        "outer_body", [helper.make_tensor_value_info("j", TensorProto.INT64, []),
                       helper.make_tensor_value_info("go_in", TensorProto.BOOL, [])],
        [helper.make_tensor_value_info("go_out", TensorProto.BOOL, []),
         helper.make_tensor_value_info("h_i", TensorProto.FLOAT, [1, WIDTH])])
    graph = helper.make_graph(
        [helper.make_node("Loop", ["twice", ""], ["hs_outer"], name="outer", body=body),
         helper.make_node("Gather", ["hs_outer", "last"], ["h"], name="last_h", axis=0)], "nested",
        list(inner.graph.input), [helper.make_tensor_value_info("h", TensorProto.FLOAT, [1, WIDTH])],
        [*inner.graph.initializer, numpy_helper.from_array(np.array(2, np.int64), "twice"),
         numpy_helper.from_array(np.array(1, np.int64), "last")])
    return _model(graph, check=False)


def test_scan_body_is_observed_over_every_step_and_quantized(tmp_path):
    model, wx, ws = _scan(np.random.default_rng(9))
    onnx.save(model, tmp_path / "scan.onnx")
    rng = np.random.default_rng(10)
    data = [{"x": rng.normal(0, 1, (STEPS, 4)).astype(np.float32)} for _ in range(8)]
    table = api.calibrate(tmp_path / "scan.onnx", data, progress=False)
    # the int8 MatMuls' inputs are observed; MatMul -> Add -> Tanh compute the body's outputs in
    # float (the MatMuls' integer kernels write float)
    values: dict[str, list[np.ndarray]] = {"x_t": [], "s_in": []}
    for feeds in data:
        s = np.zeros(4)
        for x_t in feeds["x"].astype(np.float64):
            values["x_t"].append(x_t)
            values["s_in"].append(s)
            s = np.tanh(x_t @ wx + s @ ws)
    _check_ranges(table, _extremes(values))
    result = api.quantize(tmp_path / "scan.onnx", table=table, progress=False)
    ops = _body_ops(result.model)["body"]
    assert ops.count("QuantizeLinear") == 2 and ops.count("MatMul") == 2, ops
    inits = _body_initializers(result.model, "body")
    assert inits["Ws_quantized"].dtype == np.int8 and inits["Wx_quantized"].dtype == np.int8  # inner and outer weight
    _close(model, result.model, data[0], 0.05)


def test_silero_lstms_inside_if_branches_become_int8(tmp_path):
    """silero VAD keeps its LSTM in both branches of /model/decoder/If_1, its W and R sliced from
    outer-scope weights. Only the LSTMs quantized (every other op type excluded), calibrated on half
    of the kit's chunks: the VAD probability on the other half stays within 40 dB of fp32's."""
    source = kit_path("models", "silero_vad_16k_op15.onnx")
    chunks = sorted(kit_path("inputs", "silero_vad_16k_op15", "calib").glob("*.npz"))
    model = onnx.load(source)
    others = sorted({n.op_type for n in scoped_nodes(model.graph)} - {"LSTM"})
    calib = [dict(np.load(p)) for p in chunks[:32]]
    result = api.quantize(source, data=calib, config={"quantization": {"exclude_op_types": others}}, progress=False)
    branch = next(n for n in result.model.graph.node if n.name == "/model/decoder/If_1")
    lstms = [n for _, body in bodies(branch) for n in scoped_nodes(body) if "LSTM" in n.op_type]
    assert [n.op_type for n in lstms] == ["DynamicQuantizeLSTM"] * 2
    weights = {t.name: t for t in result.model.graph.initializer}
    assert all(weights[n.input[1]].data_type == TensorProto.INT8 for n in lstms)
    held_out = [dict(np.load(p)) for p in chunks[32:]]
    ref = np.array([_run(model, feeds)[0] for feeds in held_out]).ravel()
    got = np.array([_run(result.model, feeds)[0] for feeds in held_out]).ravel()
    sqnr = 10 * np.log10(np.sum(ref.astype(np.float64) ** 2) / np.sum((ref - got).astype(np.float64) ** 2))
    assert sqnr > 40 and np.abs(ref - got).max() < 0.02, (sqnr, np.abs(ref - got).max())


def test_if_inside_a_loop_is_observed_on_the_iterations_that_take_each_branch(tmp_path):
    """A Loop whose body chooses per iteration: h = Relu(h @ W) when sum(h) > 0, else Softsign(h @ W @ W)
    (the then-branch MatMul output is fused into its Relu; the else-branch's first, read by its
    second, is observed; the second's, which only the float Softsign reads, its integer kernel
    writes in float)."""
    w = np.random.default_rng(11).normal(0, 0.5, (WIDTH, WIDTH)).astype(np.float32)
    vector = [1, WIDTH]

    def branch(name, activation, out, twice=False):
        first = helper.make_node("MatMul", ["h_in", "W"], [f"{name}_mm"], name=f"{name}_mm")
        second = [helper.make_node("MatMul", [f"{name}_mm", "W"], [f"{name}_mm2"], name=f"{name}_mm2")] if twice else []
        act = helper.make_node(activation, [f"{name}_mm2" if twice else f"{name}_mm"], [out], name=f"{name}_act")
        return helper.make_graph([first, *second, act], name, [],
                                 [helper.make_tensor_value_info(out, TensorProto.FLOAT, vector)])

    body = helper.make_graph([
        helper.make_node("ReduceSum", ["h_in"], ["total"], name="total", keepdims=0),
        helper.make_node("Greater", ["total", "zero"], ["positive"], name="positive"),
        helper.make_node("If", ["positive"], ["h_out"], name="choose", then_branch=branch("up", "Relu", "r"),
                         else_branch=branch("down", "Softsign", "t", twice=True)),
        helper.make_node("Identity", ["cond_in"], ["cond_out"], name="keep_going")], "body",
        [helper.make_tensor_value_info("i", TensorProto.INT64, []),
         helper.make_tensor_value_info("cond_in", TensorProto.BOOL, []),
         helper.make_tensor_value_info("h_in", TensorProto.FLOAT, vector)],
        [helper.make_tensor_value_info("cond_out", TensorProto.BOOL, []),
         helper.make_tensor_value_info("h_out", TensorProto.FLOAT, vector)])
    model = _model(helper.make_graph(
        [helper.make_node("Loop", ["M", "", "x"], ["h"], name="loop", body=body)], "nested",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, vector)],
        [helper.make_tensor_value_info("h", TensorProto.FLOAT, vector)],
        [numpy_helper.from_array(np.array(4, np.int64), "M"), numpy_helper.from_array(w, "W"),
         numpy_helper.from_array(np.array(0, np.float32), "zero")]))
    onnx.save(model, tmp_path / "nested.onnx")
    rng = np.random.default_rng(12)
    data = [{"x": rng.normal(0, 1, vector).astype(np.float32)} for _ in range(8)]
    table = api.calibrate(tmp_path / "nested.onnx", data, progress=False)
    values: dict[str, list[np.ndarray]] = {"h_in": [], "down_mm": []}
    branches = set()
    for feeds in data:
        h = feeds["x"].astype(np.float64)
        for _ in range(4):
            values["h_in"].append(h)
            branches.add(h.sum() > 0)
            if h.sum() > 0:
                h = np.maximum(h @ w, 0)
            else:
                values["down_mm"].append(h @ w)
                h = h @ w @ w / (1 + np.abs(h @ w @ w))
    assert branches == {True, False}  # the iterations take both branches
    _check_ranges(table, _extremes(values))
    result = api.quantize(tmp_path / "nested.onnx", table=table, progress=False)
    assert not result.notes
    ops = _body_ops(result.model)["body"]
    assert ops.count("MatMul") == 3 and ops.count("QuantizeLinear") == 2, ops  # h_in, down_mm
    _close(model, result.model, data[0], 0.05)


def _counted_loop(rng) -> tuple[onnx.ModelProto, np.ndarray]:
    """A decoder-like Loop that counts in float, as Paddle exports write it: at iteration i it reads
    row int(i * 50 + 1) of a table (Cast -> Mul -> Add -> Cast back to int64 -> Gather) into its
    state h; beside it, a uint8 image cast to float and scaled by 1/255 feeds a Conv."""
    table = rng.normal(0, 1, (300, WIDTH)).astype(np.float32)
    body = helper.make_graph([
        helper.make_node("Cast", ["i"], ["step"], name="step", to=TensorProto.FLOAT),
        helper.make_node("Mul", ["step", "fifty"], ["scaled"], name="scale_step"),
        helper.make_node("Add", ["scaled", "one"], ["position"], name="next_position"),
        helper.make_node("Cast", ["position"], ["row_index"], name="row_index", to=TensorProto.INT64),
        helper.make_node("Gather", ["table", "row_index"], ["row"], name="row", axis=0),
        helper.make_node("Add", ["h_in", "row"], ["h_out"], name="accumulate"),
        helper.make_node("Identity", ["cond_in"], ["cond_out"], name="go_on")],
        "body", [helper.make_tensor_value_info("i", TensorProto.INT64, []),
                 helper.make_tensor_value_info("cond_in", TensorProto.BOOL, []),
                 helper.make_tensor_value_info("h_in", TensorProto.FLOAT, [1, WIDTH])],
        [helper.make_tensor_value_info("cond_out", TensorProto.BOOL, []),
         helper.make_tensor_value_info("h_out", TensorProto.FLOAT, [1, WIDTH])],
        [numpy_helper.from_array(np.array(50, np.float32), "fifty"),
         numpy_helper.from_array(np.array(1, np.float32), "one")])
    graph = helper.make_graph(
        [helper.make_node("Loop", ["M", "", "x"], ["h"], name="loop", body=body),
         helper.make_node("Cast", ["image"], ["pixels"], name="pixels", to=TensorProto.FLOAT),
         helper.make_node("Mul", ["pixels", "inv255"], ["scaled_image"], name="scale_image"),
         helper.make_node("Conv", ["scaled_image", "K"], ["y"], name="conv", pads=[1, 1, 1, 1])], "counted",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, WIDTH]),
         helper.make_tensor_value_info("image", TensorProto.UINT8, [1, 3, 8, 8])],
        [helper.make_tensor_value_info("h", TensorProto.FLOAT, [1, WIDTH]),
         helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4, 8, 8])],
        [numpy_helper.from_array(np.array(6, np.int64), "M"), numpy_helper.from_array(table, "table"),
         numpy_helper.from_array(np.array(1 / 255, np.float32), "inv255"),
         numpy_helper.from_array(rng.normal(0, 0.3, (4, 3, 3, 3)).astype(np.float32), "K")])
    return _model(graph), table


def test_a_count_kept_in_float_inside_a_loop_is_never_quantized(tmp_path):
    """An int8 range over the positions 1..251 has a step of about 1: quantized, they truncate to
    the wrong row. The count stays float (the Cast from the step to the Cast back to int64), so
    every iteration reads the row fp32 reads; the image cast from uint8 is data and its Conv int8."""
    model, table = _counted_loop(np.random.default_rng(13))
    onnx.save(model, tmp_path / "counted.onnx")
    rng = np.random.default_rng(14)
    data = [{"x": rng.normal(0, 1, (1, WIDTH)).astype(np.float32),
             "image": rng.integers(0, 256, (1, 3, 8, 8), dtype=np.uint8)} for _ in range(8)]
    result = api.quantize(tmp_path / "counted.onnx", data=data, progress=False)
    assert any("1 count in float" in note for note in result.notes), result.notes
    readers = {n.input[0] for n in scoped_nodes(result.model.graph) if n.op_type == "QuantizeLinear"}
    assert not readers & {"step", "scaled", "position"}, readers
    assert "scaled_image" in readers  # the Conv's input
    feeds = {"x": np.zeros((1, WIDTH), np.float32), "image": data[0]["image"]}
    expected = sum(table[int(i * 50 + 1)] for i in range(6))
    h = _run(result.model, feeds)[0]
    assert np.abs(h - expected).max() < 0.1, np.abs(h - expected).max()  # a wrong row is off by ~1
