"""Front end: bring an fp32 graph into the canonical form the planner expects.

The same preparation runs before calibration and before quantization, so tensor
names in the calibration table always match the graph being quantized. Every step
is deterministic and keeps the model's outputs unchanged (a float16 model's, computed in float32,
within float16 rounding).
"""

from __future__ import annotations

import itertools
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Collection, Optional

import numpy as np
import onnx
from onnx import inliner, numpy_helper, version_converter

from qtool.graph.index import (GraphIndex, attribute, bodies, body_reads, default_opset, keep_initializers,
                               made_in, names_read, rename_reads, replace_nodes, scoped_nodes, set_attribute,
                               tensor_bytes)
from qtool.graph.kernels import INTEGER_CONV, INTEGER_MATMUL
from qtool.graph.modelio import copy_model, file_key, kept, load_model
from qtool.graph.movement import MOVEMENT_OPS, compute
from qtool.graph.shapes import elem_types, infer_shapes, inferred
from qtool.prepare.bn_fold import fold_affine, fold_batchnorm
from qtool.prepare.concat_affine import affine_over_concat
from qtool.prepare.float16 import widen_float16
from qtool.prepare.fused_activations import write_out_fused_activations
from qtool.prepare.nhwc import activations_before_layout_moves, fold_pads_into_convs
from qtool.errors import QtoolError

MIN_QDQ_OPSET = 10  # QuantizeLinear/DequantizeLinear exist
MIN_PER_CHANNEL_OPSET = 13  # DequantizeLinear gets its `axis` attribute


def inline_functions(model: onnx.ModelProto, path: object = None) -> tuple[onnx.ModelProto, Optional[str]]:
    """The model with every call of a model-local function replaced by the function's nodes, and a
    note when there was one. Exporters that write each module as a local function (PyTorch's
    dynamo exporter without its optimizer, onnxscript) hide every MatMul and Conv inside them;
    onnxruntime inlines them when it loads the model, so the inlined graph computes the same.
    A function onnx's inliner cannot take is a QtoolError naming `path`."""
    if not model.functions:
        return model, None
    local = {(function.domain, function.name) for function in model.functions}
    calls = sorted(f"{node.domain}.{node.op_type}" for node in scoped_nodes(model.graph)
                   if (node.domain, node.op_type) in local)
    opset = default_opset(model)
    convert = any(entry.domain in ("", "ai.onnx") and entry.version != opset
                  for function in model.functions for entry in function.opset_import)
    try:
        inlined = inliner.inline_local_functions(model, convert_version=convert)
    except Exception as exc:  # the inliner raises bare C++ errors
        raise QtoolError(f"its model-local functions cannot be inlined ({str(exc).strip().splitlines()[0]})",
                         path) from None
    if not calls:
        return inlined, None
    kinds = sorted(set(calls))
    return inlined, (f"inlined {len(calls)} call(s) of {len(kinds)} model-local function(s) "
                     f"({', '.join(kinds[:4])}{', ...' if len(kinds) > 4 else ''}) so that their nodes are quantized")


def settle_opset(model: onnx.ModelProto, keep_opset: bool = False, path: object = None,
                 per_channel: bool = True) -> tuple[onnx.ModelProto, Optional[str]]:
    """The model at an opset its quantization can use, and a note when that took a step.

    QDQ needs opset 10, per-channel weights 13 (DequantizeLinear's `axis`). An older model is
    converted to opset 13 with onnx's version converter. Where conversion is refused
    (keep_opset) or the converter fails, a model at opset 10..12 keeps its opset and gets
    per-tensor weights (build_plan reads the opset); below 10 nothing can be quantized.
    """
    opset = default_opset(model)
    if opset >= (MIN_PER_CHANNEL_OPSET if per_channel else MIN_QDQ_OPSET):
        return model, None
    if keep_opset:
        refused = "keep_opset (--keep-opset) forbids converting it"
    else:
        try:
            converted = version_converter.convert_version(model, MIN_PER_CHANNEL_OPSET)
        except Exception as exc:  # the converter raises bare RuntimeErrors with C++ messages
            refused = (f"onnx's version converter could not convert it to opset {MIN_PER_CHANNEL_OPSET} "
                       f"({str(exc).strip().splitlines()[0]})")
        else:
            return converted, f"converted opset {opset} -> {MIN_PER_CHANNEL_OPSET} with onnx's version converter"
    if opset < MIN_QDQ_OPSET:
        raise QtoolError(f"opset {opset} is too old (QuantizeLinear/DequantizeLinear need >= {MIN_QDQ_OPSET}) "
                         f"and {refused}", path)
    return model, (f"opset {opset} kept, as {refused}: per-tensor weights "
                   f"(per-channel DequantizeLinear needs opset {MIN_PER_CHANNEL_OPSET})")


