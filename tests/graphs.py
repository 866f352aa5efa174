"""Small real ONNX graphs built with onnx.helper, and calibration data for them."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

OPSET = 17
# A test of quantization mechanics on a graph this small sets the speed rule off (qtool.choices.speed):
# at a few thousand MACs per layer it would rightly keep most of the graph float.
RULE_OFF = {"speed_rule": "off"}


def mechanics(options=None):
    """`options` (a QuantizeConfig; default the plain one) with the speed rule off."""
    from qtool.config import QuantizeConfig, with_options

    return with_options(options if options is not None else QuantizeConfig(), **RULE_OFF)


def mechanics_yaml(folder: Path, extra: str = "") -> Path:
    """A config file for the CLI with the speed rule off (and `extra` YAML under quantization:)."""
    path = folder / "rule_off.yaml"
    path.write_text(f"quantization:\n  advanced:\n    speed_rule: 'off'\n{extra}")
    return path


def model(nodes, inputs, outputs, initializers=(), opset=OPSET) -> onnx.ModelProto:
    graph = helper.make_graph(nodes, "test", inputs, outputs, list(initializers))
    m = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    m.ir_version = 8
    return checked(m)


def checked(m: onnx.ModelProto) -> onnx.ModelProto:
    """`m` with its outputs declared without a shape given the inferred one (the checker wants a
    shape), checked in full."""
    done = onnx.shape_inference.infer_shapes(m).graph
    inferred = {v.name: v for v in list(done.value_info) + list(done.output)}
    for out in m.graph.output:
        if not out.type.tensor_type.HasField("shape") and out.name in inferred:
            out.CopyFrom(inferred[out.name])
    onnx.checker.check_model(m, full_check=True)
    return m


def tensor(name, shape, elem=TensorProto.FLOAT):
    return helper.make_tensor_value_info(name, elem, shape)


def init(name, array) -> onnx.TensorProto:
    return numpy_helper.from_array(np.asarray(array), name)


def conv_model(rng, c_in=8, c_out=16, group=1, activation=None, pool=None, size=12) -> onnx.ModelProto:
    """x -> Conv(+bias) [-> Relu/Clip] [-> MaxPool/AveragePool/GlobalAveragePool] -> y"""
    w = rng.normal(0, 0.3, (c_out, c_in // group, 3, 3)).astype(np.float32)
    b = rng.normal(0, 0.1, c_out).astype(np.float32)
    nodes = [helper.make_node("Conv", ["x", "w", "b"], ["conv"], name="conv", pads=[1, 1, 1, 1], group=group)]
    inits = [init("w", w), init("b", b)]
    last = "conv"
    if activation == "Relu":
        nodes.append(helper.make_node("Relu", [last], ["act"], name="relu"))
        last = "act"
    elif activation == "Clip":
        inits += [init("lo", np.float32(0)), init("hi", np.float32(6))]
        nodes.append(helper.make_node("Clip", [last, "lo", "hi"], ["act"], name="clip"))
        last = "act"
    if pool == "MaxPool":
        nodes.append(helper.make_node("MaxPool", [last], ["pool"], name="pool", kernel_shape=[2, 2], strides=[2, 2]))
        last = "pool"
    elif pool == "AveragePool":
        nodes.append(helper.make_node("AveragePool", [last], ["pool"], name="pool", kernel_shape=[2, 2],
                                      strides=[2, 2]))
        last = "pool"
    elif pool == "GlobalAveragePool":
        nodes.append(helper.make_node("GlobalAveragePool", [last], ["pool"], name="pool"))
        last = "pool"
    # a final float op (no int8 rule) keeps `last` an internal tensor that an int8 op writes for a
    # float one, so its Q/DQ is visible
    nodes.append(helper.make_node("Softsign", [last], ["y"], name="out"))
    return model(nodes, [tensor("x", ["N", c_in, size, size])], [tensor("y", None)], inits)


def gemm_model(rng, k=32, n=10, trans_b=1) -> onnx.ModelProto:
    w = rng.normal(0, 0.2, (n, k) if trans_b else (k, n)).astype(np.float32)
    b = rng.normal(0, 0.1, n).astype(np.float32)
    nodes = [helper.make_node("Gemm", ["x", "w", "b"], ["y"], name="gemm", transB=trans_b)]
    return model(nodes, [tensor("x", ["N", k])], [tensor("y", ["N", n])], [init("w", w), init("b", b)])


def matmul_model(rng, k=32, n=24) -> onnx.ModelProto:
    w = rng.normal(0, 0.2, (k, n)).astype(np.float32)
    nodes = [helper.make_node("MatMul", ["x", "w"], ["mm"], name="matmul"),
             helper.make_node("Relu", ["mm"], ["y"], name="relu")]
    return model(nodes, [tensor("x", ["N", 5, k])], [tensor("y", None)], [init("w", w)])


def add_model(rng, c=8) -> onnx.ModelProto:
    """Two convs whose outputs are added: an Add of two activations, then Relu."""
    w1 = rng.normal(0, 0.3, (c, c, 1, 1)).astype(np.float32)
    w2 = rng.normal(0, 0.3, (c, c, 1, 1)).astype(np.float32)
    nodes = [helper.make_node("Conv", ["x", "w1"], ["a"], name="conv_a"),
             helper.make_node("Conv", ["x", "w2"], ["b"], name="conv_b"),
             helper.make_node("Add", ["a", "b"], ["s"], name="add"),
             helper.make_node("Relu", ["s"], ["r"], name="relu"),
             helper.make_node("Sigmoid", ["r"], ["y"], name="out")]
    return model(nodes, [tensor("x", ["N", c, 6, 6])], [tensor("y", None)], [init("w1", w1), init("w2", w2)])


def crushed_conv_pair(rng, tail: list, output: str = "y") -> onnx.ModelProto:
    """x -> conv_a -> relu (r) -> conv_b (b) -> `tail` nodes -> `output`, where conv_b's per-tensor
    weight scale is crushed: relu zeroes channel 0, and conv_b's one large weight on that channel
    adds nothing to the output but sets the scale of every other weight."""
    wa = rng.normal(0, 0.3, (6, 3, 3, 3)).astype(np.float32)
    wb = rng.normal(0, 0.3, (6, 6, 1, 1)).astype(np.float32)
    ba = np.zeros(6, np.float32)
    ba[0] = -100.0  # relu zeroes channel 0 ...
    wb[0, 0, 0, 0] = 40.0  # ... so this outlier adds nothing, but sets conv_b's per-tensor weight scale
    nodes = [helper.make_node("Conv", ["x", "wa", "ba"], ["a"], name="conv_a", pads=[1, 1, 1, 1]),
             helper.make_node("Relu", ["a"], ["r"], name="relu"),
             helper.make_node("Conv", ["r", "wb"], ["b"], name="conv_b"), *tail]
    return model(nodes, [tensor("x", ["N", 3, 8, 8])], [tensor(output, None)],
                 [init("wa", wa), init("ba", ba), init("wb", wb)])


def write_samples(folder: Path, rng, shape, count=16, name="x", scale=1.0) -> Path:
    """One .npy file per sample (batch dimension 1)."""
    folder.mkdir(parents=True, exist_ok=True)
    for i in range(count):
        np.save(folder / f"s{i:03d}.npy", (rng.normal(0, scale, (1, *shape))).astype(np.float32))
    return folder


def calibrated(folder: Path, rng, built: onnx.ModelProto, options, shape=(3, 8, 8), count=8):
    """`built` saved in `folder`, 8 random samples of `shape` beside it and its calibration table
    under `options`: (model path, table)."""
    from qtool.calibration.calibrate import calibrate
    from qtool.config import CalibrationConfig, PreprocessConfig

    path = folder / "m.onnx"
    onnx.save(built, path)
    data = write_samples(folder / "data", rng, shape, count=count)
    return path, calibrate(path, data, PreprocessConfig(), CalibrationConfig(), options, progress=False)


def fused_block_model(rng, c=8, size=12) -> onnx.ModelProto:
    """A small net with the patterns a runtime fuses into its layers: x -> Conv -> SiLU (Sigmoid,
    Mul) -> depthwise Conv -> Add residual -> Clip -> Concat with a Conv branch (after Relu) ->
    Conv -> HardSwish -> GlobalAveragePool -> Flatten -> Gemm -> Mul by a constant -> y, and a
    MatMul by a weight on the Flatten -> z."""
    def w(*shape):
        return rng.normal(0, 0.3, shape).astype(np.float32)
    inits = [init("w1", w(c, 3, 3, 3)), init("b1", w(c)), init("wd", w(c, 1, 3, 3)), init("bd", w(c)),
             init("w2", w(c, c, 1, 1)), init("w3", w(c, 2 * c, 1, 1)), init("b3", w(c)),
             init("lo", np.float32(0)), init("hi", np.float32(6)), init("wg", w(5, c)), init("bg", w(5)),
             init("k", np.float32(0.5)), init("wm", w(c, 4))]
    nodes = [helper.make_node("Conv", ["x", "w1", "b1"], ["c1"], name="conv1", pads=[1, 1, 1, 1]),
             helper.make_node("Sigmoid", ["c1"], ["s1"], name="sig1"),
             helper.make_node("Mul", ["c1", "s1"], ["a1"], name="silu1"),
             helper.make_node("Conv", ["a1", "wd", "bd"], ["dw"], name="dwconv", pads=[1, 1, 1, 1], group=c),
             helper.make_node("Add", ["dw", "a1"], ["res"], name="residual"),
             helper.make_node("Clip", ["res", "lo", "hi"], ["r6"], name="clip"),
             helper.make_node("Conv", ["a1", "w2"], ["c2"], name="conv2"),
             helper.make_node("Relu", ["c2"], ["r2"], name="relu2"),
             helper.make_node("Concat", ["r6", "r2"], ["cat"], name="concat", axis=1),
             helper.make_node("Conv", ["cat", "w3", "b3"], ["c3"], name="conv3"),
             helper.make_node("HardSwish", ["c3"], ["h3"], name="hswish"),
             helper.make_node("GlobalAveragePool", ["h3"], ["gap"], name="gap"),
             helper.make_node("Flatten", ["gap"], ["flat"], name="flatten"),
             helper.make_node("Gemm", ["flat", "wg", "bg"], ["g"], name="gemm", transB=1),
             helper.make_node("Mul", ["g", "k"], ["y"], name="scale"),
             helper.make_node("MatMul", ["flat", "wm"], ["z"], name="matmul")]
    return model(nodes, [tensor("x", ["N", 3, size, size])], [tensor("y", None), tensor("z", None)], inits)
