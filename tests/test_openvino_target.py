"""--target openvino: Q/DQ only where OpenVINO's int8 layers read (Target.activation_placement
"inputs_of_int8_ops"), a Concat feeding one quantized on its inputs with one scale, nothing on a
layer's output or between the ops OpenVINO fuses into it, static int8 weight MatMuls with the
transformer blocks float, no onnxruntime rewrite; the model runs in onnxruntime and in OpenVINO."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import helper, numpy_helper

import qtool
from qtool.evaluation.metrics import sample_cosines
from qtool.targets import TARGETS
from tests import graphs
from tests.conftest import openvino_weights
from tests.test_transformer_blocks import _attention_model, _gelu_model, _ln_model

# nothing measured: no OpenVINO needed to quantize; toy layers, which the speed rule would keep float
CONFIG = {"calibration": {"method": "minmax"},
          "quantization": {"target": "openvino", "bias_correction": "off", **openvino_weights(),
                           "advanced": {"head_tails": "off", **graphs.RULE_OFF}}}
RULE_ON = {"calibration": {"method": "minmax"},
           "quantization": {"target": "openvino", "bias_correction": "off", **openvino_weights(), "advanced": {"head_tails": "off"}}}
LAYERS = ("Conv", "ConvTranspose", "Gemm", "MatMul")


def _quantize(tmp_path, built: onnx.ModelProto, shape, config=CONFIG):
    path = tmp_path / "m.onnx"
    onnx.save(built, path)
    data = graphs.write_samples(tmp_path / "data", np.random.default_rng(1), shape, count=8)
    result = qtool.quantize(str(path), data=str(data), config=config, progress=False)
    onnx.checker.check_model(result.model, full_check=True)
    return path, data, result


def _quantized_tensors(model: onnx.ModelProto) -> set[str]:
    """The float tensors a QuantizeLinear reads (activations; weights are stored int8)."""
    return {n.input[0] for n in model.graph.node if n.op_type == "QuantizeLinear"}


def _readers_of_dequantized(model: onnx.ModelProto) -> dict[str, set[str]]:
    """Activation DequantizeLinear outputs -> the op types reading them."""
    inits = {t.name for t in model.graph.initializer}
    readers: dict[str, set[str]] = {}
    activation_dq = {n.output[0] for n in model.graph.node if n.op_type == "DequantizeLinear" and n.input[0] not in inits}
    for node in model.graph.node:
        for name in node.input:
            if name in activation_dq:
                readers.setdefault(name, set()).add(node.op_type)
    return readers


def _params(model: onnx.ModelProto, tensor: str) -> tuple[float, int]:
    inits = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}
    q = next(n for n in model.graph.node if n.op_type == "QuantizeLinear" and n.input[0] == tensor)
    return float(inits[q.input[1]]), int(inits[q.input[2]])


def _activation_types(model: onnx.ModelProto) -> dict[str, type]:
    inits = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}
    return {n.input[0]: inits[n.input[2]].dtype.type for n in model.graph.node if n.op_type == "QuantizeLinear"}


def _range_of(path, data, tensor: str) -> tuple[float, float]:
    """The fp32 model's min and max of `tensor` over the samples in `data`."""
    from qtool.graph.edit import with_outputs

    session = ort.InferenceSession(with_outputs(onnx.load(path), [tensor]).SerializeToString())
    values = [session.run([tensor], {session.get_inputs()[0].name: np.load(f)})[0] for f in sorted(data.iterdir())]
    return float(min(v.min() for v in values)), float(max(v.max() for v in values))


def _movers_model(rng, activation: str = "Relu") -> onnx.ModelProto:
    """x -> Conv -> Relu (r) -> Split (a, b); b -> MaxPool (same size) -> m; Concat(a, m, Resize
    nearest of a 2x-pooled r) -> Conv -> y: every input the last Conv reads only moves r's values."""
    def w(*shape):
        return rng.normal(0, 0.3, shape).astype(np.float32)
    nodes = [helper.make_node("Conv", ["x", "w1"], ["c"], name="conv1", pads=[1, 1, 1, 1]),
             helper.make_node(activation, ["c"], ["r"], name="relu"),
             helper.make_node("Split", ["r"], ["a", "b"], name="split", axis=1, num_outputs=2),
             helper.make_node("MaxPool", ["b"], ["m"], name="pool", kernel_shape=[3, 3], pads=[1, 1, 1, 1]),
             helper.make_node("AveragePool", ["r"], ["half"], name="down", kernel_shape=[2, 2], strides=[2, 2]),
             helper.make_node("Resize", ["half", "", "scales"], ["up"], name="up", mode="nearest"),
             helper.make_node("Concat", ["a", "m", "up"], ["cat"], name="concat", axis=1),
             helper.make_node("Conv", ["cat", "w2"], ["y"], name="conv2")]
    inits = [graphs.init("w1", w(8, 3, 3, 3)), graphs.init("w2", w(4, 16, 1, 1)),
             graphs.init("scales", np.array([1, 1, 2, 2], np.float32))]
    return graphs.model(nodes, [graphs.tensor("x", ["N", 3, 8, 8])], [graphs.tensor("y", None)], inits, opset=18)