def settle_ir_version(model: onnx.ModelProto) -> None:
    """At least the IR version the model's opset needs, and 4: onnx's version converter keeps the old
    one (IR 3 at opset 13 fails the checker once an initializer is added), and IR 3 wants every
    initializer listed as an input, which weights_out_of_inputs undoes."""
    model.ir_version = max(model.ir_version, 4,
                           onnx.helper.find_min_ir_version_for(list(model.opset_import), ignore_unknown=True))


def weights_out_of_inputs(model: onnx.ModelProto) -> int:
    """Initializers listed as graph inputs too are taken as constants and leave the inputs; returns
    how many. IR 3 required the listing, and exporters still write it (torch's
    keep_initializers_as_inputs). From IR 4 it makes the value an input the caller may override,
    which onnxruntime then does not take as a constant weight, and neither could quantization."""
    initializers = {t.name for t in model.graph.initializer}
    inputs = [i for i in model.graph.input if i.name not in initializers]
    dropped = len(model.graph.input) - len(inputs)
    if dropped:
        del model.graph.input[:]
        model.graph.input.extend(inputs)
    return dropped


def per_channel_possible(model: onnx.ModelProto) -> bool:
    """Whether the model's opset has per-channel DequantizeLinear."""
    return default_opset(model) >= MIN_PER_CHANNEL_OPSET


def constants_to_initializers(model: onnx.ModelProto | onnx.GraphProto) -> None:
    """Constant nodes holding tensors become initializers (Paddle exports keep weights there)."""
    graph = model.graph if isinstance(model, onnx.ModelProto) else model
    keep = []
    for node in graph.node:
        if node.op_type == "Constant" and node.domain in ("", "ai.onnx") and len(node.attribute) == 1:
            attr = node.attribute[0]
            value = None
            if attr.name == "value":
                value = numpy_helper.to_array(attr.t)
            elif attr.name in ("value_float", "value_int", "value_floats", "value_ints"):
                value = attribute(node, attr.name)
                value = np.asarray(value, dtype=np.float32 if "float" in attr.name else np.int64)
            if value is not None:
                graph.initializer.append(numpy_helper.from_array(value, node.output[0]))
                continue
        keep.append(node)
    replace_nodes(graph, keep)


_LARGE_BYTES = 1024  # a constant this large is not copied by folding a move of it in the main graph


