"""Per-layer error: every int8 tensor against its fp32 twin, found by the DequantizeLinear naming."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import numpy_helper

from qtool.calibration.calibrate import calibrate
from qtool.config import CalibrationConfig, PreprocessConfig, QuantizeConfig
from qtool.data.dataset import Batch
from qtool.evaluation.layer_error import layer_errors, twins, worst
from qtool.evaluation.metrics import sqnr_db
from qtool.graph.edit import with_outputs
from qtool.quantization.quantize import quantize_model
from qtool.quantization.rewrite import DQ_SUFFIX

from tests import graphs


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("layer_error")
    rng = np.random.default_rng(0)
    fp32 = graphs.add_model(rng)
    path = tmp / "m.onnx"
    onnx.save(fp32, path)
    data = graphs.write_samples(tmp / "data", rng, (8, 6, 6), count=8)
    table = calibrate(path, data, PreprocessConfig(), CalibrationConfig(), QuantizeConfig(), progress=False)
    int8 = quantize_model(path, table, QuantizeConfig()).model
    x = np.random.default_rng(1).normal(0, 1, (6, 8, 6, 6)).astype(np.float32)
    return fp32, int8, [Batch(list("abc"), {"x": x[:3]}), Batch(list("def"), {"x": x[3:]})]


def test_twins_are_the_quantized_activations_in_graph_order(models):
    fp32, int8, _ = models
    pairs = twins(fp32, int8)
    # x, the Add's inputs a and b, the Add+Relu output r (Sigmoid's output is the graph output)
    assert [p.tensor for p in pairs] == ["x", "a", "b", "r"]
    assert [p.op_type for p in pairs] == ["input", "Conv", "Conv", "Relu"]
    assert not any(p.tensor.startswith("w") for p in pairs)  # weights are not layers


def test_input_error_is_the_quantization_error_of_its_scale(models):
    fp32, int8, batches = models
    errors = {e.tensor: e for e in layer_errors(fp32, int8, batches)}
    inits = {t.name: numpy_helper.to_array(t) for t in int8.graph.initializer}
    scale, zero = float(inits["x_scale"]), int(inits["x_zero_point"])
    x = np.concatenate([b.feeds["x"] for b in batches]).astype(np.float64)
    q = np.clip(np.round(x / scale) + zero, 0, 255)
    deq = (q - zero) * scale
    assert errors["x"].sqnr_db == pytest.approx(sqnr_db(float(np.sum(x ** 2)), float(np.sum((deq - x) ** 2))),
                                                abs=1e-3)
    assert errors["x"].max_abs_error == pytest.approx(float(np.max(np.abs(deq - x))), rel=1e-4)


def test_errors_match_exposed_tensors_and_leave_outputs_unchanged(models):
    fp32, int8, batches = models
    errors = {e.tensor: e for e in layer_errors(fp32, int8, batches)}
    plain = ort.InferenceSession(int8.SerializeToString(), providers=["CPUExecutionProvider"])
    exposed = ort.InferenceSession(with_outputs(int8, ["r" + DQ_SUFFIX]).SerializeToString(),
                                   providers=["CPUExecutionProvider"])
    ref = ort.InferenceSession(with_outputs(fp32, ["r"]).SerializeToString(), providers=["CPUExecutionProvider"])
    feeds = {"x": np.concatenate([b.feeds["x"] for b in batches])}
    y_plain = plain.run(["y"], feeds)[0]
    y_exposed, r_int8 = exposed.run(["y", "r" + DQ_SUFFIX], feeds)
    np.testing.assert_array_equal(y_plain, y_exposed)
    r = ref.run(["r"], feeds)[0].astype(np.float64)
    expected = sqnr_db(float(np.sum(r ** 2)), float(np.sum((r_int8 - r) ** 2)))
    assert errors["r"].sqnr_db == pytest.approx(expected, abs=1e-6)
    assert worst(list(errors.values()), 2) == sorted(errors.values(), key=lambda e: e.sqnr_db)[:2]


def test_dynamic_matmuls_are_paired_by_their_outputs_fp32_names(tmp_path):
    """A dynamic int8 MatMul has no DequantizeLinear: its twin is its output, named as in fp32,
    also where two MatMuls reading one activation were merged into one and split back."""
    from qtool import api
    from qtool.config import Config
    from tests.test_dynamic_matmul import _block, _samples

    path = tmp_path / "block.onnx"
    fp32 = _block(np.random.default_rng(0))
    onnx.save(fp32, path)
    data = _samples(tmp_path, np.random.default_rng(1))
    int8 = api.quantize(path, data=data, config=Config(quantization=graphs.mechanics(QuantizeConfig(matmul="dynamic"))),
                        progress=False).model
    pairs = twins(fp32, int8)
    # q and k (merged, then split back after their bias Adds) and o; nothing else is quantized
    assert [(p.tensor, p.op_type) for p in pairs] == [("q1", "Add"), ("k1", "Add"), ("o", "MatMul")]
    samples = [np.load(f) for f in sorted(data.glob("*.npy"))]  # the block takes batch 1
    errors = {e.tensor: e for e in layer_errors(fp32, int8, [Batch([str(i)], {"x": x}) for i, x in enumerate(samples)])}
    ref = ort.InferenceSession(with_outputs(fp32, ["o"]).SerializeToString(), providers=["CPUExecutionProvider"])
    test = ort.InferenceSession(with_outputs(int8, ["o"]).SerializeToString(), providers=["CPUExecutionProvider"])
    o_ref = np.concatenate([ref.run(["o"], {"x": x})[0] for x in samples]).astype(np.float64)
    o_int8 = np.concatenate([test.run(["o"], {"x": x})[0] for x in samples])
    assert errors["o"].sqnr_db == pytest.approx(sqnr_db(float(np.sum(o_ref ** 2)),
                                                         float(np.sum((o_int8 - o_ref) ** 2))), abs=1e-6)
    assert 15 < errors["o"].sqnr_db < 80  # quantized: an error, and a small one


def test_exposed_int8_tensors_are_typed_in_a_model_written_without_value_info(models):
    """qtool writes its onnxruntime models without value_info; reading their int8 tensors out
    (per-layer error, sensitivity) takes the types from shape inference, not float by default."""
    _, int8, batches = models
    assert not int8.graph.value_info
    codes = [n.output[0] for n in int8.graph.node if n.op_type == "QuantizeLinear"]
    assert codes
    session = ort.InferenceSession(with_outputs(int8, codes).SerializeToString(), providers=["CPUExecutionProvider"])
    got = session.run(codes, batches[0].feeds)
    assert {a.dtype for a in got} <= {np.dtype(np.int8), np.dtype(np.uint8)}
