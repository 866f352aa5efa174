"""Middle end: decide, per tensor, how the graph will be quantized.

The plan is a pure function of the prepared graph and the options. Calibration uses
it to know which tensors to observe (only these, not every tensor of the graph), and
quantization uses it again to know where Q/DQ pairs go, so both always agree.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable, Collection, Optional

import onnx

from pathlib import Path

from qtool.config import EMBEDDING_AUTO_BYTES, QuantizeConfig
from qtool.errors import QtoolError
from qtool.graph.modelio import input_specs
from qtool.graph.index import (GraphIndex, attribute, bodies, made_in, matches, node_label,
                               scoped_nodes)
from qtool.plan.dynamic import dynamic_layer, matmul_strategy
from qtool.plan.ops import OpRule, float_blocks, rule_for
from qtool.plan.ops.pad import pad_value
from qtool.targets import Target, target_of
from qtool.graph.shapes import infer_shapes
from qtool.plan.smooth_quant import smooth, smoothing_alpha
from qtool.plan.speed import WEIGHTED
from qtool.prepare.equalize import equalize, equalize_activations
from qtool.prepare.graph_prep import divisions_to_multiplications, per_channel_possible, prepare_file
from qtool.prepare.passes import PASSES as PREPARE_PASSES
from qtool.prepare.merge_matmuls import merge_shared_input_matmuls


@dataclass(frozen=True)
class WeightPlan:
    tensor: str
    axis: Optional[int]  # None: per tensor
    node: str


@dataclass(frozen=True)
class BiasPlan:
    tensor: str
    activation: str  # the node's quantized input, whose scale multiplies the weight's
    weight: str
    groups: int  # ConvTranspose with groups: per-channel weight scales repeat per group
    node: str


@dataclass(frozen=True)
class DynamicPlan:
    """A weight-only node: its constant weights are stored int8 and it becomes `kernel`, which
    quantizes its activations itself at run time (no Q/DQ, no calibration)."""

    node: str
    kernel: str
    weights: tuple[str, ...]


@dataclass
class QuantPlan:
    activations: list[str] = field(default_factory=list)  # Q/DQ per tensor, in graph order
    weights: dict[str, WeightPlan] = field(default_factory=dict)
    biases: dict[str, BiasPlan] = field(default_factory=dict)
    tie_groups: list[list[str]] = field(default_factory=list)  # tensors sharing scale and zero point
    fixed: dict[str, OpRule] = field(default_factory=dict)  # tensor -> rule fixing its output range
    quantized_nodes: list[str] = field(default_factory=list)
    float_nodes: list[str] = field(default_factory=list)  # nodes left in float, with their op type
    fused: list[str] = field(default_factory=list)  # compute outputs absorbed by the activation after them
    # float constant operands stored quantized per tensor (Add/Mul operands) -> first node reading them
    constants: dict[str, str] = field(default_factory=dict)
    # tensor -> a real value its range must contain (a Pad's non-zero constant border)
    include_values: dict[str, float] = field(default_factory=dict)
    # what preparing the graph did (opset converted or kept), and why nodes an int8 kernel exists for
    # elsewhere stay float
    notes: list[str] = field(default_factory=list)
    # embedding tables stored int8 per row (weight-only) -> the Gather nodes reading them
    embeddings: dict[str, list[str]] = field(default_factory=dict)
    dynamic: dict[str, DynamicPlan] = field(default_factory=dict)  # node -> its weight-only rewrite
    # on a target writing signed codes uint8 (Target.signed_as_uint8), the activations that stay int8
    # with zero point 0 (qtool.table.resolve): those only layers and Target.int8_code_readers read directly
    # (with a zero point OpenVINO's AMX int8 convolutions take longer), those only MatMul/Gemm layers read (OpenVINO
    # fuses a FullyConnected's dequantization only without a zero point), and the layer outputs quantized for
    # the runtime's sake (Target.requantize_beside) that no int8 layer reads (dequantized at once:
    # a zero point adds a Subtract to the Convert and Multiply)
    int8_kept: list[str] = field(default_factory=list)

    def int8_weights(self) -> int:
        """Weights stored int8: the QDQ layers', the weight-only kernels' and the dynamic MatMuls'."""
        return len(self.weights) + sum(len(d.weights) for d in self.dynamic.values()) + len(self.dynamic_matmuls)
    # MatMul/Gemm run with dynamic int8 activations (qtool.plan.dynamic); every other node is float
    dynamic_matmuls: list[str] = field(default_factory=list)

    def group_of(self) -> dict[str, int]:
        return {t: i for i, group in enumerate(self.tie_groups) for t in group}


def _excluded(node: onnx.NodeProto, options: QuantizeConfig) -> bool:
    if node.op_type in options.exclude_op_types:
        return True
    return matches(node_label(node), options.exclude_nodes)


