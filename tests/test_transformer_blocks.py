"""Block rules on small graphs: the decomposed LayerNorm chain and other normalizations written
out, GELU (Erf and tanh forms), attention scores with an additive mask (-1e4, float32 min, or -inf
through Where), residual Adds, magnitudes and log spectra."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from qtool.calibration.calibrate import calibrate
from qtool.config import CalibrationConfig, PreprocessConfig, QuantizeConfig
from qtool.evaluation.metrics import sqnr_db
from qtool.graph.index import GraphIndex
from qtool.plan.ops import float_blocks
from qtool.plan.planner import build_plan
from qtool.quantization.ort_cpu.gelu_form import NOTE as GELU_NOTE, fused_gelus
from qtool.quantization.quantize import quantize_model

from tests import graphs

S, D = 6, 16
STATIC = QuantizeConfig(matmul="static")
LN_NODES = ["mean", "sub", "pow", "var", "eps", "sqrt", "div", "gamma", "beta"]


def _weight(rng, name, rows, cols):
    return graphs.init(name, rng.normal(0, 0.3, (rows, cols)).astype(np.float32))


def _layer_norm(x: str, out: str) -> tuple[list, list]:
    c = graphs.init
    nodes = [
        helper.make_node("ReduceMean", [x], ["mu"], name="mean", axes=[-1]),
        helper.make_node("Sub", [x, "mu"], ["d"], name="sub"),
        helper.make_node("Pow", ["d", "two"], ["d2"], name="pow"),
        helper.make_node("ReduceMean", ["d2"], ["v"], name="var", axes=[-1]),
        helper.make_node("Add", ["v", "epsilon"], ["ve"], name="eps"),
        helper.make_node("Sqrt", ["ve"], ["sd"], name="sqrt"),
        helper.make_node("Div", ["d", "sd"], ["n"], name="div"),
        helper.make_node("Mul", ["n", "g"], ["ng"], name="gamma"),
        helper.make_node("Add", ["ng", "b"], [out], name="beta"),
    ]
    inits = [c("two", np.float32(2.0)), c("epsilon", np.float32(1e-5)), c("g", np.full(D, 1.5, np.float32)),
             c("b", np.full(D, 0.1, np.float32))]
    return nodes, inits


def _ln_model(rng) -> onnx.ModelProto:
    """x -> MatMul -> Add(x) residual -> decomposed LayerNorm -> MatMul -> y"""
    ln, inits = _layer_norm("res", "ln")
    nodes = [helper.make_node("MatMul", ["x", "w1"], ["h"], name="mm1"),
             helper.make_node("Add", ["h", "x"], ["res"], name="residual"),
             *ln,
             helper.make_node("MatMul", ["ln", "w2"], ["y"], name="mm2")]
    return graphs.model(nodes, [graphs.tensor("x", ["N", S, D])], [graphs.tensor("y", None)],
                        [_weight(rng, "w1", D, D), _weight(rng, "w2", D, D), *inits])


def _gelu_model(rng, form: str) -> onnx.ModelProto:
    c = graphs.init
    if form == "erf":
        gelu = [helper.make_node("Div", ["h", "sqrt2"], ["hs"], name="g_scale"),
                helper.make_node("Erf", ["hs"], ["e"], name="g_erf"),
                helper.make_node("Add", ["e", "one"], ["e1"], name="g_plus1"),
                helper.make_node("Mul", ["h", "e1"], ["he"], name="g_mul"),
                helper.make_node("Mul", ["he", "half"], ["g"], name="g_half")]
        inits = [c("sqrt2", np.float32(np.sqrt(2.0)))]
    elif form == "tanh_jax":  # jax2tf: sqrt(2/pi) * (x + x * (x * (0.044715 * x)))
        gelu = [helper.make_node("Mul", ["k", "h"], ["hk"], name="g_coeff"),
                helper.make_node("Mul", ["h", "hk"], ["h2k"], name="g_square"),
                helper.make_node("Mul", ["h", "h2k"], ["h3k"], name="g_cube"),
                helper.make_node("Add", ["h", "h3k"], ["inner"], name="g_inner"),
                helper.make_node("Mul", ["s2pi", "inner"], ["arg"], name="g_scale"),
                helper.make_node("Tanh", ["arg"], ["t"], name="g_tanh"),
                helper.make_node("Add", ["one", "t"], ["e1"], name="g_plus1"),
                helper.make_node("Mul", ["half", "e1"], ["e1h"], name="g_half"),
                helper.make_node("Mul", ["h", "e1h"], ["g"], name="g_mul")]
        inits = [c("k", np.float32(0.044715)), c("s2pi", np.float32(np.sqrt(2 / np.pi)))]
    elif form == "tanh_factored":  # x * (1 + 0.044715 x^2) * sqrt(2/pi)
        gelu = [helper.make_node("Mul", ["h", "h"], ["h2"], name="g_square"),
                helper.make_node("Mul", ["h2", "k"], ["h2k"], name="g_coeff"),
                helper.make_node("Add", ["h2k", "one"], ["f"], name="g_factor"),
                helper.make_node("Mul", ["h", "f"], ["inner"], name="g_inner"),
                helper.make_node("Mul", ["inner", "s2pi"], ["arg"], name="g_scale"),
                helper.make_node("Tanh", ["arg"], ["t"], name="g_tanh"),
                helper.make_node("Add", ["t", "one"], ["e1"], name="g_plus1"),
                helper.make_node("Mul", ["h", "e1"], ["he"], name="g_mul"),
                helper.make_node("Mul", ["he", "half"], ["g"], name="g_half")]
        inits = [c("k", np.float32(0.044715)), c("s2pi", np.float32(np.sqrt(2 / np.pi)))]
    else:
        gelu = [helper.make_node("Pow", ["h", "three"], ["h3"], name="g_cube"),
                helper.make_node("Mul", ["h3", "k"], ["h3k"], name="g_coeff"),
                helper.make_node("Add", ["h", "h3k"], ["inner"], name="g_inner"),
                helper.make_node("Mul", ["inner", "s2pi"], ["arg"], name="g_scale"),
                helper.make_node("Tanh", ["arg"], ["t"], name="g_tanh"),
                helper.make_node("Add", ["t", "one"], ["e1"], name="g_plus1"),
                helper.make_node("Mul", ["h", "half"], ["hh"], name="g_halfx"),
                helper.make_node("Mul", ["hh", "e1"], ["g"], name="g_mul")]
        inits = [c("three", np.float32(3.0)), c("k", np.float32(0.044715)),
                 c("s2pi", np.float32(np.sqrt(2 / np.pi)))]
    nodes = [helper.make_node("MatMul", ["x", "w1"], ["h"], name="mm1"), *gelu,
             helper.make_node("MatMul", ["g", "w2"], ["y"], name="mm2")]
    return graphs.model(nodes, [graphs.tensor("x", ["N", S, D])], [graphs.tensor("y", None)],
                        [_weight(rng, "w1", D, D), _weight(rng, "w2", D, D), c("one", np.float32(1.0)),
                         c("half", np.float32(0.5)), *inits])


def _attention_model(rng, mask: str) -> onnx.ModelProto:
    """Single-head attention with the last two key positions masked out: a constant additive
    mask of -1e4, BERT's (1 - m) * float32 min on a mask input, or a Where filling -inf."""
    c = graphs.init
    keep = np.ones((S, S), np.float32)
    keep[:, -2:] = 0
    nodes = [helper.make_node("MatMul", ["x", "wq"], ["q"], name="q"),
             helper.make_node("MatMul", ["x", "wk"], ["k"], name="k"),
             helper.make_node("MatMul", ["x", "wv"], ["v"], name="v"),
             helper.make_node("Transpose", ["k"], ["kt"], name="kt", perm=[0, 2, 1]),
             helper.make_node("MatMul", ["q", "kt"], ["s"], name="qk"),
             helper.make_node("Mul", ["s", "scale"], ["ss"], name="scale")]
    inits = [_weight(rng, n, D, D) for n in ("wq", "wk", "wv")] + [c("scale", np.float32(D ** -0.5))]
    if mask == "constant":
        nodes.append(helper.make_node("Add", ["ss", "mask"], ["sm"], name="mask_add"))
        inits.append(c("mask", (1 - keep) * np.float32(-1e4)))
    elif mask == "bert":
        nodes += [helper.make_node("Sub", ["one", "keep"], ["inv"], name="inv"),
                  helper.make_node("Mul", ["inv", "fmin"], ["bias"], name="mask_mul"),
                  helper.make_node("Add", ["ss", "bias"], ["sm"], name="mask_add")]
        inits += [c("one", np.float32(1.0)), c("keep", keep), c("fmin", np.float32(np.finfo(np.float32).min))]
    else:
        nodes += [helper.make_node("Where", ["cond", "ss", "ninf"], ["sm"], name="mask_where")]
        inits += [c("cond", keep.astype(bool)), c("ninf", np.float32(-np.inf))]
    nodes += [helper.make_node("Softmax", ["sm"], ["p"], name="softmax", axis=-1),
              helper.make_node("MatMul", ["p", "v"], ["y"], name="pv")]
    return graphs.model(nodes, [graphs.tensor("x", ["N", S, D])], [graphs.tensor("y", None)], inits)


