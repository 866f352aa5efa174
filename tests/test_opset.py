"""Models older than opset 13: converted by default, kept with per-tensor weights when the
converter fails or keep_opset forbids it, an error when nothing can be quantized."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

import qtool
from qtool.errors import QtoolError
from tests.conftest import kit_path, run_qtool
from tests.graphs import conv_model, write_samples

CORPUS = Path(__file__).resolve().parent / "bad_inputs"
OK_DATA = CORPUS / "data" / "ok"
PER_TENSOR_NOTE = "per-tensor weights (per-channel DequantizeLinear needs opset 13)"


def _opset(model: onnx.ModelProto) -> int:
    return next(o.version for o in model.opset_import if o.domain in ("", "ai.onnx"))


def _weight_scales(model: onnx.ModelProto) -> list[np.ndarray]:
    """Scales of the dequantized Conv weights."""
    inits = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}
    dq = {n.output[0]: n for n in model.graph.node if n.op_type == "DequantizeLinear"}
    return [inits[dq[n.input[1]].input[1]] for n in model.graph.node if n.op_type == "Conv" and n.input[1] in dq]


def _sparse_constant_model() -> onnx.ModelProto:
    """Opset 11 Conv(+bias) -> Relu -> Add of a Constant holding a sparse tensor: a valid model
    that onnx's version converter cannot convert ("Sparse tensors not supported")."""
    rng = np.random.default_rng(0)
    weight = numpy_helper.from_array(rng.normal(0, 0.5, (4, 3, 3, 3)).astype(np.float32), "W")
    bias = numpy_helper.from_array(rng.normal(0, 0.1, (4,)).astype(np.float32), "B")
    sparse = helper.make_sparse_tensor(numpy_helper.from_array(np.array([0.5, -0.25], np.float32), "S"),
                                       numpy_helper.from_array(np.array([1, 5], np.int64), "S_idx"), [8])
    nodes = [helper.make_node("Conv", ["x", "W", "B"], ["c"], name="conv", pads=[1, 1, 1, 1]),
             helper.make_node("Relu", ["c"], ["r"], name="relu"),
             helper.make_node("Constant", [], ["k"], name="k", sparse_value=sparse),
             helper.make_node("Add", ["r", "k"], ["y"], name="add")]
    graph = helper.make_graph(nodes, "sparse", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 3, 8, 8])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 4, 8, 8])], [weight, bias])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 11)])
    model.ir_version = 6
    onnx.checker.check_model(model, full_check=True)
    return model


def test_kit_opset_11_model_is_converted_without_a_flag(tmp_path):
    model = kit_path("models", "rapidocr_cls_mobile_v2.onnx")
    data = kit_path("inputs", "rapidocr_cls_mobile_v2", "calib")
    assert _opset(onnx.load(str(model), load_external_data=False)) == 11
    table, out = tmp_path / "t.json", tmp_path / "q.onnx"
    proc = run_qtool("calibrate", model, "--data", data, "--num-samples", "4", "-o", table)
    assert proc.returncode == 0, proc.stderr
    assert "note: converted opset 11 -> 13 with onnx's version converter" in proc.stderr
    proc = run_qtool("quantize", model, "--table", table, "-o", out)
    assert proc.returncode == 0, proc.stderr
    assert "note: converted opset 11 -> 13 with onnx's version converter" in proc.stderr
    qmodel = onnx.load(str(out))
    assert _opset(qmodel) == 13
    assert all(scale.ndim == 1 for scale in _weight_scales(qmodel))  # per-channel
    sample = np.load(sorted(data.iterdir())[0])
    feed = {name: sample[name] for name in sample.files}
    ref = ort.InferenceSession(str(model)).run(None, feed)[0]
    got = ort.InferenceSession(str(out)).run(None, feed)[0]
    assert got.shape == ref.shape and np.all(np.isfinite(got))


def test_keep_opset_gives_per_tensor_weights_with_a_note():
    model = CORPUS / "models" / "opset12.onnx"
    result = qtool.quantize(model, data=OK_DATA, config={"quantization": {"keep_opset": True}}, progress=False)
    assert _opset(result.model) == 12
    assert any(note == f"opset 12 kept, as keep_opset (--keep-opset) forbids converting it: {PER_TENSOR_NOTE}"
               for note in result.notes), result.notes
    assert not any("does not satisfy target" in note for note in result.notes)
    scales = _weight_scales(result.model)
    assert scales and all(scale.ndim == 0 for scale in scales)
    onnx.checker.check_model(result.model, full_check=True)
    x = np.load(OK_DATA / "x.npy")
    ref = ort.InferenceSession(str(model)).run(None, {"x": x})[0]
    got = ort.InferenceSession(result.model.SerializeToString()).run(None, {"x": x})[0]
    assert np.abs(ref - got).max() < 0.05 * np.abs(ref).max()