def build_plan(model: onnx.ModelProto, options: QuantizeConfig, only: Optional[Collection[str]] = None,
               keep_float: Collection[str] = ()) -> QuantPlan:
    """`only`: quantize just these nodes (names, or first output for unnamed nodes); every
    other node is treated as excluded. The sensitivity ranking quantizes one layer at a time.
    `keep_float`: nodes (same labels) treated as excluded, those whose int8 form onnxruntime
    cannot run (qtool.quantization.run_check); the options' settled `float_nodes` join them."""
    keep_float = {*keep_float, *options.advanced.float_nodes}
    ctx = GraphIndex(model)
    if matmul_strategy(model, ctx, options)[0] == "dynamic":
        return _dynamic_plan(model, ctx, options, only, keep_float)
    plan = QuantPlan()
    per_channel = per_channel_possible(model)  # an opset < 13 the converter could not (or may not) lift
    scope = _Scope(per_channel, options, only, keep_float)
    _plan_graph(model.graph, ctx, plan, scope)
    plan.fused = sorted(scope.fused)
    plan.activations = scope.ordered
    plan.tie_groups = _merge_groups(scope.ties)
    plan.embeddings = _embedding_tables(model, ctx, options, only)
    target = target_of(options)
    if target.signed_as_uint8 and options.symmetric_activations:
        plan.int8_kept = _int8_codes(plan, ctx, (*WEIGHTED, *target.int8_code_readers)) + \
            [t for t in scope.requantized if t in scope.quantized]
    return plan


_LINEAR = ("MatMul", "Gemm")
_CONVOLUTIONS = ("Conv", "ConvTranspose", "QLinearConv", "ConvInteger")


def _int8_codes(plan: QuantPlan, ctx: GraphIndex, readers_kept: tuple[str, ...]) -> list[str]:
    """The planned activations of the main graph whose codes stay int8 on a target writing signed
    codes uint8 (Target.signed_as_uint8): those only `readers_kept` read directly (the layers and the
    target's int8_code_readers: no Split, Concat or pooling passes the codes on), and
    those MatMul/Gemm layers read, directly or through ops that only move values (a Reshape,
    Transpose, Concat), and no Conv reads so; a shared-scale group goes as a whole. For the second,
    readers in float (a residual Add) do not count."""
    def layers_only(name: str) -> bool:
        readers = ctx.consumers.get(name, [])
        return bool(readers) and all(node.op_type in readers_kept and node.domain in ("", "ai.onnx")
                                     for node in readers)

    def linear_only(name: str, depth: int = 0) -> Optional[bool]:
        """True: a MatMul/Gemm reads it; False: a Conv does; None: neither."""
        found = None
        for node in ctx.consumers.get(name, []):
            if node.op_type in _CONVOLUTIONS or node.op_type in _CONTROL_FLOW:
                return False  # (a body's readers are not followed)
            if node.op_type in _LINEAR and node.domain in ("", "ai.onnx"):
                found = True
            elif node.op_type in (*_MOVERS, "Concat") and depth < 16:
                for out in node.output:
                    below = linear_only(out, depth + 1) if out else None
                    if below is False:
                        return False
                    found = found or below
        return found

    main = set(ctx.producer) | {i.name for i in ctx.graph.input}
    eligible = {name for name in plan.activations
                if name in main and name not in plan.fixed and (layers_only(name) or linear_only(name))}
    for group in plan.tie_groups:
        if not all(name in eligible for name in group):
            eligible.difference_update(group)
    return [name for name in plan.activations if name in eligible]


@dataclass
class _Scope:
    """What planning the main graph and its If/Loop/Scan bodies shares: the options, and the
    tensors planned so far (a body may read the main graph's tensors)."""

    per_channel: bool
    options: QuantizeConfig
    only: Optional[Collection[str]]
    keep_float: Collection[str]
    quantized: set[str] = field(default_factory=set)
    ordered: list[str] = field(default_factory=list)
    fused: set[str] = field(default_factory=set)
    ties: list[list[str]] = field(default_factory=list)
    requantized: list[str] = field(default_factory=list)