def test_quantizers_go_above_ops_that_only_move_values(tmp_path):
    path, data, result = _quantize(tmp_path, _movers_model(np.random.default_rng(0)), (3, 8, 8))
    model = result.model
    # the Split's and MaxPool's inputs are r: one quantizer there, on conv1's Relu, which OpenVINO
    # fuses into the Conv; the Resize's input is the AveragePool's output, tied to r
    assert _quantized_tensors(model) == {"x", "r", "half"}
    assert _params(model, "r") == _params(model, "half")
    assert min(_cosines(path, model, data)) > 0.999


def test_signed_codes_through_ops_that_move_them_are_written_uint8(tmp_path):
    """The int8 grid written uint8 with zero point 128 where signed codes pass a Split or a pooling
    (OpenVINO computes int8 codes through a Split wrongly on CPUs without AMX: the YOLO test below),
    with the same values as int8 with zero point 0; the Resize's input, tied to them, goes with them."""
    path, data, result = _quantize(tmp_path, _movers_model(np.random.default_rng(0), "LeakyRelu"), (3, 8, 8))
    model = result.model
    assert _quantized_tensors(model) == {"x", "r", "half"} and _range_of(path, data, "r")[0] < 0
    types = _activation_types(model)
    assert types["r"] == types["half"] == np.uint8 and _params(model, "r")[1] == 128
    assert types["x"] == np.int8  # only conv1 reads it
    assert min(_cosines(path, model, data)) > 0.999


def test_signed_codes_a_resize_passes_to_a_layer_stay_int8(tmp_path):
    """x -> Conv -> LeakyRelu (r) -> nearest Resize -> Conv: the quantizer goes above the Resize, and
    its signed codes stay int8 with zero point 0 (OpenVINO computes codes through a Resize right
    without AMX, and a zero point would slow the reading Convolution on AMX)."""
    rng = np.random.default_rng(0)
    nodes = [helper.make_node("Conv", ["x", "w1"], ["c"], name="conv1", pads=[1, 1, 1, 1]),
             helper.make_node("LeakyRelu", ["c"], ["r"], name="leaky"),
             helper.make_node("Resize", ["r", "", "scales"], ["up"], name="up", mode="nearest"),
             helper.make_node("Conv", ["up", "w2"], ["y"], name="conv2")]
    inits = [graphs.init("w1", rng.normal(0, 0.3, (8, 3, 3, 3)).astype(np.float32)),
             graphs.init("w2", rng.normal(0, 0.3, (4, 8, 1, 1)).astype(np.float32)),
             graphs.init("scales", np.array([1, 1, 2, 2], np.float32))]
    built = graphs.model(nodes, [graphs.tensor("x", ["N", 3, 8, 8])], [graphs.tensor("y", None)], inits, opset=18)
    path, data, result = _quantize(tmp_path, built, (3, 8, 8))
    assert _quantized_tensors(result.model) == {"x", "r"} and _range_of(path, data, "r")[0] < 0
    assert _activation_types(result.model)["r"] == np.int8 and _params(result.model, "r")[1] == 0
    assert min(_cosines(path, result.model, data)) > 0.999


def _cosines(path, model: onnx.ModelProto, data) -> list[float]:
    feeds = [{"x": np.load(f)} for f in sorted(data.iterdir())]
    fp32 = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    int8 = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    found = []
    for f in feeds:
        for a, b in zip(fp32.run(None, f), int8.run(None, f)):
            a, b = a.ravel().astype(np.float64), b.ravel().astype(np.float64)
            found.append(float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b))))
    return found


def test_the_openvino_target_is_data():
    target = TARGETS["openvino"]
    assert target.activation_placement == "inputs_of_int8_ops"
    assert not target.dynamic_matmul and not target.int8_embeddings and not target.kernels
    assert target.prepare_passes == ("residual_gate",)  # OpenVINO's form, none of onnxruntime's
    assert not (target.finish_passes or target.form_passes)
    assert target.per_channel