def fold_constant_moves(model: onnx.ModelProto) -> None:
    """Movement ops on constants alone are computed once: inside If/Loop/Scan bodies (whose Constant
    nodes become the body's initializers), and in the main graph where they build a float tensor.
    A layer's weights are often built that way: torch's LSTM export slices the gates of its weights
    and concatenates them again, in each If branch or, once a tool has inlined the branch, in the main
    graph. Folded, the planner sees them constant, as it sees stored weights. The main graph's integer
    shape computations are left as exported, and so is a move that would store a large tensor twice
    (a tied embedding table, gathered and transposed for the output layer)."""
    opsets, opset = list(model.opset_import), default_opset(model)

    def builds_float(node: onnx.NodeProto, known: dict[str, onnx.TensorProto]) -> bool:
        if node.op_type == "Cast":
            return attribute(node, "to", 0) == onnx.TensorProto.FLOAT
        return known[node.input[0]].data_type == onnx.TensorProto.FLOAT

    def foldable(node: onnx.NodeProto, known: Collection[str], outputs: set[str]) -> bool:
        inputs = [name for name in node.input if name]
        return (node.op_type in MOVEMENT_OPS and node.domain in ("", "ai.onnx") and bool(inputs)
                and all(name in known for name in inputs) and not any(o in outputs for o in node.output))

    def shared_large(graph: onnx.GraphProto, outputs: set[str]) -> set[str]:
        """Large initializers that a node other than a foldable move reads: folding would copy them."""
        known, moves = {t.name for t in graph.initializer}, set()
        for index, node in enumerate(graph.node):
            if foldable(node, known, outputs):
                moves.add(index)
                known |= set(node.output)
        large = {t.name for t in graph.initializer if tensor_bytes(t) >= _LARGE_BYTES}
        return {name for index, node in enumerate(graph.node) if index not in moves
                for name in names_read(node) if name in large}

    def fold(graph: onnx.GraphProto, outer: dict[str, onnx.TensorProto], main: bool) -> None:
        if not main:
            constants_to_initializers(graph)
        known = {**outer, **{t.name: t for t in graph.initializer}}
        outputs = {o.name for o in graph.output}
        shared = shared_large(graph, outputs) if main else set()
        keep = []
        for node in graph.node:
            inputs = [name for name in node.input if name]
            if (foldable(node, known, outputs)
                    and (not main or (builds_float(node, known) and not shared.intersection(inputs)))):
                moved = compute(node, [numpy_helper.to_array(known[name]) if name else None for name in node.input],
                                opset)
                if moved is not None:
                    values = [moved]
                else:
                    from onnx.reference import ReferenceEvaluator  # here: its import takes 0.1 s

                    part = onnx.helper.make_model(onnx.helper.make_graph(
                        [node], "fold", [], [onnx.helper.make_empty_tensor_value_info(o) for o in node.output],
                        [known[name] for name in dict.fromkeys(inputs)]), opset_imports=opsets)
                    values = ReferenceEvaluator(part).run(None, {})
                for name, value in zip(node.output, values):
                    known[name] = numpy_helper.from_array(np.asarray(value), name)
                    graph.initializer.append(known[name])
                continue
            keep.append(node)
            for _, body in bodies(node):
                fold(body, known, main=False)
        replace_nodes(graph, keep)
        # an initializer only folded ops read is read by nothing now, nor is one the model never read:
        # it goes (a graph input's stays)
        read = ({name for node in graph.node for name in names_read(node)} | outputs
                | {i.name for i in graph.input})
        keep_initializers(graph, lambda t: t.name in read)

    fold(model.graph, {}, main=True)


def outputs_made_by_nodes(model: onnx.ModelProto) -> int:
    """Each If/Loop/Scan body output, at any depth, that no node of its body makes (an initializer, a
    Constant made one, an outer-scope value, the body's own input) becomes an Identity's output: the
    checker and onnxruntime want a body's outputs made in the body (onnxruntime returns zeros for a
    Scan state passed through unchanged), and the passes that drop unread initializers keep one an
    Identity reads. Also a main graph output that is an initializer. Returns the Identities added."""
    graphs = [model.graph, *(body for node in scoped_nodes(model.graph) for _, body in bodies(node))]
    taken = {name for g in graphs for name in [*made_in(g), *(t.name for t in g.initializer),
                                               *(o.name for o in g.output)]}
    added = 0
    for graph in graphs:
        main = graph is model.graph
        made = GraphIndex(graph).producer
        initializers = {t.name: t for t in graph.initializer}
        for output in graph.output:
            if output.name in made or (main and output.name not in initializers):
                continue
            fresh = next(f"{output.name}_{k}" for k in itertools.count() if f"{output.name}_{k}" not in taken)
            taken.add(fresh)
            if main:  # the model's output names stay: the initializer is renamed
                initializers[output.name].name = fresh
                graph.node.append(onnx.helper.make_node("Identity", [fresh], [output.name], name=fresh))
            else:  # a body's outputs are positional: the output is renamed
                graph.node.append(onnx.helper.make_node("Identity", [output.name], [fresh], name=fresh))
                output.name = fresh
            added += 1
    return added


def remove_identities(model: onnx.ModelProto) -> None:
    """Drop Identity and inference-mode Dropout nodes, and Casts to the type their input already
    has (TensorFlow exports leave one after many ops: each a copy of its tensor, and between Q/DQ
    pairs a float op that splits int8 chains), wiring their consumers to the input."""
    # Graph outputs keep their names; so do names read inside subgraphs (rewiring those
    # would mean editing the bodies too).
    fixed_names = {o.name for o in model.graph.output}
    fixed_names |= {name for node in model.graph.node for name in body_reads(node)}
    casts = any(node.op_type == "Cast" for node in model.graph.node)
    types = {**elem_types(inferred(model, data_prop=False)), **{t.name: t.data_type for t in model.graph.initializer}} \
        if casts else {}
    rename: dict[str, str] = {}
    keep = []
    for node in model.graph.node:
        passthrough = node.op_type == "Identity" or (
            node.op_type == "Dropout" and (len(node.output) == 1 or not node.output[1])) or (
            node.op_type == "Cast" and types.get(node.input[0], 0) == attribute(node, "to"))
        if passthrough and node.domain in ("", "ai.onnx") and node.output[0] not in fixed_names:
            source = node.input[0]
            rename[node.output[0]] = rename.get(source, source)
            continue
        keep.append(node)
    rename_reads(keep, rename)
    replace_nodes(model.graph, keep)


