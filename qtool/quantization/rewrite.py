"""Back end: rewrite the fp32 graph into an int8 QDQ graph.

QDQ form keeps every original op and surrounds it with QuantizeLinear/DequantizeLinear
pairs; onnxruntime (and TensorRT) pattern-match DQ -> op -> Q into integer kernels
(QLinearConv, QGemm, MatMulInteger...). Weights are stored as int8 initializers and
biases as int32 initializers, each followed by a DequantizeLinear, so the file is
about 4x smaller and the runtime never quantizes constants at load time.
"""

from __future__ import annotations

import itertools
import warnings
from dataclasses import dataclass, field
from typing import Callable, Iterator, Optional

import numpy as np
import onnx
from onnx import helper, numpy_helper

from qtool.table import qparams as qp
from qtool.graph.edit import drop_unread
from qtool.graph.index import (GraphIndex, attribute, bodies, default_opset, keep_initializers, made_in, matches,
                               names_read, node_label, replace_nodes, scoped_initializers)
from qtool.plan.ops import rule_for
from qtool.plan.planner import QuantPlan, row_gather
from qtool.quantization.ort_cpu.weight_only import KERNELS, MS_DOMAIN, stored_once, use_kernel_domain
from qtool.quantization.dynamic_matmul import DynamicMatMuls, Gathered
from qtool.config import QuantizeConfig
from qtool.targets import SYMMETRIC_HALF_GRID, target_of, weight_qmax

# Names of the tensors the rewrite adds. evaluate's per-layer matching relies on them:
# the DequantizeLinear output `<name>` + DQ_SUFFIX stands for fp32 tensor `<name>`.
Q_SUFFIX = "_QuantizeLinear_Output"
DQ_SUFFIX = "_DequantizeLinear_Output"
SCALE_SUFFIX = "_scale"
ZP_SUFFIX = "_zero_point"
WEIGHT_SUFFIX = "_quantized"

_NP_DTYPE = {"uint8": np.uint8, "int8": np.int8, "uint16": np.uint16, "int16": np.int16}
# Standard QuantizeLinear/DequantizeLinear take 16-bit types from this opset; before it,
# onnxruntime's com.microsoft ones do (it runs both, at any opset of the model)
SIXTEEN_BIT_OPSET = 21


def qdq_domain(model: onnx.ModelProto, dtype: str) -> str:
    """The domain of a QuantizeLinear/DequantizeLinear pair of integer type `dtype` in `model`."""
    if np.dtype(_NP_DTYPE[dtype]).itemsize == 1:
        return ""
    return "" if default_opset(model) >= SIXTEEN_BIT_OPSET else MS_DOMAIN


