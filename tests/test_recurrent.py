"""Recurrent layers through the CLI: an LSTM's W and R go int8 as onnxruntime's
DynamicQuantizeLSTM on ort-cpu; a GRU, and an LSTM on a target without such a kernel, stay float
with a note that says why."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
from onnx import helper, numpy_helper

from qtool.evaluation.macs import int8_macs
from tests.conftest import run_qtool

STEPS, INPUT, HIDDEN, DIRS = 20, 16, 32, 2


def _recurrent_model(op: str, rng, tail: bool = False, **attrs) -> onnx.ModelProto:
    """x [STEPS, 1, INPUT] -> bidirectional `op` -> y, y_h. Each gate column's weights get their own
    magnitude (spread over e^3 = 20x), so one scale per direction would lose the small columns.
    `tail`: a Squeeze after y, a tie op that must not pull a Q/DQ pair onto the float output."""
    gates = 4 if op == "LSTM" else 3
    column_scale = np.exp(rng.uniform(-3, 0, (DIRS, gates * HIDDEN, 1)))
    w = (rng.normal(0, 1, (DIRS, gates * HIDDEN, INPUT)) * column_scale).astype(np.float32)
    r = (rng.normal(0, 0.2, (DIRS, gates * HIDDEN, HIDDEN)) * column_scale).astype(np.float32)
    b = rng.normal(0, 0.1, (DIRS, 2 * gates * HIDDEN)).astype(np.float32)
    nodes = [helper.make_node(op, ["x", "W", "R", "B"], ["y", "y_h"], name="rnn", hidden_size=HIDDEN,
                              direction="bidirectional", **attrs)]
    outputs = [helper.make_tensor_value_info("y_h", onnx.TensorProto.FLOAT, [DIRS, 1, HIDDEN])]
    if tail:
        nodes.append(helper.make_node("Squeeze", ["y", "axis"], ["y_seq"], name="squeeze"))
        outputs.append(helper.make_tensor_value_info("y_seq", onnx.TensorProto.FLOAT, [STEPS, DIRS, HIDDEN]))
    else:
        outputs.append(helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [STEPS, DIRS, 1, HIDDEN]))
    inits = [numpy_helper.from_array(a, n) for a, n in ((w, "W"), (r, "R"), (b, "B"), (np.array([2]), "axis"))]
    graph = helper.make_graph(nodes, op.lower(), [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT,
                                                                                [STEPS, 1, INPUT])],
                              outputs, inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return model


def _quantize(tmp_path, model: onnx.ModelProto, *args) -> tuple[onnx.ModelProto, str]:
    rng = np.random.default_rng(1)
    source = tmp_path / "rnn.onnx"
    onnx.save(model, source)
    # .npy samples have a leading batch dimension of 1: the sequence axis here, so STEPS is split off
    data = tmp_path / "data"
    data.mkdir()
    for i in range(8):
        np.save(data / f"s{i:03d}.npy", rng.normal(0, 1, (STEPS, 1, INPUT)).astype(np.float32))
    out = tmp_path / "rnn.int8.onnx"
    result = run_qtool("quantize", source, "--data", data, "-o", out, *args)
    assert result.returncode == 0, result.stderr
    return onnx.load(out), result.stdout + result.stderr


def _cosines(fp32: onnx.ModelProto, int8: onnx.ModelProto, rng) -> list[float]:
    feeds = {"x": rng.normal(0, 1, (STEPS, 1, INPUT)).astype(np.float32)}
    ref = ort.InferenceSession(fp32.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feeds)
    test = ort.InferenceSession(int8.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feeds)
    return [float(np.dot(r.ravel(), t.ravel()) / (np.linalg.norm(r) * np.linalg.norm(t))) for r, t in zip(ref, test)]


def _initializer(model: onnx.ModelProto, name: str) -> np.ndarray:
    return numpy_helper.to_array(next(t for t in model.graph.initializer if t.name == name))


def test_lstm_becomes_dynamic_quantize_lstm_with_int8_weights_per_gate_column(tmp_path):
    model = _recurrent_model("LSTM", np.random.default_rng(0), tail=True)
    qmodel, output = _quantize(tmp_path, model)
    ops = [n.op_type for n in qmodel.graph.node]
    assert "DynamicQuantizeLSTM" in ops and "LSTM" not in ops, ops
    lstm = next(n for n in qmodel.graph.node if n.op_type == "DynamicQuantizeLSTM")
    assert lstm.domain == "com.microsoft" and lstm.name == "rnn"
    w, r = (_initializer(qmodel, name) for name in lstm.input[1:3])
    assert w.dtype == np.int8 and w.shape == (DIRS, INPUT, 4 * HIDDEN)  # the kernel's transposed layout
    assert r.dtype == np.int8 and r.shape == (DIRS, HIDDEN, 4 * HIDDEN)
    assert _initializer(qmodel, lstm.input[8]).shape == (DIRS, 4 * HIDDEN)  # one scale per gate column
    assert not any(n.op_type in ("QuantizeLinear", "DequantizeLinear") for n in qmodel.graph.node)  # Squeeze stays float
    assert "1 recurrent layer(s) with int8 weights" in output
    macs = int8_macs(qmodel)  # every step, both directions: 4 gates x (input + hidden) products
    assert macs.total == macs.int8 == STEPS * DIRS * 4 * HIDDEN * (INPUT + HIDDEN)
    # Measured: 0.99993 for both outputs (38-39 dB); one scale per direction gives 0.9994, and a
    # weight in the wrong layout or at the wrong scale gives garbage.
    assert min(_cosines(model, qmodel, np.random.default_rng(2))) > 0.9997


def test_lstm_weights_built_from_slices_in_the_main_graph_are_folded_and_go_int8(tmp_path):
    """W and R as torch's LSTM export builds them once a tool has inlined the If branch holding them
    (silero VAD's OpenVINO export): each gate sliced out of a stored tensor, concatenated back and
    unsqueezed, in the main graph. Folded on loading, they are constants and the LSTM goes int8. An
    initializer no node reads (which onnxruntime drops before it resolves shared weights) is dropped."""
    model = _recurrent_model("LSTM", np.random.default_rng(0), tail=True)
    graph = model.graph
    stored = {t.name: numpy_helper.to_array(t) for t in graph.initializer}
    built = []
    for name in ("W", "R"):
        full = stored[name][::-1].copy()  # stored with the directions swapped: Slice puts them back
        graph.initializer.remove(next(t for t in graph.initializer if t.name == name))
        graph.initializer.extend([numpy_helper.from_array(full, f"{name}_stored"),
                                  numpy_helper.from_array(np.array([1]), f"{name}_s0"),
                                  numpy_helper.from_array(np.array([2]), f"{name}_e0"),
                                  numpy_helper.from_array(np.array([0]), f"{name}_s1"),
                                  numpy_helper.from_array(np.array([1]), f"{name}_e1"),
                                  numpy_helper.from_array(np.array([0]), f"{name}_axis")])
        built += [helper.make_node("Slice", [f"{name}_stored", f"{name}_s{i}", f"{name}_e{i}", f"{name}_axis"],
                                   [f"{name}_{i}"], name=f"slice_{name}_{i}") for i in (0, 1)]
        built += [helper.make_node("Concat", [f"{name}_0", f"{name}_1"], [f"{name}_cat"], name=f"cat_{name}", axis=0),
                  helper.make_node("Squeeze", [f"{name}_cat"], [f"{name}_flat"], name=f"flat_{name}"),
                  helper.make_node("Reshape", [f"{name}_flat", f"{name}_shape"], [name], name=f"shape_{name}")]
        graph.initializer.append(numpy_helper.from_array(np.array(stored[name].shape), f"{name}_shape"))
    graph.initializer.append(numpy_helper.from_array(np.zeros((64, 64), np.float32), "never_read"))
    nodes = built + list(graph.node)
    del graph.node[:]
    graph.node.extend(nodes)
    onnx.checker.check_model(model)
    qmodel, output = _quantize(tmp_path, model)
    ops = [n.op_type for n in qmodel.graph.node]
    assert ops.count("DynamicQuantizeLSTM") == 1 and not {"LSTM", "Slice", "Concat"} & set(ops), ops
    assert "never_read" not in {t.name for t in qmodel.graph.initializer}
    assert min(_cosines(model, qmodel, np.random.default_rng(2))) > 0.9997


def test_lstm_without_per_channel_weights_has_one_scale_per_direction(tmp_path):
    model = _recurrent_model("LSTM", np.random.default_rng(0))
    config = tmp_path / "per_tensor.yaml"
    config.write_text("quantization:\n  per_channel: false\n")
    qmodel, output = _quantize(tmp_path, model, "--config", config)
    lstm = next(n for n in qmodel.graph.node if n.op_type == "DynamicQuantizeLSTM")
    assert _initializer(qmodel, lstm.input[8]).shape == (DIRS,) and "per direction" in output
    assert min(_cosines(model, qmodel, np.random.default_rng(2))) > 0.999  # measured 0.9994


def test_gru_stays_float_with_a_note(tmp_path):
    qmodel, output = _quantize(tmp_path, _recurrent_model("GRU", np.random.default_rng(0)))
    assert [n.op_type for n in qmodel.graph.node] == ["GRU"]
    assert "GRU node 'rnn' kept float: onnxruntime CPU has no int8 GRU kernel" in output
    macs = int8_macs(qmodel)
    assert macs.total == STEPS * DIRS * 3 * HIDDEN * (INPUT + HIDDEN) and macs.int8 == 0


def test_lstm_on_tensorrt_stays_float_with_a_note(tmp_path):
    qmodel, output = _quantize(tmp_path, _recurrent_model("LSTM", np.random.default_rng(0)), "--target", "tensorrt")
    assert [n.op_type for n in qmodel.graph.node] == ["LSTM"]
    assert "LSTM node 'rnn' kept float: TensorRT has no int8 LSTM kernel" in output


def test_lstm_with_a_form_the_kernel_lacks_stays_float_with_a_note(tmp_path):
    model = _recurrent_model("LSTM", np.random.default_rng(0), activations=["Sigmoid", "Tanh", "Relu"] * 2)
    qmodel, output = _quantize(tmp_path, model)
    assert [n.op_type for n in qmodel.graph.node] == ["LSTM"]
    assert "LSTM node 'rnn' kept float: DynamicQuantizeLSTM needs" in output


def test_lstms_sharing_weights_share_one_int8_copy(tmp_path):
    model = _recurrent_model("LSTM", np.random.default_rng(0))
    twin = onnx.helper.make_node("LSTM", ["x", "W", "R", "B"], ["y2", "y2_h"], name="rnn2", hidden_size=HIDDEN,
                                 direction="bidirectional")
    model.graph.node.append(twin)
    model.graph.output.append(helper.make_tensor_value_info("y2_h", onnx.TensorProto.FLOAT, [DIRS, 1, HIDDEN]))
    qmodel, output = _quantize(tmp_path, model)
    kernels = [n for n in qmodel.graph.node if n.op_type == "DynamicQuantizeLSTM"]
    assert len(kernels) == 2 and kernels[0].input[1:3] == kernels[1].input[1:3]
    assert sum(t.data_type == onnx.TensorProto.INT8 and len(t.dims) == 3 for t in qmodel.graph.initializer) == 2
    assert "2 recurrent layer(s) with int8 weights" in output
    assert min(_cosines(model, qmodel, np.random.default_rng(2))) > 0.9997


def test_a_gemm_after_a_gru_goes_dynamic_int8(tmp_path):
    """A GRU -> Gemm net (no LayerNorm, attention or Conv), as the romanizer encoder: `auto` takes
    the dynamic MatMul strategy for a recurrent net, so the Gemm goes dynamic int8 as under
    quantize_dynamic and the GRU stays float, with a note that says why."""
    rng = np.random.default_rng(0)
    model = _recurrent_model("GRU", rng)
    model.graph.node.extend([helper.make_node("Reshape", ["y_h", "flat"], ["h"], name="flatten"),
                             helper.make_node("Gemm", ["h", "wg"], ["out"], name="fc", transB=1)])
    model.graph.initializer.extend([numpy_helper.from_array(np.array([1, DIRS * HIDDEN]), "flat"),
                                    numpy_helper.from_array(rng.normal(0, 0.3, (4, DIRS * HIDDEN)).astype(np.float32),
                                                            "wg")])
    model.graph.output.append(helper.make_tensor_value_info("out", onnx.TensorProto.FLOAT, [1, 4]))
    quantized, log = _quantize(tmp_path, model)
    ops = [n.op_type for n in quantized.graph.node]
    assert ops.count("MatMulInteger") == 1 and ops.count("GRU") == 1 and "QuantizeLinear" not in ops
    assert "quantized dynamically" in log and "1 recurrent layer(s)" in log