def test_qdq_only_on_the_inputs_of_int8_layers(tmp_path):
    path, data, result = _quantize(tmp_path, graphs.fused_block_model(np.random.default_rng(0)), (3, 12, 12))
    model = result.model
    # the inputs of conv1 (x), of dwconv and conv2 (a1), the Concat's inputs (r6, r2: one scale
    # shared, so the Concat copies codes) and the Gemm's and MatMul's, above the Flatten that only
    # reshapes it (gap); nothing on a layer's output, the SiLU, the residual Add, Clip, Relu,
    # HardSwish or the Mul by a constant
    assert _quantized_tensors(model) == {"x", "a1", "r6", "r2", "gap"}
    assert _params(model, "r6") == _params(model, "r2")
    # symmetric: uint8 with zero point 0 where the range has no negative value (after Clip and Relu:
    # every code on the values taken), and int8 where only layers and residual Adds read them (x:
    # conv1; a1: the depthwise Conv and the residual Add; gap, below); signed codes through a Split
    # or pooling: test_signed_codes_through_ops_that_move_them_are_written_uint8
    types = _activation_types(model)
    assert types["r6"] == types["r2"] == np.uint8 and _params(model, "r6")[1] == 0
    assert types["x"] == np.int8 and _params(model, "x")[1] == 0 and min(np.load(f).min() for f in data.iterdir()) < 0
    assert types["a1"] == np.int8 and _params(model, "a1")[1] == 0 and _range_of(path, data, "a1")[0] < 0
    # gap, which only the Gemm and the MatMul read (through the Flatten), is symmetric int8 like the
    # rest: OpenVINO fuses a FullyConnected's dequantization only without a zero point
    assert types["gap"] == np.int8 and _params(model, "gap")[1] == 0 and _range_of(path, data, "gap")[0] < 0
    for readers in _readers_of_dequantized(model).values():
        # a1 is also the residual Add's other input: it reads the codes the depthwise Conv reads;
        # the Flatten only reshapes the Gemm's and MatMul's input
        assert readers <= {"Conv", "Gemm", "MatMul", "Concat", "Add", "Flatten"}
    # weights int8 symmetric per output channel (the depthwise Conv's too)
    inits = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}
    weights = [n for n in model.graph.node if n.op_type == "DequantizeLinear" and n.input[0] in inits
               and inits[n.input[0]].dtype == np.int8]
    assert len(weights) == 6
    for dq in weights:
        scale, zero = inits[dq.input[1]], inits[dq.input[2]]
        assert scale.ndim == 1 and scale.size > 1 and not zero.any()
    # no onnxruntime form: standard domain only, no extra op
    assert all(n.domain in ("", "ai.onnx") for n in model.graph.node)
    assert {n.op_type for n in model.graph.node} - {"QuantizeLinear", "DequantizeLinear"} == \
        {n.op_type for n in onnx.load(path).graph.node}
    assert min(_cosines(path, model, data)) > 0.999


@pytest.mark.parametrize("build", [lambda rng: _attention_model(rng, "bert"), lambda rng: _gelu_model(rng, "erf"),
                                   _ln_model], ids=["attention", "gelu", "layernorm"])
def test_transformer_weight_matmuls_static_int8_with_the_blocks_float(tmp_path, build):
    built = build(np.random.default_rng(0))
    path, data, result = _quantize(tmp_path, built, (6, 16))
    model = result.model
    ops = {n.op_type for n in model.graph.node}
    assert not ops & {"DynamicQuantizeLinear", "MatMulInteger"}  # never dynamic
    nodes = {n.name: n for n in built.graph.node}
    weights = {t.name for t in built.graph.initializer}
    expected = {nodes[n].input[0] for n in nodes if nodes[n].op_type == "MatMul" and nodes[n].input[1] in weights}
    assert _quantized_tensors(model) == expected  # the MatMuls of two activations and every block float
    assert min(_cosines(path, model, data)) > 0.99


def test_openvino_runs_the_layers_in_int8(tmp_path):
    ov = pytest.importorskip("openvino", reason="openvino is not installed (pip install \"qtool[openvino]\")")
    path, data, result = _quantize(tmp_path, graphs.fused_block_model(np.random.default_rng(0)), (3, 12, 12))
    written = tmp_path / "int8.onnx"
    onnx.save(result.model, written)
    core = ov.Core()
    compiled = core.compile_model(str(written), "CPU", {"INFERENCE_NUM_THREADS": 1})
    ops = [(o.get_rt_info()["layerType"].astype(str), o.get_rt_info()["runtimePrecision"].astype(str))
           for o in compiled.get_runtime_model().get_ordered_ops()]
    layers = [p for t, p in ops if t in ("Convolution", "FullyConnected", "MatMul")]
    assert len(layers) == 6 and all(p in ("u8", "i8") for p in layers)
    # the only FakeQuantize left as an op of its own: the graph's input and the pooled vector,
    # which no layer writes
    assert sum(t == "FakeQuantize" for t, _ in ops) <= 2
    reference = core.compile_model(str(path), "CPU", {"INFERENCE_NUM_THREADS": 1, "INFERENCE_PRECISION_HINT": "f32"})
    for f in sorted(data.iterdir()):
        x = np.load(f)
        for a, b in zip(reference({"x": x}).values(), compiled({"x": x}).values()):
            a, b = a.ravel().astype(np.float64), b.ravel().astype(np.float64)
            assert a @ b / (np.linalg.norm(a) * np.linalg.norm(b)) > 0.999