class _Builder:
    def __init__(self, model: onnx.ModelProto, scope: str = ""):
        self.model = model
        self.initializers: list[onnx.TensorProto] = []
        self.head: list[onnx.NodeProto] = []  # DQ nodes of constants, graph-input Q/DQ
        self.scope = scope  # a body's: names its copies of outer-scope values
        self.outer: dict[str, str] = {}  # outer-scope activation -> its DequantizeLinear output here

    def outer_activation(self, name: str, params: qp.QParams) -> str:
        """A body's own DequantizeLinear of an activation quantized in an enclosing graph: onnxruntime
        fuses DequantizeLinear -> op -> QuantizeLinear within one graph only, so a layer in a body
        reading the outer DequantizeLinear output would run in float."""
        if name not in self.outer:
            self.outer[name] = f"{name}{DQ_SUFFIX}{self.scope}"
            self.head.append(helper.make_node("DequantizeLinear", [name + Q_SUFFIX, name + SCALE_SUFFIX,
                                                                   name + ZP_SUFFIX],
                                              [self.outer[name]], name=f"{name}_DequantizeLinear{self.scope}",
                                              domain=qdq_domain(self.model, params.dtype) or None))
        return self.outer[name]

    def add_init(self, array: np.ndarray, name: str) -> str:
        self.initializers.append(numpy_helper.from_array(array, name))
        return name

    def qdq_pair(self, name: str, params: qp.QParams) -> list[onnx.NodeProto]:
        scale = self.add_init(np.array(params.scale, dtype=np.float32), name + SCALE_SUFFIX)
        zero = self.add_init(np.array(params.zero_point, dtype=_NP_DTYPE[params.dtype]), name + ZP_SUFFIX)
        domain = qdq_domain(self.model, params.dtype) or None  # None: no domain field, as before 16 bits
        return [
            helper.make_node("QuantizeLinear", [name, scale, zero], [name + Q_SUFFIX], name=name + "_QuantizeLinear",
                             domain=domain),
            helper.make_node("DequantizeLinear", [name + Q_SUFFIX, scale, zero], [name + DQ_SUFFIX],
                             name=name + "_DequantizeLinear", domain=domain),
        ]

    def quantized_constant(self, name: str, q: np.ndarray, scale: np.ndarray,
                           zero: np.ndarray) -> tuple[str, str, str]:
        return (self.add_init(q, name + WEIGHT_SUFFIX), self.add_init(scale, name + SCALE_SUFFIX),
                self.add_init(zero, name + ZP_SUFFIX))

    def dequantized_constant(self, name: str, q: np.ndarray, scale: np.ndarray, zero: np.ndarray,
                             axis) -> str:
        qname, sname, zname = self.quantized_constant(name, q, scale, zero)
        attrs = {"axis": axis} if axis is not None else {}
        self.head.append(helper.make_node("DequantizeLinear", [qname, sname, zname], [name + DQ_SUFFIX],
                                          name=name + "_DequantizeLinear", **attrs))
        return name + DQ_SUFFIX


def quantize_with(model: onnx.ModelProto, plan: QuantPlan, params: dict[str, qp.QParams], options: QuantizeConfig,
                  rounding: Optional[Callable] = None, bias_shift: Optional[Callable] = None
                  ) -> tuple[onnx.ModelProto, list[str]]:
    """quantize_graph with the grid arguments the options and their target give, and the
    activations `options.int16_activations` names in 16 bits. Dynamic MatMul weights are per
    column unless the options say per tensor (per_channel false, or dynamic_weights tensor)."""
    wide = {name for name in params if matches(name, options.int16_activations)}
    params = {name: qp.sixteen_bit(p) if name in wide else p for name, p in params.items()}
    return quantize_graph(model, plan, params, options.per_channel, weight_qmax(options.reduce_range),
                          options.activation_dtype, options.symmetric_activations, rounding,
                          target_of(options).symmetric_qmax,
                          options.per_channel and options.advanced.dynamic_weights != "tensor",
                          target_of(options).activation_placement == "every_op", bias_shift)


