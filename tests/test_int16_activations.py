"""16-bit activations: quantize --int16-activations writes a tensor's Q/DQ pair in 16 bits over
its calibrated range (about 256 times smaller rounding error, a model onnxruntime runs), and
the mixed-precision search can choose the move when asked (--search-int16)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from qtool.calibration.calibrate import calibrate
from qtool.config import CalibrationConfig, PreprocessConfig, QuantizeConfig, load_config
from qtool.data.dataset import Batch
from qtool.evaluation.macs import int8_macs
from qtool.evaluation.mixed_precision import Target, search
from qtool.graph.runtime import create_session
from qtool.quantization.quantize import quantize_model
from qtool.table import qparams as qp

from tests import graphs

OPTIONS = QuantizeConfig()
CHANNELS = 4


def _identity_convs(opset: int = graphs.OPSET) -> onnx.ModelProto:
    """x -> conv_a -> a -> conv_b -> y, both 1x1 identities: their int8 weights are exact (1.0 is
    code 127 at scale 1/127), so every error is the activations' rounding."""
    eye = np.eye(CHANNELS, dtype=np.float32).reshape(CHANNELS, CHANNELS, 1, 1)
    nodes = [helper.make_node("Conv", ["x", "wa"], ["a"], name="conv_a"),
             helper.make_node("Conv", ["a", "wb"], ["y"], name="conv_b")]
    model = graphs.model(nodes, [graphs.tensor("x", ["N", CHANNELS, 6, 6])], [graphs.tensor("y", None)],
                         [graphs.init("wa", eye), graphs.init("wb", eye)], opset=opset)
    if opset >= 21:
        model.ir_version = 10
    return model


def _samples(folder: Path, count: int = 8) -> tuple[Path, np.ndarray]:
    """Normal values with one outlier of 60 per sample: the range the 8-bit grid must span."""
    rng = np.random.default_rng(0)
    x = rng.normal(0, 1, (count, CHANNELS, 6, 6)).astype(np.float32)
    x[:, 0, 0, 0] = 60.0
    folder.mkdir(parents=True, exist_ok=True)
    for i in range(count):
        np.save(folder / f"s{i:03d}.npy", x[i:i + 1])
    return folder, x