def _residual_layer_norm_model(rng, outlier: float = 40.0) -> onnx.ModelProto:
    """x -> LayerNormalization (gamma `outlier` on channel 0: an outlier channel) -> ln; ln -> MatMul -> h;
    y = ln + h: the residual stream reads ln too, so SmoothQuant cannot fold into the LayerNorm."""
    d = 16
    gamma = np.ones(d, np.float32)
    gamma[0] = outlier
    nodes = [helper.make_node("LayerNormalization", ["x", "gamma", "beta"], ["ln"], name="ln", axis=-1),
             helper.make_node("MatMul", ["ln", "w"], ["h"], name="mm"),
             helper.make_node("Add", ["ln", "h"], ["y"], name="residual")]
    inits = [graphs.init("gamma", gamma), graphs.init("beta", np.zeros(d, np.float32)),
             graphs.init("w", rng.normal(0, 0.3, (d, d)).astype(np.float32))]
    return graphs.model(nodes, [graphs.tensor("x", ["N", 6, d])], [graphs.tensor("y", None)], inits, opset=17)


@pytest.mark.parametrize("outlier", [40.0, 2.0])
def test_smoothquant_by_default_in_a_transformer_through_an_inserted_mul(tmp_path, outlier):
    """The inserted Mul folds into OpenVINO's quantizer after it, so it is inserted with or without
    an outlier channel (onnxruntime's dynamic MatMuls get it only past OUTLIER_RATIO)."""
    built = _residual_layer_norm_model(np.random.default_rng(0), outlier)
    path, data, result = _quantize(tmp_path, built, (6, 16))
    model = result.model
    assert any("SmoothQuant (alpha 0.8)" in note for note in result.notes)
    producer = {o: n for n in model.graph.node for o in n.output}
    matmul = next(n for n in model.graph.node if n.op_type == "MatMul")
    dq = producer[matmul.input[0]]
    quantized = producer[producer[dq.input[0]].input[0]]  # DQ <- Q <- the tensor the MatMul reads
    assert quantized.op_type == "Mul" and "ln" in quantized.input  # ln / s, read by the MatMul only
    residual = next(n for n in model.graph.node if n.name == "residual")
    assert "ln" in residual.input  # the residual stream keeps ln as it is
    assert min(_cosines(path, model, data)) > 0.99


@pytest.mark.slow
def test_a_yolo_detector_fuses_every_quantizer_on_openvino(tmp_path):
    """nudenet's YOLOv8n: every Conv in int8 on OpenVINO, no FakeQuantize left but the input's and
    the DFL Softmax's (NNCF's model leaves the same two), and the same fidelity on OpenVINO as on
    onnxruntime (an ort-cpu model's head Concat pairs are computed differently by OpenVINO; on a CPU
    without AMX, so are int8 codes through its C2f blocks' Split and residual Add: Target.signed_as_uint8)."""
    ov = pytest.importorskip("openvino", reason="openvino is not installed (pip install \"qtool[openvino]\")")
    from tests.conftest import kit_path, kit_samples

    model = kit_path("models", "nudenet_yolov8n_320.onnx")
    samples = kit_samples("nudenet_yolov8n_320", 24, tmp_path / "calib")
    held = [dict(np.load(p)) for p in sorted(kit_path("inputs", "nudenet_yolov8n_320", "calib").glob("*.npz"))[-6:]]
    result = qtool.quantize(str(model), data=str(tmp_path / "calib"), config=CONFIG, progress=False)
    assert len(samples) == 24
    written = tmp_path / "int8.onnx"
    onnx.save(result.model, written)
    core = ov.Core()
    compiled = _compile(core, written)
    kinds = [(o.get_rt_info()["layerType"].astype(str), o.get_rt_info()["runtimePrecision"].astype(str))
             for o in compiled.get_runtime_model().get_ordered_ops()]
    convs = [p for t, p in kinds if t == "Convolution"]
    assert len(convs) == 64 and all(p in ("u8", "i8") for p in convs)
    assert sum(t == "FakeQuantize" for t, _ in kinds) == 2
    reference = _compile(core, model, f32=True)
    session = ort.InferenceSession(str(written), providers=["CPUExecutionProvider"])
    on_ov = _cosines_to(reference, lambda feeds: next(iter(compiled(feeds).values())), held)
    on_ort = _cosines_to(reference, lambda feeds: session.run(None, feeds)[0], held)
    assert np.mean(on_ov) > 0.995 and abs(np.mean(on_ov) - np.mean(on_ort)) < 0.001
    # the same on a CPU without AMX: there int8 codes through the C2f blocks' Split and Concat are
    # computed wrongly (0.992 written so)
    assert _cosine_without_amx(model, written, held, tmp_path) > 0.995