def quantize_graph(model: onnx.ModelProto, plan: QuantPlan, params: dict[str, qp.QParams],
                   per_channel: bool = True, weight_qmax: int = qp.WEIGHT_QMAX, activation_dtype: str = "uint8",
                   symmetric: bool = False, rounding: Optional[Callable] = None,
                   symmetric_qmax: float = SYMMETRIC_HALF_GRID,
                   dynamic_per_column: bool = True, exact_float_reads: bool = True,
                   bias_shift: Optional[Callable] = None) -> tuple[onnx.ModelProto, list[str]]:
    """Return the QDQ model and notes about what was adjusted (bias overflow, ...).

    `rounding({name: (weight, its final scales)})`: int8 values of the weights it rounds, by name
    (adaptive rounding); the others round to nearest. `bias_shift(bias, weight, dequantized)`:
    what to add to a float bias for its layer's weight as dequantized (bias correction,
    qtool.quantization.bias_correction.WeightShifts), or None to leave it. `symmetric_qmax`: the target's symmetric
    activation convention (qtool.targets), for constant operands quantized like activations.
    `exact_float_reads`: float readers of a float node's quantized output read its exact values
    (_exact_reads); off for a runtime that fuses each quantizer into the op before it, which then
    writes only the quantized values."""
    out = onnx.ModelProto()
    out.CopyFrom(model)
    graph = out.graph
    builder = _Builder(out)
    notes: list[str] = []
    float_inits = scoped_initializers(graph)  # a layer in a body may own its weight

    # Weights: int8 per output channel (or per tensor), symmetric, zero point 0.
    weight_scales: dict[str, np.ndarray] = {}
    weight_data: dict[str, np.ndarray] = {}
    for name, wplan in plan.weights.items():
        weight = numpy_helper.to_array(float_inits[name])
        axis = wplan.axis if per_channel else None
        weight_scales[name] = qp.weight_scales(weight, axis, weight_qmax)
        weight_data[name] = weight

    # Biases: int32, scale exactly s_in * s_w[c]; widen a channel's weight scale where the
    # int32 range would overflow (tiny input scale times tiny weight scale).
    float_biases: dict[str, tuple[np.ndarray, np.ndarray]] = {}  # float bias, its int32 scale
    widened: list[str] = []
    for name, bplan in plan.biases.items():
        if bplan.activation not in params or bplan.weight not in weight_scales:
            continue
        bias = numpy_helper.to_array(float_inits[name]).astype(np.float32)
        s_in = params[bplan.activation].scale
        scales = weight_scales[bplan.weight]
        per_out = np.tile(scales, bplan.groups) if scales.ndim else np.full(bias.shape, scales, np.float32)
        if per_out.shape != bias.shape:
            continue  # a bias that does not match the output channels stays float
        fixed, changed = qp.fit_weight_scales_to_bias(bias, s_in, per_out)
        if changed.size:
            if bplan.groups > 1 or scales.ndim == 0:
                # one weight scale serves several bias channels: widen it for all of them
                widest = fixed.reshape(bplan.groups, -1).max(axis=0) if scales.ndim else fixed.max()
                weight_scales[bplan.weight] = np.asarray(widest, np.float32)
                per_out = np.tile(widest, bplan.groups) if scales.ndim else np.full(bias.shape, widest, np.float32)
            else:
                weight_scales[bplan.weight] = fixed
                per_out = fixed
            widened.append(f"{bplan.node} ({changed.size})")
        b_scale = qp.bias_scale(s_in, per_out)
        if weight_scales[bplan.weight].ndim == 0 and b_scale.size:
            b_scale = b_scale.reshape(-1)[0].reshape(())  # per-tensor: one scale, no axis (opset < 13 has none)
        float_biases[name] = (bias, b_scale)

    if widened:
        notes.append(f"int32 bias would overflow in near-zero weight channels; widened the weight scale of those "
                     f"channels in {len(widened)} layer(s): {', '.join(widened)}")

    forms: dict[str, tuple] = {}  # float constant -> (int values, scale, zero point, axis) of its DequantizeLinear
    chosen = rounding({name: (weight, weight_scales[name]) for name, weight in weight_data.items()}) if rounding else {}
    for name, weight in weight_data.items():
        axis = plan.weights[name].axis if per_channel else None
        scales = weight_scales[name]
        q = chosen.get(name)
        q = qp.quantize_weight(weight, scales, axis, weight_qmax) if q is None else q
        forms[name] = (q, scales, np.zeros(scales.shape, np.int8), axis if scales.ndim else None)
    bias_arrays: dict[str, tuple[np.ndarray, np.ndarray]] = {}  # int32 bias, its scale
    for name, (bias, b_scale) in float_biases.items():
        shift = None
        if bias_shift is not None:
            weight = plan.biases[name].weight
            q, scales, _, axis = forms[weight]
            shape = [1] * q.ndim
            if axis is not None:
                shape[axis] = -1
            shift = bias_shift(name, weight_data[weight], q * scales.astype(np.float64).reshape(shape))
        bias_arrays[name] = (qp.quantize_bias(bias if shift is None else (bias + shift).astype(np.float32), b_scale),
                             b_scale)
    for name in plan.constants:
        # a constant operand: quantized per tensor like an activation, over its own exact range
        values = numpy_helper.to_array(float_inits[name]).astype(np.float32)
        if values.size == 0 or not np.all(np.isfinite(values)):
            continue
        cp = qp.activation_qparams(float(values.min()), float(values.max()), activation_dtype, symmetric,
                                   symmetric_qmax)
        qmin, qmax = qp.INT_RANGES[activation_dtype]
        q = np.clip(np.rint(values.astype(np.float64) / cp.scale) + cp.zero_point, qmin, qmax)
        forms[name] = (q.astype(_NP_DTYPE[activation_dtype]), np.array(cp.scale, np.float32),
                       np.array(cp.zero_point, _NP_DTYPE[activation_dtype]), None)
    for name, (q, scale) in bias_arrays.items():
        forms[name] = (q, scale, np.zeros(scale.shape, np.int32), 0 if scale.ndim else None)
    # the main graph's layers' constants are dequantized at its head; a body's inside the body (below)
    owner = {**{n: w.node for n, w in plan.weights.items()}, **plan.constants,
             **{n: b.node for n, b in plan.biases.items()}}
    top = {node_label(node) for node in graph.node}
    constants = _Constants(forms, builder)
    for name in forms:
        if owner[name] in top:
            constants.dequantized(name)

    activations = [a for a in plan.activations if a in params]
    graph_inputs = {i.name for i in graph.input}
    for name in activations:
        if name in graph_inputs:
            builder.head.extend(builder.qdq_pair(name, params[name]))

    row_scales = {name: _int8_rows(name, numpy_helper.to_array(float_inits[name]), builder)
                  for name in plan.embeddings}

    quantized_nodes = set(plan.quantized_nodes)
    dynamic = {label: p for label, p in plan.dynamic.items() if label in quantized_nodes}
    dynamic_matmuls = DynamicMatMuls(builder.add_init, weight_qmax, dynamic_per_column,
                                     _gathered_rows(graph, plan, set(row_scales)) if plan.dynamic_matmuls else None)
    rewrite = _NodeRewrite(plan, params, set(activations), quantized_nodes, dynamic, float_inits, per_channel,
                           weight_qmax, row_scales, dynamic_matmuls, stored_once(builder.quantized_constant),
                           exact_float_reads)
    new_nodes = rewrite.nodes(graph, builder, constants)
    wide = sorted(name for name in activations if params[name].dtype in qp.SIXTEEN_BITS.values())
    if wide:
        if qdq_domain(out, params[wide[0]].dtype) == MS_DOMAIN:
            use_kernel_domain(out)
        shown = ", ".join(wide[:10]) + (f" and {len(wide) - 10} more" if len(wide) > 10 else "")
        notes.append(f"{len(wide)} activation(s) in 16 bits ({params[wide[0]].dtype}: the calibrated ranges on a "
                     f"grid about 256 times finer; onnxruntime runs the nodes reading or writing them in "
                     f"float): {shown}")
    if dynamic:
        use_kernel_domain(out)
        kernels = sorted({p.kernel for p in dynamic.values()})
        notes.append(f"{len(dynamic)} recurrent layer(s) with int8 weights ({', '.join(kernels)}: weights int8 per "
                     f"{'gate column' if per_channel else 'direction'}, activations quantized at run time)")
    _install(graph, builder, new_nodes)
    if dynamic_matmuls.tables:
        drop_unread(graph)  # the float Gather and its table, read as codes now
        notes.append(f"{dynamic_matmuls.tables} embedding table(s) read by dynamic int8 MatMuls stored as uint8 "
                     "codes with one scale: the MatMuls read the gathered codes (no quantization at run time)")
    return out, notes