@pytest.fixture(scope="module", params=[graphs.OPSET, 21])
def outliers(request, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("int16")
    path = tmp / "m.onnx"
    onnx.save(_identity_convs(request.param), path)
    data, x = _samples(tmp / "data")
    table = calibrate(path, data, PreprocessConfig(), CalibrationConfig(method="minmax"), OPTIONS, progress=False)
    return request.param, path, table, data, x


def _mean_error(model, path: Path, x: np.ndarray) -> float:
    ref = create_session(str(path), 1, "fp32").run(None, {"x": x})[0]
    got = create_session(model, 1, "quantized").run(None, {"x": x})[0]
    return float(np.mean(np.abs(got - ref)))


def test_an_outlier_tensor_in_16_bits_has_about_256_times_smaller_error(outliers):
    opset, path, table, _, x = outliers
    int8 = quantize_model(path, table, OPTIONS)  # runs the model through onnxruntime's run check
    wide = quantize_model(path, table, QuantizeConfig(int16_activations=("x", "a")))
    zero_points = {t.name: t.data_type for t in wide.model.graph.initializer if t.name.endswith("_zero_point")}
    assert zero_points["x_zero_point"] == zero_points["a_zero_point"] == TensorProto.UINT16
    domains = {n.domain for n in wide.model.graph.node if n.op_type in ("QuantizeLinear", "DequantizeLinear")}
    assert domains == ({""} if opset >= 21 else {"", "com.microsoft"})  # the weights' DequantizeLinear: standard
    assert any(note.startswith("2 activation(s) in 16 bits") for note in wide.notes)
    ratio = _mean_error(int8.model, path, x) / _mean_error(wide.model, path, x)
    assert 150 < ratio < 400, ratio
    # no 16-bit activation: no MAC counts as int8 where a 16-bit tensor is read or written
    macs = int8_macs(wide.model)
    assert macs.int8 == 0 and macs.int16 == macs.total > 0


def test_sixteen_bit_parameters_keep_the_range():
    for params in (qp.activation_qparams(-1.0, 3.0, "uint8"), qp.activation_qparams(-1.0, 3.0, "int8"),
                   qp.activation_qparams(0.0, 6.0, "uint8", symmetric=True)):
        wide = qp.sixteen_bit(params)
        assert wide.dtype == qp.SIXTEEN_BITS[params.dtype]
        # the 8-bit range and half an 8-bit step beyond each end, where the calibrated range may reach
        lo, hi = params.range
        assert wide.range[0] <= lo - params.scale / 2 + wide.scale and wide.range[1] >= hi + params.scale / 2 - wide.scale
        assert params.scale / wide.scale == pytest.approx(256, rel=0.01)
    symmetric = qp.sixteen_bit(qp.activation_qparams(-2.0, 3.0, "int8", symmetric=True, symmetric_qmax=127))
    assert symmetric.zero_point == 0 and symmetric.dtype == "int16"
    assert symmetric.scale * 32767 == pytest.approx(128.5 * 3.0 / 127, rel=1e-6)


def test_config_and_cli_take_int16_activations(outliers, tmp_path, qtool_cli):
    _, path, table, _, _ = outliers
    cfg = load_config({"quantization": {"int16_activations": "a*"}})
    assert cfg.quantization.int16_activations == ("a*",)
    table_path = tmp_path / "t.json"
    table.save(table_path)
    out = tmp_path / "q.onnx"
    done = qtool_cli("quantize", path, "--table", table_path, "--int16-activations", "x,a",
                     "-o", out)
    assert done.returncode == 0, done.stderr
    assert "2 activation(s) in 16 bits" in done.stderr
    zero = {t.name: numpy_helper.to_array(t) for t in onnx.load(out).graph.initializer}
    assert zero["x_zero_point"].dtype == np.uint16 and zero["a_zero_point"].dtype == np.uint16
    refused = qtool_cli("quantize", path, "--table", table_path, "--search-int16", "-o", tmp_path / "r.onnx")
    assert refused.returncode != 0 and "--search-int16" in refused.stderr  # an option of qtool search


def test_the_search_chooses_16_bit_activations_when_offered(outliers):
    _, path, table, _, x = outliers
    evals = [Batch([f"s{i}" for i in range(j, j + 4)], {"x": x[j:j + 4]}) for j in range(0, 8, 4)]
    goal = Target(cosine=0.999999)
    offered = search(path, table, OPTIONS, goal, evals, None, 2, int16=True).chosen
    assert offered.int16_layers == ["conv_a"] and offered.float_layers == []
    assert goal.met(offered.figures) and offered.int8_mac_fraction == 0.0
    # not offered: the same target needs float layers
    plain = search(path, table, OPTIONS, goal, evals, None, 2).chosen
    assert plain.float_layers and not plain.int16_layers


def test_patterns_that_name_nothing_get_a_note(outliers):
    """A 16-bit or exclusion pattern that names no quantized activation, node or op type of the
    prepared model changes nothing: a note says so, one per pattern; the patterns that match do."""
    _, path, table, _, _ = outliers
    options = QuantizeConfig(int16_activations=("a", "nosuch*"), exclude_nodes=("gone",),
                             exclude_op_types=("Softmax",))
    result = quantize_model(path, table, options)
    unmatched = [note for note in result.notes if note.startswith("--")]
    assert unmatched == [
        "--exclude-op-types Softmax: the prepared model has no Softmax node",
        "--exclude-nodes gone: no node of the prepared model is named so (folded or fused nodes are gone)",
        "--int16-activations nosuch*: the plan quantizes no activation so named, so nothing goes to 16 bits for it "
        "(qtool evaluate --per-layer lists the quantized tensors)"]
    assert any(note.startswith("1 activation(s) in 16 bits") for note in result.notes)  # 'a' matched