def _plan_graph(graph: onnx.GraphProto, ctx: GraphIndex, plan: QuantPlan, scope: _Scope) -> None:
    """Plan one graph's nodes, then its nodes' bodies in turn (the same rules: a body's node is
    quantized in place, its outer-scope inputs through `ctx`, which sees the enclosing scopes)."""
    options, only, keep_float, per_channel = scope.options, scope.only, scope.keep_float, scope.per_channel
    blocks = float_blocks(ctx)
    if blocks.counts:
        found = ", ".join(f"{count} {name}" for name, count in blocks.counts.items())
        plan.notes.append(f"blocks kept float ({len(blocks.nodes)} nodes): {found}")
    rules: dict[int, OpRule] = {}
    chosen_float: set[int] = set()  # float by the options, the search or the latency choice
    chosen_rules: dict[int, OpRule] = {}  # ... and their rules, where they would be int8 otherwise
    for index, node in enumerate(graph.node):
        rule = rule_for(node.op_type, node.domain)
        label = node_label(node)
        chosen = _excluded(node, options) or (only is not None and label not in only) or label in keep_float
        note = None
        if rule is not None and label not in blocks.nodes:
            note = _float_note(node, rule, ctx, target_of(options))
            if note is None and (not rule.applies or rule.applies(node, ctx)):
                (chosen_rules if chosen else rules)[index] = rule
        if index not in rules:
            plan.float_nodes.append(f"{label} ({node.op_type})")
            if chosen:
                chosen_float.add(index)
            else:
                plan.notes.extend([note] if note else [])

    # A Relu/Clip after a float op (no rule, excluded, weight-only) runs in float with it: quantizing
    # its input would only add a Q/DQ pair that no kernel absorbs (onnxruntime leaves DQ -> Q behind).
    nodes = list(graph.node)
    for index in [i for i, r in rules.items() if r.fusable_activation]:
        producer = ctx.producer.get(nodes[index].input[0])
        if producer is not None and not _int8_output(nodes.index(producer), rules):
            node = nodes[index]
            del rules[index]
            plan.float_nodes.append(f"{node_label(node)} ({node.op_type})")
    inputs_only = target_of(options).activation_placement == "inputs_of_int8_ops"
    if inputs_only:
        _int8_layers_only(nodes, rules, ctx, plan)
    elif target_of(options).float_outputs:
        _float_before_float(nodes, rules, chosen_float, ctx, plan)

    # Compute op -> activation pairs that the runtime fuses: the compute output gets no Q/DQ.
    fused: set[str] = scope.fused  # the enclosing scopes' too: a body never quantizes a fused tensor
    for index, rule in rules.items():
        node = nodes[index]
        if not rule.absorbs_activation or not node.output:
            continue
        out = node.output[0]
        users = ctx.consumers.get(out, [])
        if out in ctx.outputs or len(users) != 1:
            continue
        user_index = nodes.index(users[0])
        user_rule = rules.get(user_index)
        if user_rule is not None and user_rule.fusable_activation:
            fused.add(out)
        elif (target_of(options).fuses_residual_add and rule.weight is not None and users[0].op_type == "Add"
              and user_rule is not None and not any(i in fused for i in users[0].input)):
            # a runtime that fuses a weighted layer into the residual Add after it (Conv+Add+Relu):
            # the layer's output gets no Q/DQ, the Add's other input does.
            fused.add(out)

    quantized, ordered = scope.quantized, scope.ordered
    # the tail as if the chosen float nodes were int8: a node kept float leaves its neighbours as they
    # were (a tensor the all-int8 plan leaves float never gets a Q/DQ, nor needs a range, for it)
    tail = _float_tail(nodes, {**rules, **chosen_rules}, ctx, fused) if target_of(options).float_outputs else set()
    if target_of(options).float_outputs and not inputs_only:
        tail |= _written_float(nodes, rules, ctx, fused)

    def want(name: str) -> None:
        if (name and name not in quantized and ctx.is_float(name) and not ctx.is_constant(name) and name not in fused
                and name not in blocks.tensors and name not in tail):
            quantized.add(name)
            ordered.append(name)

    ties = scope.ties
    if inputs_only:
        want = _concat_inputs(want, ctx, ties, quantized)
    # Movement ops ("tie") are quantized only where their data input already is, so a
    # Reshape on a float path does not pull Q/DQ into it. Graph order makes chains work.
    for index, node in enumerate(nodes):
        rule = rules.get(index)
        if rule is None:
            continue
        if rule.kernel:
            label = node_label(node)
            plan.dynamic[label] = DynamicPlan(label, rule.kernel, tuple(node.input[i] for i in rule.kernel_weights))
            plan.quantized_nodes.append(label)
            continue
        inputs = [i for i in range(len(node.input))] if rule.activations is None else list(rule.activations)
        if rule.weight is None and all(o in tail or o in ctx.outputs for o in _planned_outputs(node, rule)):
            plan.float_nodes.append(f"{node_label(node)} ({node.op_type})")  # it computes the outputs in float
            continue
        if rule.output == "tie":
            data = [node.input[i] for i in inputs if i < len(node.input) and node.input[i]]
            producer_quantized = any(name in quantized or _produced_by_quantized(name, ctx, rules, nodes)
                                     for name in data)
            if not producer_quantized or not node.output or not ctx.is_float(node.output[0]):
                plan.float_nodes.append(f"{node_label(node)} ({node.op_type})")
                continue
        _plan_node(node, rule, inputs, ctx, plan, want, fused, per_channel)
        if inputs_only and rule.weight is not None and _mixed_readers(node, ctx, target_of(options).requantize_beside):
            want(node.output[0])
            if not any(r.op_type in (*_CONVOLUTIONS, *_LINEAR) for r in ctx.consumers[node.output[0]]):
                scope.requantized.append(node.output[0])
        # A tie op's every float output (Split has several) shares the input's parameters;
        # other ops quantize their first output (MaxPool's second one is int64 indices).
        outputs = _planned_outputs(node, rule)
        tied_inputs = [n for n in (node.input[i] for i in inputs if i < len(node.input)) if n in quantized]
        tied_outputs = []
        for out in ([] if inputs_only else outputs):
            if out and out not in fused and out not in ctx.outputs and ctx.is_float(out):
                want(out)
                tied_outputs.append(out)
                if rule.output == "fixed":
                    plan.fixed[out] = rule
        if rule.output == "tie" and tied_outputs:
            ties.append(tied_inputs + tied_outputs)
            if node.op_type == "Pad":
                value = pad_value(node, ctx)
                if value != 0.0:
                    plan.include_values[tied_outputs[0]] = value
        plan.quantized_nodes.append(node_label(node))

    for node in graph.node:
        for _, body in bodies(node):
            _plan_graph(body, GraphIndex(body, outer=ctx), plan, scope)