def _gathered_rows(graph: onnx.GraphProto, plan: QuantPlan, int8_rows: set[str]) -> Gathered:
    """Which dynamic MatMul inputs are rows of a constant table: written by a row Gather
    (planner.row_gather) of a 2-D float32 initializer that nothing else reads and that is not
    stored as int8 rows, and read only as the first input of dynamic MatMul/Gemm layers."""
    index = GraphIndex(graph)
    dynamic = set(plan.dynamic_matmuls)

    def rows(name: str) -> Optional[tuple[onnx.NodeProto, np.ndarray]]:
        gather = index.producer.get(name)
        if gather is None or name in index.outputs or not row_gather(gather, gather.input[0], index):
            return None
        table = gather.input[0]
        if (table not in index.initializers or table in int8_rows or len(index.consumers.get(table, [])) != 1
                or index.initializers[table].data_type != onnx.TensorProto.FLOAT
                or len(index.initializers[table].dims) != 2):
            return None
        readers = index.consumers.get(name, [])
        if not readers or any(node_label(r) not in dynamic or r.op_type not in ("MatMul", "Gemm") or r.input[0] != name
                              or attribute(r, "transA", 0) for r in readers):
            return None
        return gather, numpy_helper.to_array(index.initializers[table])
    return rows


def _install(graph: onnx.GraphProto, builder: "_Builder", new_nodes: list[onnx.NodeProto]) -> None:
    """The rewritten nodes in place of the graph's (the builder's head first); the initializers no
    node reads any more go (an int8 copy replaced them), the builder's new ones join."""
    used = {name for node in new_nodes + builder.head for name in names_read(node)}
    keep_initializers(graph, lambda t: t.name in used)
    graph.initializer.extend(builder.initializers)
    replace_nodes(graph, builder.head + new_nodes)