BIASED = ("Conv", "ConvTranspose", "Gemm")  # the layers whose third input is a bias


def untie_shared_biases(model: onnx.ModelProto) -> None:
    """A bias initializer that several layers read (exporters share equal constants) copied, so that
    each layer after the first reads its own: an int32 bias's scale is its layer's input scale times
    its weight scales, and an integer kernel adds it to its accumulator as it is, so one int32 bias
    cannot serve layers whose input scales differ. An all-zero bias stays shared (zero at any scale)."""
    graph = model.graph
    index = GraphIndex(model)
    inits = index.initializers
    names = set(inits) | set(index.producer) | {value.name for value in graph.input}
    seen: set[str] = set()
    for node in graph.node:
        if node.op_type not in BIASED or node.domain not in ("", "ai.onnx") or len(node.input) < 3:
            continue
        name = node.input[2]
        if name not in inits or len(index.consumers.get(name, ())) < 2:
            continue
        if name not in seen:
            seen.add(name)
            continue
        if not np.any(numpy_helper.to_array(inits[name])):
            continue
        fresh = next(f"{name}_{i}" for i in itertools.count(1) if f"{name}_{i}" not in names)
        names.add(fresh)
        copy = onnx.TensorProto()
        copy.CopyFrom(inits[name])
        copy.name = fresh
        graph.initializer.append(copy)
        node.input[2] = fresh


# ops whose output has its first input's rank when every other input is a constant of rank 2 or less
_RANK_KEEPING = ("Relu", "LeakyRelu", "PRelu", "Sigmoid", "Tanh", "Clip", "HardSigmoid", "HardSwish", "Elu", "Selu",
                 "Softplus", "Add", "Mul", "Sub", "Div")


def matmuls_as_gemms(model: onnx.ModelProto) -> int:
    """A MatMul of a rank-2 activation by a 2-D constant, whose output only an Add of a bias per column
    reads, written as a Gemm (the same product): the Add then folds into the Gemm (fold_affine), so a
    Dense layer exported as MatMul and Add (Keras, tf2onnx) quantizes as one integer Gemm with an
    int32 bias instead of an integer MatMul, a requantization and an integer Add. The rank comes from
    the graph: a Flatten, a Gemm, a Reshape to two dims, a rank-2 graph input, or rank-keeping ops on
    one. Returns how many; none below opset 11, where a Gemm must have a bias input."""
    if default_opset(model) < 11:
        return 0
    index = GraphIndex(model)
    inits = index.initializers
    inputs = {value.name: value for value in model.graph.input}

    def rank2(name: str, depth: int = 0) -> bool:
        node = index.producer.get(name)
        if node is None:
            value = inputs.get(name)
            return value is not None and value.type.tensor_type.HasField("shape") and \
                len(value.type.tensor_type.shape.dim) == 2
        if node.op_type in ("Flatten", "Gemm"):
            return True
        if node.op_type == "Reshape":
            return len(node.input) > 1 and node.input[1] in inits and list(inits[node.input[1]].dims) == [2]
        if node.op_type == "MatMul":
            return node.input[1] in inits and len(inits[node.input[1]].dims) == 2 and rank2(node.input[0], depth + 1)
        if node.op_type in _RANK_KEEPING and depth < 16:
            rest = node.input[1:]
            return all(n in inits and len(inits[n].dims) <= 2 for n in rest if n) and rank2(node.input[0], depth + 1)
        return False

    def bias_after(node: onnx.NodeProto) -> bool:
        """Its output's only reader adds a constant of one value per output column."""
        reader = index.only_consumer(node.output[0])
        if reader is None or reader.op_type != "Add" or len(reader.input) != 2:
            return False
        other = [name for name in reader.input if name != node.output[0]]
        columns = inits[node.input[1]].dims[1]
        return (len(other) == 1 and other[0] in inits
                and list(inits[other[0]].dims) in ([columns], [1, columns]))

    written = 0
    for node in model.graph.node:
        if (node.op_type == "MatMul" and node.domain in ("", "ai.onnx") and node.input[1] in inits
                and len(inits[node.input[1]].dims) == 2 and rank2(node.input[0]) and bias_after(node)):
            node.op_type = "Gemm"
            written += 1
    return written


