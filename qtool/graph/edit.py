"""Models derived from a model: extra outputs to read intermediate tensors (those inside If/Loop/
Scan bodies too), or a sub-model of some of its nodes. Every stage that runs part of a graph
(calibration, bias correction, adaptive rounding, per-layer error, sensitivity, verify-int) builds
it here; the rewrites that leave nodes behind drop them here (drop_unread); an exact rewrite that
rescales tensors under their own names records them here (mark_rescaled)."""

from __future__ import annotations

from typing import Iterable

import itertools
import json

import numpy as np
import onnx
from onnx import helper, numpy_helper

from qtool.graph.index import (GraphIndex, attribute, bodies, default_opset, keep_initializers, made_in,
                               names_read, rename_reads, replace_nodes, scoped_initializers, scoped_nodes,
                               set_attribute)
from qtool.graph.shapes import elem_types, inferred


def with_outputs(model: onnx.ModelProto, names: Iterable[str]) -> onnx.ModelProto:
    """A copy of `model` that also outputs the named intermediate tensors, typed as the model
    declares them or, where it does not (a model written without value_info), as shape inference
    finds them."""
    exposed = onnx.ModelProto()
    exposed.CopyFrom(model)
    present = {o.name for o in exposed.graph.output} | {i.name for i in exposed.graph.input}
    names = [name for name in names if name not in present]
    types = elem_types(exposed)
    if any(name not in types for name in names):
        types = {**elem_types(inferred(exposed, data_prop=False)), **types}
    for name in names:
        exposed.graph.output.append(helper.make_tensor_value_info(name, types.get(name, onnx.TensorProto.FLOAT), None))
    return exposed


ROUTE_PREFIX = "qtool_route"


def with_body_outputs(model: onnx.ModelProto, names: Iterable[str]) -> tuple[onnx.ModelProto, dict[str, str]]:
    """`model` with the named tensors that If/Loop/Scan bodies compute routed out to graph outputs,
    and {body tensor: the graph output carrying it}; `model` itself when none of them is in a body.

    A body's tensor cannot be a graph output: it leaves through its node. An If's branch that
    computes it outputs it, the other branch outputs an empty tensor of its type in its place (If
    outputs may differ in shape between branches), so an empty value means "this branch did not
    run". A Loop carries the values of every iteration out, flattened and concatenated (a loop-
    carried value may grow; an iteration that skips the tensor, in an If inside the body, adds
    nothing), empty when the body never ran: from opset 13 (a Loop may carry a sequence) each
    iteration appends to a sequence concatenated once after the loop, time linear in the values;
    before it a carried tensor is concatenated at each iteration. A Scan outputs it as an extra
    scan output, stacked over the iterations (its state cannot change shape, and scan outputs
    must keep theirs, so only the Scan body's own tensors leave it: the bodies nested in it are
    not observed). Nested bodies route it out level by level."""
    wanted = set(names)
    if not any(bodies(node) for node in model.graph.node):
        return model, {}
    routed = onnx.ModelProto()
    routed.CopyFrom(model)
    types = {v.name: v.type.tensor_type.elem_type for node in scoped_nodes(routed.graph)
             for _, body in bodies(node) for v in [*body.value_info, *body.output]
             if v.type.HasField("tensor_type") and v.type.tensor_type.elem_type}
    sequences = default_opset(routed) >= 13
    routes = _route(routed.graph, wanted, types, itertools.count(), sequences)
    if not routes:
        return model, {}
    for tensor, name in routes.items():
        routed.graph.output.append(helper.make_tensor_value_info(name, types.get(tensor, onnx.TensorProto.FLOAT),
                                                                 None))
    return routed, routes


def _route(graph: onnx.GraphProto, wanted: set[str], types: dict[str, int], fresh,
           sequences: bool) -> dict[str, str]:
    """{wanted tensor computed in a body of a node of `graph`: the name carrying it in `graph`};
    edits the bodies and nodes (and adds `graph` initializers) to carry them."""
    routes: dict[str, str] = {}
    around: dict[int, tuple[list[onnx.NodeProto], list[onnx.NodeProto]]] = {}
    for at, node in enumerate(graph.node):
        if node.op_type not in ("If", "Loop", "Scan") or node.domain not in ("", "ai.onnx"):
            continue
        inner = {attr: {**{t: t for t in made_in(body) if t in wanted},
                        **(_route(body, wanted, types, fresh, sequences) if node.op_type != "Scan" else {})}
                 for attr, body in bodies(node)}
        tensors = list(dict.fromkeys(t for carried in inner.values() for t in carried))
        if node.op_type == "Loop" and tensors:
            accumulated, before, after = _accumulate(graph, node, inner["body"], types, fresh, sequences)
            routes.update(accumulated)
            if before or after:
                around[at] = (before, after)
            continue
        for tensor in tensors:
            elem = types.get(tensor, onnx.TensorProto.FLOAT)
            for attr, body in bodies(node):
                out = f"{ROUTE_PREFIX}_{next(fresh)}"  # a name of its own: the tensor may be an output already
                carried = inner[attr].get(tensor)
                if carried is None:  # the other If branch: an empty tensor of the same type
                    body.node.append(helper.make_node("Constant", [], [out], name=out, value=_empty(out, elem)))
                else:
                    body.node.append(helper.make_node("Identity", [carried], [out], name=out))
                body.output.append(helper.make_tensor_value_info(out, elem, None))
            if node.op_type == "Scan":  # the new scan outputs stack along axis 0, forwards
                for name in ("scan_output_axes", "scan_output_directions"):
                    if attribute(node, name) is not None:
                        set_attribute(node, name, [*attribute(node, name), 0])
            routes[tensor] = f"{ROUTE_PREFIX}_{next(fresh)}"
            node.output.append(routes[tensor])
    if around:
        nodes = list(graph.node)
        del graph.node[:]
        for at, node in enumerate(nodes):
            before, after = around.get(at, ([], []))
            graph.node.extend([*before, node, *after])
    return routes