def test_residual_add_codes_stay_int8_and_are_computed_right_without_amx(tmp_path):
    """The PP-OCR text-line classifier (MobileNetV3 blocks, every layer int8): codes that residual
    Adds read are int8 with zero point 0 (a Convolution reading them with zero point 128 takes 1.6-3.6
    times as long on AMX), and OpenVINO computes them as right without AMX as with it."""
    ov = pytest.importorskip("openvino", reason="openvino is not installed (pip install \"qtool[openvino]\")")
    from tests.conftest import kit_path, kit_samples

    model = kit_path("models", "rapidocr_cls_mobile_v2.onnx")
    kit_samples("rapidocr_cls_mobile_v2", 24, tmp_path / "calib")
    held = [dict(np.load(p)) for p in sorted(kit_path("inputs", "rapidocr_cls_mobile_v2", "calib").glob("*.npz"))[-8:]]
    result = qtool.quantize(str(model), data=str(tmp_path / "calib"), config=CONFIG, progress=False)
    written = tmp_path / "int8.onnx"
    onnx.save(result.model, written)
    types = _activation_types(result.model)
    by_add = {name for name, readers in _readers_of_quantized(result.model).items() if "Add" in readers}
    assert by_add and all(types[name] == np.int8 for name in by_add)
    assert all(t != np.uint8 or _params(result.model, name)[1] == 0 for name, t in types.items())
    core = ov.Core()
    compiled = _compile(core, written)
    with_amx = np.mean(_cosines_to(_compile(core, model, f32=True), lambda feeds: next(iter(compiled(feeds).values())),
                                   held))
    assert with_amx > 0.98 and abs(_cosine_without_amx(model, written, held, tmp_path) - with_amx) < 0.002


def _readers_of_quantized(model: onnx.ModelProto) -> dict[str, set[str]]:
    """Quantized activations -> the op types reading their dequantized values."""
    quantized = {n.output[0]: n.input[0] for n in model.graph.node if n.op_type == "QuantizeLinear"}
    source = {n.output[0]: quantized[n.input[0]] for n in model.graph.node
              if n.op_type == "DequantizeLinear" and n.input[0] in quantized}
    return {source[dq]: readers for dq, readers in _readers_of_dequantized(model).items() if dq in source}