class _Constants:
    """Where each quantized constant's DequantizeLinear output is, per scope: a graph reads those it
    or an enclosing graph made, and makes the others (a body makes its layers' own, so the runtime
    finds DequantizeLinear -> op in one graph and fuses them). A constant dequantized in several
    bodies gets one copy per body, each under a name of its own."""

    def __init__(self, forms: dict[str, tuple], builder: _Builder, outer: Optional["_Constants"] = None,
                 taken: Optional[set[str]] = None):
        self.forms, self.builder, self.outer = forms, builder, outer
        self.taken = set() if taken is None else taken  # base names used, over the whole model
        self.made: dict[str, str] = {}

    def inner(self, builder: _Builder) -> "_Constants":
        return _Constants(self.forms, builder, self, self.taken)

    def _found(self, name: str) -> Optional[str]:
        return self.made.get(name) or (self.outer._found(name) if self.outer else None)

    def dequantized(self, name: str) -> Optional[str]:
        """The DequantizeLinear output standing for float constant `name` here; None if it stays float."""
        found = self._found(name)
        if found is None and name in self.forms:
            base = name if name not in self.taken else name + self.builder.scope
            self.taken.add(base)
            found = self.made[name] = self.builder.dequantized_constant(base, *self.forms[name])
        return found


@dataclass(frozen=True)
class _NodeRewrite:
    """The rewrite of one graph's nodes, applied to the main graph and to each If/Loop/Scan body
    inside it (with the body's own builder: its Q/DQ pairs, scales and int8 weights live in it)."""

    plan: QuantPlan
    params: dict[str, qp.QParams]
    act_set: set[str]
    quantized_nodes: set[str]
    dynamic: dict
    float_inits: dict[str, onnx.TensorProto]
    per_channel: bool
    weight_qmax: int
    row_scales: dict[str, str]
    dynamic_matmuls: DynamicMatMuls
    store_kernel_weights: Callable
    exact_float_reads: bool = True
    scopes: Iterator[int] = field(default_factory=itertools.count)  # numbers the bodies

    def nodes(self, graph: onnx.GraphProto, builder: _Builder, constants: _Constants) -> list[onnx.NodeProto]:
        """The graph's new nodes (builder.head not included: the caller placed the graph inputs' Q/DQ pairs)."""
        params, act_set, quantized_nodes, dynamic = self.params, self.act_set, self.quantized_nodes, self.dynamic
        graph_inputs = {i.name for i in graph.input}
        local = set(made_in(graph))
        exact = _exact_reads(graph, quantized_nodes, act_set) if self.exact_float_reads else set()
        dynamic_matmuls = set(self.plan.dynamic_matmuls)
        new_nodes: list[onnx.NodeProto] = []
        for node in graph.node:
            for _, body in bodies(node):
                self._body(body, builder, constants)
            if node_label(node) in dynamic_matmuls:
                new_nodes.extend(self.dynamic_matmuls.rewrite(node, numpy_helper.to_array(
                    self.float_inits[node.input[1]])))
                continue
            if node.op_type == "Gather" and node.input[0] in self.row_scales:
                new_nodes.extend(_gather_int8_rows(node, self.row_scales[node.input[0]]))
                for output in node.output:
                    if output in act_set:
                        new_nodes.extend(builder.qdq_pair(output, params[output]))
                continue
            # Every consumer of a quantized activation reads its DequantizeLinear output: a
            # producer whose output went both to Q and elsewhere could not be fused; but see _exact_reads.
            for i, name in enumerate(node.input):
                if name in act_set and (name, node_label(node)) in exact:
                    continue
                if name in act_set:
                    node.input[i] = name + DQ_SUFFIX if name in local else builder.outer_activation(name, params[name])
                elif node_label(node) in quantized_nodes and _constant_slot(node, i):
                    node.input[i] = constants.dequantized(name) or name
            if _needs_float_guard(node, quantized_nodes, act_set, self.float_inits):
                new_nodes.append(float_guard(node, builder.add_init))
            if node_label(node) in dynamic:
                weights = {name: numpy_helper.to_array(self.float_inits[name])
                           for name in dynamic[node_label(node)].weights}
                node = KERNELS[dynamic[node_label(node)].kernel](node, weights, self.per_channel, self.weight_qmax,
                                                                 self.store_kernel_weights)
            new_nodes.append(node)
            for output in node.output:
                if output in act_set and output not in graph_inputs:
                    new_nodes.extend(builder.qdq_pair(output, params[output]))
        return new_nodes

    def _body(self, body: onnx.GraphProto, outer: _Builder, constants: _Constants) -> None:
        """Rewrite a body in place: its inputs' Q/DQ pairs and its constants' DequantizeLinear first,
        then its nodes; the initializers it no longer reads go (an int8 copy replaced them)."""
        builder = _Builder(outer.model, f"_body{next(self.scopes)}")
        for name in [i.name for i in body.input if i.name in self.act_set]:
            builder.head.extend(builder.qdq_pair(name, self.params[name]))
        _install(body, builder, self.nodes(body, builder, constants.inner(builder)))