def _accumulate(graph: onnx.GraphProto, loop: onnx.NodeProto, carried: dict[str, str], types: dict[str, int],
                fresh, sequences: bool) -> tuple[dict[str, str], list[onnx.NodeProto], list[onnx.NodeProto]]:
    """Extra loop-carried values of `loop`, one per tensor: ({tensor: the tensor holding the values
    of every iteration, flattened}, the nodes to put before the loop, the nodes to put after it).
    With `sequences`, a sequence that starts as [empty] and gets Reshape(tensor, [-1]) appended at
    each iteration, concatenated after the loop (linear in the values on onnxruntime: 500
    iterations of 100k floats took 0.17 s, against 3.3 s by Concat; a Loop carries a sequence from
    opset 13); otherwise a tensor that starts empty and becomes Concat(previous, Reshape(tensor,
    [-1])) at each iteration, which copies everything gathered so far each time."""
    body = dict(bodies(loop))["body"]
    state = len(loop.input) - 2  # the carried values so far: body inputs 2.., outputs 1.., node outputs 0..
    flat = f"{ROUTE_PREFIX}_{next(fresh)}"
    body.initializer.append(numpy_helper.from_array(np.array([-1], np.int64), flat))
    inputs, outputs, node_outputs = list(body.input), list(body.output), list(loop.output)
    added_in, added_out, added_node_out = [], [], []
    before_loop, after_loop = [], []
    routes = {}
    for tensor, name in carried.items():
        elem = types.get(tensor, onnx.TensorProto.FLOAT)
        empty, before, values, after, out = (f"{ROUTE_PREFIX}_{next(fresh)}" for _ in range(5))
        graph.initializer.append(_empty(empty, elem))
        body.node.append(helper.make_node("Reshape", [name, flat], [values], name=values))
        if sequences:
            start, joined = (f"{ROUTE_PREFIX}_{next(fresh)}" for _ in range(2))
            before_loop.append(helper.make_node("SequenceConstruct", [empty], [start], name=start))
            body.node.append(helper.make_node("SequenceInsert", [before, values], [after], name=after))
            after_loop.append(helper.make_node("ConcatFromSequence", [out], [joined], name=joined, axis=0))
            routes[tensor] = joined
            value_info = helper.make_tensor_sequence_value_info
        else:
            start = empty
            body.node.append(helper.make_node("Concat", [before, values], [after], name=after, axis=0))
            routes[tensor] = out
            value_info = helper.make_tensor_value_info
        loop.input.append(start)
        added_in.append(value_info(before, elem, None))
        added_out.append(value_info(after, elem, None))
        added_node_out.append(out)
    splices = ((body.input, inputs, added_in, 2 + state), (body.output, outputs, added_out, 1 + state),
               (loop.output, node_outputs, added_node_out, state))
    for field, items, extra, at in splices:  # after the carried values, before the scan outputs
        del field[:]
        field.extend(items[:at] + extra + items[at:])
    return routes, before_loop, after_loop


def _empty(name: str, elem: int) -> onnx.TensorProto:
    return numpy_helper.from_array(np.zeros(0, helper.tensor_dtype_to_np_dtype(elem)), name)


def array_input(name: str, array: np.ndarray) -> onnx.ValueInfoProto:
    """A graph input of the array's element type and any shape (a boundary fed from a cache)."""
    return helper.make_tensor_value_info(name, helper.np_dtype_to_tensor_dtype(array.dtype), None)


def sub_model(model: onnx.ModelProto, nodes: list[onnx.NodeProto], inputs: list[onnx.ValueInfoProto],
              outputs: list[onnx.ValueInfoProto], name: str = "part") -> onnx.ModelProto:
    """A model of `nodes` alone: it reads `inputs` and the initializers of `model` its nodes read,
    and outputs `outputs`; opsets, IR version and local functions are those of `model`."""
    read = {x for n in nodes for x in n.input if x}
    graph = helper.make_graph(nodes, name, inputs, outputs, [t for t in model.graph.initializer if t.name in read])
    part = helper.make_model(graph, opset_imports=list(model.opset_import), functions=list(model.functions))
    part.ir_version = model.ir_version
    return part