def unreached_bodies(graph: onnx.GraphProto, activations: Collection[str], reached: Callable[[str], bool]
                     ) -> tuple[list[str], list[str]]:
    """(labels of the nodes to keep float, notes naming each body): the If branches and Loop/Scan
    bodies the calibration data never ran. A body ran if one of the planned activations it
    computes (or a body inside it computes) was seen; it has no range otherwise, so it stays float.
    A body with no planned activation needs no range (a weight-only LSTM) and is not judged."""
    planned = set(activations)
    kept: list[str] = []
    notes: list[str] = []

    def ran(body: onnx.GraphProto) -> Optional[bool]:
        """Whether `body` ran; None when neither it nor a body inside it computes a planned activation."""
        own = [t for t in made_in(body) if t in planned]
        inner = [v for node in body.node for _, b in bodies(node) if (v := ran(b)) is not None]
        return any(reached(t) for t in own) or any(inner) if own or inner else None

    def visit(graph: onnx.GraphProto) -> None:
        for node in graph.node:
            for attr, body in bodies(node):
                if ran(body) is False:
                    labels = [node_label(n) for n in scoped_nodes(body)]
                    kept.extend(labels)
                    notes.append(f"{node.op_type} node '{node_label(node)}': its {attr} never ran on the "
                                 f"calibration data, so its {len(labels)} node(s) have no ranges and stay float")
                else:
                    visit(body)

    visit(graph)
    return kept, notes


def _dynamic_plan(model: onnx.ModelProto, ctx: GraphIndex, options: QuantizeConfig,
                  only: Optional[Collection[str]], keep_float: Collection[str]) -> QuantPlan:
    """The weighted MatMul/Gemm (and fused attentions) quantized dynamically, every other node float
    (no Q/DQ, no ranges)."""
    plan = QuantPlan()
    for node in model.graph.node:
        label = node_label(node)
        if (dynamic_layer(node, ctx) and not _excluded(node, options) and (only is None or label in only)
                and label not in keep_float):
            plan.dynamic_matmuls.append(label)
            plan.quantized_nodes.append(label)
        else:
            plan.float_nodes.append(f"{label} ({node.op_type})")
    plan.embeddings = _embedding_tables(model, ctx, options, only)
    return plan


def _embedding_tables(model: onnx.ModelProto, ctx: GraphIndex, options: QuantizeConfig,
                      only: Optional[Collection[str]]) -> dict[str, list[str]]:
    """Float tables that only Gathers read, by row (axis 0) at computed indices: token, position
    or character embeddings. Stored int8 per row they shrink about 4x (a BERT's word table is half
    its file); the Gather moves int8 rows and the rows are dequantized after it, so the cost is one
    multiply per gathered value. Every reader must be such a Gather, else the float table stays in
    the file and nothing is saved. `auto` takes tables of EMBEDDING_AUTO_BYTES or more (below that
    the saving is small and the graph stays as it was), on a target with Target.int8_embeddings only:
    where the int8 Gather -> Cast -> Mul was measured; `int8` with `embedding_tables` takes those only."""
    if options.advanced.embeddings == "float" or (options.advanced.embeddings == "auto"
                                                  and not target_of(options).int8_embeddings):
        return {}
    auto = options.advanced.embeddings == "auto"
    listed = options.advanced.embedding_tables  # as `auto` settled them (qtool.choices.embeddings)
    in_bodies = ctx.body_readers
    tables: dict[str, list[str]] = {}
    for name, init in ctx.initializers.items():
        users = ctx.consumers.get(name, [])
        if (not users or name in ctx.outputs or name in in_bodies or init.data_type != onnx.TensorProto.FLOAT
                or len(init.dims) < 2 or (auto and 4 * math.prod(init.dims) < EMBEDDING_AUTO_BYTES)
                or (not auto and listed is not None and name not in listed)):
            continue
        if all(_row_gather(node, name, ctx, options, only) for node in users):
            tables[name] = [node_label(node) for node in users]
    return tables


def row_gather(node: onnx.NodeProto, table: str, ctx: GraphIndex) -> bool:
    """Whether `node` is a Gather of rows (axis 0) of `table` at computed indices: an embedding lookup."""
    return (node.op_type == "Gather" and node.domain in ("", "ai.onnx") and len(node.input) == 2
            and node.input[0] == table and node.input[1] != table and not ctx.is_constant(node.input[1])
            and attribute(node, "axis", 0) in (0, -ctx.rank(table)))


def _row_gather(node: onnx.NodeProto, table: str, ctx: GraphIndex, options: QuantizeConfig,
                only: Optional[Collection[str]]) -> bool:
    return (row_gather(node, table, ctx) and not _excluded(node, options)
            and (only is None or node_label(node) in only))