def _exact_reads(graph: onnx.GraphProto, quantized_nodes: set[str], act_set: set[str]) -> set[tuple[str, str]]:
    """(tensor, reader) pairs where a float reader of a quantized activation reads its exact values: the
    tensor is made by a float node or is the graph's input (a producer that fuses nothing), and what the
    reader computes reaches no int8 node except through a quantized activation of its own (a Shape
    whose values an int8 Reshape reads stays on the DequantizeLinear, as before: it reads no values).
    Such a reader (a graph output's Reshape beside the int8 Concat the tensor also feeds) then
    computes on the values the model made, not on another reader's grid."""
    index = GraphIndex(graph)
    readers = index.consumers
    reaches: dict[str, bool] = {}  # read by an int8 node directly or through float nodes, not re-quantized

    def carries(reader: onnx.NodeProto) -> bool:
        return any(o and o not in act_set and reaches.get(o, False) for o in reader.output)

    for node in reversed(graph.node):  # readers come after their producer in a valid graph
        for name in node.output:
            reaches[name] = any(node_label(r) in quantized_nodes or carries(r) for r in readers.get(name, []))
    made_float = {i.name for i in graph.input} | {name for name, producer in index.producer.items()
                                                  if node_label(producer) not in quantized_nodes}
    return {(name, node_label(reader)) for name in act_set & made_float for reader in readers.get(name, [])
            if node_label(reader) not in quantized_nodes and not carries(reader)}