_PADDED = ("Conv", "MaxPool", "AveragePool", "LpPool")  # auto_pad as explicit pads (ConvTranspose's differs)


def explicit_pads(model: onnx.ModelProto) -> None:
    """auto_pad written as the pads it stands for, where they do not depend on the input's size:
    VALID (no padding) and SAME_UPPER/SAME_LOWER at stride 1, whose total padding is
    dilation * (kernel - 1) per axis (the odd one at the end, or at the start for SAME_LOWER).
    Same outputs; the integer check, adaptive rounding and the stem rewrite read pads only. A
    strided SAME op keeps auto_pad: its padding depends on the input's size."""
    inits = {t.name: t for t in model.graph.initializer}
    for node in model.graph.node:
        mode = attribute(node, "auto_pad", b"NOTSET")
        mode = mode.decode() if isinstance(mode, bytes) else mode
        if node.op_type not in _PADDED or node.domain not in ("", "ai.onnx") or mode == "NOTSET":
            continue
        kernel = attribute(node, "kernel_shape")
        if kernel is None and node.op_type == "Conv" and len(node.input) > 1 and node.input[1] in inits:
            kernel = list(inits[node.input[1]].dims[2:])
        if kernel is None:
            continue
        rank = len(kernel)
        strides = attribute(node, "strides") or [1] * rank
        dilations = attribute(node, "dilations") or [1] * rank
        if mode == "VALID" and not (attribute(node, "ceil_mode", 0) and any(s != 1 for s in strides)):
            pads = [0] * (2 * rank)  # (a strided pooling op's ceil_mode sizes its output differently there)
        elif mode in ("SAME_UPPER", "SAME_LOWER") and all(s == 1 for s in strides):
            totals = [d * (k - 1) for k, d in zip(kernel, dilations)]
            small = [t // 2 for t in totals]
            begins = small if mode == "SAME_UPPER" else [t - b for t, b in zip(totals, small)]
            pads = begins + [t - b for t, b in zip(totals, begins)]
        else:
            continue
        kept = [a for a in node.attribute if a.name != "auto_pad"]
        del node.attribute[:]
        node.attribute.extend(kept)
        set_attribute(node, "pads", pads)


def divisions_to_multiplications(model: onnx.ModelProto) -> None:
    """Div by a float constant becomes Mul by its reciprocal (Paddle's written-out hard-swish ends in "/ 6").

    Runtimes have integer kernels for Mul (onnxruntime QLinearMul, LiteRT MUL) but not for
    Div, which would stay in float between a DequantizeLinear and a QuantizeLinear. x * (1/c)
    differs from x / c by at most one float32 rounding.
    """
    inits = {t.name: t for t in model.graph.initializer}
    readers: dict[str, int] = {}
    for node in model.graph.node:
        for name in names_read(node):
            readers[name] = readers.get(name, 0) + 1
    for node in model.graph.node:
        if node.op_type != "Div" or node.domain not in ("", "ai.onnx") or len(node.input) != 2:
            continue
        init = inits.get(node.input[1])
        if init is None or init.data_type != onnx.TensorProto.FLOAT:
            continue
        divisor = numpy_helper.to_array(init)
        if divisor.size == 0 or not np.all(np.isfinite(divisor)) or np.any(divisor == 0):
            continue
        name = init.name + "_reciprocal"
        if name not in inits:
            reciprocal = numpy_helper.from_array((1.0 / divisor.astype(np.float64)).astype(np.float32), name)
            model.graph.initializer.append(reciprocal)
            inits[name] = reciprocal
        node.op_type = "Mul"
        node.input[1] = name


@dataclass(frozen=True)
class Prepared:
    model: onnx.ModelProto
    notes: tuple[str, ...] = ()  # functions inlined; the opset step (converted, or kept); float16 widened; fused ops


# ops of a model that is quantized already: qtool's input is a float model
_QUANTIZED_OPS = (*INTEGER_CONV, *INTEGER_MATMUL, "QuantizeLinear", "DequantizeLinear", "DynamicQuantizeLinear",
                  "DynamicQuantizeLSTM", "QAttention", "QEmbedLayerNormalization")


def refuse_quantized(model: onnx.ModelProto, path: object = None) -> None:
    """A one-line error for a model that is quantized already (quantize_dynamic's ConvInteger and
    DynamicQuantizeLinear, a QDQ model): quantizing it again would stack a second set of ranges
    on int8 codes, and the names qtool gives its Q/DQ tensors may already be taken."""
    found = Counter(n.op_type for n in scoped_nodes(model.graph)
                    if n.op_type in _QUANTIZED_OPS or n.op_type.startswith("QLinear"))
    if found:
        ops = ", ".join(f"{count} {op}" for op, count in found.most_common())
        raise QtoolError(f"the model is quantized already ({ops}); qtool quantizes float models: "
                         f"give it the fp32 model", path)


# A job prepares its model file several times (calibration, the prepared graphs of the choices'
# candidates and of the build): the last result is kept, keyed by the file's bytes and the
# arguments, and a copy handed out. Only graphs with up to this many bytes of initializers: on a
# larger one copying costs about what preparing does, and the copy is held in memory.
_KEPT_PREPARED_BYTES = 32 << 20
_prepared: dict[tuple, Prepared] = {}


def prepare_file(path: str | Path, keep_opset: bool = False, per_channel: bool = True,
                 divisions: bool = True) -> Prepared:
    """prepare(load_model(path), ...): the same graph, a copy of the last one made from the same file
    with the same arguments when load_model keeps the file and the graph is small enough to keep."""
    key = (file_key(path, _KEPT_PREPARED_BYTES), keep_opset, per_channel, divisions)  # no CRC of a larger file
    held = _prepared.get(key)  # one look-up: another thread may clear it
    if held is not None:
        return Prepared(copy_model(held.model), held.notes)
    prepared = prepare(load_model(path), keep_opset, path, per_channel, divisions=divisions, in_place=True)
    _prepared.clear()
    if kept(key[0]) and \
            sum(tensor_bytes(t) for t in prepared.model.graph.initializer) <= _KEPT_PREPARED_BYTES:
        _prepared[key] = Prepared(copy_model(prepared.model), prepared.notes)
    return prepared


def prepare(model: onnx.ModelProto, keep_opset: bool = False, path: object = None,
            per_channel: bool = True, divisions: bool = True, in_place: bool = False) -> Prepared:
    """Return a prepared copy; the input model is not modified (`in_place`: it is the copy, for a
    caller that holds the only reference, as load_model returns it). `divisions` False keeps Div by a
    constant as it is: where no Mul is quantized (dynamic MatMul strategy) the Mul gains nothing and
    hides GELU's x / sqrt(2) from onnxruntime's Gelu fusion."""
    refuse_quantized(model, path)
    prepared = model if in_place else onnx.ModelProto()
    if not in_place:
        prepared.CopyFrom(model)
    ir_version = prepared.ir_version
    prepared, inlined = inline_functions(prepared, path)
    prepared, note = settle_opset(prepared, keep_opset, path, per_channel)
    listed = weights_out_of_inputs(prepared)
    settle_ir_version(prepared)
    listed = (f"{listed} initializer(s) also listed as graph inputs taken as constant weights: the int8 "
              "model does not list them as inputs") if listed and ir_version >= 4 else None
    halves = widen_float16(prepared)
    constants_to_initializers(prepared)
    fold_constant_moves(prepared)
    outputs_made_by_nodes(prepared)
    explicit_pads(prepared)
    remove_identities(prepared)
    fold_pads_into_convs(prepared)
    activations_before_layout_moves(prepared)
    fused = write_out_fused_activations(prepared, default_opset(prepared))
    matmuls_as_gemms(prepared)
    affine_over_concat(prepared)
    fold_batchnorm(prepared)
    fold_affine(prepared)
    untie_shared_biases(prepared)
    if divisions:
        divisions_to_multiplications(prepared)
    written = (f"{fused} onnxruntime FusedConv/FusedGemm node(s) written back as the Conv or Gemm and its "
               f"activation, so that they are quantized") if fused else None
    half = (f"float16 model: quantized in float32 ({halves} float16 tensors, casts and graph inputs/outputs "
            f"widened); its inputs and outputs keep their types") if halves else None
    return Prepared(infer_shapes(prepared), tuple(n for n in (inlined, note, listed, half, written) if n))