def _planned_outputs(node: onnx.NodeProto, rule: OpRule) -> list[str]:
    """The outputs a rule quantizes: a tie op's every float output (Split has several), another
    op's first (MaxPool's second one is int64 indices)."""
    return [o for o in node.output if o] if rule.output == "tie" else list(node.output[:1])


_CONTROL_FLOW = ("If", "Loop", "Scan")


def _mixed_readers(node: onnx.NodeProto, ctx: GraphIndex, movers: Collection[str]) -> bool:
    """Whether a layer's output has a dynamic dimension and is read both by an op in `movers`
    (Target.requantize_beside) and by another op or as a graph output."""
    out = node.output[0] if node.output else ""
    readers = {reader.op_type for reader in ctx.consumers.get(out, [])}
    others = readers - set(movers) or out in ctx.outputs
    shape = ctx.shapes.get(out)
    return bool(readers & set(movers)) and bool(others) and (shape is None or None in shape)


def _int8_layers_only(nodes: list, rules: dict[int, OpRule], ctx: GraphIndex, plan) -> None:
    """A runtime that quantizes only where its int8 layers read (Target.activation_placement
    "inputs_of_int8_ops"): the ops with a constant float weight (Conv, ConvTranspose, Gemm, a MatMul
    by a weight) keep their rule; every other op (activations, elementwise, pooling, movement, a
    MatMul of two activations) computes in float, fused into the layer before it by the runtime."""
    for index in sorted(rules):
        node, rule = nodes[index], rules[index]
        weight = node.input[rule.weight] if rule.weight is not None and rule.weight < len(node.input) else ""
        if rule.kernel is None and weight and ctx.is_constant(weight) and ctx.is_float(weight):
            continue
        del rules[index]
        plan.float_nodes.append(f"{node_label(node)} ({node.op_type})")


# Ops that only move or select values: a quantizer on their output equals one on their input, so
# inputs-only placement puts it where the values are computed (a Resize only when nearest).
_MOVERS = ("MaxPool", "Split", "Reshape", "Flatten", "Squeeze", "Unsqueeze", "Transpose", "Slice", "Resize")


def _moved_from(name: str, ctx: GraphIndex) -> str:
    """The tensor whose values `name` only moves or selects, through a chain of _MOVERS."""
    while True:
        producer = ctx.producer.get(name)
        if producer is None or producer.op_type not in _MOVERS or producer.domain not in ("", "ai.onnx"):
            return name
        if producer.op_type == "MaxPool" and len(producer.output) > 1 and producer.output[1]:
            return name  # its indices are read
        if producer.op_type == "MaxPool" and attribute(producer, "ceil_mode", 0):
            return name  # OpenVINO computes a ceil-mode MaxPool of a quantized tensor wrongly (docs/targets.md)
        if producer.op_type == "Resize" and attribute(producer, "mode", b"nearest") not in (b"nearest", "nearest"):
            return name
        data = producer.input[0]
        if not data or ctx.is_constant(data) or not ctx.is_float(data):
            return name
        name = data


def _concat_inputs(want: Callable[[str], None], ctx: GraphIndex, ties: list[list[str]],
                   quantized: Collection[str]) -> Callable[[str], None]:
    """`want` for inputs-only placement: a layer's input is quantized where its values are computed,
    above the ops that only move or select them (a Split, MaxPool, nearest Resize, Reshape), so that
    the producing layer's kernel writes the codes; one that a Concat of float activations makes is
    quantized so on each of the Concat's inputs, one scale shared by them (a tie group), and the
    Concat only copies codes."""
    def resolve(name: str, depth: int = 0) -> list[str]:
        source = _moved_from(name, ctx)
        producer = ctx.producer.get(source)
        parts = list(producer.input) if producer is not None and producer.op_type == "Concat" \
            and producer.domain in ("", "ai.onnx") and depth < 8 else []
        if len(parts) >= 2 and all(p and not ctx.is_constant(p) and ctx.is_float(p) for p in parts):
            found = [t for part in parts for t in resolve(part, depth + 1)]
            if all(t in quantized for t in found):
                return found
        for candidate in (source, name):
            want(candidate)
            if candidate in quantized:
                return [candidate]
        return []

    def want_input(name: str) -> None:
        tied = list(dict.fromkeys(resolve(name)))
        if len(tied) > 1:
            ties.append(tied)
    return want_input