def test_keep_opset_below_10_is_an_error():
    with pytest.raises(QtoolError, match=r"opset 9 is too old .* keep_opset \(--keep-opset\) forbids converting it"):
        qtool.quantize(CORPUS / "models" / "opset9.onnx", data=OK_DATA, config={"quantization": {"keep_opset": True}},
                       progress=False)


def test_upgrade_opset_is_an_unknown_key():
    with pytest.raises(QtoolError, match=r"unknown key 'quantization.upgrade_opset'"):
        qtool.quantize(CORPUS / "models" / "opset12.onnx", data=OK_DATA,
                       config={"quantization": {"upgrade_opset": True}}, progress=False)


def test_converter_failure_falls_back_to_per_tensor_weights(tmp_path):
    path = tmp_path / "sparse.onnx"
    onnx.save(_sparse_constant_model(), str(path))
    x = np.random.default_rng(1).normal(size=(1, 3, 8, 8)).astype(np.float32)
    data = tmp_path / "data"
    data.mkdir()
    np.save(data / "x.npy", x)
    result = qtool.quantize(path, data=data, progress=False)
    assert _opset(result.model) == 11
    assert any(note.startswith("opset 11 kept, as onnx's version converter could not convert it to opset 13 "
                               "(Sparse tensors not supported") and note.endswith(PER_TENSOR_NOTE)
               for note in result.notes), result.notes
    scales = _weight_scales(result.model)
    assert scales and all(scale.ndim == 0 for scale in scales)
    assert any(t.data_type == TensorProto.INT32 for t in result.model.graph.initializer)  # the bias is int32
    onnx.checker.check_model(result.model, full_check=True)
    ref = ort.InferenceSession(str(path)).run(None, {"x": x})[0]
    got = ort.InferenceSession(result.model.SerializeToString()).run(None, {"x": x})[0]
    assert np.abs(ref - got).max() < 0.05 * np.abs(ref).max()



def test_a_model_at_exactly_opset_13_gets_per_channel_weights(tmp_path):
    """Opset 13 is the first with per-channel DequantizeLinear (its `axis`): such a model is neither
    converted nor left per-tensor. A Conv whose output channels' weights span ranges 50x apart gets
    one scale per output channel (axis 0), each rounding its own channel to within half its step."""
    rng = np.random.default_rng(2)
    built = conv_model(rng, c_in=3, c_out=6, activation="Relu", size=8)
    built.opset_import[0].version = 13  # Conv, Relu and Softsign are the same ops there
    weight = next(t for t in built.graph.initializer if t.name == "w")
    gains = np.array([1.0, 0.02, 0.3, 5.0, 0.1, 1.5], np.float32).reshape(-1, 1, 1, 1)
    weight.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(weight) * gains, "w"))
    onnx.checker.check_model(built, full_check=True)
    path = tmp_path / "m13.onnx"
    onnx.save(built, path)
    data = write_samples(tmp_path / "data", rng, (3, 8, 8), count=8)
    result = qtool.quantize(path, data=data, config={"calibration": {"method": "minmax"},
                                                     "quantization": {}}, progress=False)
    assert _opset(result.model) == 13
    assert not any("opset" in note or "per-tensor" in note for note in result.notes), result.notes
    inits = {t.name: numpy_helper.to_array(t) for t in result.model.graph.initializer}
    conv = next(n for n in result.model.graph.node if n.op_type == "Conv")
    dq = next(n for n in result.model.graph.node if n.op_type == "DequantizeLinear" and n.output[0] == conv.input[1])
    axis = next((a.i for a in dq.attribute if a.name == "axis"), 1)  # DequantizeLinear's default axis is 1
    scale, zero = inits[dq.input[1]], inits[dq.input[2]]
    assert axis == 0 and scale.shape == (6,) and zero.shape == (6,)
    w = numpy_helper.to_array(weight)
    dequantized = (inits[dq.input[0]].astype(np.float32) - zero.reshape(-1, 1, 1, 1)) * scale.reshape(-1, 1, 1, 1)
    error = np.abs(dequantized - w).reshape(6, -1).max(axis=1)
    assert (error <= scale * 0.5 * (1 + 1e-5)).all()
    # each channel's step follows its own range (a per-tensor step would be the largest for all)
    ranges = np.abs(w).reshape(6, -1).max(axis=1)
    assert scale.argmax() == ranges.argmax() and scale.argmin() == ranges.argmin()
    assert scale.max() / scale.min() > 0.5 * ranges.max() / ranges.min()