def drop_unread(graph: onnx.GraphProto) -> None:
    """Drop the nodes nothing reads any more (a replaced Q/DQ pair, a rewritten stem's
    SpaceToDepth), repeatedly, then the initializers nothing reads."""
    outputs = {o.name for o in graph.output}
    while True:
        read = {name for node in graph.node for name in names_read(node)} | outputs
        kept = [n for n in graph.node if any(o in read for o in n.output)]
        if len(kept) == len(graph.node):
            break  # `read` is what the nodes kept read
        replace_nodes(graph, kept)
    keep_initializers(graph, lambda t: t.name in read)


RESCALED_KEY = "qtool.rescaled_tensors"  # metadata: tensors whose values a rewrite rescaled


def mark_rescaled(model: onnx.ModelProto, names: Iterable[str]) -> None:
    """Record in `model`'s metadata that the named tensors keep their names but no longer their
    values (an exact rewrite divided them per channel, its factors taken up further on): a per-layer
    comparison with the original model must not pair them. The quantized model inherits it."""
    marked = rescaled_tensors(model) | set(names)
    entries = [p for p in model.metadata_props if p.key != RESCALED_KEY]
    del model.metadata_props[:]
    model.metadata_props.extend(entries)
    if marked:
        model.metadata_props.add(key=RESCALED_KEY, value=json.dumps(sorted(marked)))


def rescaled_tensors(model: onnx.ModelProto) -> set[str]:
    """The tensors mark_rescaled recorded in `model`."""
    for prop in model.metadata_props:
        if prop.key == RESCALED_KEY:
            return set(json.loads(prop.value))
    return set()


UNTIE_PREFIX = "qtool_untied"  # names of the copies untied_int8 makes


def untied_int8(model: onnx.ModelProto) -> onnx.ModelProto | None:
    """A copy of `model` in which no int8 initializer is read by two integer kernels: each reader
    after the first (a node reading it, or one more reader of a DequantizeLinear of it) gets its own
    copy, and its own DequantizeLinear. None where nothing is shared. The model computes the same;
    onnxruntime's exact-product rewrite on x86 without VNNI (session.x64quantprecision) names the
    uint8 copy it makes of an int8 weight or zero point after it, so a second reader fails to load."""
    int8 = {name for name, t in scoped_initializers(model.graph).items() if t.data_type == onnx.TensorProto.INT8}
    reads: dict[str, int] = {}
    _count_int8_reads(model.graph, int8, reads)
    if all(n <= 1 for n in reads.values()):
        return None
    untied = onnx.ModelProto()
    untied.CopyFrom(model)
    _untie(untied.graph, int8, scoped_initializers(untied.graph), set(), itertools.count())
    return untied


def _count_int8_reads(graph: onnx.GraphProto, int8: set[str], reads: dict[str, int]) -> None:
    """reads[name] += one per node reading an int8 initializer, one per reader of a DequantizeLinear of it."""
    readers = GraphIndex(graph).consumers
    for node in graph.node:
        times = len(readers.get(node.output[0], ())) or 1 if node.op_type == "DequantizeLinear" else 1
        for name in node.input:
            if name in int8:
                reads[name] = reads.get(name, 0) + times
        for _, body in bodies(node):
            _count_int8_reads(body, int8, reads)


def _untie(graph: onnx.GraphProto, int8: set[str], inits: dict[str, onnx.TensorProto], seen: set[str], fresh) -> None:
    """Give each reader of an int8 initializer after the first (in model order) its own copy; a
    DequantizeLinear of one gets a copy of itself per reader after its first."""

    def own(name: str) -> str:
        if name not in int8:
            return name
        if name not in seen:
            seen.add(name)
            return name
        copy = onnx.TensorProto()
        copy.CopyFrom(inits[name])
        copy.name = f"{UNTIE_PREFIX}_{next(fresh)}_{name}"
        graph.initializer.append(copy)
        return copy.name

    readers = GraphIndex(graph).consumers
    nodes: list[onnx.NodeProto] = []
    for node in list(graph.node):
        nodes.append(node)
        original = list(node.input)
        node.input[:] = [own(x) for x in original]
        if node.op_type == "DequantizeLinear" and original[0] in int8:
            for user in readers.get(node.output[0], [])[1:]:
                out = f"{UNTIE_PREFIX}_{next(fresh)}_{node.output[0]}"
                copy = helper.make_node("DequantizeLinear", [own(x) for x in original], [out], name=out)
                copy.attribute.extend(node.attribute)  # axis, block_size
                nodes.append(copy)
                rename_reads([user], {node.output[0]: out})
        for _, body in bodies(node):
            _untie(body, int8, inits, seen, fresh)
    if len(nodes) > len(graph.node):
        replace_nodes(graph, nodes)  # each copy right after the DequantizeLinear it copies