def _float_before_float(nodes: list, rules: dict[int, OpRule], chosen_float: set[int], ctx: GraphIndex,
                        plan) -> None:
    """An op without a weight that reads no int8 codes and whose outputs only float ops read (ops
    without an int8 rule or in a float block; not the graph's outputs, which _float_tail sees to) has
    no int8 neighbour to take codes from or hand them to: it computes in float with them (a floor 80
    dB below the loudest bin, computed in float for a Clip's bound), from the outputs back, so that a
    chain of them goes together. Nodes in `chosen_float` (excluded, kept float by the search or the
    latency choice, outside the layers quantized alone) count neither as such readers nor as float
    producers: those choices keep their neighbours as they were, so a layer's sensitivity equals its
    model with the rest excluded."""
    position = {name: i for i, node in enumerate(nodes) for name in node.output}
    in_bodies = ctx.body_readers

    def _float_op(index: int) -> bool:
        return index not in rules and index not in chosen_float

    for index in sorted(rules, reverse=True):
        node, rule = nodes[index], rules[index]
        producers = [position[name] for name in node.input if name in position]
        if rule.weight is not None or rule.kernel is not None or rule.output == "tie" or any(
                _int8_output(i, rules) or i in chosen_float for i in producers):
            continue  # it reads codes (a pooling or an activation after a Conv): its int8 kernel hands them on
        outputs = [o for o in node.output if o]
        readers = [r for o in outputs for r in ctx.consumers.get(o, [])]
        if (outputs and readers and not any(o in ctx.outputs or o in in_bodies for o in outputs)
                and all(r.op_type not in _CONTROL_FLOW and _float_op(position.get(r.output[0] if r.output else "", -1))
                        for r in readers)):
            del rules[index]
            plan.float_nodes.append(f"{node_label(node)} ({node.op_type})")


def _float_tail(nodes: list, rules: dict[int, OpRule], ctx: GraphIndex, fused: Collection[str]) -> set[str]:
    """Tensors that reach the graph's outputs only through ops computing in float: they get no Q/DQ,
    and the ops between them and the outputs run in float on dequantized inputs. A Q/DQ pair there
    would only round what the model returns (a probability below 1/512 read as 0, a box coordinate
    rounded to a step of its range) while sparing a float kernel on a tensor that nothing but
    movement or elementwise ops follow. A tensor is in the tail when every reader is an op with an
    own, fixed or tie rule and no weight, or an If/Loop/Scan node (a body reading the tensor makes
    its node a reader), whose outputs are graph outputs or in the tail; Shape and Size read no
    values, and an op without an int8 rule that writes no float tensor (a comparison with a
    threshold, an ArgMax) reads the float value as it is. Any other op without an int8 rule, or
    an op kept float, ends the tail. The tensor's producer must not be an op whose integer kernel
    writes int8 only (Conv, ConvTranspose, or the activation fused with one): a Conv's output keeps
    its Q, and a Gemm's or MatMul's integer kernel writes float. A movement op whose input carries
    int8 codes stays int8."""
    position = {name: i for i, node in enumerate(nodes) for name in node.output}
    readers: dict[str, list] = {name: list(users) for name, users in ctx.consumers.items()}
    for name, nodes_reading in ctx.body_readers.items():
        readers.setdefault(name, []).extend(nodes_reading)
    tail: set[str] = set()  # tensors of int8-rule ops that get no Q/DQ
    free: set[str] = set()  # outputs of control-flow nodes that reach the graph's outputs in float

    def settled(names) -> bool:
        return all(o in tail or o in free or o in ctx.outputs for o in names if o)

    def float_reader(node: onnx.NodeProto) -> bool:
        if node.op_type in ("Shape", "Size") and node.domain in ("", "ai.onnx"):
            return True
        rule = rules.get(position.get(node.output[0], -1)) if node.output else None
        if rule is None and node.op_type in _CONTROL_FLOW:  # what its bodies read is planned there
            return bool(node.output) and settled(node.output)
        if rule is None:  # a comparison with a threshold, an ArgMax: reads the value, writes no float
            return bool(node.output) and not any(ctx.is_float(o) for o in node.output if o)
        return rule.kernel is None and rule.weight is None and settled(_planned_outputs(node, rule))

    def reaches_outputs_in_float(name: str) -> bool:
        users = readers.get(name, [])
        return name not in ctx.outputs and bool(users) and all(float_reader(r) for r in users)

    for index in reversed(range(len(nodes))):
        node, rule = nodes[index], rules.get(index)
        if rule is None:
            if node.op_type in _CONVOLUTIONS or node.op_type in _CONTROL_FLOW:
                free.update(o for o in node.output if o and reaches_outputs_in_float(o))
            continue
        if (rule.kernel is not None or (rule.weight is not None and not rule.float_output)
                or (rule.fusable_activation and node.input[0] in fused)):
            continue
        tail.update(o for o in _planned_outputs(node, rule) if reaches_outputs_in_float(o))
    # A movement op only copies codes: behind an int8 producer (a Conv's output upsampled by a Resize
    # before the outputs) it stays int8 at no cost in precision, and its reader dequantizes
    codes: set[str] = set()  # tensors that carry int8 codes
    for index, node in enumerate(nodes):
        rule = rules.get(index)
        if rule is None or rule.kernel is not None:
            continue
        outputs = _planned_outputs(node, rule)
        if rule.output == "tie" and any(name in codes for name in node.input if name):
            tail.difference_update(outputs)
        if rule.output != "tie" or not tail.intersection(outputs):
            codes.update(o for o in outputs if o not in tail)
    return tail


