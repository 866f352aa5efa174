"""One quantization convention per target (docs/targets.md#conventions): TensorRT's activation
scales are amax/127 with zero point 0, the value its calibration cache holds, so a qtool table
and the same table converted to a cache quantize to the same bytes."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import numpy_helper

from qtool.config import QuantizeConfig
from qtool.table.qparams import activation_qparams
from qtool.targets import TARGETS
from tests.conftest import EFFNET_CONFIG, kit_path, run_qtool


def _run(*args) -> None:
    proc = run_qtool(*args)
    assert proc.returncode == 0, proc.stderr


def test_tensorrt_model_from_a_table_equals_the_model_from_its_tensorrt_cache(tmp_path):
    model = kit_path("models", "efficientnet_lite0_dyn.onnx")
    images = kit_path("data", "calib", "images")
    table, cache = tmp_path / "calib.json", tmp_path / "calib.cache"
    from_cache, from_table = tmp_path / "from_cache.onnx", tmp_path / "from_table.onnx"
    _run("calibrate", model, "--data", images, "--num-samples", "4", "--config", EFFNET_CONFIG, "-o", table)
    _run("table", "convert", table, "--to", "tensorrt", "-o", cache)
    # a cache holds scales only, not the channel means the config's bias correction reads: off for both
    off = ("--bias-correction", "off")
    _run("quantize", model, "--table", cache, "--target", "tensorrt", "--config", EFFNET_CONFIG, *off, "-o", from_cache)
    _run("quantize", model, "--table", table, "--target", "tensorrt", "--config", EFFNET_CONFIG, *off, "-o", from_table)
    assert from_cache.read_bytes() == from_table.read_bytes()

    # and the scales are amax/127 of the (default-target, asymmetric) table's ranges, zero point 0
    ranges = {name: entry["range"] for name, entry in json.loads(table.read_text())["tensors"].items()}
    qmodel = onnx.load(str(from_table))
    inits = {t.name: numpy_helper.to_array(t) for t in qmodel.graph.initializer}
    checked = 0
    for node in qmodel.graph.node:
        if node.op_type == "QuantizeLinear" and node.input[0] in ranges:
            lo, hi = ranges[node.input[0]]
            assert inits[node.input[1]] == np.float32(max(-lo, hi) / 127.0)
            assert inits[node.input[2]].dtype == np.int8 and int(inits[node.input[2]]) == 0
            checked += 1
    assert checked > 20


@pytest.mark.parametrize("target, scale", [("tensorrt", 2.54 / 127.0), ("ort-cpu", 2.54 / 127.5),
                                           ("litert", 2.54 / 127.5)])
def test_symmetric_scale_convention_of_each_target(target, scale):
    options = QuantizeConfig(target=target, activation_dtype="int8", symmetric_activations=True)
    params = activation_qparams(-1.0, 2.54, "int8", True, TARGETS[options.target].symmetric_qmax)
    assert params.scale == float(np.float32(scale)) and params.zero_point == 0


def test_targets_doc_states_each_presets_convention():
    text = (Path(__file__).resolve().parents[1] / "docs" / "targets.md").read_text()
    section = text[text.index("## Conventions"):]
    for target in TARGETS:
        assert f"`{target}`" in section
    assert "amax / 127" in section and "2 amax / 255" in section