def _cosine_without_amx(fp32, int8, held: list[dict], tmp_path) -> float:
    """_openvino_cosine on a CPU without AMX, as oneDNN runs when told to use AVX-512 VNNI at most (it
    reads that once per process: a process of its own)."""
    name = next(iter(held[0]))
    np.savez(tmp_path / "held.npz", *[feeds[name] for feeds in held])
    script = ("import sys\nfrom tests.test_openvino_target import _openvino_cosine\n"
              "print(_openvino_cosine(*sys.argv[1:]))\n")
    done = subprocess.run([sys.executable, "-c", script, str(fp32), str(int8), str(tmp_path / "held.npz"), name],
                          env=dict(os.environ, ONEDNN_MAX_CPU_ISA="AVX512_CORE_VNNI"), capture_output=True, text=True,
                          cwd=Path(__file__).resolve().parents[1], timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    return float(done.stdout.strip().splitlines()[-1])


def _compile(core, path, f32: bool = False):
    """`path` compiled for OpenVINO's CPU plugin on 1 thread, at f32 or at its default precision."""
    config = {"INFERENCE_NUM_THREADS": 1, **({"INFERENCE_PRECISION_HINT": "f32"} if f32 else {})}
    return core.compile_model(str(path), "CPU", config)


def _cosines_to(reference, run, held: list[dict]) -> list[float]:
    """Per sample of `held`, the cosine of `run(feeds)` (a first output) to `reference`'s first output."""
    return [float(sample_cosines(next(iter(reference(feeds).values())), np.asarray(run(feeds)))[0]) for feeds in held]


def _openvino_cosine(fp32, int8, held_npz, name: str) -> float:
    """The mean over the inputs `name` saved in `held_npz` of `int8`'s cosine on OpenVINO to `fp32`'s
    at f32 (run in a process whose oneDNN is capped: _cosine_without_amx)."""
    import openvino as ov

    core, held = ov.Core(), np.load(held_npz)
    compiled = _compile(core, int8)
    return float(np.mean(_cosines_to(_compile(core, fp32, f32=True), lambda feeds: next(iter(compiled(feeds).values())),
                                     [{name: held[key]} for key in held.files])))


def test_a_matmul_input_is_symmetric_so_openvino_fuses_its_dequantization(tmp_path):
    """x (mostly positive, some negative values) -> MatMul -> Softmax: the MatMul's input is int8
    with zero point 0, and OpenVINO runs the MatMul as one FullyConnected that takes the
    dequantization in (with a zero point its profile lists a plain FullyConnected and the
    dequantization's Subtract and Multiply as nodes of their own)."""
    rng = np.random.default_rng(0)
    nodes = [helper.make_node("MatMul", ["x", "w"], ["m"], name="fc"),
             helper.make_node("Softmax", ["m"], ["y"], axis=-1)]
    built = graphs.model(nodes, [graphs.tensor("x", [1, 19, 120])], [graphs.tensor("y", [1, 19, 256])],
                         [graphs.init("w", rng.normal(0, 0.2, (120, 256)).astype(np.float32))])
    path = tmp_path / "m.onnx"
    onnx.save(built, path)
    data = tmp_path / "data"
    data.mkdir()
    for i in range(8):
        np.save(data / f"s{i:03d}.npy", (rng.normal(0, 1, (1, 19, 120)) + 0.8).astype(np.float32))
    result = qtool.quantize(str(path), data=str(data), config=CONFIG, progress=False)
    assert _quantized_tensors(result.model) == {"x"} and min(np.load(f).min() for f in data.iterdir()) < 0
    assert _activation_types(result.model)["x"] == np.int8 and _params(result.model, "x")[1] == 0
    ov = pytest.importorskip("openvino", reason="openvino is not installed (pip install \"qtool[openvino]\")")
    written = tmp_path / "q.onnx"
    onnx.save(result.model, written)
    compiled = ov.Core().compile_model(str(written), "CPU", {"INFERENCE_NUM_THREADS": 1, "PERF_COUNT": True})
    request = compiled.create_infer_request()
    request.infer({"x": np.load(data / "s000.npy")})
    listed = [(p.node_name, p.node_type) for p in request.profiling_info]
    assert any(kind.startswith("FullyConnected") and "Dequantization" in name for name, kind in listed), listed
    assert not any(kind in ("Subtract", "Multiply") for _, kind in listed), listed


def test_a_ceil_mode_maxpool_keeps_its_quantizer_after_it(tmp_path):
    """x -> Conv -> Relu -> MaxPool(ceil_mode 1) -> Conv -> y: OpenVINO computes a ceil-mode MaxPool
    of a quantized tensor wrongly in a CRNN from a wheel (cosine 0.56 against 0.9993 with the
    quantizer after the MaxPool; docs/targets.md; this small net does not show the fault itself),
    so the quantizer stays on the MaxPool's output, where the second Conv reads it."""
    rng = np.random.default_rng(0)
    nodes = [helper.make_node("Conv", ["x", "w1"], ["c"], name="conv1", pads=[1, 1, 1, 1], strides=[2, 2]),
             helper.make_node("Relu", ["c"], ["r"], name="relu"),
             helper.make_node("MaxPool", ["r"], ["m"], name="pool", kernel_shape=[3, 3], strides=[2, 2], ceil_mode=1),
             helper.make_node("Conv", ["m", "w2"], ["y"], name="conv2")]
    inits = [graphs.init("w1", rng.normal(0, 0.3, (16, 3, 3, 3)).astype(np.float32)),
             graphs.init("w2", rng.normal(0, 0.3, (8, 16, 1, 1)).astype(np.float32))]
    built = graphs.model(nodes, [graphs.tensor("x", ["N", 3, 30, 80])], [graphs.tensor("y", None)], inits)
    path, data, result = _quantize(tmp_path, built, (3, 30, 80))
    assert _quantized_tensors(result.model) == {"x", "m"}
    assert min(_cosines(path, result.model, data)) > 0.999


def _convs_then_gemm(rng, small_out: int, big_out: int, size: int = 48, head: bool = True,
                     second_big: bool = False) -> onnx.ModelProto:
    """x -> a 1x1 Conv 8 -> small_out -> Relu -> a 3x3 Conv -> big_out [-> another] -> GlobalAveragePool
    -> Flatten [-> a Gemm to 4 classes]."""
    inits = [graphs.init("ws", rng.normal(0, 0.3, (small_out, 8, 1, 1)).astype(np.float32)),
             graphs.init("wb", rng.normal(0, 0.3, (big_out, small_out, 3, 3)).astype(np.float32)),
             graphs.init("wb2", rng.normal(0, 0.1, (big_out, big_out, 3, 3)).astype(np.float32)),
             graphs.init("wg", rng.normal(0, 0.3, (4, big_out)).astype(np.float32))]
    nodes = [helper.make_node("Conv", ["x", "ws"], ["s"], name="small"),
             helper.make_node("Relu", ["s"], ["r"], name="relu"),
             helper.make_node("Conv", ["r", "wb"], ["b"], name="big", pads=[1, 1, 1, 1]),
             helper.make_node("GlobalAveragePool", ["b"], ["p"], name="pool"),
             helper.make_node("Flatten", ["p"], ["f"], name="flat"),
             helper.make_node("Gemm", ["f", "wg"], ["y"], name="head", transB=1)]
    if not head:
        nodes[-1] = helper.make_node("Softsign", ["f"], ["y"], name="out")
    if second_big:
        nodes[2].output[0] = "b1"
        nodes.insert(3, helper.make_node("Conv", ["b1", "wb2"], ["b"], name="big2", pads=[1, 1, 1, 1]))
    return graphs.model(nodes, [graphs.tensor("x", ["N", 8, size, size])],
                        [graphs.tensor("y", ["N", 4 if head else big_out])], inits)


def _float_weights(model: onnx.ModelProto) -> set[str]:
    """Labels of the weighted nodes that read a float initializer as their weight."""
    inits = {t.name: t for t in model.graph.initializer}
    return {n.name for n in model.graph.node if n.op_type in LAYERS and n.input[1] in inits
            and inits[n.input[1]].data_type == onnx.TensorProto.FLOAT}


def test_the_openvino_speed_rule_keeps_small_convolutions_float(tmp_path):
    # small: 8 x 8 x 48 x 48 = 147k MACs, under 2^18; big: 32 x 72 x 48 x 48 = 5.3M; the Gemm's 128
    # MACs stay int8 (OpenVINO's int8 FullyConnected gained at most sizes measured)
    path, data, result = _quantize(tmp_path, _convs_then_gemm(np.random.default_rng(0), 8, 32), (8, 48, 48),
                                   config=RULE_ON)
    decision = next(d for d in result.decisions if d.option == "quantization.advanced.float_nodes")
    assert decision.value == ("small",) and "OpenVINO" in decision.rule
    assert _float_weights(result.model) == {"small"}
    assert "x" not in _quantized_tensors(result.model) and "r" in _quantized_tensors(result.model)
    assert result.settled.quantization.advanced.float_nodes == ("small",)


def test_in_a_network_of_small_convolutions_the_openvino_speed_rule_floats_the_middling_ones_too(tmp_path):
    # small: 147k MACs; "big" 8 x 72 x 48 x 48 = 1.3M, over 2^18 but under 2^22, where an int8 convolution
    # gains a few percent at most: in a network whose convolutions are half small it goes float with them
    path, data, result = _quantize(tmp_path, _convs_then_gemm(np.random.default_rng(0), 8, 8), (8, 48, 48),
                                   config=RULE_ON)
    decision = next(d for d in result.decisions if d.option == "quantization.advanced.float_nodes")
    assert decision.value == ("small", "big") and "1 larger ones" in decision.details[0]
    assert _float_weights(result.model) == {"small", "big"}


def test_the_openvino_speed_rule_leaves_an_int8_model(tmp_path):
    # both convolutions under 2^18 MACs at 12 x 12 and no other weighted layer: the larger Conv stays int8
    built = _convs_then_gemm(np.random.default_rng(0), 8, 8, size=12, head=False)
    path, data, result = _quantize(tmp_path, built, (8, 12, 12), config=RULE_ON)
    decision = next(d for d in result.decisions if d.option == "quantization.advanced.float_nodes")
    assert decision.value == ("small",)
    assert _float_weights(result.model) == {"small"}


def test_the_openvino_speed_rule_leaves_a_few_small_convolutions_among_large_ones_int8(tmp_path):
    # one small convolution of three: floated alone among int8 layers it gains nothing whole-model
    built = _convs_then_gemm(np.random.default_rng(0), 8, 32, second_big=True)
    path, data, result = _quantize(tmp_path, built, (8, 48, 48), config=RULE_ON)
    decision = next(d for d in result.decisions if d.option == "quantization.advanced.float_nodes")
    assert decision.value == ()
    assert _float_weights(result.model) == set()


def _se_block(rng, dims, residual: bool = False) -> onnx.ModelProto:
    """x -> Conv (c) -> [GlobalAveragePool -> Conv -> Relu -> Conv -> Sigmoid (g); Mul(c, g) -> y]:
    a squeeze-and-excitation block, the pooling and the Mul both reading the Conv's output.
    `residual`: y = c + Mul(c, g), a gated residual (PP-OCR's detector neck)."""
    inits = [graphs.init("w1", rng.normal(0, 0.3, (16, 8, 3, 3)).astype(np.float32)),
             graphs.init("w2", rng.normal(0, 0.3, (4, 16, 1, 1)).astype(np.float32)),
             graphs.init("b2", rng.normal(0, 0.3, 4).astype(np.float32)),
             graphs.init("w3", rng.normal(0, 0.3, (16, 4, 1, 1)).astype(np.float32)),
             graphs.init("b3", rng.normal(0, 0.3, 16).astype(np.float32))]
    nodes = [helper.make_node("Conv", ["x", "w1"], ["c"], name="conv", pads=[1, 1, 1, 1]),
             helper.make_node("GlobalAveragePool", ["c"], ["p"], name="pool"),
             helper.make_node("Conv", ["p", "w2", "b2"], ["s"], name="squeeze"),
             helper.make_node("Relu", ["s"], ["r"], name="relu"),
             helper.make_node("Conv", ["r", "w3", "b3"], ["e"], name="excite"),
             helper.make_node("Sigmoid", ["e"], ["g"], name="gate"),
             helper.make_node("Mul", ["c", "g"], ["m" if residual else "y"], name="scale")]
    if residual:
        nodes.append(helper.make_node("Add", ["c", "m"], ["y"], name="residual"))
    return graphs.model(nodes, [graphs.tensor("x", dims)], [graphs.tensor("y", None)], inits)


def test_a_gated_residual_is_written_with_one_reader_of_its_input(tmp_path):
    """x + x * g written x * (1 + g) (qtool.prepare.residual_gate): the same values, and where x is a
    quantized layer output only the pooling and one Mul read it, so OpenVINO fuses its
    dequantization into the Mul instead of a pass of its own."""
    from qtool.prepare.residual_gate import gated_residuals

    built = _se_block(np.random.default_rng(0), ["N", 8, "H", "W"], residual=True)
    copy = onnx.ModelProto()
    copy.CopyFrom(built)
    assert gated_residuals(copy) == 1 and {n.op_type for n in copy.graph.node} == \
        {"Conv", "GlobalAveragePool", "Relu", "Sigmoid", "Add", "Mul"}
    x = np.random.default_rng(1).normal(0, 1, (2, 8, 12, 12)).astype(np.float32)
    before = ort.InferenceSession(built.SerializeToString()).run(None, {"x": x})[0]
    after = ort.InferenceSession(copy.SerializeToString()).run(None, {"x": x})[0]
    np.testing.assert_allclose(after, before, rtol=1e-5, atol=1e-5)
    # a product that something else reads too stays
    shared = onnx.ModelProto()
    shared.CopyFrom(built)
    shared.graph.output.append(graphs.tensor("m", None))
    assert gated_residuals(shared) == 0

    path, data, result = _quantize(tmp_path, built, (8, 12, 12))
    model = result.model
    assert _readers_of_quantized(model)["c"] == {"GlobalAveragePool", "Mul"}
    assert min(_cosines(path, model, data)) > 0.999
    ov = pytest.importorskip("openvino", reason="openvino is not installed (pip install \"qtool[openvino]\")")
    compiled = ov.Core().compile_model(ov.Core().read_model(model.SerializeToString(), b""), "CPU")
    names = [o.get_rt_info()["originalLayersNames"].astype(str).split(",")
             for o in compiled.get_runtime_model().get_ordered_ops()]
    assert not any(all(n.endswith("_DequantizeLinear") for n in layer) for layer in names)  # no pass of its own


def test_a_layer_output_read_by_a_pooling_and_another_op_gets_its_own_quantizer(tmp_path):
    """With a dynamic dimension OpenVINO moves the Conv's dequantization through the pooling and still
    applies it on the Conv for the Mul: the pooling's branch sees it twice (docs/targets.md). A
    quantizer on the Conv's output, which both read, makes OpenVINO compute what onnxruntime does;
    with every dimension fixed the fault does not occur and the output stays unquantized."""
    rng = np.random.default_rng(0)
    fixed = tmp_path / "fixed"
    fixed.mkdir()
    _, _, static = _quantize(fixed, _se_block(rng, [1, 8, 12, 12]), (8, 12, 12))
    assert "c" not in _quantized_tensors(static.model)
    path, data, result = _quantize(tmp_path, _se_block(np.random.default_rng(0), ["N", 8, "H", "W"]), (8, 12, 12))
    assert {"x", "c"} <= _quantized_tensors(result.model)
    # only float ops read it, dequantized at once: int8 with zero point 0 (no Subtract), as the
    # Conv's signed input, which only the Conv reads
    assert _params(result.model, "c")[1] == 0 and _activation_types(result.model)["c"] is np.int8
    assert _params(result.model, "x")[1] == 0 and _activation_types(result.model)["x"] is np.int8
    ov = pytest.importorskip("openvino", reason="openvino is not installed (pip install \"qtool[openvino]\")")
    compiled = ov.Core().compile_model(ov.Core().read_model(result.model.SerializeToString(), b""), "CPU",
                                       {"INFERENCE_PRECISION_HINT": "f32"})
    session = ort.InferenceSession(result.model.SerializeToString(), providers=["CPUExecutionProvider"])
    for f in sorted(data.iterdir()):
        x = np.load(f)
        a = session.run(None, {"x": x})[0].ravel().astype(np.float64)
        b = np.asarray(compiled({"x": x})[0]).ravel().astype(np.float64)
        assert float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b))) > 0.9999