def _written_float(nodes: list, rules: dict[int, OpRule], ctx: GraphIndex, fused: Collection[str]) -> set[str]:
    """Outputs of int8 layers whose integer kernel can write float (Gemm, MatMul: onnxruntime's QGemm
    and MatMulIntegerToFloat) that no int8 node reads: every reader runs in float (kept float, or
    no int8 rule), so a Q/DQ pair there would only round what they read and add two passes. A
    graph output is left to _float_tail, a tensor a body reads to its body's plan."""
    position = {name: i for i, node in enumerate(nodes) for name in node.output}
    in_bodies = ctx.body_readers
    written = set()
    for index, rule in rules.items():
        node = nodes[index]
        if rule.weight is None or not rule.float_output or rule.kernel is not None or not node.output:
            continue
        out = node.output[0]
        users = ctx.consumers.get(out, [])
        if (out in ctx.outputs or out in fused or out in in_bodies or not users
                or any(position.get(u.output[0], -1) in rules or u.op_type in _CONTROL_FLOW
                       for u in users if u.output)):
            continue
        written.add(out)
    return written


def _produced_by_quantized(name: str, ctx: GraphIndex, rules: dict[int, OpRule], nodes: list) -> bool:
    producer = ctx.producer.get(name)
    return producer is not None and _int8_output(nodes.index(producer), rules)


def _int8_output(index: int, rules: dict[int, OpRule]) -> bool:
    """Whether the node's output gets int8 parameters: a weight-only op's output stays float."""
    return index in rules and rules[index].kernel is None


def _float_note(node, rule: OpRule, ctx: GraphIndex, target: Target) -> Optional[str]:
    """Why a node of an op that has (or lacks) a dedicated int8 kernel stays float; None if it does not."""
    if rule.kernel is not None and rule.kernel not in target.kernels:
        return f"{node.op_type} node '{node_label(node)}' kept float: {target.runtime} has no int8 " \
               f"{node.op_type} kernel"
    if rule.unsupported and rule.applies and not rule.applies(node, ctx):
        return f"{node.op_type} node '{node_label(node)}' kept float: {rule.unsupported}"
    return None


def _plan_node(node, rule: OpRule, inputs: list[int], ctx: GraphIndex, plan: QuantPlan, want, fused,
               per_channel: bool) -> None:
    weight_name = node.input[rule.weight] if rule.weight is not None and rule.weight < len(node.input) else ""
    constant_weight = bool(weight_name) and ctx.is_constant(weight_name) and ctx.is_float(weight_name)
    for i in inputs:
        if i >= len(node.input) or not node.input[i]:
            continue
        name = node.input[i]
        if i == rule.weight and constant_weight:
            continue
        if ctx.is_constant(name):
            # constant non-weight inputs stay float unless the rule stores them quantized
            if rule.quantize_constants and ctx.is_float(name) and name not in plan.weights:
                plan.constants.setdefault(name, node_label(node))
            continue
        want(name)
    if constant_weight and weight_name not in plan.weights:
        rank = ctx.rank(weight_name)
        axis = rule.weight_axis(node, rank) if per_channel and rule.weight_axis and rank >= 2 else None
        plan.weights[weight_name] = WeightPlan(weight_name, axis, node_label(node))
    if rule.bias is not None and rule.bias < len(node.input) and node.input[rule.bias] and constant_weight:
        bias = node.input[rule.bias]
        activation = node.input[inputs[0]]
        if (ctx.is_constant(bias) and ctx.is_float(bias) and ctx.rank(bias) == 1 and bias not in plan.biases
                and not ctx.is_constant(activation) and _bias_compatible(node)):
            groups = attribute(node, "group", 1) if node.op_type == "ConvTranspose" else 1
            plan.biases[bias] = BiasPlan(bias, activation, weight_name, groups, node_label(node))


def _bias_compatible(node) -> bool:
    # Gemm's C is scaled by beta and the product by alpha; int32 bias folding needs both 1.
    if node.op_type != "Gemm":
        return True
    return attribute(node, "alpha", 1.0) == 1.0 and attribute(node, "beta", 1.0) == 1.0


def _merge_groups(groups: list[list[str]]) -> list[list[str]]:
    """Union of overlapping tie groups (a Reshape after a MaxPool shares one scale)."""
    parent: dict[str, str] = {}

    def find(x: str) -> str:
        while parent.setdefault(x, x) != x:
            parent[x] = parent[parent[x]]
            x = parent[x]
        return x

    order: list[str] = []
    for group in groups:
        for name in group:
            if name not in parent:
                order.append(name)
            find(name)
        for name in group[1:]:
            parent[find(name)] = find(group[0])
    merged: dict[str, list[str]] = {}
    for name in order:
        merged.setdefault(find(name), []).append(name)
    return [g for g in merged.values() if len(g) > 1]


EQUALIZED_NOTE = "activation ranges equalized across channels"


def prepared_model(model_path: str | Path, options: QuantizeConfig) -> tuple[onnx.ModelProto, QuantPlan]:
    return prepared_with_strategy(model_path, options)[:2]


