"""Per-op rules (LiteRT int8 spec) on small graphs: every op of the registry quantizes, stays
close to fp32, and keeps the spec's shared and fixed scales exactly.

Each graph is x -> Conv 1x1 -> OP -> Neg -> y: the Conv makes the op's input a quantized
activation with its own range, and Neg (no rule: float) makes the op's output an internal
tensor whose Q/DQ pair is visible.
"""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import helper, numpy_helper

from qtool.calibration.calibrate import calibrate
from qtool.config import CalibrationConfig, PreprocessConfig, QuantizeConfig
from qtool.evaluation.metrics import sqnr_db
from qtool.plan.ops import RULES
from qtool.targets import TARGETS
from qtool.quantization.quantize import quantize_model

from tests import graphs

C, H, W = 8, 6, 6


def _i64(*values):
    return np.array(values, np.int64)


def _f32(*values):
    return np.array(values, np.float32)


# op -> (nodes from "pre" to the op's outputs, constants, the op's outputs, expected output rule)
# The rule: "tie" output shares the input's scale and zero point; "fixed": the spec's fixed
# parameters; "own": a calibrated range of its own.
CASES = {
    "Add": ([("Add", ["pre", "x"], {})], {}, "own"),
    "Sub": ([("Sub", ["pre", "x"], {})], {}, "own"),
    "Mul": ([("Mul", ["pre", "x"], {})], {}, "own"),
    "Concat": ([("Concat", ["pre", "pre"], {"axis": 1})], {}, "tie"),
    "MaxPool": ([("MaxPool", ["pre"], {"kernel_shape": [2, 2]})], {}, "tie"),
    "AveragePool": ([("AveragePool", ["pre"], {"kernel_shape": [2, 2]})], {}, "own"),
    "GlobalAveragePool": ([("GlobalAveragePool", ["pre"], {})], {}, "own"),
    "ReduceMean": ([("ReduceMean", ["pre"], {"axes": [2, 3], "keepdims": 1})], {}, "own"),
    "Resize": ([("Resize", ["pre", "", "sc"], {"mode": "nearest"})], {"sc": _f32(1, 1, 2, 2)}, "tie"),
    "Resize-linear": ([("Resize", ["pre", "", "sc"], {"mode": "linear"})], {"sc": _f32(1, 1, 2, 2)}, "tie"),
    "Reshape": ([("Reshape", ["pre", "shape"], {})], {"shape": _i64(0, C, H * W)}, "tie"),
    "Flatten": ([("Flatten", ["pre"], {})], {}, "tie"),
    "Squeeze": ([("Unsqueeze", ["pre", "ax"], {}), ("Squeeze", ["op0", "ax"], {})], {"ax": _i64(2)}, "tie"),
    "Unsqueeze": ([("Unsqueeze", ["pre", "ax"], {})], {"ax": _i64(2)}, "tie"),
    "Transpose": ([("Transpose", ["pre"], {"perm": [0, 2, 3, 1]})], {}, "tie"),
    "Slice": ([("Slice", ["pre", "st", "en", "ax"], {})], {"st": _i64(1, 1), "en": _i64(5, 4), "ax": _i64(2, 3)},
              "tie"),
    "Gather": ([("Gather", ["pre", "idx"], {"axis": 1})], {"idx": _i64(3, 0, 1, 7)}, "tie"),
    "Pad": ([("Pad", ["pre", "pads"], {})], {"pads": _i64(0, 0, 1, 2, 0, 0, 2, 1)}, "tie"),
    "Pad-value": ([("Pad", ["pre", "pads", "pv"], {})], {"pads": _i64(0, 0, 1, 1, 0, 0, 1, 1), "pv": _f32(-7.5)},
                  "tie"),
    "Pad-reflect": ([("Pad", ["pre", "pads"], {"mode": "reflect"})], {"pads": _i64(0, 0, 1, 1, 0, 0, 1, 1)}, "tie"),
    "Split": ([("Split", ["pre", "sp"], {"axis": 1})], {"sp": _i64(3, 5)}, "tie"),
    "Relu": ([("Relu", ["pre"], {})], {}, "own"),
    "Clip": ([("Clip", ["pre", "lo", "hi"], {})], {"lo": _f32(-1)[0], "hi": _f32(1)[0]}, "own"),
    "LeakyRelu": ([("LeakyRelu", ["pre"], {"alpha": 0.1})], {}, "own"),
    "PRelu": ([("PRelu", ["pre", "slope"], {})], {"slope": np.linspace(0, 0.5, C, dtype=np.float32).reshape(C, 1, 1)},
              "own"),
    "Sigmoid": ([("Sigmoid", ["pre"], {})], {}, "fixed"),
    "Tanh": ([("Tanh", ["pre"], {})], {}, "fixed"),
    "Softmax": ([("Softmax", ["pre"], {"axis": 1})], {}, "fixed"),
    "HardSigmoid": ([("HardSigmoid", ["pre"], {})], {}, "own"),
    "HardSwish": ([("HardSwish", ["pre"], {})], {}, "own"),
    "MatMul": ([("Transpose", ["pre"], {"perm": [0, 1, 3, 2]}), ("MatMul", ["pre", "op0"], {})], {}, "own"),
}
OUTPUTS = {"Split": 2}
# The spec's fixed output parameters: (scale, zero point) for int8 and uint8.
FIXED = {"Sigmoid": {"int8": (1 / 256, -128), "uint8": (1 / 256, 0)},
         "Softmax": {"int8": (1 / 256, -128), "uint8": (1 / 256, 0)},
         "Tanh": {"int8": (1 / 128, 0), "uint8": (1 / 128, 128)}}
