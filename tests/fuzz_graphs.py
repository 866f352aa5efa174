"""Hypothesis strategy for random small valid ONNX graphs built from qtool's supported ops.

A graph is an NCHW trunk of random layers (Conv and ConvTranspose with random channels,
groups, kernels, strides, dilations and asymmetric pads; pooling; activations; Add/Mul/
Concat with earlier tensors; Transpose, Reshape, Unsqueeze/Squeeze, Softmax; an
activation x activation MatMul; an `If` on a data-dependent condition whose branches read the
trunk from the outer scope; a second, int64 input of token ids whose embedding rows are added
to the trunk; an If, Loop or Scan, nested up to three deep, whose bodies output constants,
initializers, outer-scope values or their own inputs, added to the trunk), optionally followed
by a 2-D head (Flatten, Gemm with random transB/alpha/beta, MatMul with a constant, Softmax). Every draw tracks shapes so the graph is valid by
construction; the batch dimension is dynamic.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import onnx
from hypothesis import strategies as st
from onnx import TensorProto, helper, numpy_helper

TRUNK_OPS = ("Conv", "ConvTranspose", "Relu", "Clip", "Sigmoid", "MaxPool", "AveragePool", "Add", "Mul", "Concat",
             "Transpose", "Reshape", "Unsqueeze", "Softmax", "MatMulSelf", "SiLU", "Sub", "Tanh", "LeakyRelu",
             "PRelu", "HardSigmoid", "HardSwish", "ReduceMean", "Resize", "Pad", "Gather", "Split", "If",
             "IdsInput")
HEAD_OPS = ("Gemm", "MatMul", "Relu", "Softmax", "Clip", "Add")
# Softmax's int8 output has the fixed scale 1/256 (LiteRT spec): over a long axis every
# probability is below one step, which is the spec's known limit, not something to fuzz.
SOFTMAX_MAX_AXIS = 32
# Ratio of the largest to the smallest possible output-channel magnitude of a weight. With even
# channels a per-channel scale on the wrong axis is nearly right; uneven ones make it miss the small
# channels' grid by up to this factor. 100 is too wide: the per-tensor activation of such a layer
# then loses its small channels legitimately (ConvTranspose -> Tanh at 11% error).
CHANNEL_SPREAD = 10.0
VOCABULARY = 5  # token ids of the int64 input are drawn from range(VOCABULARY)


@dataclass
class Builder:
    rng: np.random.Generator
    nodes: list = field(default_factory=list)
    inits: list = field(default_factory=list)
    shapes: dict = field(default_factory=dict)  # tensor -> per-sample shape (without batch)
    count: int = 0
    ids: tuple = ()  # per-sample shape of the int64 input `ids`, once a layer reads it

    def name(self, prefix: str) -> str:
        self.count += 1
        return f"{prefix}{self.count}"

    def const(self, array: np.ndarray, prefix: str = "k") -> str:
        name = self.name(prefix)
        self.inits.append(numpy_helper.from_array(np.asarray(array, np.float32) if array.dtype.kind == "f"
                                                  else array, name))
        return name

    def node(self, op: str, inputs: list[str], shape: tuple, **attrs) -> str:
        out = self.name(op.lower() + "_")
        self.nodes.append(helper.make_node(op, inputs, [out], name=out + "_node", **attrs))
        self.shapes[out] = tuple(shape)
        return out

    def weight(self, shape: tuple, fan_in: int, out_axis: int) -> tuple[str, np.ndarray]:
        """A weight whose output channels (along `out_axis`) differ in magnitude by up to
        CHANNEL_SPREAD, as BN-folded weights do; returns it and the per-channel factors."""
        factors = CHANNEL_SPREAD ** self.rng.uniform(-0.5, 0.5, shape[out_axis])
        values = self.rng.normal(0, 1 / np.sqrt(max(fan_in, 1)), shape)
        values = values * np.expand_dims(factors, [a for a in range(len(shape)) if a != out_axis])
        return self.const(values.astype(np.float32), "w"), factors

    def bias(self, factors: np.ndarray, groups: int = 1) -> str:
        """A bias whose channels follow the weight's magnitudes (repeated per group)."""
        return self.const((self.rng.normal(0, 0.2, factors.size * groups) * np.tile(factors, groups))
                          .astype(np.float32), "bias")


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _conv_out(size: int, k: int, s: int, d: int, pb: int, pe: int) -> int:
    return (size + pb + pe - d * (k - 1) - 1) // s + 1