def _int8_rows(name: str, table: np.ndarray, builder: _Builder) -> str:
    """Store an embedding table int8 with one symmetric scale per row; returns the scales' name.
    The scales keep the table's rank ([V, 1, ...]) so that gathered with the rows they broadcast
    over them. 8 bits, not the 7 of reduce_range: no integer kernel ever sums these values."""
    scales = qp.weight_scales(table, 0)
    builder.add_init(qp.quantize_weight(table, scales, 0), name + WEIGHT_SUFFIX)
    return builder.add_init(scales.reshape((-1,) + (1,) * (table.ndim - 1)), name + SCALE_SUFFIX)


def _gather_int8_rows(node: onnx.NodeProto, scales: str) -> list[onnx.NodeProto]:
    """Gather(table, ids) -> Gather(int8 table, ids) * Gather(row scales, ids), the same values as a
    DequantizeLinear of the table but computed for the gathered rows only. A DequantizeLinear on
    the table would dequantize all of it on every run (onnxruntime does not fold it), and one after
    the Gather cannot take per-row scales (its scale is 1-D along an
    axis; the rows' scales have the shape of the indices)."""
    table, ids = node.input
    out, label = node.output[0], node_label(node)
    codes, row_scale, values = out + "_int8_rows", out + "_row_scales", out + "_int8_rows_float"
    return [
        helper.make_node("Gather", [table + WEIGHT_SUFFIX, ids], [codes], name=label, axis=0),
        helper.make_node("Gather", [scales, ids], [row_scale], name=label + "_row_scales", axis=0),
        helper.make_node("Cast", [codes], [values], name=label + "_cast", to=onnx.TensorProto.FLOAT),
        helper.make_node("Mul", [values, row_scale], [out], name=label + "_dequantize"),
    ]


GUARDED_OPS = ("Conv", "ConvTranspose", "Gemm")
FLOAT_GUARD_SUFFIX = "_float_guard"


def _needs_float_guard(node: onnx.NodeProto, quantized_nodes: set[str], act_set: set[str],
                       float_inits: dict) -> bool:
    """A float Conv/ConvTranspose/Gemm reading a DequantizeLinear output with a float weight
    initializer: onnxruntime's WeightBiasQuantization transformer would quantize its weight to
    per-tensor int8 behind our back, so a layer left in float would not be float at all
    (docs/design/float-guard.md)."""
    return (node.op_type in GUARDED_OPS and node.domain in ("", "ai.onnx") and node_label(node) not in quantized_nodes
            and len(node.input) > 1 and node.input[0].endswith(DQ_SUFFIX)
            and node.input[0][:-len(DQ_SUFFIX)] in act_set and node.input[1] in float_inits)


def float_guard(node: onnx.NodeProto, add_init: Callable[[np.ndarray, str], str]) -> onnx.NodeProto:
    """Max(x, lowest float32): the identity for every finite x, an op between the DequantizeLinear
    and the float layer that no onnxruntime transformer removes or moves a DequantizeLinear across.
    Rewires `node` to read it and returns the new node; `add_init(array, name)` stores the constant."""
    source = node.input[0]
    guarded = node_label(node) + FLOAT_GUARD_SUFFIX
    lowest = add_init(np.array(np.finfo(np.float32).min, np.float32), guarded + "_lowest")
    node.input[0] = guarded
    return helper.make_node("Max", [source, lowest], [guarded], name=guarded)


def _constant_slot(node: onnx.NodeProto, index: int) -> bool:
    rule = rule_for(node.op_type, node.domain)
    if rule is None:
        return False
    if rule.quantize_constants and (rule.activations is None or index in rule.activations):
        return True
    return index in (rule.weight, rule.bias)


def warn_notes(notes: list[str]) -> None:
    for note in notes:
        warnings.warn(note, stacklevel=2)