def _quantize(tmp_path, m: onnx.ModelProto) -> tuple[onnx.ModelProto, float]:
    """The int8 model of `m` calibrated on 16 random samples, and its output SQNR on them."""
    path = tmp_path / "m.onnx"
    onnx.save(m, path)
    data = graphs.write_samples(tmp_path / "data", np.random.default_rng(1), (S, D), count=16)
    table = calibrate(path, data, PreprocessConfig(), CalibrationConfig(batch_size=8), STATIC, progress=False)
    qmodel = quantize_model(path, table, STATIC).model
    onnx.checker.check_model(qmodel, full_check=True)
    x = np.concatenate([np.load(f) for f in sorted(data.iterdir())])
    ref = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    got = ort.InferenceSession(qmodel.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    ref, got = ref.astype(np.float64), got.astype(np.float64)
    return qmodel, sqnr_db(float(np.sum(ref ** 2)), float(np.sum((ref - got) ** 2)))


def _float(plan) -> set[str]:
    return {entry.split(" (")[0] for entry in plan.float_nodes}


def _quantize_scales(qmodel: onnx.ModelProto) -> dict[str, float]:
    """Input tensor of every QuantizeLinear -> the width of its range (255 codes)."""
    inits = {t.name: numpy_helper.to_array(t) for t in qmodel.graph.initializer}
    return {n.input[0]: float(np.max(inits[n.input[1]])) * 255
            for n in qmodel.graph.node if n.op_type == "QuantizeLinear"}


def test_decomposed_layer_norm_chain_and_residual_add_stay_float(tmp_path):
    m = _ln_model(np.random.default_rng(0))
    blocks = float_blocks(GraphIndex(m))
    assert blocks.counts == {"LayerNorm chain": 1, "residual Add": 1}
    plan = build_plan(m, STATIC)
    assert set(LN_NODES) | {"residual"} <= _float(plan)
    assert {"mm1", "mm2"} <= set(plan.quantized_nodes)
    # the squared deviations and the variance get no range; the LayerNorm output does (mm2 reads it)
    assert not {"d", "d2", "v", "ve", "n", "res"} & set(plan.activations)
    assert "ln" in plan.activations
    qmodel, sqnr = _quantize(tmp_path, m)
    assert sqnr > 25


@pytest.mark.parametrize("norm, domain", [("LayerNormalization", ""), ("SimplifiedLayerNormalization", ""),
                                          ("SkipLayerNormalization", "com.microsoft")])
def test_a_residual_add_into_a_layer_norm_op_stays_float(norm, domain):
    """The one-op LayerNorms of exporters and of onnxruntime's fused graphs (RMS-style
    SimplifiedLayerNormalization, the com.microsoft SkipLayerNormalization) read the residual
    stream as the decomposed chain does."""
    rng = np.random.default_rng(0)
    inputs = ["res", "zeros", "gamma"] if norm == "SkipLayerNormalization" else ["res", "gamma"]
    nodes = [helper.make_node("MatMul", ["x", "w1"], ["h"], name="mm1"),
             helper.make_node("Add", ["h", "x"], ["res"], name="residual"),
             helper.make_node(norm, inputs, ["ln"], name="norm", domain=domain, epsilon=1e-5),
             helper.make_node("MatMul", ["ln", "w2"], ["y"], name="mm2")]
    inits = [_weight(rng, "w1", D, D), _weight(rng, "w2", D, D), graphs.init("gamma", np.ones(D, np.float32)),
             graphs.init("zeros", np.zeros((1, S, D), np.float32))]
    graph = helper.make_graph(nodes, "test", [graphs.tensor("x", [1, S, D])], [graphs.tensor("y", [1, S, D])], inits)
    m = helper.make_model(graph, opset_imports=[helper.make_opsetid("", graphs.OPSET),
                                                helper.make_opsetid("com.microsoft", 1)])
    ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"])  # onnxruntime runs it
    assert float_blocks(GraphIndex(m)).counts == {"residual Add": 1}
    plan = build_plan(m, STATIC)
    assert "residual" in _float(plan) and {"mm1", "mm2"} <= set(plan.quantized_nodes)


def _normalization(form: str, x: str, out: str) -> tuple[list, list, list[str]]:
    """x -> out normalized over the last axis as other exporters write it: (nodes, constants, the
    nodes that must stay float). tf: jax2tf's mean(x^2) - mean(x)^2 from ReduceSums, Max 0,
    Reciprocal(Sqrt); keras: Mul(d, d) squares and beta - mean * scale; rms: x / sqrt(mean(x^2))."""
    c, m = graphs.init, helper.make_node
    inits = [c("inv_n", np.float32(1.0 / D)), c("epsilon", np.float32(1e-5)), c("zero", np.float32(0.0)),
             c("g", np.linspace(0.5, 2.0, D, dtype=np.float32)), c("b", np.full(D, 0.1, np.float32)),
             c("axes", np.array([-1], np.int64))]
    if form == "tf":
        nodes = [m("ReduceSum", [x, "axes"], ["s1"], name="sum", keepdims=1),
                 m("Mul", [x, x], ["x2"], name="square"),
                 m("ReduceSum", ["x2", "axes"], ["s2"], name="sum_sq", keepdims=1),
                 m("Mul", ["s1", "inv_n"], ["mu"], name="mean"),
                 m("Mul", ["s2", "inv_n"], ["m2"], name="mean_sq"),
                 m("Mul", ["mu", "mu"], ["mu2"], name="mean_2"),
                 m("Sub", ["m2", "mu2"], ["v0"], name="var"),
                 m("Max", ["zero", "v0"], ["v"], name="clamp"),
                 m("Add", ["v", "epsilon"], ["ve"], name="eps"),
                 m("Sqrt", ["ve"], ["sd"], name="sqrt"),
                 m("Reciprocal", ["sd"], ["r"], name="rsqrt"),
                 m("Mul", ["r", "g"], ["rg"], name="gamma"),
                 m("Sub", [x, "mu"], ["d"], name="centre"),
                 m("Mul", ["d", "rg"], ["n"], name="scale"),
                 m("Add", ["n", "b"], [out], name="beta")]
    elif form == "keras":
        nodes = [m("ReduceMean", [x], ["mu"], name="mean", axes=[-1]),
                 m("Sub", [x, "mu"], ["d"], name="centre"),
                 m("Mul", ["d", "d"], ["d2"], name="square"),
                 m("ReduceMean", ["d2"], ["v"], name="var", axes=[-1]),
                 m("Add", ["v", "epsilon"], ["ve"], name="eps"),
                 m("Sqrt", ["ve"], ["sd"], name="sqrt"),
                 m("Reciprocal", ["sd"], ["r"], name="rsqrt"),
                 m("Mul", ["r", "g"], ["rg"], name="gamma"),
                 m("Mul", [x, "rg"], ["xs"], name="scale"),
                 m("Mul", ["mu", "rg"], ["ms"], name="mean_scale"),
                 m("Sub", ["b", "ms"], ["shift"], name="beta_shift"),
                 m("Add", ["xs", "shift"], [out], name="beta")]
    else:
        nodes = [m("Pow", [x, "two"], ["x2"], name="square"),
                 m("ReduceMean", ["x2"], ["ms"], name="mean_sq", axes=[-1]),
                 m("Add", ["ms", "epsilon"], ["ve"], name="eps"),
                 m("Sqrt", ["ve"], ["rms"], name="sqrt"),
                 m("Div", [x, "rms"], ["n"], name="scale"),
                 m("Mul", ["n", "g"], [out], name="gamma")]
        inits.append(c("two", np.float32(2.0)))
    return nodes, inits, [n.name for n in nodes]


@pytest.mark.parametrize("form", ["tf", "keras", "rms"])
def test_normalizations_written_in_other_forms_stay_float(tmp_path, form):
    rng = np.random.default_rng(0)
    norm, inits, names = _normalization(form, "res", "ln")
    nodes = [helper.make_node("MatMul", ["x", "w1"], ["h"], name="mm1"),
             helper.make_node("Add", ["h", "x"], ["res"], name="residual"),
             *norm,
             helper.make_node("MatMul", ["ln", "w2"], ["y"], name="mm2")]
    m = graphs.model(nodes, [graphs.tensor("x", ["N", S, D])], [graphs.tensor("y", None)],
                     [_weight(rng, "w1", D, D), _weight(rng, "w2", D, D), *inits])
    assert float_blocks(GraphIndex(m)).counts == {"normalization": 1, "residual Add": 1}
    plan = build_plan(m, STATIC)
    assert set(names) | {"residual"} <= _float(plan)
    assert {"mm1", "mm2"} <= set(plan.quantized_nodes)
    inner = {o for n in norm for o in n.output} - {"ln"}
    assert not inner & set(plan.activations) and "ln" in plan.activations
    _, sqnr = _quantize(tmp_path, m)
    assert sqnr > 25


def test_a_mean_that_scales_without_a_square_root_is_no_normalization():
    """x * mean(x) (a pooled gate) and x / sum(x) have no square root of a statistic: not normalizations."""
    c, m = graphs.init, helper.make_node
    nodes = [m("MatMul", ["x", "w1"], ["h"], name="mm1"),
             m("ReduceMean", ["h"], ["mu"], name="pool", axes=[-1]),
             m("Sigmoid", ["mu"], ["gate"], name="gate"),
             m("Mul", ["h", "gate"], ["hg"], name="apply"),
             m("ReduceSum", ["hg", "axes"], ["s"], name="sum"),
             m("Add", ["s", "eps"], ["se"], name="eps"),
             m("Div", ["hg", "se"], ["ln"], name="share"),
             m("MatMul", ["ln", "w2"], ["y"], name="mm2")]
    rng = np.random.default_rng(0)
    model = graphs.model(nodes, [graphs.tensor("x", ["N", S, D])], [graphs.tensor("y", None)],
                         [_weight(rng, "w1", D, D), _weight(rng, "w2", D, D), c("eps", np.float32(1e-3)),
                          c("axes", np.array([-1], np.int64))])
    assert float_blocks(GraphIndex(model)).counts == {}


def test_a_broken_chain_is_not_a_layer_norm():
    m = _ln_model(np.random.default_rng(0))
    pow_node = next(n for n in m.graph.node if n.op_type == "Pow")
    pow_node.input[1] = "epsilon"  # d ** 1e-5 is no variance
    assert "LayerNorm chain" not in float_blocks(GraphIndex(m)).counts


@pytest.mark.parametrize("form, nodes", [("erf", ["g_scale", "g_erf", "g_plus1", "g_mul", "g_half"]),
                                         ("tanh", ["g_cube", "g_coeff", "g_inner", "g_scale", "g_tanh",
                                                   "g_plus1", "g_halfx", "g_mul"]),
                                         ("tanh_jax", ["g_coeff", "g_square", "g_cube", "g_inner", "g_scale",
                                                       "g_tanh", "g_plus1", "g_half", "g_mul"]),
                                         ("tanh_factored", ["g_square", "g_coeff", "g_factor", "g_inner",
                                                            "g_scale", "g_tanh", "g_plus1", "g_mul", "g_half"])])
def test_gelu_chain_stays_float_between_int8_matmuls(tmp_path, form, nodes):
    m = _gelu_model(np.random.default_rng(0), form)
    assert float_blocks(GraphIndex(m)).counts == {"GELU": 1}
    plan = build_plan(m, STATIC)
    assert set(nodes) <= _float(plan)
    assert {"mm1", "mm2"} <= set(plan.quantized_nodes)
    assert "g" in plan.activations  # the GELU output is quantized where mm2 reads it
    _, sqnr = _quantize(tmp_path, m)
    assert sqnr > 25


def _erf_gelu(form: str) -> list[onnx.NodeProto]:
    """h -> g in the three orders exporters write: x / sqrt 2 ... (x * (1 + erf)) * 0.5, the same
    with x * (1 / sqrt 2), and (0.5 * x) * (1 + erf)."""
    scale = helper.make_node("Div", ["h", "sqrt2"], ["hs"], name="g_scale") if form != "mul" \
        else helper.make_node("Mul", ["h", "rsqrt2"], ["hs"], name="g_scale")
    head = [scale, helper.make_node("Erf", ["hs"], ["e"], name="g_erf"),
            helper.make_node("Add", ["e", "one"], ["e1"], name="g_plus1")]
    if form == "half_first":
        return head + [helper.make_node("Mul", ["h", "half"], ["hh"], name="g_halfx"),
                       helper.make_node("Mul", ["hh", "e1"], ["g"], name="g_mul")]
    return head + [helper.make_node("Mul", ["h", "e1"], ["he"], name="g_mul"),
                   helper.make_node("Mul", ["he", "half"], ["g"], name="g_half")]


@pytest.mark.parametrize("shared", [True, False], ids=["after_a_dequantize", "after_a_float_int8_matmul"])
@pytest.mark.parametrize("form", ["div", "mul", "half_first"])
def test_a_float_erf_gelu_after_a_dequantize_runs_as_onnxruntime_gelu(tmp_path, form, shared):
    """`shared`: mm3 reads h too, so mm1 writes int8 codes and the GELU reads a DequantizeLinear; else
    mm1, read by float ops only, writes float (MatMulIntegerToFloat). onnxruntime fuses neither chain."""
    rng = np.random.default_rng(0)
    c = graphs.init
    nodes = [helper.make_node("MatMul", ["x", "w1"], ["h"], name="mm1"), *_erf_gelu(form),
             helper.make_node("MatMul", ["g", "w2"], ["y"], name="mm2")]
    nodes += [helper.make_node("MatMul", ["h", "w3"], ["y3"], name="mm3")] if shared else []
    outputs = [graphs.tensor("y", None)] + ([graphs.tensor("y3", None)] if shared else [])
    m = graphs.model(nodes, [graphs.tensor("x", ["N", S, D])], outputs,
                     [_weight(rng, "w1", D, D), _weight(rng, "w2", D, D), _weight(rng, "w3", D, D), c("one", np.float32(1.0)),
                      c("half", np.float32(0.5)), c("sqrt2", np.float32(np.sqrt(2.0))),
                      c("rsqrt2", np.float32(np.sqrt(0.5)))])
    assert fused_gelus(onnx.ModelProto.FromString(m.SerializeToString())) == 0  # fp32: x is no DequantizeLinear
    path = tmp_path / "m.onnx"
    onnx.save(m, path)
    data = graphs.write_samples(tmp_path / "data", np.random.default_rng(1), (S, D), count=16)
    table = calibrate(path, data, PreprocessConfig(), CalibrationConfig(batch_size=8), STATIC, progress=False)
    graph = quantize_model(path, table, STATIC)
    onnx.checker.check_model(graph.model, full_check=True)
    gelus = [n for n in graph.model.graph.node if n.op_type == "Gelu"]
    assert len(gelus) == 1 and gelus[0].domain == "com.microsoft" and GELU_NOTE.format(1) in graph.notes
    assert not any(n.op_type == "Erf" for n in graph.model.graph.node)
    assert any(n.op_type == "Erf" for n in graph.canonical.graph.node)  # the table's tensors: the written-out chain
    options = ort.SessionOptions()
    options.optimized_model_filepath = str(tmp_path / "optimized.onnx")
    session = ort.InferenceSession(graph.model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    assert not any(n.op_type == "Erf" for n in onnx.load(tmp_path / "optimized.onnx").graph.node)
    x = np.concatenate([np.load(f) for f in sorted(data.iterdir())])
    canonical = ort.InferenceSession(graph.canonical.SerializeToString(), providers=["CPUExecutionProvider"])
    got, ref = session.run(None, {"x": x})[0], canonical.run(None, {"x": x})[0]
    # the same values up to float32 rounding, which can move a code of the GELU's int8 output
    assert np.count_nonzero(np.abs(got - ref) > 1e-6) < 0.05 * got.size
    assert np.abs(got - ref).max() < 0.02 * np.abs(ref).max()


def test_an_erf_gelu_whose_inner_tensor_is_read_elsewhere_stays_written_out():
    m = graphs.model([helper.make_node("DequantizeLinear", ["q", "s"], ["h"], name="dq"), *_erf_gelu("div"),
                      helper.make_node("Relu", ["hs"], ["r"], name="other_reader")],
                     [graphs.tensor("q", ["N", S, D], onnx.TensorProto.UINT8)],
                     [graphs.tensor("g", None), graphs.tensor("r", None)],
                     [graphs.init("s", np.float32(0.1)), graphs.init("one", np.float32(1.0)),
                      graphs.init("half", np.float32(0.5)), graphs.init("sqrt2", np.float32(np.sqrt(2.0)))])
    assert float_blocks(GraphIndex(m)).counts == {"GELU": 1}
    assert fused_gelus(m) == 0  # x / sqrt 2 is read by the Relu too
    assert sum(n.op_type == "Erf" for n in m.graph.node) == 1
    m.graph.node.pop()  # without the other reader it is a Gelu
    m.graph.output.pop()
    assert fused_gelus(m) == 1 and [n.op_type for n in m.graph.node] == ["DequantizeLinear", "Gelu"]


@pytest.mark.parametrize("mask", ["constant", "bert", "where"])
def test_mask_never_gets_an_int8_range(tmp_path, mask):
    m = _attention_model(np.random.default_rng(0), mask)
    plan = build_plan(m, STATIC)
    assert {"qk", "scale", "softmax"} <= _float(plan)
    assert {"q", "k", "v", "pv"} <= set(plan.quantized_nodes)
    assert not {"s", "ss", "sm", "bias"} & set(plan.activations)
    qmodel, sqnr = _quantize(tmp_path, m)
    widths = _quantize_scales(qmodel)
    assert "p" in widths and max(widths.values()) < 1e3  # no range reaches -1e4
    assert sqnr > 20


def test_mask_tensors_are_never_quantized_even_without_attention():
    """A mask added to an activation that no Softmax follows: the rule still keeps its range out."""
    c = graphs.init
    nodes = [helper.make_node("Add", ["x", "mask"], ["xm"], name="mask_add"),
             helper.make_node("Relu", ["xm"], ["r"], name="relu"),
             helper.make_node("MatMul", ["r", "w"], ["y"], name="mm")]
    mask = np.zeros((S, D), np.float32)
    mask[0] = -1e9
    m = graphs.model(nodes, [graphs.tensor("x", ["N", S, D])], [graphs.tensor("y", None)],
                     [c("mask", mask), _weight(np.random.default_rng(0), "w", D, D)])
    plan = build_plan(m, STATIC)
    assert "xm" not in plan.activations and "r" not in plan.activations and "mask" not in plan.constants
    assert {"mask_add", "relu"} <= _float(plan)


def test_magnitude_sqrt_of_squares_stays_float(tmp_path):
    """sqrt(a^2 + b^2 + eps) between two int8 MatMuls: the squares get no range."""
    c = graphs.init
    nodes = [helper.make_node("MatMul", ["x", "wa"], ["a"], name="re"),
             helper.make_node("MatMul", ["x", "wb"], ["b"], name="im"),
             helper.make_node("Pow", ["a", "two"], ["a2"], name="pow_a"),
             helper.make_node("Pow", ["b", "two"], ["b2"], name="pow_b"),
             helper.make_node("Add", ["a2", "b2"], ["s"], name="sum"),
             helper.make_node("Add", ["s", "eps"], ["se"], name="eps"),
             helper.make_node("Sqrt", ["se"], ["mag"], name="sqrt"),
             helper.make_node("MatMul", ["mag", "wo"], ["y"], name="out")]
    rng = np.random.default_rng(0)
    m = graphs.model(nodes, [graphs.tensor("x", ["N", S, D])], [graphs.tensor("y", None)],
                     [_weight(rng, "wa", D, D), _weight(rng, "wb", D, D), _weight(rng, "wo", D, D),
                      c("two", np.float32(2.0)), c("eps", np.float32(1e-6))])
    assert float_blocks(GraphIndex(m)).counts == {"magnitude": 1}
    plan = build_plan(m, STATIC)
    assert {"pow_a", "pow_b", "sum", "eps", "sqrt"} <= _float(plan)
    assert not {"a2", "b2", "s", "se"} & set(plan.activations) and "mag" in plan.activations
    _, sqnr = _quantize(tmp_path, m)
    assert sqnr > 25
    m.graph.node[2].input[1] = "eps"  # a ** 1e-6 is no square: no magnitude
    assert "magnitude" not in float_blocks(GraphIndex(m)).counts


def _log_mel_model(rng, frames: int = 8, bins: int = 17, mels: int = 6) -> onnx.ModelProto:
    """audio [N, 1, T] -> an STFT as two Convs (cos and sin windows) -> Transpose -> power ->
    mel MatMul -> Clip 1e-10 -> Log -> dB (* 10 / ln 10) -> a floor 80 dB below the maximum
    (ReduceMax, Sub 80, Cast, Clip's bound) -> y, as an audio front end exported from PyTorch writes it."""
    c, m = graphs.init, helper.make_node
    n = 2 * (bins - 1)
    t = np.arange(n)
    window = np.hanning(n)
    cos = (np.cos(2 * np.pi * np.outer(np.arange(bins), t) / n) * window)[:, None, :].astype(np.float32)
    sin = (-np.sin(2 * np.pi * np.outer(np.arange(bins), t) / n) * window)[:, None, :].astype(np.float32)
    mel = np.abs(rng.normal(0, 1, (bins, mels))).astype(np.float32)
    nodes = [m("Conv", ["x", "cos"], ["re"], name="stft_re", strides=[n // 2]),
             m("Conv", ["x", "sin"], ["im"], name="stft_im", strides=[n // 2]),
             m("Transpose", ["re"], ["re_t"], name="re_t", perm=[0, 2, 1]),
             m("Transpose", ["im"], ["im_t"], name="im_t", perm=[0, 2, 1]),
             m("Pow", ["re_t", "two"], ["re2"], name="re2"),
             m("Pow", ["im_t", "two"], ["im2"], name="im2"),
             m("Add", ["re2", "im2"], ["power"], name="power"),
             m("MatMul", ["power", "mel"], ["mels"], name="mel"),
             m("Clip", ["mels", "tiny", "huge"], ["clipped"], name="floor"),
             m("Log", ["clipped"], ["ln"], name="log"),
             m("Mul", ["ln", "ten"], ["ln10"], name="db_mul"),
             m("Div", ["ln10", "ln_ten"], ["db"], name="db_div"),
             m("ReduceMax", ["db"], ["top"], name="top", keepdims=0),
             m("Sub", ["top", "range"], ["low"], name="low"),
             m("Cast", ["low"], ["low_f"], name="low_cast", to=TensorProto.FLOAT),
             m("Clip", ["db", "low_f"], ["y"], name="top_db")]
    inits = [c("cos", cos), c("sin", sin), c("mel", mel), c("two", np.float32(2)), c("tiny", np.float32(1e-10)),
             c("huge", np.float32(1e10)), c("ten", np.float32(10)), c("ln_ten", np.float32(np.log(10))),
             c("range", np.float32(80))]
    return graphs.model(nodes, [graphs.tensor("x", ["N", 1, n // 2 * (frames + 1)])], [graphs.tensor("y", None)],
                        inits)


def test_a_log_spectrum_stays_float_with_its_transform(tmp_path):
    """The power spectrum spans twice the decades of the audio and the Log reads it relative to its
    size: the STFT Convs, the squares, the mel MatMul and the Log stay float (int8 steps of the loudest
    bin put the quiet ones tens of dB off), and the dB floor computed for the Clip's bound is float
    with them: the model stays float, as given."""
    m = _log_mel_model(np.random.default_rng(0))
    assert float_blocks(GraphIndex(m)).counts == {"log spectrum": 1}
    plan = build_plan(m, STATIC)
    assert {"stft_re", "stft_im", "re2", "im2", "power", "mel", "floor", "log", "db_mul", "db_div", "low"} \
        <= _float(plan)
    assert not plan.activations and not plan.quantized_nodes
    m.graph.node[4].input[1] = "ten"  # re ** 10 is no power: no block, the Convs go int8
    assert "log spectrum" not in float_blocks(GraphIndex(m)).counts
    assert {"stft_re", "stft_im"} <= set(build_plan(m, STATIC).quantized_nodes)


def _constant_q_model(rng, bins: int = 12, taps: int = 32, hop: int = 16, frames: int = 16) -> onnx.ModelProto:
    """audio [1, 1, T] -> two octaves (the second on the audio averaged down by 2), each a bank of
    complex filters as one Conv (real and imaginary halves) -> Slice apart (the imaginary half negated)
    -> squares -> Add -> Sqrt -> a constant scale (magnitude) (a Shape reads one) -> Concat of the octaves -> square (power) -> Add eps -> Log -> dB -> a CNN (Conv,
    Relu, Conv) on the log spectrum, as a constant-Q front end exported from TensorFlow writes it."""
    c, m = graphs.init, helper.make_node
    nodes, inits, octaves = [], [c("two", np.float32(2)), c("eps", np.float32(1e-8)), c("norm", np.float32(0.25)),
                                 c("ten", np.float32(10 / np.log(10)))], []
    for o in range(2):  # the second octave: half the taps and the hop on audio at half the rate
        t = np.arange(taps >> o)
        freqs = 0.05 * 2 ** (np.arange(bins) / bins)
        window = np.hanning(taps >> o)
        bank = np.concatenate([np.cos(2 * np.pi * np.outer(freqs, t)) * window,
                               np.sin(2 * np.pi * np.outer(freqs, t)) * window])[:, None, :].astype(np.float32)
        source = "x"
        if o:
            nodes.append(m("AveragePool", ["x"], ["x_half"], name="downsample", kernel_shape=[2], strides=[2]))
            source = "x_half"
        inits += [c(f"bank{o}", bank), c(f"lo{o}", np.array([0], np.int64)), c(f"mid{o}", np.array([bins], np.int64)),
                  c(f"hi{o}", np.array([2 * bins], np.int64)), c(f"ax{o}", np.array([1], np.int64))]
        nodes += [m("Conv", [source, f"bank{o}"], [f"cq{o}"], name=f"cqt{o}", strides=[hop // (o + 1)]),
                  m("Slice", [f"cq{o}", f"lo{o}", f"mid{o}", f"ax{o}"], [f"re{o}"], name=f"re{o}"),
                  m("Slice", [f"cq{o}", f"mid{o}", f"hi{o}", f"ax{o}"], [f"im{o}"], name=f"im{o}"),
                  m("Pow", [f"re{o}", "two"], [f"re2_{o}"], name=f"re2_{o}"),
                  m("Neg", [f"im{o}"], [f"conj{o}"], name=f"conj{o}"),
                  m("Mul", [f"conj{o}", f"conj{o}"], [f"im2_{o}"], name=f"im2_{o}"),
                  m("Add", [f"re2_{o}", f"im2_{o}"], [f"pw{o}"], name=f"pw{o}"),
                  m("Sqrt", [f"pw{o}"], [f"root{o}"], name=f"root{o}"),
                  m("Mul", [f"root{o}", "norm"], [f"mag{o}"], name=f"mag{o}")]
        octaves.append(f"mag{o}")
    w1 = rng.normal(0, 0.3, (8, 1, 3, 3)).astype(np.float32)
    w2 = rng.normal(0, 0.3, (4, 8, 3, 3)).astype(np.float32)
    inits += [c("w1", w1), c("w2", w2), c("b1", np.zeros(8, np.float32)), c("b2", np.zeros(4, np.float32)),
              c("chan", np.array([1], np.int64))]
    nodes += [m("Concat", octaves, ["cqt"], name="octaves", axis=1),
              m("Shape", ["mag0"], ["mag_shape"], name="mag_shape"),  # reads no values
              m("Pow", ["cqt", "two"], ["power"], name="power"),
              m("Add", ["power", "eps"], ["power_eps"], name="floor"),
              m("Log", ["power_eps"], ["ln"], name="log"),
              m("Mul", ["ln", "ten"], ["db"], name="db"),
              m("Unsqueeze", ["db", "chan"], ["image"], name="image"),
              m("Conv", ["image", "w1", "b1"], ["h1"], name="cnn1", pads=[1, 1, 1, 1]),
              m("Relu", ["h1"], ["r1"], name="relu1"),
              m("Conv", ["r1", "w2", "b2"], ["y"], name="cnn2", pads=[1, 1, 1, 1])]
    return graphs.model(nodes, [graphs.tensor("x", [1, 1, hop * frames + taps])], [graphs.tensor("y", None)], inits)


def test_a_constant_q_log_spectrum_stays_float_through_its_magnitudes_and_octaves():
    """The power of a magnitude: the walk from the Log passes the square, the octaves' Concat, each
    octave's sqrt(re^2 + im^2) and the Slices of one complex Conv back to the filter banks, which stay
    float with it; the CNN reading the log spectrum goes int8."""
    m = _constant_q_model(np.random.default_rng(0))
    assert float_blocks(GraphIndex(m)).counts == {"log spectrum": 1}
    plan = build_plan(m, STATIC)
    assert {"cqt0", "cqt1", "re0", "im1", "conj0", "re2_0", "im2_1", "pw0", "root1", "mag1", "octaves", "power",
            "log", "db"} \
        <= _float(plan)
    assert {"cnn1", "cnn2"} <= set(plan.quantized_nodes)
    m.graph.node[-1].input[0] = "cq0"  # the bank's output read elsewhere too: not the front end's alone
    m.graph.output[0].CopyFrom(graphs.tensor("y", None))
    assert "cqt0" not in _float(build_plan(m, STATIC))


def test_cnn_without_transformer_blocks_matches_nothing():
    m = graphs.conv_model(np.random.default_rng(0), activation="Relu", pool="MaxPool")
    assert float_blocks(GraphIndex(m)).counts == {}


@pytest.mark.parametrize("name, found", [
    # PP-OCRv4 recognizer, SVTR neck (Paddle export): 5 decomposed LayerNorms, 2 attention heads' score
    # paths (an opset-12 Softmax the version converter turns into Shape/Flatten/Softmax/Reshape), 4 residuals
    ("rapidocr_v4_rec.onnx", {"LayerNorm chain": 5, "attention scores": 2, "residual Add": 4}),
    # BERT (classic exporter): LayerNormalization ops, Erf GELU, (1 - mask) * float32 min, 6 layers
    ("minilm_l6_v2_sentence.onnx", {"GELU": 6, "attention scores": 6, "mask": 1, "residual Add": 13}),
    ("silero_vad_16k_op15.onnx", {"magnitude": 1}),  # its STFT front end: sqrt(re^2 + im^2)
    ("efficientnet_lite0_dyn.onnx", {}),
    ("nudenet_yolov8n_320.onnx", {}),  # its DFL Softmax follows a Conv, not an attention MatMul
])
def test_kit_transformer_blocks_are_recognised(name, found):
    from qtool.plan.planner import prepared_model
    from tests.conftest import kit_path

    model, plan = prepared_model(kit_path("models", name), STATIC)
    assert float_blocks(GraphIndex(model)).counts == found
    if name == "minilm_l6_v2_sentence.onnx":  # no range anywhere near float32 min
        masked = float_blocks(GraphIndex(model)).tensors
        assert masked and not masked & set(plan.activations)


def _bert_mask_attention(rng) -> onnx.ModelProto:
    """Single-head attention whose additive mask is BERT's (1 - m) * -10000 on a mask input m:
    the constant is exactly -1e4, the value at which the mask rule begins (MASK_LIMIT)."""
    c = graphs.init
    nodes = [helper.make_node("MatMul", ["x", "wq"], ["q"], name="q"),
             helper.make_node("MatMul", ["x", "wk"], ["k"], name="k"),
             helper.make_node("MatMul", ["x", "wv"], ["v"], name="v"),
             helper.make_node("Transpose", ["k"], ["kt"], name="kt", perm=[0, 2, 1]),
             helper.make_node("MatMul", ["q", "kt"], ["s"], name="qk"),
             helper.make_node("Mul", ["s", "scale"], ["ss"], name="scale"),
             helper.make_node("Sub", ["one", "m"], ["inv"], name="inv"),
             helper.make_node("Mul", ["inv", "minus"], ["bias"], name="mask_mul"),
             helper.make_node("Add", ["ss", "bias"], ["sm"], name="mask_add"),
             helper.make_node("Softmax", ["sm"], ["p"], name="softmax", axis=-1),
             helper.make_node("MatMul", ["p", "v"], ["y"], name="pv")]
    inits = [_weight(rng, n, D, D) for n in ("wq", "wk", "wv")] + [
        c("scale", np.float32(D ** -0.5)), c("one", np.float32(1.0)), c("minus", np.float32(-10000.0))]
    return graphs.model(nodes, [graphs.tensor("x", ["N", S, D]), graphs.tensor("m", ["N", 1, S])],
                        [graphs.tensor("y", None)], inits)


def test_bert_mask_of_exactly_minus_ten_thousand_is_a_mask(tmp_path):
    """(1 - m) * -10000: the Mul writing the mask is kept float by the mask rule alone (the
    attention-scores rule covers MatMul -> Softmax, not the mask's own nodes), and no int8 range
    of the quantized model reaches the mask's -1e4."""
    rng = np.random.default_rng(0)
    m = _bert_mask_attention(rng)
    plan = build_plan(m, STATIC)
    assert not {"bias", "sm"} & set(plan.activations) and "mask_mul" in _float(plan)
    assert float_blocks(GraphIndex(m)).counts.get("mask") == 1
    assert {"q", "k", "v", "pv"} <= set(plan.quantized_nodes)
    keep = np.ones((1, 1, S), np.float32)
    keep[..., -2:] = 0  # the last two key positions masked out
    samples = [{"x": rng.normal(0, 1, (1, S, D)).astype(np.float32), "m": keep} for _ in range(16)]
    path = tmp_path / "m.onnx"
    onnx.save(m, path)
    table = calibrate(path, samples, PreprocessConfig(), CalibrationConfig(batch_size=8, method="minmax"), STATIC,
                      progress=False)
    qmodel = quantize_model(path, table, STATIC).model
    widths = _quantize_scales(qmodel)
    assert "p" in widths and max(widths.values()) < 1e3  # no range holds -1e4
    feeds = {"x": np.concatenate([s["x"] for s in samples]), "m": np.repeat(keep, len(samples), axis=0)}
    ref = ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feeds)[0]
    got = ort.InferenceSession(qmodel.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feeds)[0]
    ref, got = ref.astype(np.float64), got.astype(np.float64)
    assert sqnr_db(float(np.sum(ref ** 2)), float(np.sum((ref - got) ** 2))) > 20