@pytest.mark.parametrize("command", ["calibrate", "quantize"])
def test_help_documents_keep_opset(command):
    proc = run_qtool(command, "--help")
    assert proc.returncode == 0, proc.stderr
    text = " ".join(proc.stdout.split())
    assert "--keep-opset Never convert a model older than opset 13" in text
    assert "--upgrade-opset" not in text


def test_docs_describe_keep_opset():
    root = Path(__file__).resolve().parents[1] / "docs"
    cli, config = (root / "cli.md").read_text(), (root / "config.md").read_text()
    assert "`--keep-opset`" in cli and "upgrade-opset" not in cli
    assert "| `keep_opset` |" in config and "upgrade_opset" not in config


def _quantized_with_weights_as_inputs(tmp_path, opset=None, ir_version=None, config=None):
    """The quantize of a Conv -> Relu model whose initializers are graph inputs too, at `opset` and
    `ir_version` (else conv_model's), with `config` (else the plain command's)."""
    model = conv_model(np.random.default_rng(0), activation="Relu")
    if opset is not None:
        del model.opset_import[:]
        model.opset_import.append(helper.make_opsetid("", opset))
        model.ir_version = ir_version
    model.graph.input.extend(helper.make_tensor_value_info(t.name, t.data_type, list(t.dims))
                             for t in model.graph.initializer)
    onnx.checker.check_model(model)
    onnx.save(model, str(tmp_path / "m.onnx"))
    data = write_samples(tmp_path / "data", np.random.default_rng(1), (8, 12, 12), count=8)
    return qtool.quantize(tmp_path / "m.onnx", data=data, config=config, progress=False)


def test_an_ir_3_model_kept_at_its_opset_gets_a_later_ir_version(tmp_path):
    """IR 3 at opset 10 with --keep-opset: not converted, per-tensor weights; without the listing of
    its weights as inputs it needs a later IR version to pass the checker."""
    config = tmp_path / "keep.yaml"
    config.write_text("quantization:\n  keep_opset: true\n")
    result = _quantized_with_weights_as_inputs(tmp_path, opset=10, ir_version=3, config=config)
    assert _opset(result.model) == 10 and result.model.ir_version >= 5
    assert [i.name for i in result.model.graph.input] == ["x"]
    assert [scale.ndim for scale in _weight_scales(result.model)] == [0]
    onnx.checker.check_model(result.model)


def test_an_ir_3_model_lists_its_weights_as_inputs_and_is_quantized_as_a_newer_one(tmp_path):
    """Opset 9 at IR version 3 (the old model zoo's form): every initializer is a graph input too,
    as that IR required. The converted model gets the IR version opset 13 needs, and its weights
    are constants, not inputs a caller may override: int8 weights, integer kernels, a model that
    loads and runs on the image alone."""
    result = _quantized_with_weights_as_inputs(tmp_path, opset=9, ir_version=3)
    qmodel = result.model
    assert qmodel.ir_version >= 7 and _opset(qmodel) == 13
    assert [i.name for i in qmodel.graph.input] == ["x"] and _weight_scales(qmodel)
    x = np.random.default_rng(2).normal(0, 1, (1, 8, 12, 12)).astype(np.float32)
    got = ort.InferenceSession(qmodel.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    ref = ort.InferenceSession(str(tmp_path / "m.onnx"), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    assert got.shape == ref.shape and np.corrcoef(got.ravel(), ref.ravel())[0, 1] > 0.99


def test_weights_an_exporter_also_lists_as_inputs_are_quantized_with_a_note(tmp_path):
    """torch's keep_initializers_as_inputs at opset 17: the weights are graph inputs too. They are
    taken as the constants they are (int8 weights), leave the int8 model's inputs, and a note says so."""
    result = _quantized_with_weights_as_inputs(tmp_path)
    assert [i.name for i in result.model.graph.input] == ["x"] and len(_weight_scales(result.model)) == 1
    assert any(n.startswith("2 initializer(s) also listed as graph inputs") for n in result.notes)