@st.composite
def _conv(draw, b: Builder, x: str, transpose: bool) -> str:
    c, h, w = b.shapes[x]
    group = draw(st.sampled_from(_divisors(c)))
    out_c = group * draw(st.integers(1, 3))
    k = (draw(st.integers(1, 3)), draw(st.integers(1, 3)))
    s = (draw(st.integers(1, 2)), draw(st.integers(1, 2)))
    d = (1, 1) if transpose else (draw(st.integers(1, 2)), draw(st.integers(1, 2)))
    pads = [draw(st.integers(0, k[i] - 1)) for i in (0, 1)] + [draw(st.integers(0, k[i] - 1)) for i in (0, 1)]
    attrs = dict(kernel_shape=list(k), strides=list(s), dilations=list(d), pads=pads, group=group)
    if transpose:
        out_pad = [draw(st.integers(0, s[i] - 1)) for i in (0, 1)]
        attrs["output_padding"] = out_pad
        size = [s[i] * ((h, w)[i] - 1) + out_pad[i] + (k[i] - 1) * d[i] + 1 - pads[i] - pads[i + 2] for i in (0, 1)]
        w_shape, fan_in = (c, out_c // group, *k), c // group * k[0] * k[1]
    else:
        size = [_conv_out((h, w)[i], k[i], s[i], d[i], pads[i], pads[i + 2]) for i in (0, 1)]
        w_shape, fan_in = (out_c, c // group, *k), c // group * k[0] * k[1]
    if min(size) < 1 or max(size) > 24:
        return x  # this geometry does not fit: skip the layer
    weight, factors = b.weight(w_shape, fan_in, 1 if transpose else 0)
    inputs = [x, weight]
    if draw(st.booleans()):
        inputs.append(b.bias(factors, group if transpose else 1))
    return b.node("ConvTranspose" if transpose else "Conv", inputs, (out_c, *size), **attrs)


@st.composite
def _pool(draw, b: Builder, x: str, op: str) -> str:
    c, h, w = b.shapes[x]
    k = (draw(st.integers(1, 3)), draw(st.integers(1, 3)))
    s = (draw(st.integers(1, 2)), draw(st.integers(1, 2)))
    pads = [draw(st.integers(0, k[i] - 1)) for i in (0, 1)] * 2
    size = [_conv_out((h, w)[i], k[i], s[i], 1, pads[i], pads[i + 2]) for i in (0, 1)]
    if min(size) < 1:
        return x
    attrs = dict(kernel_shape=list(k), strides=list(s), pads=pads)
    if op == "AveragePool":
        attrs["count_include_pad"] = draw(st.integers(0, 1))
    return b.node(op, [x], (c, *size), **attrs)


def _same_shape_partner(draw, b: Builder, x: str) -> str | None:
    partners = [t for t, s in b.shapes.items() if s == b.shapes[x] and t != x]
    return draw(st.sampled_from(partners)) if partners and draw(st.booleans()) else None


@st.composite
def _trunk_layer(draw, b: Builder, x: str, ops: tuple = TRUNK_OPS) -> str:
    op = draw(st.sampled_from(ops))
    c, h, w = b.shapes[x]
    if op in ("Conv", "ConvTranspose"):
        return draw(_conv(b, x, op == "ConvTranspose"))
    if op in ("MaxPool", "AveragePool"):
        return draw(_pool(b, x, op))
    if op in ("Relu", "Sigmoid"):
        return b.node(op, [x], (c, h, w))
    if op == "SiLU":
        return b.node("Mul", [x, b.node("Sigmoid", [x], (c, h, w))], (c, h, w))
    if op in ("Tanh", "HardSigmoid", "HardSwish"):
        return b.node(op, [x], (c, h, w))
    if op == "LeakyRelu":
        return b.node(op, [x], (c, h, w), alpha=draw(st.sampled_from([0.01, 0.1, 0.3])))
    if op == "PRelu":
        return b.node(op, [x, b.const(b.rng.uniform(0, 0.5, (c, 1, 1)).astype(np.float32))], (c, h, w))
    if op == "Sub":  # x minus its channel mean (ReduceMean then Sub), or minus an earlier tensor
        partner = _same_shape_partner(draw, b, x)
        if partner is None:
            partner = b.node("ReduceMean", [x], (1, h, w), axes=[1], keepdims=1)
        return b.node("Sub", [x, partner], (c, h, w))
    if op == "ReduceMean":  # squeeze-excite style: spatial mean scales the channels
        mean = b.node("ReduceMean", [x], (c, 1, 1), axes=[2, 3], keepdims=1)
        return b.node("Mul", [x, b.node("Sigmoid", [mean], (c, 1, 1))], (c, h, w))
    if op == "Resize":  # upsample 2x then Slice back to h x w, or downsample 2x (nearest, linear or cubic)
        mode = draw(st.sampled_from(["nearest", "linear", "cubic"]))
        if draw(st.booleans()) and min(h, w) >= 2:
            return b.node("Resize", [x, "", b.const(np.array([1, 1, 0.5, 0.5], np.float32))], (c, h // 2, w // 2),
                          mode=mode)
        up = b.node("Resize", [x, "", b.const(np.array([1, 1, 2, 2], np.float32))], (c, 2 * h, 2 * w), mode=mode)
        return b.node("Slice", [up, b.const(np.array([0, 0], np.int64)), b.const(np.array([h, w], np.int64)),
                                b.const(np.array([2, 3], np.int64))], (c, h, w))
    if op == "Pad":  # pad by one (constant 0 or a non-zero value, or reflect), then a 3x3 max pool
        mode, value = draw(st.sampled_from([("constant", 0.0), ("constant", -0.5), ("reflect", 0.0)]))
        if mode == "reflect" and min(h, w) < 2:
            return x
        inputs = [x, b.const(np.array([0, 0, 1, 1, 0, 0, 1, 1], np.int64))]
        if value:
            inputs.append(b.const(np.array(value, np.float32)))
        padded = b.node("Pad", inputs, (c, h + 2, w + 2), mode=mode)
        return b.node("MaxPool", [padded], (c, h, w), kernel_shape=[3, 3])
    if op == "If":  # a data-dependent branch: Relu or Sigmoid of the outer-scope trunk
        cond = b.node("Greater", [b.node("ReduceMean", [x], (), keepdims=0), b.const(np.array(0.0, np.float32))], ())
        branches = {}
        for attr, body_op in (("then_branch", "Relu"), ("else_branch", "Sigmoid")):
            out = b.name(body_op.lower() + "_in_if_")
            branches[attr] = helper.make_graph([helper.make_node(body_op, [x], [out], name=out + "_node")], attr, [],
                                               [helper.make_tensor_value_info(out, TensorProto.FLOAT, None)])
        return b.node("If", [cond], (c, h, w), **branches)
    if op == "ControlFlow":  # x + an If/Loop/Scan whose bodies output constants, at random depth
        return b.node("Add", [x, draw(_control_flow(b, _Scope(b.nodes, b.inits, []), (1, c, h, w), x, 1))],
                      (c, h, w))
    if op == "IdsInput":  # embedding rows of int64 token ids [N, c], one row of width w per channel
        if b.ids:
            return x
        b.ids = (c,)
        table = b.const(b.rng.normal(0, 0.5, (VOCABULARY, w)).astype(np.float32), "table")
        rows = b.node("Gather", [table, "ids"], (c, w), axis=0)
        return b.node("Add", [x, b.node("Unsqueeze", [rows, b.const(np.array([2], np.int64))], (c, 1, w))],
                      (c, h, w))
    if op == "Gather":  # channels in a random order
        order = b.rng.permutation(c).astype(np.int64)
        return b.node("Gather", [x, b.const(order)], (c, h, w), axis=1)
    if op == "Split":  # split the channels and concatenate them the other way round
        if c < 2:
            return x
        first = draw(st.integers(1, c - 1))
        out_a, out_b = b.name("split_"), b.name("split_")
        b.nodes.append(helper.make_node("Split", [x, b.const(np.array([first, c - first], np.int64))],
                                        [out_a, out_b], name=out_a + "_node", axis=1))
        b.shapes[out_a], b.shapes[out_b] = (first, h, w), (c - first, h, w)
        return b.node("Concat", [out_b, out_a], (c, h, w), axis=1)
    if op == "Clip":
        low, high = draw(st.sampled_from([(0.0, 6.0), (-1.0, 1.0), (0.0, 1.0)]))
        return b.node("Clip", [x, b.const(np.array(low, np.float32)), b.const(np.array(high, np.float32))],
                      (c, h, w))
    if op in ("Add", "Mul"):
        partner = _same_shape_partner(draw, b, x)
        if partner is None:
            partner = b.const(b.rng.normal(0.5 if op == "Mul" else 0, 0.5, (c, 1, 1)).astype(np.float32))
        return b.node(op, [x, partner], (c, h, w))
    if op == "Concat":
        partners = [t for t, s in b.shapes.items() if s[1:] == (h, w)]
        other = draw(st.sampled_from(partners))
        return b.node("Concat", [x, other], (c + b.shapes[other][0], h, w), axis=1)
    if op == "Transpose":
        return b.node("Transpose", [x], (c, w, h), perm=[0, 1, 3, 2])
    if op == "Reshape":  # fold H into C and back: shape ops on a quantized path
        flat = b.node("Reshape", [x, b.const(np.array([0, c * h, w], np.int64))], (c * h, w))
        return b.node("Reshape", [flat, b.const(np.array([0, c, h, w], np.int64))], (c, h, w))
    if op == "Unsqueeze":
        up = b.node("Unsqueeze", [x, b.const(np.array([2], np.int64))], (c, 1, h, w))
        return b.node("Squeeze", [up, b.const(np.array([2], np.int64))], (c, h, w))
    if op == "Softmax":
        axis = draw(st.integers(1, 3))
        if (c, h, w)[axis - 1] > SOFTMAX_MAX_AXIS:
            return x
        return b.node("Softmax", [x], (c, h, w), axis=axis)
    # MatMulSelf: activation x activation, x @ x^T over the last two axes. Once per graph:
    # chained, it raises values to the 8th power, whose range no 8-bit grid covers.
    if any(n.op_type == "MatMul" for n in b.nodes):
        return x
    t = b.node("Transpose", [x], (c, w, h), perm=[0, 1, 3, 2])
    return b.node("MatMul", [x, t], (c, h, h))


@dataclass
class _Scope:
    """A graph being built (the main graph or a body): its nodes, initializers, the values of the
    construct's shape it may read from enclosing graphs (`outer`) and its own such inputs."""
    nodes: list
    inits: list
    outer: list
    inputs: list = field(default_factory=list)


# What an If/Loop/Scan body outputs: a Constant node's output, its own initializer, an Identity of a
# value of an enclosing graph, its own input unchanged, a value computed from the outer-scope trunk,
# or the output of a construct nested in it.
BODY_VALUES = ("constant", "initializer", "outer", "input", "computed", "nested")
MAX_DEPTH = 3


def _values(b: Builder, shape: tuple, elem: int) -> np.ndarray:
    return np.array(True) if elem == TensorProto.BOOL else b.rng.normal(0, 0.5, shape).astype(np.float32)


@st.composite
def _body_value(draw, b: Builder, scope: _Scope, shape: tuple, x: str, depth: int,
                elem: int = TensorProto.FLOAT) -> str:
    """A value of `shape` made in `scope` for its graph to output; its name."""
    kinds = [k for k in BODY_VALUES if (k != "input" or scope.inputs) and (k != "outer" or scope.outer)
             and (elem == TensorProto.FLOAT or k not in ("computed", "nested"))
             and (k != "nested" or depth < MAX_DEPTH)]
    kind = draw(st.sampled_from(kinds))
    if kind == "input":
        return draw(st.sampled_from(scope.inputs))
    if kind == "nested":
        return draw(_control_flow(b, scope, shape, x, depth + 1))
    name = b.name(kind + "_")
    if kind == "constant":
        scope.nodes.append(helper.make_node("Constant", [], [name], name=name + "_node",
                                            value=numpy_helper.from_array(_values(b, shape, elem), name)))
    elif kind == "initializer":
        scope.inits.append(numpy_helper.from_array(_values(b, shape, elem), name))
    elif kind == "outer":
        scope.nodes.append(helper.make_node("Identity", [draw(st.sampled_from(scope.outer))], [name],
                                            name=name + "_node"))
    else:  # computed: a visible value scaled by the mean of the outer-scope trunk
        mean = b.name("mean_")
        scope.nodes += [helper.make_node("ReduceMean", [x], [mean], name=mean + "_node", keepdims=1),
                        helper.make_node("Mul", [draw(st.sampled_from(scope.outer + scope.inputs)), mean], [name],
                                         name=name + "_node")]
    return name


def _body(b: Builder, scope: _Scope, name: str, inputs: list, outputs: list) -> onnx.GraphProto:
    return helper.make_graph(scope.nodes, name, [helper.make_tensor_value_info(n, e, s) for n, e, s in inputs],
                             [helper.make_tensor_value_info(n, e, s) for n, e, s in outputs], scope.inits)


@st.composite
def _control_flow(draw, b: Builder, scope: _Scope, shape: tuple, x: str, depth: int) -> str:
    """An If, Loop or Scan node in `scope` whose output has `shape`, its bodies' outputs drawn from
    BODY_VALUES; its output's name."""
    op = draw(st.sampled_from(("If", "Loop", "Scan")))
    out = b.name(op.lower() + "_")
    start = b.name("start_")  # a value of `shape` in `scope`, readable in the bodies
    scope.inits.append(numpy_helper.from_array(_values(b, shape, TensorProto.FLOAT), start))
    outer = scope.outer + scope.inputs + [start]
    value = (TensorProto.FLOAT, list(shape))
    if op == "If":
        mean, zero, cond = b.name("mean_"), b.name("zero_"), b.name("cond_")
        scope.inits.append(numpy_helper.from_array(np.array(0.0, np.float32), zero))
        scope.nodes += [helper.make_node("ReduceMean", [x], [mean], name=mean + "_node", keepdims=0),
                        helper.make_node("Greater", [mean, zero], [cond], name=cond + "_node")]
        branches = {}
        for attr in ("then_branch", "else_branch"):
            body = _Scope([], [], outer)
            result = draw(_body_value(b, body, shape, x, depth))
            branches[attr] = _body(b, body, b.name(attr), [], [(result, *value)])
        node = helper.make_node("If", [cond], [out], name=out + "_node", **branches)
    elif op == "Loop":  # two iterations of a carried value
        trips, go = b.name("trips_"), b.name("go_")
        scope.inits += [numpy_helper.from_array(np.array(2, np.int64), trips),
                        numpy_helper.from_array(np.array(True), go)]
        step, cond_in, carried = b.name("step_"), b.name("cond_in_"), b.name("carried_")
        body = _Scope([], [], outer, [carried])
        cond_body = _Scope(body.nodes, body.inits, [go], [cond_in])
        cond_out = draw(_body_value(b, cond_body, (), x, depth, TensorProto.BOOL))
        result = draw(_body_value(b, body, shape, x, depth))
        graph = _body(b, body, b.name("loop_body"),
                      [(step, TensorProto.INT64, []), (cond_in, TensorProto.BOOL, []), (carried, *value)],
                      [(cond_out, TensorProto.BOOL, []), (result, *value)])
        node = helper.make_node("Loop", [trips, go, start], [out], name=out + "_node", body=graph)
    else:  # a state carried over the batch's samples
        state, sample = b.name("state_"), b.name("sample_")
        # not its state unchanged as an output: onnxruntime's fp32 run returns zeros for it
        # (tests/test_control_flow.py checks qtool's int8 model against the ONNX reference there)
        body = _Scope([], [], outer + [state])
        result = draw(_body_value(b, body, shape, x, depth))
        graph = _body(b, body, b.name("scan_body"), [(state, *value), (sample, TensorProto.FLOAT, list(shape[1:]))],
                      [(result, *value)])
        node = helper.make_node("Scan", [start, x], [out], name=out + "_node", body=graph, num_scan_inputs=1)
    scope.nodes.append(node)
    if start not in _reads(node):  # an If whose branches did not read it
        scope.inits.remove(next(t for t in scope.inits if t.name == start))
    return out


def _reads(node: onnx.NodeProto) -> set[str]:
    """The names a node reads, in its bodies too."""
    names = set(node.input)
    for attr in node.attribute:
        if attr.HasField("g"):
            names |= {name for inner in attr.g.node for name in _reads(inner)}
    return names


@st.composite
def _head_layer(draw, b: Builder, x: str, ops: tuple = HEAD_OPS) -> str:
    (f,) = b.shapes[x]
    op = draw(st.sampled_from(ops))
    if op in ("Gemm", "MatMul"):
        k = draw(st.integers(1, 12))
        if op == "MatMul":
            return b.node("MatMul", [x, b.weight((f, k), f, 1)[0]], (k,))
        trans_b = draw(st.integers(0, 1))
        weight, factors = b.weight((k, f) if trans_b else (f, k), f, 0 if trans_b else 1)
        inputs = [x, weight]
        if draw(st.booleans()):
            inputs.append(b.bias(factors))
        alpha, beta = draw(st.sampled_from([(1.0, 1.0), (1.0, 1.0), (0.5, 1.0), (1.0, 2.0)]))
        return b.node("Gemm", inputs, (k,), transB=trans_b, alpha=alpha, beta=beta)
    if op == "Clip":
        return b.node("Clip", [x, b.const(np.array(0.0, np.float32)), b.const(np.array(6.0, np.float32))], (f,))
    if op == "Add":
        return b.node("Add", [x, b.const(b.rng.normal(0, 0.5, f).astype(np.float32))], (f,))
    if op == "Softmax" and f > SOFTMAX_MAX_AXIS:
        return x
    return b.node(op, [x], (f,))


@st.composite
def random_model(draw, trunk_ops: tuple = TRUNK_OPS,
                 head_ops: tuple = HEAD_OPS) -> tuple[onnx.ModelProto, tuple[int, int, int]]:
    """A random valid model with input `x` [N, C, H, W] (and int64 `ids` [N, C] when a layer reads
    token ids) and one output, its trunk drawn from `trunk_ops`, its head from `head_ops`; returns it
    and (C, H, W)."""
    b = Builder(np.random.default_rng(draw(st.integers(0, 2**32 - 1))))
    shape = (draw(st.integers(1, 6)), draw(st.integers(3, 10)), draw(st.integers(3, 10)))
    b.shapes["x"] = shape
    current = "x"
    for _ in range(draw(st.integers(1, 5))):
        current = draw(_trunk_layer(b, current, trunk_ops))
    if draw(st.booleans()):
        if draw(st.booleans()):
            current = b.node("GlobalAveragePool", [current], (b.shapes[current][0], 1, 1))
        c, h, w = b.shapes[current]
        current = b.node("Flatten", [current], (c * h * w,))
        for _ in range(draw(st.integers(1, 3))):
            current = draw(_head_layer(b, current, head_ops))
    if current == "x":
        current = b.node("Relu", ["x"], shape)
    inputs = [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", *shape])]
    if b.ids:
        inputs.append(helper.make_tensor_value_info("ids", TensorProto.INT64, ["N", *b.ids]))
    graph = helper.make_graph(b.nodes, "fuzz", inputs,
                              [helper.make_tensor_value_info(current, TensorProto.FLOAT, ["N", *b.shapes[current]])],
                              b.inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return model, shape


# what an exporter writes when it traces a graph at batch 1 and declares the batch dynamic anyway
BAKED_FORMS = ("Reshape", "ReshapeFolding", "Expand", "Tile")
BAKED_TRUNK_OPS = ("Conv", "Relu", "Sigmoid", "MaxPool", "Add", "Mul", "Concat")


@st.composite
def baked_batch_model(draw) -> tuple[onnx.ModelProto, tuple[int, int, int], str]:
    """A random trunk on x [N, C, H, W], N declared dynamic, with batch 1 baked in at a random
    point: a Reshape to a constant shape [1, C, W, H] (a traced view), a Reshape that folds the
    batch into the channels ([1, -1, H, W]), or a constant Expanded, or Tiled, to a fixed
    [1, C', H, W] and concatenated with the trunk on the channels. onnxruntime refuses a batch of
    several samples, or its outputs mix them; one sample runs. Returns (model, (C, H, W), form)."""
    b = Builder(np.random.default_rng(draw(st.integers(0, 2**32 - 1))))
    shape = (draw(st.integers(1, 4)), draw(st.integers(3, 8)), draw(st.integers(3, 8)))
    b.shapes["x"] = shape
    current = "x"
    for _ in range(draw(st.integers(0, 2))):
        current = draw(_trunk_layer(b, current, BAKED_TRUNK_OPS))
    form = draw(st.sampled_from(BAKED_FORMS))
    c, h, w = b.shapes[current]
    if form == "Reshape":
        current = b.node("Reshape", [current, b.const(np.array([1, c, w, h], np.int64))], (c, w, h))
    elif form == "ReshapeFolding":
        current = b.node("Reshape", [current, b.const(np.array([1, -1, h, w], np.int64))], (c, h, w))
    else:
        extra = draw(st.integers(1, 3))
        seed = b.const(b.rng.normal(0, 1, (1, extra, 1, 1)).astype(np.float32))
        if form == "Expand":
            fixed = b.node("Expand", [seed, b.const(np.array([1, extra, h, w], np.int64))], (extra, h, w))
        else:
            fixed = b.node("Tile", [seed, b.const(np.array([1, 1, h, w], np.int64))], (extra, h, w))
        current = b.node("Concat", [current, fixed], (c + extra, h, w), axis=1)
    for _ in range(draw(st.integers(1, 2))):
        current = draw(_trunk_layer(b, current, BAKED_TRUNK_OPS))
    graph = helper.make_graph(b.nodes, "baked", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", *shape])],
                              [helper.make_tensor_value_info(current, TensorProto.FLOAT, ["N", *b.shapes[current]])],
                              b.inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return model, shape, form
