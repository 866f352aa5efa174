"""Single ops where onnxruntime's CPU kernels leave the common path: float against int8 as qtool writes it.

    python benchmarks/kernel_quirks.py [--runs 300]

Each case is one small ONNX graph in two forms: float, and with the op between QuantizeLinear /
DequantizeLinear pairs (int8 weights per output channel, uint8 activations), so that onnxruntime
fuses what it can into its integer kernel. Batch 1, 1 thread, the two sessions taking turns run by
run (qtool.graph.runtime.time_models); medians. The cases are onnxruntime behaviours qtool.plan.speed
models without its least-squares fit over the kit models (which have none of them), and one it does
not model:

- a Conv with one input and one output channel (a Conv1D resampling filter written as Conv2D),
  which onnxruntime's QLinearConv runs on its depthwise kernel;
- PRelu, which has no integer kernel;
- a MaxPool whose QuantizeLinear onnxruntime moves above it, on a float producer;
- a MaxPool after an integer Conv and a hard-swish (in its integer form: an Add of a constant whose
  QuantizeLinear clips, and a Mul) or a SiLU, as the graph's output or read by another Conv: onnxruntime
  runs an NhwcMaxPool only where it carries the Conv's NHWC layout on to another integer Conv;
- Mul by a one-value constant of rank 1 over a tensor whose last axis is 1, and the same constant
  written as [1, 1, 1, 1];
- Convs with few channels per kernel tap (8 channels, a 3 x 39 kernel) and others, for comparison, and
  the same kernels at several sizes (output pixels x taps: the integer kernel's pointers).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from qtool.graph.runtime import time_models  # noqa: E402


def _graph(nodes, x_shape, inits, opset=13):
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, x_shape)],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    model.ir_version = 7
    return model


def _qdq(name, scale, zero=128):
    """QuantizeLinear + DequantizeLinear of `name`, and their constants."""
    inits = [numpy_helper.from_array(np.array(scale, np.float32), f"{name}_s"),
             numpy_helper.from_array(np.array(zero, np.uint8), f"{name}_z")]
    nodes = [helper.make_node("QuantizeLinear", [name, f"{name}_s", f"{name}_z"], [f"{name}_q"]),
             helper.make_node("DequantizeLinear", [f"{name}_q", f"{name}_s", f"{name}_z"], [f"{name}_dq"])]
    return nodes, inits, f"{name}_dq"


def _weights(w, quantized):
    """(nodes, initializers) giving the tensor "w": float, or int8 codes per output channel behind a
    DequantizeLinear, as qtool writes them."""
    if not quantized:
        return [], [numpy_helper.from_array(w, "w")]
    scales = np.abs(w).reshape(w.shape[0], -1).max(axis=1) / 127
    codes = np.round(w / scales.reshape((-1,) + (1,) * (w.ndim - 1))).astype(np.int8)
    inits = [numpy_helper.from_array(codes, "wq"), numpy_helper.from_array(scales.astype(np.float32), "ws"),
             numpy_helper.from_array(np.zeros(w.shape[0], np.int8), "wz")]
    return [helper.make_node("DequantizeLinear", ["wq", "ws", "wz"], ["w"], axis=0)], inits


def conv(c_in, c_out, kernel, size, strides, quantized):
    rng = np.random.default_rng(0)
    w = rng.normal(0, 0.1, (c_out, c_in, *kernel)).astype(np.float32)
    nodes, inits, x = _qdq("x", 0.02) if quantized else ([], [], "x")
    more, extra = _weights(w, quantized)
    nodes, inits = nodes + more, inits + extra
    nodes.append(helper.make_node("Conv", [x, "w"], ["c" if quantized else "y"], strides=list(strides)))
    if quantized:
        more, extra, out = _qdq("c", 0.05)
        nodes += more + [helper.make_node("Identity", [out], ["y"])]
        inits += extra
    return _graph(nodes, [1, c_in, *size], inits)


def prelu(shape, quantized):
    slope = numpy_helper.from_array(np.full((shape[1], 1, 1), 0.2, np.float32), "slope")
    nodes, inits, x = _qdq("x", 0.02) if quantized else ([], [], "x")
    nodes.append(helper.make_node("PRelu", [x, "slope"], ["p" if quantized else "y"]))
    if quantized:
        more, extra, out = _qdq("p", 0.02)
        nodes += more + [helper.make_node("Identity", [out], ["y"])]
        inits += extra
    return _graph(nodes, shape, inits + [slope])


def maxpool_after_float(shape, quantized):
    """Relu (float) -> MaxPool -> [QuantizeLinear -> DequantizeLinear]: onnxruntime moves the
    QuantizeLinear above the MaxPool, which then runs on uint8."""
    nodes = [helper.make_node("Relu", ["x"], ["r"]),
             helper.make_node("MaxPool", ["r"], ["m" if quantized else "y"], kernel_shape=[2, 2], strides=[2, 2])]
    inits = []
    if quantized:
        more, inits, out = _qdq("m", 0.02, 0)
        nodes += more + [helper.make_node("Identity", [out], ["y"])]
    return _graph(nodes, shape, inits)


def maxpool_after_activation(shape, activation, quantized, conv_after=False):
    """x -> Conv 1x1 -> hard-swish or SiLU -> MaxPool 2x2 -> y, float or with Q/DQ on every tensor as qtool
    writes it for onnxruntime (the hard-swish as Add(x, 3) whose QuantizeLinear clips to [0, 6], and a Mul
    whose second DequantizeLinear carries the 1/6)."""
    nodes, inits = [], []

    def pair(name, scale, zero=128):
        """`name` behind a Q/DQ pair where the graph is quantized: the name to read."""
        if not quantized:
            return name
        more, extra, out = _qdq(name, scale, zero)
        nodes.extend(more)
        inits.extend(extra)
        return out

    channels = shape[1]
    w = np.random.default_rng(0).normal(0, 0.1, (channels, channels, 1, 1)).astype(np.float32)
    x = pair("x", 0.02)
    more, extra = _weights(w, quantized)
    nodes += more
    inits += extra
    nodes.append(helper.make_node("Conv", [x, "w"], ["c"]))
    c = pair("c", 0.05)
    if activation == "silu":
        nodes.append(helper.make_node("Sigmoid", [c], ["s"]))
        nodes.append(helper.make_node("Mul", [c, pair("s", 1 / 255, 0)], ["a"]))
    elif not quantized:
        nodes.append(helper.make_node("HardSwish", [c], ["a"]))
    else:
        inits += [numpy_helper.from_array(np.array(3 / 0.05 + 128, np.uint8), "three_q"),
                  numpy_helper.from_array(np.array(0.05, np.float32), "three_s"),
                  numpy_helper.from_array(np.array(128, np.uint8), "three_z"),
                  numpy_helper.from_array(np.array(6 / 255, np.float32), "g_s"),
                  numpy_helper.from_array(np.array(0, np.uint8), "g_z"),
                  numpy_helper.from_array(np.array(1 / 255, np.float32), "g_s6")]
        nodes += [helper.make_node("DequantizeLinear", ["three_q", "three_s", "three_z"], ["three"]),
                  helper.make_node("Add", [c, "three"], ["p"]),
                  helper.make_node("QuantizeLinear", ["p", "g_s", "g_z"], ["g_q"]),
                  helper.make_node("DequantizeLinear", ["g_q", "g_s6", "g_z"], ["g"]),
                  helper.make_node("Mul", [c, "g"], ["a"])]
    nodes.append(helper.make_node("MaxPool", [pair("a", 0.05, 10)], ["m"], kernel_shape=[2, 2], strides=[2, 2]))
    m = pair("m", 0.05, 10)
    if conv_after:  # a second Conv reading the MaxPool, with the first one's weights
        nodes.append(helper.make_node("Conv", [m, "w"], ["d"]))
        m = pair("d", 0.05)
    nodes.append(helper.make_node("Identity", [m], ["y"]))
    return _graph(nodes, shape, inits, opset=14)


def scalar_mul(shape, constant_shape, quantized):
    nodes, inits, x = _qdq("x", 0.02) if quantized else ([], [], "x")
    if quantized:  # the constant as int8 codes behind a DequantizeLinear, as qtool writes it
        inits += [numpy_helper.from_array(np.full(constant_shape, 200, np.uint8), "cq"),
                  numpy_helper.from_array(np.array(0.0035, np.float32), "cs"),
                  numpy_helper.from_array(np.array(0, np.uint8), "cz")]
        nodes.append(helper.make_node("DequantizeLinear", ["cq", "cs", "cz"], ["c"]))
    else:
        inits.append(numpy_helper.from_array(np.full(constant_shape, 0.7, np.float32), "c"))
    nodes.append(helper.make_node("Mul", [x, "c"], ["m" if quantized else "y"]))
    if quantized:
        more, extra, out = _qdq("m", 0.02)
        nodes += more + [helper.make_node("Identity", [out], ["y"])]
        inits += extra
    return _graph(nodes, shape, inits)


CASES = [
    ("Conv 1 -> 1, 1 x 256 at stride 2, 44098 samples", lambda q: conv(1, 1, (1, 256), (1, 44098), (1, 2), q),
     [1, 1, 1, 44098]),
    ("Conv 1 -> 4, the same filter", lambda q: conv(1, 4, (1, 256), (1, 44098), (1, 2), q), [1, 1, 1, 44098]),
    ("PRelu, 28 x 22 x 22", lambda q: prelu([1, 28, 22, 22], q), [1, 28, 22, 22]),
    ("MaxPool 2x2 after a float Relu, 28 x 22 x 22", lambda q: maxpool_after_float([1, 28, 22, 22], q), [1, 28, 22, 22]),
    ("Conv 1x1, hard-swish, MaxPool 2x2, 200 x 2 x 96 (the graph's output)",
     lambda q: maxpool_after_activation([1, 200, 2, 96], "hardswish", q), [1, 200, 2, 96]),
    ("Conv 1x1, hard-swish, MaxPool 2x2, 200 x 2 x 96, Conv 1x1",
     lambda q: maxpool_after_activation([1, 200, 2, 96], "hardswish", q, conv_after=True), [1, 200, 2, 96]),
    ("Conv 1x1, SiLU, MaxPool 2x2, 64 x 40 x 40 (the graph's output)",
     lambda q: maxpool_after_activation([1, 64, 40, 40], "silu", q), [1, 64, 40, 40]),
    ("Conv 1x1, SiLU, MaxPool 2x2, 64 x 40 x 40, Conv 1x1",
     lambda q: maxpool_after_activation([1, 64, 40, 40], "silu", q, conv_after=True), [1, 64, 40, 40]),
    ("Mul by a [1] scalar over [1, 172, 264, 1]", lambda q: scalar_mul([1, 172, 264, 1], [1], q), [1, 172, 264, 1]),
    ("Mul by a [1, 1, 1, 1] scalar over [1, 172, 264, 1]", lambda q: scalar_mul([1, 172, 264, 1], [1, 1, 1, 1], q),
     [1, 172, 264, 1]),
    ("Conv 8 -> 8, 3 x 39, 172 x 302", lambda q: conv(8, 8, (3, 39), (172, 302), (1, 1), q), [1, 8, 172, 302]),
    ("Conv 8 -> 16, 3 x 39, 172 x 302", lambda q: conv(8, 16, (3, 39), (172, 302), (1, 1), q), [1, 8, 172, 302]),
    ("Conv 8 -> 32, 5 x 5 at stride (1, 3), 172 x 264", lambda q: conv(8, 32, (5, 5), (172, 264), (1, 3), q),
     [1, 8, 172, 264]),
    ("Conv 576 -> 1, 7 x 7, 22 x 22", lambda q: conv(576, 1, (7, 7), (22, 22), (1, 1), q), [1, 576, 22, 22]),
    ("Conv 32 -> 3, 3 x 3, 130 x 130", lambda q: conv(32, 3, (3, 3), (130, 130), (1, 1), q), [1, 32, 130, 130]),
    ("Conv 32 -> 32, 3 x 3, 86 x 88", lambda q: conv(32, 32, (3, 3), (86, 88), (1, 1), q), [1, 32, 86, 88]),
    # output pixels x taps (no padding here), the integer kernel's pointers, from 0.18 to 1.1 million
    ("Conv 8 -> 8, 3 x 39, 43 x 76 (0.18 M pointers)", lambda q: conv(8, 8, (3, 39), (43, 76), (1, 1), q),
     [1, 8, 43, 76]),
    ("Conv 8 -> 8, 3 x 39, 60 x 110 (0.49 M pointers)", lambda q: conv(8, 8, (3, 39), (60, 110), (1, 1), q),
     [1, 8, 60, 110]),
    ("Conv 8 -> 8, 3 x 39, 86 x 151 (1.1 M pointers)", lambda q: conv(8, 8, (3, 39), (86, 151), (1, 1), q),
     [1, 8, 86, 151]),
    ("Conv 33 -> 1, 3 x 3, 172 x 264 (0.40 M pointers)", lambda q: conv(33, 1, (3, 3), (172, 264), (1, 1), q),
     [1, 33, 172, 264]),
    ("Conv 32 -> 1, 7 x 3, 172 x 264 (0.91 M pointers)", lambda q: conv(32, 1, (7, 3), (172, 264), (1, 1), q),
     [1, 32, 172, 264]),
    ("Conv 1 -> 32, 7 x 7 at stride (1, 3), 172 x 264 (0.70 M pointers)",
     lambda q: conv(1, 32, (7, 7), (172, 264), (1, 3), q), [1, 1, 172, 264]),
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=300)
    args = parser.parse_args()
    print(f"onnxruntime {ort.__version__}, batch 1, 1 thread, medians of {args.runs} runs taking turns\n")
    print("| case | float us | int8 (with its Q/DQ) us | int8 speed |")
    print("|---|---|---|---|")
    for label, build, shape in CASES:
        x = np.random.default_rng(1).standard_normal(shape).astype(np.float32)
        times = time_models({"float": build(False), "int8": build(True)}, {"x": x}, threads=1, warmup=5,
                            runs=args.runs)
        fp32, int8 = (float(np.median(times[k])) * 1e6 for k in ("float", "int8"))
        print(f"| {label} | {fp32:.0f} | {int8:.0f} | {fp32 / int8:.2f}x |", flush=True)


if __name__ == "__main__":
    main()
