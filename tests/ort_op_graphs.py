"""The graphs of onnxruntime's quantization op tests, rebuilt in our own code, with data for them.

Each entry of GRAPHS is (name, builder): builder(rng) returns the fp32 model and a function that
draws one sample ({input name: array}) from a generator. The shapes are small; many inputs have a
first dimension fixed above 1, as in those tests, so no batch of several samples exists for them.
`compare` quantizes one graph with the plain command and with onnxruntime's quantize_static (QDQ,
default options, the same samples) and measures both on held-out samples (worst-output SQNR).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from tests.graphs import checked

F = TensorProto.FLOAT


class Graph:
    """A graph under construction: nodes, initializers, inputs and their sample draws."""

    def __init__(self, opset: int = 17):
        self.opset = opset
        self.nodes: list = []
        self.inits: list = []
        self.inputs: list = []
        self.outputs: list = []
        self.draws: dict[str, Callable] = {}

    def input(self, name, shape, draw=None, elem=F):
        self.inputs.append(helper.make_tensor_value_info(name, elem, shape))
        fixed = [1 if isinstance(d, str) else d for d in shape]
        self.draws[name] = draw or (lambda rng, s=tuple(fixed): rng.normal(0, 1, s).astype(np.float32))
        return name

    def const(self, name, array):
        self.inits.append(numpy_helper.from_array(np.asarray(array), name))
        return name

    def weight(self, rng, name, shape, std=0.3):
        return self.const(name, rng.normal(0, std, shape).astype(np.float32))

    def node(self, op, inputs, outputs=None, name=None, domain=None, **attrs):
        outputs = outputs or [(name or op.lower()) + "_out"]
        self.nodes.append(helper.make_node(op, inputs, outputs, name=name or outputs[0], domain=domain, **attrs))
        return outputs[0] if len(outputs) == 1 else outputs

    def output(self, *names, elem=F, shape=None):
        for n in names:
            self.outputs.append(helper.make_tensor_value_info(n, elem, shape))

    def build(self, extra_domains=()):
        graph = helper.make_graph(self.nodes, "ort_op_graph", self.inputs, self.outputs, self.inits)
        opsets = [helper.make_opsetid("", self.opset)] + [helper.make_opsetid(d, 1) for d in extra_domains]
        m = helper.make_model(graph, opset_imports=opsets)
        m.ir_version = 8 if self.opset < 21 else 10
        draws = dict(self.draws)
        return checked(m), lambda rng: {name: draw(rng) for name, draw in draws.items()}


def _ints(values):
    return np.array(values, dtype=np.int64)


# ---- Conv families (test_qdq.py, test_op_relu/maxpool/pooling/gavgpool/concat/pad/resize...) ----

def _conv(g, rng, x, c_in, c_out, name, k=3, pads=1, group=1, bias=True):
    w = g.weight(rng, name + "_w", (c_out, c_in // group, k, k), std=0.4 / np.sqrt(c_in // group * k * k) * 3)
    ins = [x, w] + ([g.weight(rng, name + "_b", (c_out,), std=0.1)] if bias else [])
    return g.node("Conv", ins, name=name, pads=[pads] * 4, group=group)


def conv(rng, bias=True):
    g = Graph(13)
    y = _conv(g, rng, g.input("input", [1, 8, 17, 17]), 8, 16, "conv", pads=0, bias=bias)
    g.output(y)
    return g.build()


def conv_clip_reshape(rng):
    g = Graph(13)
    y = _conv(g, rng, g.input("input", [1, 8, 12, 12]), 8, 8, "conv", bias=False)
    y = g.node("Clip", [y, g.const("lo", np.float32(-0.5)), g.const("hi", np.float32(0.5))], name="clip")
    g.output(g.node("Reshape", [y, g.const("shape", _ints([-1]))], name="reshape"))
    return g.build()


def conv_relu(rng, opset=13):
    g = Graph(opset)
    y = _conv(g, rng, g.input("input", [1, 8, 12, 12]), 8, 8, "conv")
    g.output(g.node("Relu", [y], name="relu"))
    return g.build()


def conv_maxpool(rng, opset=12):
    g = Graph(opset)
    y = _conv(g, rng, g.input("input", [1, 2, 26, 42]), 2, 3, "conv")
    y = g.node("MaxPool", [y], name="maxpool", kernel_shape=[3, 3], strides=[2, 2])
    g.output(_conv(g, rng, y, 3, 4, "conv2"))
    return g.build()


def conv_averagepool(rng):
    g = Graph(13)
    y = _conv(g, rng, g.input("input", [1, 4, 16, 16]), 4, 6, "conv")
    y = g.node("AveragePool", [y], name="avgpool", kernel_shape=[3, 3], strides=[2, 2], pads=[1, 1, 1, 1])
    g.output(_conv(g, rng, y, 6, 4, "conv2"))
    return g.build()


def conv_gavgpool(rng):
    g = Graph(13)
    y = _conv(g, rng, g.input("input", [1, 8, 12, 12]), 8, 8, "conv")
    y = g.node("GlobalAveragePool", [y], name="gap")
    g.output(_conv(g, rng, y, 8, 8, "conv2", k=1, pads=0))
    return g.build()


def conv_concat(rng, opset=13):
    g = Graph(opset)
    x = g.input("input", [1, 3, 15, 15])
    branches = [_conv(g, rng, x, 3, 2, f"conv{i}") for i in range(3)]
    g.output(g.node("Concat", branches, name="concat", axis=1))
    return g.build()


def conv_pad(rng, mode="constant", value=None, opset=13):
    g = Graph(opset)
    y = _conv(g, rng, g.input("input", [1, 4, 10, 10]), 4, 6, "conv")
    ins = [y, g.const("pads", _ints([0, 0, 1, 2, 0, 0, 2, 1]))]
    if value is not None:
        ins.append(g.const("pad_value", np.float32(value)))
    g.output(g.node("Pad", ins, name="pad", mode=mode))
    return g.build()


def pad_conv(rng):
    g = Graph(13)
    y = g.node("Pad", [g.input("input", [1, 4, 10, 10]), g.const("pads", _ints([0, 0, 1, 1, 0, 0, 1, 1]))],
               name="pad", mode="reflect")
    g.output(_conv(g, rng, y, 4, 6, "conv", pads=0))
    return g.build()


def conv_resize(rng, mode="nearest", opset=13):
    g = Graph(opset)
    y = _conv(g, rng, g.input("input", [1, 2, 8, 8]), 2, 4, "conv")
    scales = g.const("scales", np.array([1, 1, 2, 2], dtype=np.float32))
    roi = g.const("roi", np.array([], dtype=np.float32)) if opset < 13 else ""  # opset 11 needs the input
    y = g.node("Resize", [y, roi, scales], name="resize", mode=mode)
    g.output(_conv(g, rng, y, 4, 4, "conv2"))
    return g.build()


def conv_reshape(rng):
    g = Graph(13)
    y = _conv(g, rng, g.input("input", [3, 7, 7, 7]), 7, 8, "conv", pads=0)
    y = g.node("Reshape", [y, g.const("shape", _ints([3, -1]))], name="reshape")
    g.output(g.node("Gemm", [y, g.weight(rng, "fc_w", (10, 200), 0.05), g.weight(rng, "fc_b", (10,), 0.1)],
                    name="gemm", transB=1))
    return g.build()


def conv_transpose_op(rng):
    g = Graph(13)
    y = _conv(g, rng, g.input("input", [1, 4, 6, 6]), 4, 8, "conv")
    y = g.node("Transpose", [y], name="transpose", perm=[0, 2, 3, 1])
    g.output(g.node("MatMul", [y, g.weight(rng, "mm_w", (8, 5), 0.3)], name="matmul"))
    return g.build()


def conv_squeeze_unsqueeze(rng, opset=13):
    g = Graph(opset)
    y = _conv(g, rng, g.input("input", [1, 3, 1, 8]), 3, 4, "conv", k=1, pads=0)
    if opset >= 13:
        y = g.node("Squeeze", [y, g.const("axes", _ints([2]))], name="squeeze")
        y = g.node("Unsqueeze", [y, g.const("axes2", _ints([2]))], name="unsqueeze")
    else:
        y = g.node("Squeeze", [y], name="squeeze", axes=[2])
        y = g.node("Unsqueeze", [y], name="unsqueeze", axes=[2])
    g.output(_conv(g, rng, y, 4, 4, "conv2", k=1, pads=0))
    return g.build()


def conv_softmax(rng):
    g = Graph(13)
    y = _conv(g, rng, g.input("input", [1, 2, 8, 8]), 2, 6, "conv")
    g.output(g.node("Softmax", [y], name="softmax", axis=1))
    return g.build()


def conv_argmax(rng, opset=13):
    g = Graph(opset)
    y = _conv(g, rng, g.input("input", [1, 4, 8, 8]), 4, 6, "conv")
    g.output(g.node("ArgMax", [y], name="argmax", axis=1, keepdims=0), elem=TensorProto.INT64)
    return g.build()


def conv_instance_norm(rng):
    g = Graph(13)
    y = _conv(g, rng, g.input("input", [1, 4, 8, 8]), 4, 6, "conv")
    y = g.node("InstanceNormalization", [y, g.weight(rng, "in_s", (6,), 0.5), g.weight(rng, "in_b", (6,), 0.2)],
               name="instnorm")
    g.output(_conv(g, rng, y, 6, 4, "conv2"))
    return g.build()


def conv_flatten_gemm(rng):
    g = Graph(13)
    y = _conv(g, rng, g.input("input", [1, 3, 6, 6]), 3, 4, "conv", pads=0)
    y = g.node("Flatten", [y], name="flatten", axis=1)
    g.output(g.node("Gemm", [y, g.weight(rng, "fc_w", (64, 8), 0.1), g.weight(rng, "fc_b", (8,), 0.1)],
                    name="gemm"))
    return g.build()


def conv_gather_elements(rng):
    g = Graph(13)
    y = _conv(g, rng, g.input("input", [1, 3, 6, 6]), 3, 4, "conv")
    idx = g.const("idx", rng.integers(0, 6, (1, 4, 6, 6)).astype(np.int64))
    g.output(g.node("GatherElements", [y, idx], name="gather_elements", axis=3))
    return g.build()


def conv_transpose(rng, group=1):
    g = Graph(13)
    x = g.input("input", [1, 4, 6, 6])
    w = g.weight(rng, "ct_w", (4, 8 // group, 3, 3), 0.2)
    b = g.weight(rng, "ct_b", (8,), 0.1)
    g.output(g.node("ConvTranspose", [x, w, b], name="convtranspose", group=group, strides=[2, 2],
                    pads=[1, 1, 1, 1]))
    return g.build()


def conv_transpose_fp16(rng):
    g = Graph(19)
    h = TensorProto.FLOAT16
    x = g.input("input", [1, 1, 7, 7], draw=lambda r: r.integers(-1, 2, (1, 1, 7, 7)).astype(np.float16), elem=h)
    w = g.const("weight", np.ones((1, 1, 2, 2), np.float16))
    b = g.const("bias", np.array([0.17], np.float16))
    g.output(g.node("ConvTranspose", [x, w, b], name="convtranspose", kernel_shape=[2, 2]), elem=h)
    return g.build()


def conv_fp16(rng):
    g = Graph(13)
    h = TensorProto.FLOAT16
    x = g.input("input", [1, 4, 8, 8], draw=lambda r: r.normal(0, 1, (1, 4, 8, 8)).astype(np.float16), elem=h)
    w = g.const("w", rng.normal(0, 0.3, (6, 4, 3, 3)).astype(np.float16))
    y = g.node("Conv", [x, w, g.const("b", rng.normal(0, 0.1, 6).astype(np.float16))], name="conv", pads=[1] * 4)
    g.output(g.node("Relu", [y], name="relu"), elem=h)
    return g.build()


def depthwise_conv(rng):
    g = Graph(13)
    y = _conv(g, rng, g.input("input", [1, 8, 10, 10]), 8, 8, "dw", group=8)
    y = g.node("Relu", [y], name="relu")
    g.output(_conv(g, rng, y, 8, 8, "pw", k=1, pads=0))
    return g.build()


def conv_sigmoid_mul(rng):
    g = Graph(13)
    y = _conv(g, rng, g.input("input", [1, 4, 8, 8]), 4, 6, "conv")
    s = g.node("Sigmoid", [y], name="sigmoid")
    g.output(g.node("Mul", [y, s], name="swish"))
    return g.build()


def conv_add_residual(rng):
    g = Graph(13)
    x = g.input("input", [1, 6, 8, 8])
    y = _conv(g, rng, x, 6, 6, "conv")
    g.output(g.node("Add", [x, y], name="add"))
    return g.build()


# ---- MatMul / Gemm families (test_op_matmul.py, test_op_gemm.py, test_qdq.py) ----

def gemm_clip_gemm(rng):
    g = Graph(13)
    x = g.input("input", ["N", 10], draw=lambda r: r.normal(0, 2, (5, 10)).astype(np.float32))
    y = g.node("Gemm", [x, g.weight(rng, "w1", (100, 10), 0.1), g.weight(rng, "b1", (100,), 0.1)], name="gemm1",
               transB=1)
    y = g.node("Clip", [y, g.const("lo", np.float32(-1)), g.const("hi", np.float32(1))], name="clip")
    g.output(g.node("Gemm", [y, g.weight(rng, "w2", (10, 100), 0.1), g.weight(rng, "b2", (10,), 0.1)],
                    name="gemm2", transB=1))
    return g.build()


def gemm_trans_alpha_beta(rng):
    g = Graph(13)
    x = g.input("input", [12, 4])  # transA: A is K x M
    g.output(g.node("Gemm", [x, g.weight(rng, "w", (6, 12), 0.3), g.weight(rng, "b", (1, 6), 0.2)], name="gemm",
                    transA=1, transB=1, alpha=0.5, beta=2.0))
    return g.build()


def gemm_no_bias(rng):
    g = Graph(13)
    x = g.input("input", [3, 16])
    g.output(g.node("Gemm", [x, g.weight(rng, "w", (16, 8), 0.3)], name="gemm"))
    return g.build()


def matmul_const(rng):
    g = Graph(13)
    x = g.input("input", ["N", 5, 16])
    g.output(g.node("MatMul", [x, g.weight(rng, "w", (16, 8), 0.3)], name="matmul"))
    return g.build()


def matmul_add(rng):
    g = Graph(13)
    x = g.input("input", [4, 16])
    y = g.node("MatMul", [x, g.weight(rng, "w", (16, 8), 0.3)], name="matmul")
    g.output(g.node("Add", [y, g.weight(rng, "b", (8,), 0.2)], name="add"))
    return g.build()


def matmul_batched_weight(rng):
    g = Graph(13)
    x = g.input("input", [2, 4, 8])
    g.output(g.node("MatMul", [x, g.weight(rng, "w", (2, 8, 6), 0.3)], name="matmul"))
    return g.build()


def matmul_two_activations(rng):
    g = Graph(13)
    a = g.input("a", [3, 4, 8])
    b = g.input("b", [3, 8, 5])
    g.output(g.node("MatMul", [a, b], name="matmul"))
    return g.build()


def matmul_transpose(rng):
    g = Graph(13)
    y = g.node("MatMul", [g.input("input", [2, 6, 8]), g.weight(rng, "w", (8, 4), 0.3)], name="matmul")
    g.output(g.node("Transpose", [y], name="transpose", perm=[0, 2, 1]))
    return g.build()


def matmul_reshape(rng):
    g = Graph(13)
    y = g.node("MatMul", [g.input("input", [2, 6, 8]), g.weight(rng, "w", (8, 4), 0.3)], name="matmul")
    g.output(g.node("Reshape", [y, g.const("shape", _ints([2, 24]))], name="reshape"))
    return g.build()


def matmul_layernorm(rng):
    g = Graph(17)
    y = g.node("MatMul", [g.input("input", [2, 5, 16]), g.weight(rng, "w", (16, 16), 0.3)], name="matmul")
    g.output(g.node("LayerNormalization", [y, g.weight(rng, "ln_s", (16,), 0.5), g.weight(rng, "ln_b", (16,), 0.1)],
                    name="layernorm", axis=-1))
    return g.build()


def add_reducemean_add(rng):
    g = Graph(13)
    y = g.node("Add", [g.input("L", [5, 5]), g.weight(rng, "M", (5, 5), 0.1)], name="add1")
    y = g.node("ReduceMean", [y], name="reducemean", keepdims=1)
    g.output(g.node("Add", [y, g.weight(rng, "N", (5, 5), 0.1)], name="add2"))
    return g.build()


def add_three_matmuls(rng):
    g = Graph(13)
    t = g.node("Add", [g.input("L", [5, 5]), g.weight(rng, "P", (5, 5), 0.1)], name="add")
    outs = [g.node("MatMul", [t, g.weight(rng, w, (5, 5), 0.3)], name=f"matmul{i}") for i, w in enumerate("QRS")]
    g.output(*outs)
    return g.build()


def gemm_topk(rng):
    g = Graph(13)
    y = g.node("Gemm", [g.input("input", [4, 32]), g.weight(rng, "w", (32, 24), 0.3)], name="gemm")
    values, _ = g.node("TopK", [y, g.const("k", _ints([6]))], ["values", "indices"], name="topk", axis=-1)
    g.output(values)
    return g.build()


def einsum(rng):
    g = Graph(13)
    a = g.input("a", [2, 3, 8])
    g.output(g.node("Einsum", [a, g.weight(rng, "w", (8, 5), 0.3)], name="einsum", equation="bij,jk->bik"))
    return g.build()


def embedding_gather(rng):
    g = Graph(13)
    ids = g.input("ids", [2, 6], draw=lambda r: r.integers(0, 50, (2, 6)).astype(np.int64), elem=TensorProto.INT64)
    y = g.node("Gather", [g.weight(rng, "table", (50, 16), 0.5), ids], name="gather", axis=0)
    g.output(g.node("MatMul", [y, g.weight(rng, "w", (16, 8), 0.3)], name="matmul"))
    return g.build()


def split_concat(rng):
    g = Graph(13)
    y = g.node("MatMul", [g.input("input", [6, 8]), g.weight(rng, "w", (8, 8), 0.3)], name="matmul")
    parts = g.node("Split", [y, g.const("split", _ints([2, 2, 2]))], ["s0", "s1", "s2"], name="split", axis=0)
    g.output(g.node("Concat", parts, name="concat", axis=1))
    return g.build()


def split_outputs(rng):
    g = Graph(13)
    y = _conv(g, rng, g.input("input", [1, 6, 6, 6]), 6, 6, "conv")
    g.node("Split", [y], ["s0", "s1"], name="split", axis=1)
    g.output("s0", "s1")
    return g.build()


def where(rng):
    g = Graph(16)
    c = g.input("condition", [2, 2], draw=lambda r: r.random((2, 2)) > 0.5, elem=TensorProto.BOOL)
    g.output(g.node("Where", [c, g.input("x", [2, 2]), g.input("y", [2, 2])], name="where"))
    return g.build()


def matmul_where(rng):
    g = Graph(16)
    c = g.input("condition", [3, 8], draw=lambda r: r.random((3, 8)) > 0.5, elem=TensorProto.BOOL)
    y = g.node("MatMul", [g.input("x", [3, 8]), g.weight(rng, "w", (8, 8), 0.3)], name="matmul")
    g.output(g.node("Where", [c, y, g.const("zero", np.zeros((1,), np.float32))], name="where"))
    return g.build()


def slice_steps(rng, elem=F):
    g = Graph(21)
    np_type = np.float16 if elem == TensorProto.FLOAT16 else np.float32
    x = g.input("input_0", [2, 4], draw=lambda r: r.normal(0, 4, (2, 4)).astype(np_type), elem=elem)
    g.output(g.node("Slice", [x, g.const("starts", _ints([1, 0])), g.const("ends", _ints([2, 3])), "",
                              g.const("steps", _ints([1, 2]))], name="slice"), elem=elem)
    return g.build()


def gru(rng):
    g = Graph(13)
    h = 8
    x = g.input("input", [5, 2, 6])  # seq, batch, features
    ins = [x, g.weight(rng, "W", (1, 3 * h, 6), 0.3), g.weight(rng, "R", (1, 3 * h, h), 0.3),
           g.weight(rng, "B", (1, 6 * h), 0.1)]
    y, _ = g.node("GRU", ins, ["y", "y_h"], name="gru", hidden_size=h)
    g.output(y)
    return g.build()


def lstm(rng, directions=1, bias=True):
    g = Graph(13)
    h = 8
    x = g.input("input", [5, 1, 6])
    ins = [x, g.weight(rng, "W", (directions, 4 * h, 6), 0.3), g.weight(rng, "R", (directions, 4 * h, h), 0.3)]
    if bias:
        ins.append(g.weight(rng, "B", (directions, 8 * h), 0.1))
    y, _, _ = g.node("LSTM", ins, ["y", "y_h", "y_c"], name="lstm", hidden_size=h,
                     direction="bidirectional" if directions == 2 else "forward")
    g.output(y)
    return g.build()


def lstm_matmul(rng):
    g = Graph(14)
    h = 7
    x = g.input("input", [1, "batch", 2], draw=lambda r: r.random((1, 3, 2)).astype(np.float32))
    y = g.node("LSTM", [x, g.weight(rng, "W", (1, 4 * h, 2), 0.3), g.weight(rng, "R", (1, 4 * h, h), 0.3)],
               ["y"], name="lstm", hidden_size=h)
    g.output(g.node("MatMul", [y, g.weight(rng, "w", (h, 4), 0.3)], name="matmul"))
    return g.build()


def squeeze_matmul(rng):
    g = Graph(13)
    y = g.node("Unsqueeze", [g.input("input", [3, 8]), g.const("axes", _ints([0]))], name="unsqueeze")
    y = g.node("MatMul", [y, g.weight(rng, "w", (8, 8), 0.3)], name="matmul")
    g.output(g.node("Squeeze", [y, g.const("axes0", _ints([0]))], name="squeeze"))
    return g.build()


def skip_layer_norm(rng):
    g = Graph(13)
    x = g.input("input", [1, 4, 16])
    skip = g.input("skip", [1, 4, 16])
    y = g.node("SkipLayerNormalization", [x, skip, g.weight(rng, "gamma", (16,), 0.5), g.weight(rng, "beta", (16,), 0.1)],
               name="skiplayernorm", domain="com.microsoft")
    g.output(g.node("MatMul", [y, g.weight(rng, "w", (16, 8), 0.3)], name="matmul"), shape=[1, 4, 8])
    return g.build(extra_domains=("com.microsoft",))


def conv_reshape_split(rng):
    g = Graph(13)
    y = _conv(g, rng, g.input("input", [3, 3, 2, 2]), 3, 4, "conv", k=1, pads=0, bias=False)
    y = g.node("Reshape", [y, g.const("shape", _ints([3, 16]))], name="reshape")
    g.node("Split", [y, g.const("split", _ints([1, 1, 1]))], ["output_1", "output_2", "output_3"], name="split",
           axis=0)
    g.output("output_1", "output_2", "output_3")
    return g.build()


def relu_convs_add(rng):
    g = Graph(13)
    r = g.node("Relu", [g.input("input", [1, 3, 1, 3])], name="relu1")
    a = _conv(g, rng, r, 3, 3, "conv1", k=1, pads=0)
    a = _conv(g, rng, g.node("Relu", [a], name="relu2"), 3, 3, "conv2", k=1, pads=0)
    b = _conv(g, rng, r, 3, 3, "conv3", k=1, pads=0)
    g.output(g.node("Add", [a, b], name="add"))
    return g.build()


def clip_relu(rng):
    g = Graph(13)
    y = g.node("Clip", [g.input("input", [1, 3, 1, 3]), g.const("lo", np.float32(-0.5)), g.const("hi", np.float32(0.5))],
               name="clip")
    g.output(g.node("Relu", [y], name="relu"))
    return g.build()


def topk(rng):
    g = Graph(16)
    values, indices = g.node("TopK", [g.input("input", [1, 10]), g.const("k", _ints([3]))], ["values", "indices"],
                             name="topk", axis=1)
    g.output(values)
    g.output(indices, elem=TensorProto.INT64)
    return g.build()


def attention(rng):
    g = Graph(13)
    x = g.input("input", [2, 4, 16])
    y = g.node("Attention", [x, g.weight(rng, "qkv_w", (16, 48), 0.25), g.weight(rng, "qkv_b", (48,), 0.1)],
               name="attention", domain="com.microsoft", num_heads=2)
    g.output(g.node("MatMul", [y, g.weight(rng, "w", (16, 8), 0.3)], name="matmul"), shape=[2, 4, 8])
    return g.build(extra_domains=("com.microsoft",))


def embed_layer_norm(rng):
    g = Graph(13)
    i32 = TensorProto.INT32
    ids = g.input("input_ids", [1, 6], draw=lambda r: r.integers(0, 40, (1, 6)).astype(np.int32), elem=i32)
    seg = g.input("segment_ids", [1, 6], draw=lambda r: r.integers(0, 2, (1, 6)).astype(np.int32), elem=i32)
    ins = [ids, seg, g.weight(rng, "word", (40, 16), 0.5), g.weight(rng, "pos", (8, 16), 0.2),
           g.weight(rng, "segment", (2, 16), 0.2), g.weight(rng, "gamma", (16,), 0.5), g.weight(rng, "beta", (16,), 0.1)]
    y, _ = g.node("EmbedLayerNormalization", ins, ["embedded", "mask_index"], name="embed", domain="com.microsoft",
                  epsilon=1e-12)
    g.output(g.node("MatMul", [y, g.weight(rng, "w", (16, 8), 0.3)], name="matmul"), shape=[1, 6, 8])
    return g.build(extra_domains=("com.microsoft",))


def bias_gelu(rng):
    g = Graph(13)
    y = g.node("MatMul", [g.input("input", [3, 16]), g.weight(rng, "w", (16, 16), 0.3)], name="matmul")
    y = g.node("BiasGelu", [y, g.weight(rng, "bias", (16,), 0.1)], name="biasgelu", domain="com.microsoft")
    g.output(g.node("MatMul", [y, g.weight(rng, "w2", (16, 8), 0.3)], name="matmul2"), shape=[3, 8])
    return g.build(extra_domains=("com.microsoft",))


GRAPHS: list[tuple[str, Callable]] = [
    ("conv", conv),
    ("conv_no_bias", lambda rng: conv(rng, bias=False)),
    ("conv_clip_reshape", conv_clip_reshape),
    ("conv_relu", conv_relu),
    ("conv_relu_opset11", lambda rng: conv_relu(rng, opset=11)),
    ("conv_maxpool", conv_maxpool),
    ("conv_maxpool_opset11", lambda rng: conv_maxpool(rng, opset=11)),
    ("conv_averagepool", conv_averagepool),
    ("conv_gavgpool", conv_gavgpool),
    ("conv_concat", conv_concat),
    ("conv_concat_opset11", lambda rng: conv_concat(rng, opset=11)),
    ("conv_pad_constant", conv_pad),
    ("conv_pad_constant_value", lambda rng: conv_pad(rng, value=0.5)),
    ("conv_pad_reflect", lambda rng: conv_pad(rng, mode="reflect")),
    ("conv_pad_edge", lambda rng: conv_pad(rng, mode="edge")),
    ("pad_reflect_conv", pad_conv),
    ("conv_resize_nearest", conv_resize),
    ("conv_resize_linear", lambda rng: conv_resize(rng, mode="linear")),
    ("conv_resize_opset11", lambda rng: conv_resize(rng, opset=11)),
    ("conv_reshape_gemm", conv_reshape),
    ("conv_transpose_matmul", conv_transpose_op),
    ("conv_squeeze_unsqueeze", conv_squeeze_unsqueeze),
    ("conv_squeeze_unsqueeze_opset11", lambda rng: conv_squeeze_unsqueeze(rng, opset=11)),
    ("conv_softmax", conv_softmax),
    ("conv_argmax", conv_argmax),
    ("conv_argmax_opset11", lambda rng: conv_argmax(rng, opset=11)),
    ("conv_instance_norm", conv_instance_norm),
    ("conv_flatten_gemm", conv_flatten_gemm),
    ("conv_gather_elements", conv_gather_elements),
    ("convtranspose", conv_transpose),
    ("convtranspose_grouped", lambda rng: conv_transpose(rng, group=2)),
    ("convtranspose_fp16", conv_transpose_fp16),
    ("conv_fp16", conv_fp16),
    ("depthwise_conv", depthwise_conv),
    ("conv_swish", conv_sigmoid_mul),
    ("conv_add_residual", conv_add_residual),
    ("gemm_clip_gemm", gemm_clip_gemm),
    ("gemm_transA_alpha_beta", gemm_trans_alpha_beta),
    ("gemm_no_bias", gemm_no_bias),
    ("matmul_const", matmul_const),
    ("matmul_add", matmul_add),
    ("matmul_batched_weight", matmul_batched_weight),
    ("matmul_two_activations", matmul_two_activations),
    ("matmul_transpose", matmul_transpose),
    ("matmul_reshape", matmul_reshape),
    ("matmul_layernorm", matmul_layernorm),
    ("add_reducemean_add", add_reducemean_add),
    ("add_three_matmuls", add_three_matmuls),
    ("gemm_topk", gemm_topk),
    ("einsum", einsum),
    ("embedding_gather", embedding_gather),
    ("split_concat", split_concat),
    ("conv_split_outputs", split_outputs),
    ("where", where),
    ("matmul_where", matmul_where),
    ("slice_steps_opset21", slice_steps),
    ("slice_steps_float16", lambda rng: slice_steps(rng, TensorProto.FLOAT16)),
    ("gru", gru),
    ("lstm", lstm),
    ("lstm_bidirectional", lambda rng: lstm(rng, directions=2)),
    ("lstm_matmul", lstm_matmul),
    ("unsqueeze_matmul_squeeze", squeeze_matmul),
    ("skip_layer_norm", skip_layer_norm),
    ("conv_reshape_split", conv_reshape_split),
    ("relu_convs_add", relu_convs_add),
    ("clip_relu", clip_relu),
    ("topk", topk),
    ("attention", attention),
    ("embed_layer_norm", embed_layer_norm),
    ("bias_gelu", bias_gelu),
]

CALIBRATION_SAMPLES = 8
HELD_OUT_SAMPLES = 16


def layers_int8_config() -> Optional[dict]:
    """The config under which every layer with weights the plan can quantize is int8: a speed rule
    (quantization.advanced.speed_rule, where the config has it) off. None where the plain command
    has no such rule: then it is that config. These graphs are tiny, so a rule that keeps layers
    float where onnxruntime runs them faster would leave some of them float, which is right for
    speed and closer to fp32, but says nothing of whether they can be quantized."""
    from qtool.config import AdvancedConfig

    if "speed_rule" in getattr(AdvancedConfig, "__dataclass_fields__", {}):
        return {"quantization": {"advanced": {"speed_rule": "off"}}}
    return None


def graph(name: str):
    """(model, draw) of the graph named `name`, built from a generator seeded by its name."""
    builder = dict(GRAPHS)[name]
    return builder(np.random.default_rng(sum(map(ord, name))))


def draw_samples(draw, count: int, seed: int) -> list[dict]:
    rng = np.random.default_rng(seed)
    return [draw(rng) for _ in range(count)]


def write_data(folder: Path, samples: list[dict]) -> Path:
    """The samples as .npz files keyed by input name in `folder`."""
    folder.mkdir(parents=True, exist_ok=True)
    for i, s in enumerate(samples):
        np.savez(folder / f"s{i:03d}.npz", **s)
    return folder


def fidelity(fp32_path, quantized_path, samples) -> tuple[str, float]:
    """("sqnr", the lowest SQNR in dB over the float outputs, each output's signal and noise
    summed over the samples), or, for a model with integer outputs only (ArgMax), ("agreement",
    the fraction of equal values): an index off by one is a miss, not a small error."""
    import onnxruntime as ort

    ref = ort.InferenceSession(str(fp32_path), providers=["CPUExecutionProvider"])
    test = ort.InferenceSession(str(quantized_path), providers=["CPUExecutionProvider"])
    signal: dict[int, float] = {}
    noise: dict[int, float] = {}
    equal = total = 0
    for s in samples:
        for i, (a, b) in enumerate(zip(ref.run(None, s), test.run(None, s))):
            a, b = np.asarray(a), np.asarray(b)
            if a.dtype.kind == "f":
                a, b = a.astype(np.float64), b.astype(np.float64)
                signal[i] = signal.get(i, 0.0) + float(np.sum(a ** 2))
                noise[i] = noise.get(i, 0.0) + float(np.sum((a - b) ** 2))
            else:
                equal += int(np.sum(a == b))
                total += a.size
    if not signal:
        return "agreement", equal / total
    return "sqnr", min(np.inf if noise[i] == 0 else 10 * np.log10(signal[i] / noise[i]) for i in signal)


def quantize_static_model(fp32_path: Path, out: Path, calibration: list[dict]) -> bool:
    """onnxruntime's quantize_static (QDQ format, default options) on the same samples; False when
    it raises (its failure is a figure of the comparison, not an error of ours)."""
    from onnxruntime.quantization import CalibrationDataReader, QuantFormat, quantize_static

    class Reader(CalibrationDataReader):
        def __init__(self):
            self.items = iter(calibration)

        def get_next(self):
            return next(self.items, None)

    try:
        quantize_static(str(fp32_path), str(out), Reader(), quant_format=QuantFormat.QDQ)
    except Exception:
        return False
    return True


WEIGHTED = ("Conv", "ConvTranspose", "Gemm", "MatMul", "Einsum", "LSTM", "GRU", "Gather", "Attention")
# integer kernels, and which of their inputs are weights (the others include 8-bit zero points)
KERNEL_WEIGHTS = {"MatMulInteger": (1,), "ConvInteger": (1,), "DynamicQuantizeLSTM": (1, 2), "QAttention": (1,)}


def int8_weights(path) -> int:
    """Weights of layers (Conv, Gemm, MatMul, ..., an embedding table) stored in 8 bits: whether a
    layer with weights was quantized. An Add's constant operand does not count: an op with no int8
    neighbour may rightly stay float."""
    model = onnx.load(str(path))
    eight = {t.name for t in model.graph.initializer if t.data_type in (TensorProto.INT8, TensorProto.UINT8)}
    dequantized = {n.output[0]: n.input[0] for n in model.graph.node if n.op_type == "DequantizeLinear"}
    read = {dequantized.get(name, name) for n in model.graph.node if n.op_type in WEIGHTED for name in n.input}
    read |= {n.input[i] for n in model.graph.node for i in KERNEL_WEIGHTS.get(n.op_type, ()) if i < len(n.input)}
    return len(read & eight)


@dataclass
class Comparison:
    name: str
    exit_code: int
    output: str
    ours: Optional[tuple[str, float]]  # None: our model did not run
    ours_error: str
    theirs: Optional[tuple[str, float]]  # None: quantize_static failed or its model did not run
    ours_quantized: int  # int8 weights under layers_int8_config (the plain command's where it is None)
    theirs_quantized: int


def _quantize(fp32: Path, data: Path, out: Path, config: Optional[dict] = None):
    from click.testing import CliRunner

    from qtool.cli import main

    extra = []
    if config is not None:
        import yaml

        path = out.with_suffix(".yaml")
        path.write_text(yaml.safe_dump(config))
        extra = ["--config", str(path)]
    return CliRunner().invoke(main, ["quantize", str(fp32), "--data", str(data), "-o", str(out), *extra])


def compare(name: str, folder: Path) -> Comparison:
    """The graph quantized by the plain command (in this process) and by quantize_static, both
    measured on the same held-out samples."""
    model, draw = graph(name)
    fp32 = folder / "model.onnx"
    onnx.save(model, fp32)
    calibration = draw_samples(draw, CALIBRATION_SAMPLES, seed=0)
    held_out = draw_samples(draw, HELD_OUT_SAMPLES, seed=1)
    data = write_data(folder / "data", calibration)
    ours_path, theirs_path = folder / "ours.onnx", folder / "theirs.onnx"
    result = _quantize(fp32, data, ours_path)
    output = result.output + result.stderr
    ours, error, ours_q = None, "", 0
    if result.exit_code == 0:
        try:
            ours = fidelity(fp32, ours_path, held_out)
        except Exception as exc:  # reported by the caller
            error = str(exc).splitlines()[0]
        config = layers_int8_config()
        if config is None:
            ours_q = int8_weights(ours_path)
        else:
            layers = _quantize(fp32, data, folder / "ours_int8.onnx", config)
            output += layers.output + layers.stderr
            ours_q = int8_weights(folder / "ours_int8.onnx") if layers.exit_code == 0 else 0
    theirs, theirs_q = None, 0
    if quantize_static_model(fp32, theirs_path, calibration):
        theirs_q = int8_weights(theirs_path)
        try:
            theirs = fidelity(fp32, theirs_path, held_out)
        except Exception:
            theirs = None
    return Comparison(name, result.exit_code, output, ours, error, theirs, ours_q, theirs_q)
