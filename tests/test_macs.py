"""MAC counts from inferred shapes, and the share of them a QDQ model runs in int8."""

from __future__ import annotations

import numpy as np
import onnx
from onnx import helper

from qtool.calibration.calibrate import calibrate
from qtool.config import CalibrationConfig, PreprocessConfig, QuantizeConfig
from qtool.evaluation.macs import int8_macs, node_macs
from qtool.quantization.quantize import quantize_model

from tests import graphs
from tests.conftest import EFFNET


def test_conv_macs_per_sample_and_per_batch():
    m = graphs.conv_model(np.random.default_rng(0), c_in=8, c_out=16, size=12)
    # 16 x 12 x 12 outputs (pads 1), each a sum over 8 x 3 x 3 products
    assert node_macs(m) == {"conv": 16 * 12 * 12 * 8 * 9}
    assert node_macs(m, {"x": (2, 8, 20, 20)}) == {"conv": 2 * 16 * 20 * 20 * 8 * 9}


def test_depthwise_conv_counts_one_input_channel_per_output():
    m = graphs.conv_model(np.random.default_rng(0), c_in=8, c_out=8, group=8, size=10)
    assert node_macs(m) == {"conv": 8 * 10 * 10 * 9}


def test_gemm_and_matmul_macs():
    rng = np.random.default_rng(0)
    assert node_macs(graphs.gemm_model(rng, k=32, n=10)) == {"gemm": 10 * 32}
    assert node_macs(graphs.gemm_model(rng, k=32, n=10, trans_b=0), {"x": (3, 32)}) == {"gemm": 3 * 10 * 32}
    assert node_macs(graphs.matmul_model(rng, k=32, n=24)) == {"matmul": 5 * 24 * 32}


def test_conv_transpose_macs():
    w = np.random.default_rng(0).normal(0, 1, (4, 6, 3, 3)).astype(np.float32)
    node = helper.make_node("ConvTranspose", ["x", "w"], ["y"], name="deconv", strides=[2, 2])
    m = graphs.model([node], [graphs.tensor("x", [1, 4, 5, 5])], [graphs.tensor("y", None)], [graphs.init("w", w)])
    # each of the 4 x 5 x 5 input values is scattered into 6 x 3 x 3 outputs
    assert node_macs(m) == {"deconv": 4 * 5 * 5 * 6 * 9}


def test_macs_of_a_model_over_the_protobuf_limit(monkeypatch):
    """Shape inference refuses a model over the protobuf limit (2 GiB; here lowered to 20 kB by
    a hook that refuses as protobuf would); the counts must still be exact, not the unknown
    shapes' zero (qtool.graph.shapes infers on a copy without weight payloads)."""
    m = graphs.conv_model(np.random.default_rng(0), c_in=32, c_out=64, size=12)  # 74 kB of weights
    limit = 20_000
    assert m.ByteSize() > limit
    real = onnx.shape_inference.infer_shapes

    def refusing(model, *args, **kwargs):
        if (len(model) if isinstance(model, bytes) else model.ByteSize()) > limit:
            raise ValueError("Message onnx.ModelProto exceeds maximum protobuf size of 2GB")
        return real(model, *args, **kwargs)

    monkeypatch.setattr(onnx.shape_inference, "infer_shapes", refusing)
    assert node_macs(m) == {"conv": 64 * 12 * 12 * 32 * 9}
    assert node_macs(m, {"x": (2, 32, 20, 20)}) == {"conv": 2 * 64 * 20 * 20 * 32 * 9}


def test_int8_fraction_counts_only_nodes_fed_by_dequantize(tmp_path):
    """Conv -> Relu -> MatMul; with the MatMul excluded only the Conv's MACs are int8."""
    rng = np.random.default_rng(0)
    w = rng.normal(0, 0.3, (6, 3, 3, 3)).astype(np.float32)
    wm = rng.normal(0, 0.3, (8, 5)).astype(np.float32)
    nodes = [helper.make_node("Conv", ["x", "w"], ["c"], name="conv", pads=[1, 1, 1, 1]),
             helper.make_node("Relu", ["c"], ["r"], name="relu"),
             helper.make_node("MatMul", ["r", "wm"], ["y"], name="matmul")]
    m = graphs.model(nodes, [graphs.tensor("x", ["N", 3, 8, 8])], [graphs.tensor("y", None)],
                     [graphs.init("w", w), graphs.init("wm", wm)])
    path = tmp_path / "m.onnx"
    onnx.save(m, path)
    data = graphs.write_samples(tmp_path / "data", rng, (3, 8, 8), count=4)
    conv, matmul = 6 * 8 * 8 * 3 * 9, 6 * 8 * 5 * 8
    for excluded, expected in [((), conv + matmul), (("matmul",), conv), (("conv", "matmul"), 0)]:
        options = QuantizeConfig(exclude_nodes=excluded)
        table = calibrate(path, data, PreprocessConfig(), CalibrationConfig(), options, progress=False)
        summary = int8_macs(quantize_model(path, table, options).model)
        assert summary.total == conv + matmul
        assert summary.int8 == expected
        assert summary.fraction == expected / (conv + matmul)


def test_shipped_effnet_macs_are_about_0_4_billion():
    total = sum(node_macs(onnx.load(EFFNET)).values())
    # the EfficientNet-Lite README lists about 0.4 B multiply-adds for lite0 at 224x224
    assert 370e6 < total < 420e6