# SQNR floor (dB) of the int8 graph against fp32 over the calibration samples. Measured: every
# op 33-51 dB (Mul lowest: the product of two rounded operands). A wrong scale, axis or tie,
# or a clipped range, shows up far below.
MIN_SQNR = 30.0


def _op_model(case: str) -> tuple[onnx.ModelProto, list[str]]:
    steps, consts, _ = CASES[case]
    rng = np.random.default_rng(0)
    inits = [graphs.init("w", rng.normal(0, 0.5, (C, C, 1, 1)).astype(np.float32)),
             graphs.init("b", rng.normal(0, 0.2, C).astype(np.float32))]
    inits += [graphs.init(name, value) for name, value in consts.items()]
    nodes = [helper.make_node("Conv", ["x", "w", "b"], ["pre"], name="conv")]
    for i, (op, inputs, attrs) in enumerate(steps):
        last = i == len(steps) - 1
        outs = [f"op{i}_{k}" for k in range(OUTPUTS.get(case, 1))] if last else [f"op{i}"]
        nodes.append(helper.make_node(op, inputs, outs, name="op" if last else f"step{i}", **attrs))
    ys = []
    for k, out in enumerate(nodes[-1].output):
        nodes.append(helper.make_node("Neg", [out], [f"y{k}"], name=f"neg{k}"))
        ys.append(f"y{k}")
    m = graphs.model(nodes, [graphs.tensor("x", ["N", C, H, W])], [graphs.tensor(y, None) for y in ys], inits)
    return m, list(nodes[-1 - len(ys)].output)


def _quantize(tmp_path, m, options):
    path = tmp_path / "m.onnx"
    onnx.save(m, path)
    data = graphs.write_samples(tmp_path / "data", np.random.default_rng(0), (C, H, W), count=16)
    table = calibrate(path, data, PreprocessConfig(), CalibrationConfig(batch_size=8), options, progress=False)
    result = quantize_model(path, table, options)
    onnx.checker.check_model(result.model, full_check=True)
    return path, result


def _params(model, tensor):
    inits = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}
    return inits[tensor + "_scale"], inits[tensor + "_zero_point"]