def prepared_with_strategy(model_path: str | Path, options: QuantizeConfig
                           ) -> tuple[onnx.ModelProto, QuantPlan, str, Optional[str]]:
    """prepared_model's (model, plan), and the MatMul strategy it prepared them for with `auto`'s
    note (qtool.plan.dynamic.matmul_strategy; None when `matmul` was not `auto`, or auto reports nothing)."""
    prepared = prepare_file(model_path, options.keep_opset, options.per_channel, divisions=False)
    model = prepared.model
    strategy, chosen = matmul_strategy(model, GraphIndex(model), options)
    if strategy == "static":  # Mul has integer kernels, Div none; dynamic quantizes neither and keeps Gelu's Div
        divisions_to_multiplications(model)
    elif merge_shared_input_matmuls(model, {node_label(n) for n in model.graph.node if _excluded(n, options)}):
        model = infer_shapes(model)  # the merged tensors' shapes, for the planner
    if any([PREPARE_PASSES[name](model, options) for name in target_of(options).prepare_passes]):
        model = infer_shapes(model)  # the target's own rewrites of the prepared graph
    if options.equalize:  # before calibration, so the table matches the equalized graph
        equalize(model)
    # the scales calibration measured on this graph, so that calibration and quantization agree;
    # equalize_activations takes its own tensors' entries out of them, SmoothQuant folds the rest
    scales = dict(options.smooth_scales)
    # a runtime that quantizes only its int8 layers' inputs gets the rewrite's per-channel affine
    # steps as elementwise ops it fuses, not as depthwise Convs reading a quantizer each
    equalized = equalize_activations(model, scales,
                                     elementwise=target_of(options).activation_placement == "inputs_of_int8_ops")
    if scales:
        smooth(model, scales, insert=strategy == "dynamic" or target_of(options).smooth_inserts)
    plan = build_plan(model, options)
    plan.notes.extend(prepared.notes)
    if equalized:
        plan.notes.append(f"{EQUALIZED_NOTE} in {equalized} Conv -> activation -> depthwise Conv chain(s), "
                          "exactly (one int8 range per activation then fits every channel)")
    if scales:
        alpha = smoothing_alpha(options, strategy == "dynamic" or target_of(options).smooth_inserts)
        plan.notes.append(f"SmoothQuant (alpha {alpha}): the activation "
                          f"ranges of {len(scales)} MatMul/Gemm inputs moved into their weights")
    elif options.smooth_quant is not None:
        plan.notes.append("SmoothQuant smoothed nothing: no LayerNorm or linear layer output is read by "
                          "MatMul/Gemm layers only (a residual Add beside them keeps its range)")
    if chosen:
        plan.notes.append(chosen)
    plan.notes.extend(unmatched_options(model, plan, options))
    _check_something_to_quantize(model, plan, model_path)
    return model, plan, strategy, chosen


def unmatched_options(model: onnx.ModelProto, plan: QuantPlan, options: QuantizeConfig) -> list[str]:
    """A note per exclusion or 16-bit pattern that names nothing here: a misspelt name, or one of a
    node that preparation folded away (a BatchNormalization into its Conv) or of a tensor the plan
    does not quantize, would otherwise change nothing without a word. Not an error: one config may
    serve several models."""
    nodes = list(scoped_nodes(model.graph))
    labels = [node_label(n) for n in nodes]
    types = {n.op_type for n in nodes}
    notes = [f"--exclude-op-types {op}: the prepared model has no {op} node" for op in options.exclude_op_types
             if op not in types]
    notes += [f"--exclude-nodes {p}: no node of the prepared model is named so (folded or fused nodes are gone)"
              for p in options.exclude_nodes if not any(matches(label, (p,)) for label in labels)]
    notes += [f"--int16-activations {p}: the plan quantizes no activation so named, so nothing goes to 16 bits "
              "for it (qtool evaluate --per-layer lists the quantized tensors)"
              for p in options.int16_activations if not any(matches(name, (p,)) for name in plan.activations)]
    return notes


def unquantizable(model: onnx.ModelProto) -> Optional[str]:
    """Why nothing of `model` can be quantized (no node is of an op qtool quantizes: a tree
    ensemble, a scaler), None otherwise; read from the model as given, so that such a model is
    written unchanged without calibrating it (minutes of sessions for a large ensemble). Local
    functions and onnxruntime's fused ops are written out by preparation: a model with either is
    not judged here."""
    nodes = list(scoped_nodes(model.graph))
    if model.functions or any(n.domain not in ("", "ai.onnx", "ai.onnx.ml") for n in nodes) \
            or any(rule_for(n.op_type, n.domain) is not None for n in nodes):
        return None
    ops = ", ".join(sorted({n.op_type for n in nodes})) or "none"
    return f"nothing quantized: no node of the model is of an op qtool quantizes (ops: {ops}); written unchanged"


def _check_something_to_quantize(model: onnx.ModelProto, plan: QuantPlan, path: object) -> None:
    """A model with integer inputs only (token ids, masks) is quantized in its float part; one that
    has none is refused rather than copied. A float model with every node excluded stays legal."""
    if plan.activations or plan.weights or plan.embeddings or plan.dynamic or plan.dynamic_matmuls:
        return
    specs = input_specs(model)
    if any(s.dtype.kind == "f" for s in specs):
        return
    found = ", ".join(f"{s.name} {s.dtype}" for s in specs) or "none"
    raise QtoolError(f"nothing to quantize: the model has no float input and no float tensor reaches an op "
                     f"qtool quantizes (inputs: {found})", path)