def _sqnr(path, qmodel) -> float:
    # the calibration samples themselves: the figure measures rounding, not how well 16 samples' ranges
    # cover new data (a spatial mean of white noise falls outside them often)
    x = np.random.default_rng(0).normal(0, 1, (16, 1, C, H, W)).astype(np.float32)[:8, 0]
    ref = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"]).run(None, {"x": x})
    got = ort.InferenceSession(qmodel.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"x": x})
    signal = sum(float(np.sum(r.astype(np.float64) ** 2)) for r in ref)
    noise = sum(float(np.sum((r - g).astype(np.float64) ** 2)) for r, g in zip(ref, got))
    return sqnr_db(signal, noise)


def test_every_registered_op_has_a_case():
    covered = {op for steps, _, _ in CASES.values() for op, _, _ in steps} | {"Conv"}
    # the recurrent rules (weight-only LSTM, never-int8 GRU) are tested in tests/test_recurrent.py
    qdq_ops = {op for op, rule in RULES.items() if rule.kernel is None}
    assert qdq_ops - covered <= {"ConvTranspose", "Gemm"}, sorted(qdq_ops - covered)  # tested below


@pytest.mark.parametrize("target", ["ort-cpu", "litert"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_op_quantizes_close_to_fp32_with_the_spec_parameters(tmp_path, case, target):
    m, outputs = _op_model(case)
    options = QuantizeConfig(target=target)
    path, result = _quantize(tmp_path, m, options)
    qmodel, plan = result.model, result.plan
    assert "op" in plan.quantized_nodes, plan.float_nodes
    sqnr = _sqnr(path, qmodel)
    assert sqnr >= MIN_SQNR, f"{case}: {sqnr:.1f} dB"
    kind = CASES[case][2]
    dtype = options.activation_dtype
    if case in ("Relu", "Clip"):  # fused into the Conv: no Q/DQ between them, the pair's range is the output's
        assert plan.fused == ["pre"] and "pre_scale" not in {t.name for t in qmodel.graph.initializer}
        in_scale, in_zero = None, None
    else:
        in_scale, in_zero = _params(qmodel, "pre")
        assert in_zero.dtype == np.dtype(dtype)
    written_float = TARGETS[target].float_outputs and RULES[CASES[case][0][-1][0]].float_output
    for out in outputs:
        if written_float:  # an integer MatMul/Gemm read only by a float op (Neg) writes float: no Q/DQ
            assert out + "_scale" not in {t.name for t in qmodel.graph.initializer}, case
            continue
        scale, zero = _params(qmodel, out)
        if kind == "tie":  # exactly the input's parameters: no requantization around the op
            assert scale == in_scale and zero == in_zero, case
        elif kind == "fixed":
            want_scale, want_zero = FIXED[CASES[case][0][-1][0]][dtype]
            assert scale == np.float32(want_scale) and int(zero) == want_zero, case
        else:
            assert scale != in_scale, case  # its own calibrated range
    if case == "Pad-value":  # the border value -7.5 lies far below the input's range, and is kept
        assert float(scale) * (np.iinfo(dtype).min - int(zero) - 0.5) <= -7.5  # within half a step
    assert not result.notes or "constraints" not in " ".join(result.notes)


def test_pad_border_is_exactly_the_zero_point(tmp_path):
    """A constant pad of real 0 on a quantized input dequantizes to exactly 0 (TPU-MLIR's Z_x fill)."""
    m, outputs = _op_model("Pad")
    path, result = _quantize(tmp_path, m, QuantizeConfig(target="litert"))
    qmodel = result.model
    # expose the Pad output's DequantizeLinear as a graph output
    dq = outputs[0] + "_DequantizeLinear_Output"
    qmodel.graph.output.append(helper.make_tensor_value_info(dq, onnx.TensorProto.FLOAT, None))
    x = np.random.default_rng(2).normal(0, 1, (2, C, H, W)).astype(np.float32)
    got = ort.InferenceSession(qmodel.SerializeToString(), providers=["CPUExecutionProvider"]).run([dq], {"x": x})[0]
    border = np.concatenate([got[:, :, 0, :].ravel(), got[:, :, -2:, :].ravel(), got[:, :, :, :2].ravel(),
                             got[:, :, :, -1].ravel()])
    assert np.all(border == 0.0)


def test_unknown_op_stays_float_with_qdq_at_its_boundary(tmp_path):
    m, outputs = _op_model("Relu")
    for node in m.graph.node:  # Relu -> Erf: an op without a rule
        if node.name == "op":
            node.op_type = "Erf"
    path, result = _quantize(tmp_path, m, QuantizeConfig())
    assert any(name.startswith("op (Erf)") for name in result.plan.float_nodes)
    erf = next(n for n in result.model.graph.node if n.op_type == "Erf")
    assert erf.input[0] == "pre_DequantizeLinear_Output"  # its input is dequantized from int8
    assert _sqnr(path, result.model) >= MIN_SQNR


def _conv_transpose(group: int, magnitudes: np.ndarray) -> tuple[onnx.ModelProto, np.ndarray, np.ndarray]:
    """ConvTranspose (6 output channels) -> Neg, weight column j scaled by magnitudes[j]."""
    rng = np.random.default_rng(0)
    w = rng.normal(0, 1, (C, 6 // group, 3, 3)).astype(np.float32) * magnitudes.reshape(1, -1, 1, 1)
    b = rng.normal(0, 0.1, 6).astype(np.float32)
    nodes = [helper.make_node("ConvTranspose", ["x", "w", "b"], ["ct"], name="op", group=group),
             helper.make_node("Neg", ["ct"], ["y"], name="neg")]
    m = graphs.model(nodes, [graphs.tensor("x", ["N", C, H, W])], [graphs.tensor("y", None)],
                     [graphs.init("w", w), graphs.init("b", b)])
    return m, w, b


def _assert_bias_in_accumulator_units(model: onnx.ModelProto, bias: np.ndarray, group: int) -> None:
    """Output channel o of group g is weight column o - g * (6 // group): an integer kernel adds the
    int32 bias to that channel's accumulator, whose unit is s_in * s_w[column], so the bias must be
    stored in that unit. (onnxruntime's QDQ graph hides a wrong bias scale: it dequantizes the bias
    by its own scale, losing only rounding.)"""
    inits = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}
    s_in, s_w = float(inits["x_scale"]), inits["w_scale"]
    unit = np.array([s_in * float(s_w[o % (6 // group)]) for o in range(6)])
    assert np.allclose(inits["b_scale"], unit, rtol=1e-6)
    # within half a unit, plus float32 rounding of the bias itself
    assert np.all(np.abs(inits["b_quantized"] * unit - bias) <= unit / 2 + 1e-6 * np.abs(bias))


@pytest.mark.parametrize("group", [1, 2])
def test_conv_transpose_weight_axis_is_1(tmp_path, group):
    # ConvTranspose weight (C_in, C_out/group, k, k): output channels on axis 1. Make them differ
    # strongly so a per-channel scale on the wrong axis would be visible.
    m, w, b = _conv_transpose(group, (10.0 ** -np.arange(6 // group)).astype(np.float32))
    path, result = _quantize(tmp_path, m, QuantizeConfig())
    dq = next(n for n in result.model.graph.node if n.output[0] == "w_DequantizeLinear_Output")
    assert next(a.i for a in dq.attribute if a.name == "axis") == 1
    scale, _ = _params(result.model, "w")
    expected = np.abs(w).max(axis=(0, 2, 3)) / 127
    assert np.allclose(scale, expected, rtol=1e-6)
    _assert_bias_in_accumulator_units(result.model, b, group)
    assert _sqnr(path, result.model) >= MIN_SQNR


def test_grouped_conv_transpose_widened_for_its_bias_keeps_the_bias_in_accumulator_units(tmp_path):
    # column 2 near zero: bias / (s_in * s_w) overflows int32, so its weight scale widens for both groups
    m, w, b = _conv_transpose(2, np.array([1.0, 0.1, 1e-12], np.float32))
    _, result = _quantize(tmp_path, m, QuantizeConfig())
    assert any("int32 bias would overflow" in note for note in result.notes)
    scale, _ = _params(result.model, "w")
    assert scale[2] > 1e3 * np.abs(w[:, 2]).max() / 127
    _assert_bias_in_accumulator_units(result.model, b, 2)
