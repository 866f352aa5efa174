"""Blocks that exporters write as chains of primitive ops (transformer layers, normalizations, an
STFT magnitude, a log-mel front end), recognised as a whole.

Quantizing such a chain op by op puts an int8 range on tensors that one range cannot hold: a
LayerNorm's squared deviations span several decades, an attention score map is exponentiated by
the Softmax after it, an additive mask holds -1e4 or -inf beside values near 0. Each block rule
(RULES, at the end) says which nodes stay float, and each matcher's docstring why; the tensors at
a block's boundary are quantized by the neighbouring ops as usual (a LayerNorm's output by the
MatMul that reads it), so the int8 MatMuls and Convs around the block keep their kernels.
"""

from __future__ import annotations

from typing import Iterable, Iterator, Optional

import numpy as np
import onnx
from onnx import TensorProto

from qtool.graph.index import GraphIndex, attribute, node_label
from qtool.plan.ops.rule import BlockRule

MASK_LIMIT = -1e4  # a constant at or below this is a mask's "minus infinity"
_MOVERS = ("Reshape", "Flatten", "Transpose", "Unsqueeze", "Squeeze", "Cast", "Expand", "Identity")
_SCORE_OPS = ("Mul", "Div", "Add", "Sub", "Where", *_MOVERS)
_SOFTMAX = ("Softmax", "LogSoftmax")
# Transformer layers written as one op: ONNX's (LayerNormalization; opset 23's RMSNormalization and
# Attention) and onnxruntime's fused com.microsoft ones, which its transformer optimizer and optimum
# write into BERT-, GPT- and Llama-style graphs (an Attention op holds the Q/K/V projections; the
# output and feed-forward projections stay MatMuls). None has an op rule: they stay float, but a
# fused Attention's projection goes dynamic int8 with the MatMuls (qtool.plan.dynamic), and on ort-cpu
# the model is written with SkipLayerNormalization and EmbedLayerNormalization as standard ops.
NORM_OPS = ("LayerNormalization", "RMSNormalization", "SimplifiedLayerNormalization", "SkipLayerNormalization",
            "SkipSimplifiedLayerNormalization", "EmbedLayerNormalization")
ATTENTION_OPS = ("Attention", "MultiHeadAttention", "GroupQueryAttention", "PackedAttention",
                 "PackedMultiHeadAttention", "DecoderMaskedMultiHeadAttention", "DecoderMaskedSelfAttention",
                 "LongformerAttention", "SparseAttention")


def _other_input(node: onnx.NodeProto, name: str) -> str:
    return next((i for i in node.input if i != name), name)


def _next(ctx: GraphIndex, node: onnx.NodeProto, *op_types: str) -> Optional[onnx.NodeProto]:
    """The one node reading `node`'s output (a Shape beside it reads no values: onnx's version converter
    writes Shape -> Flatten -> Softmax -> Reshape for an opset < 13 Softmax), if of one of `op_types`."""
    if not node.output or node.output[0] in ctx.outputs:
        return None
    users = [u for u in ctx.consumers.get(node.output[0], []) if u.op_type != "Shape"]
    return users[0] if len(users) == 1 and users[0].op_type in op_types else None


def layer_norm_chains(ctx: GraphIndex) -> Iterator[list[onnx.NodeProto]]:
    """From each Pow(d, 2) where d = x - ReduceMean(x): the chain to the Div and its affine tail.

    A LayerNorm as PyTorch/Paddle export it (ReduceMean -> Sub -> Pow 2 -> ReduceMean -> Add eps ->
    Sqrt -> Div, then Mul gamma / Add beta) stays float, like the LayerNormalization op (no rule)."""
    for pow_node in (n for n in ctx.graph.node if n.op_type == "Pow"):
        if len(pow_node.input) < 2 or ctx.scalar(pow_node.input[1]) != 2.0:
            continue
        sub = ctx.producer.get(pow_node.input[0])
        mean = ctx.producer.get(sub.input[1]) if sub is not None and sub.op_type == "Sub" else None
        if mean is None or mean.op_type != "ReduceMean" or mean.input[0] != sub.input[0]:
            continue
        var = _next(ctx, pow_node, "ReduceMean")
        eps = _next(ctx, var, "Add") if var else None
        sqrt = _next(ctx, eps, "Sqrt") if eps else None
        div = _next(ctx, sqrt, "Div") if sqrt else None
        if div is None or div.input[0] != sub.output[0]:
            continue
        chain = [mean, sub, pow_node, var, eps, sqrt, div]
        for op_type in ("Mul", "Add"):  # gamma, beta
            tail = _next(ctx, chain[-1], op_type)
            if tail is None or not ctx.is_constant(_other_input(tail, chain[-1].output[0])):
                break
            chain.append(tail)
        yield chain


_REDUCTIONS = ("ReduceMean", "ReduceSum", "ReduceSumSquare", "ReduceL2")
_STATISTIC_OPS = ("Add", "Sub", "Mul", "Div", "Max", "Min", "Sqrt", "Reciprocal", "Pow", "Neg", *_MOVERS)


def _float_values(ctx: GraphIndex, node: onnx.NodeProto) -> list[str]:
    """The computed float inputs of `node` (not constants; of a move or a reduction, its data alone)."""
    inputs = node.input[:1] if node.op_type in _MOVERS or node.op_type in _REDUCTIONS else node.input
    return [i for i in inputs if i and ctx.is_float(i) and not ctx.is_constant(i)]


def _statistics(ctx: GraphIndex) -> tuple[dict[str, onnx.NodeProto], set[str]]:
    """Tensors computed from reductions of activations with constants alone ({tensor: its node}: a
    mean, a variance, its inverse square root), and those among them that went through a square root."""
    made: dict[str, onnx.NodeProto] = {}
    rooted: set[str] = set()
    for node in ctx.graph.node:
        if not node.output or not node.output[0] or not ctx.is_float(node.output[0]):
            continue
        values = _float_values(ctx, node)
        statistic = node.op_type in _REDUCTIONS or (node.op_type in _STATISTIC_OPS and all(i in made for i in values))
        if not (values and statistic):
            continue
        made[node.output[0]] = node
        exponent = ctx.scalar(node.input[1]) if node.op_type == "Pow" and len(node.input) > 1 else None
        if node.op_type in ("Sqrt", "ReduceL2") or exponent in (0.5, -0.5) or any(i in rooted for i in values):
            rooted.add(node.output[0])
    return made, rooted


def _square_of(ctx: GraphIndex, node: Optional[onnx.NodeProto]) -> Optional[str]:
    """a, when `node` is Pow(a, 2) or Mul(a, a)."""
    if node is not None and node.op_type == "Pow" and len(node.input) > 1 and ctx.scalar(node.input[1]) == 2.0:
        return node.input[0]
    if node is not None and node.op_type == "Mul" and len(node.input) == 2 and node.input[0] == node.input[1]:
        return node.input[0]
    return None


def _in_order(ctx: GraphIndex, nodes: dict[str, onnx.NodeProto]) -> list[onnx.NodeProto]:
    """The nodes of {label: node}, in graph order."""
    return [n for n in ctx.graph.node if node_label(n) in nodes]


def _grow_statistics(ctx: GraphIndex, made: dict[str, onnx.NodeProto], names: list[str],
                     block: dict[str, onnx.NodeProto]) -> None:
    """Into `block`: the statistics computing `names` (_statistics' `made`), and past their reductions
    the squares read by them alone and the centring Subs (x - a statistic) they reduce."""
    pending = list(names)
    while pending:
        name = pending.pop()
        source = made.get(name) or ctx.producer.get(name)
        if source is None or node_label(source) in block:
            continue
        if name in made:
            block[node_label(source)] = source
            if source.op_type in _REDUCTIONS:  # what it reduces: a square, a centred tensor
                pending.append(source.input[0])
            else:
                pending += _float_values(ctx, source)
            continue
        square = _square_of(ctx, source)
        if square is not None and not all(r.op_type in _REDUCTIONS for r in ctx.consumers.get(name, [])):
            square = None  # a square the model uses for more than this statistic
        centring = source.op_type in ("Sub", "Add") and any(i in made for i in _float_values(ctx, source))
        if square is not None or centring:
            block[node_label(source)] = source
            pending += [square] if square is not None else _float_values(ctx, source)


def normalizations(ctx: GraphIndex) -> Iterator[list[onnx.NodeProto]]:
    """_normalizations, found once per graph (the residual Adds' rule reads them too)."""
    return iter(ctx.derived(_normalization_list))


def _normalization_list(ctx: GraphIndex) -> list[list[onnx.NodeProto]]:
    return list(_normalizations(ctx))


def _normalizations(ctx: GraphIndex) -> Iterator[list[onnx.NodeProto]]:
    """A tensor multiplied or divided by a square root of its own statistics, written out in any of the
    forms exporters write that `layer_norm_chains` does not match (TensorFlow's and JAX's
    mean(x^2) - mean(x)^2 with Reciprocal or Rsqrt, a Mul(d, d) square, RMSNorm, x / ||x||): the
    statistics, the squares and centring Subs that feed them, the Mul or Div, and an affine tail."""
    made, rooted = ctx.derived(_statistics)
    chained = {node_label(chain[6]) for chain in layer_norm_chains(ctx)}
    for node in ctx.graph.node:
        if node.op_type not in ("Mul", "Div") or node_label(node) in chained:
            continue
        values = _float_values(ctx, node)
        stats = [i for i in values if i in rooted]
        full = [i for i in values if i not in made]
        if len(stats) != 1 or len(full) != 1 or len(values) != 2:
            continue
        block: dict[str, onnx.NodeProto] = {node_label(node): node}
        _grow_statistics(ctx, made, [stats[0], full[0]], block)
        last = node
        for _ in range(3):  # gamma and beta, as constants or (TensorFlow's) beta - mean * scale
            tail = _next(ctx, last, "Mul", "Add", "Sub")
            other = _other_input(tail, last.output[0]) if tail is not None else None
            if tail is None or not (ctx.is_constant(other) or other in made):
                break
            block[node_label(tail)] = last = tail
            _grow_statistics(ctx, made, [other] if other in made else [], block)
        yield _in_order(ctx, block)


def _gelu_tail(ctx: GraphIndex, start: onnx.NodeProto, x: str) -> Optional[list[onnx.NodeProto]]:
    """erf/tanh -> Add 1 -> Mul (x or 0.5 x) [-> Mul 0.5]: the nodes after the nonlinearity."""
    plus_one = _next(ctx, start, "Add")
    if plus_one is None or ctx.scalar(_other_input(plus_one, start.output[0])) != 1.0:
        return None
    tail, node = [plus_one], plus_one
    while len(tail) < 3:
        mul = _next(ctx, node, "Mul")
        if mul is None:
            break
        other = _other_input(mul, node.output[0])
        half = ctx.producer.get(other)
        if half is not None and half.op_type == "Mul" and x in half.input:  # (0.5 x) * (1 + erf)
            tail.append(half)
        elif other != x and ctx.scalar(other) is None:
            break
        tail.append(mul)
        node = mul
    return tail if len(tail) > 1 else None


def gelu_chains(ctx: GraphIndex) -> Iterator[list[onnx.NodeProto]]:
    """Each GELU written out (Erf or Tanh form): its nodes from the op after x to the last Mul.

    x * 0.5 * (1 + erf(x / sqrt 2)) and 0.5 * x * (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))), the
    polynomial in any arrangement; the Gelu op has no rule (float already)."""
    for node in ctx.graph.node:
        if node.op_type == "Erf":
            scale = ctx.producer.get(node.input[0])  # x / sqrt 2 or x * (1 / sqrt 2)
            if scale is None or scale.op_type not in ("Div", "Mul") or ctx.scalar(scale.input[1]) is None:
                continue
            heads: Iterable[tuple[list[onnx.NodeProto], str]] = [([scale], scale.input[0])]
        elif node.op_type == "Tanh":
            heads = _tanh_gelu_heads(ctx, node)
        else:
            continue
        for head, x in heads:
            tail = _gelu_tail(ctx, node, x)
            if tail is not None:
                yield head + [node] + tail
                break


def _polynomial(ctx: GraphIndex, out: str, x: str) -> Optional[list[onnx.NodeProto]]:
    """The Mul/Add/Pow nodes computing `out` from `x` and constants alone, read by nothing else but
    the node after `out`, in graph order; None when another tensor enters."""
    nodes: dict[str, onnx.NodeProto] = {}
    pending = [out]
    while pending:
        name = pending.pop()
        if name == x:
            continue
        node = ctx.producer.get(name)
        if node is None or node.op_type not in ("Mul", "Add", "Pow") or len(nodes) > 6 or (
                node.op_type == "Pow" and ctx.scalar(node.input[1]) not in (2.0, 3.0)):
            return None
        if node_label(node) not in nodes:
            nodes[node_label(node)] = node
            pending += [i for i in node.input[:1 if node.op_type == "Pow" else 2] if not ctx.is_constant(i)]
    inner = {o for n in nodes.values() for o in n.output} - {out}
    if any(node_label(r) not in nodes for o in inner for r in ctx.consumers.get(o, [])):
        return None  # a part of it read elsewhere
    return _in_order(ctx, nodes)


def _tanh_gelu_heads(ctx: GraphIndex, tanh: onnx.NodeProto) -> Iterator[tuple[list[onnx.NodeProto], str]]:
    """(the nodes before the Tanh, x) for each x from which they compute sqrt(2/pi) (x + 0.044715 x^3)
    with constants alone, in any arrangement exporters write: Pow(x, 3) -> Mul 0.044715 -> Add x ->
    Mul sqrt(2/pi); JAX's x + x * (x * (0.044715 x)); x * (1 + 0.044715 x^2)."""
    seen, pending = set(), [tanh.input[0]]
    while pending and len(seen) < 8:
        node = ctx.producer.get(pending.pop(0))
        if node is None or node.op_type not in ("Mul", "Add", "Pow"):
            continue
        for name in node.input:
            if name and name not in seen and not ctx.is_constant(name):
                seen.add(name)
                pending.append(name)
                head = _polynomial(ctx, tanh.input[0], name)
                if head is not None and len(head) >= 3:
                    yield head, name


def _attention_scores(ctx: GraphIndex) -> Iterator[list[onnx.NodeProto]]:
    """A MatMul of two activations whose output reaches a Softmax through scale, mask and moves.

    Q K^T and what leads from it to the Softmax stay float with the Softmax; the probabilities get
    their own range where the P V MatMul reads them, and that MatMul is int8 like the weighted ones."""
    for node in ctx.graph.node:
        if node.op_type != "MatMul" or any(ctx.is_constant(i) for i in node.input):
            continue
        chain, current = [node], node
        while current is not None and current.op_type not in _SOFTMAX and len(chain) < 8:
            current = _next(ctx, current, *_SCORE_OPS, *_SOFTMAX)
            if current is not None:
                chain.append(current)
        if current is not None and current.op_type in _SOFTMAX:
            yield chain


def _residuals(ctx: GraphIndex) -> Iterator[list[onnx.NodeProto]]:
    """An Add of two activations read by a LayerNorm op (NORM_OPS) or by a decomposed chain's first ReduceMean.

    The residual stream carries the few outlier channels one static range cannot hold together with
    the rest (qtool.plan.dynamic); its readers quantize the normalized values instead."""
    starts = {node_label(chain[0]) for chain in layer_norm_chains(ctx)}
    starts |= {node_label(node) for chain in normalizations(ctx) for node in chain}
    for node in ctx.graph.node:
        if node.op_type != "Add" or any(ctx.is_constant(i) for i in node.input) or not node.output:
            continue
        readers = ctx.consumers.get(node.output[0], [])
        if any(r.op_type in NORM_OPS or node_label(r) in starts for r in readers):
            yield [node]


def _mask_origin(ctx: GraphIndex, node: onnx.NodeProto) -> bool:
    if node.op_type not in ("Add", "Sub", "Mul", "Where", "Concat", *_MOVERS):
        return False
    for name in node.input:
        value = ctx.const(name) if name else None
        if value is not None and value.dtype.kind == "f" and value.size and float(np.min(value)) <= MASK_LIMIT:
            return True
    return False


def mask_tensors(ctx: GraphIndex) -> tuple[set[str], list[onnx.NodeProto]]:
    """_mask_tensors, found once per graph (the mask rule and its never-quantized tensors both ask)."""
    return ctx.derived(_mask_tensors)


def _mask_tensors(ctx: GraphIndex) -> tuple[set[str], list[onnx.NodeProto]]:
    """Tensors holding a mask's large negative values (never quantized) and the nodes computing them,
    from the constant to the Softmax that consumes them, in graph order.

    A constant at or below MASK_LIMIT (-inf, float32 min: BERT's (1 - mask) * min, a Where filling
    -inf) marks a mask: an int8 range holding -1e4 would leave every real score in one code."""
    masked: set[str] = set()
    nodes = []
    for node in ctx.graph.node:
        if node.op_type in _SOFTMAX:
            continue
        if _mask_origin(ctx, node) or any(name in masked for name in node.input):
            masked.update(o for o in node.output if o and ctx.is_float(o))
            nodes.append(node)
    return masked, nodes


def _masks(ctx: GraphIndex) -> Iterator[list[onnx.NodeProto]]:
    nodes = mask_tensors(ctx)[1]
    if nodes:
        yield nodes


_SPECTRUM_OPS = ("Add", "Sub", "Mul", "Div", "Clip", "Max", "Min", "MatMul", "Gemm", "Sqrt", "Abs", "ReduceSum",
                 "ReduceMean", *_MOVERS)
_TRANSFORMS = ("Conv", "MatMul", "Gemm")


_MAGNITUDE = ("Sqrt", "Abs", "Add", "ReduceSum", "ReduceMean")  # sqrt(re^2 + im^2), sums of squares
_STACKING = ("Concat", "Slice", "Pad", *_MOVERS)  # octaves and real/imaginary halves stacked or cut apart
_MAX_SOURCE_NODES = 512


def _transforms_of(ctx: GraphIndex, name: str, inside: set[str]) -> list[onnx.NodeProto]:
    """The linear transforms `name` is computed from (an STFT or a constant-Q bank written as Convs or
    MatMuls with constant weights) and every node between: moves, the stacking of octaves or of
    real and imaginary parts (Concat, Slice, Pad), signs and scalings by constants, and magnitudes (sqrt of
    sums of squares). Empty
    when a path ends anywhere else, or when a node outside them and `inside` (the nodes reading
    `name`) reads one of their tensors."""
    found: dict[str, onnx.NodeProto] = {}
    pending = [name]
    while pending:
        node = ctx.producer.get(pending.pop())
        if node is None or len(found) >= _MAX_SOURCE_NODES:
            return []
        if node_label(node) in found:
            continue
        found[node_label(node)] = node
        square = _square_of(ctx, node)
        if node.op_type in _TRANSFORMS:
            if not (len(node.input) > 1 and ctx.is_constant(node.input[1])):
                return []
        elif square is not None:
            pending.append(square)
        elif node.op_type in _STACKING:
            pending += node.input[:1] if node.op_type != "Concat" else [
                i for i in node.input if i and not ctx.is_constant(i)]
        elif node.op_type in _MAGNITUDE:
            pending += _float_values(ctx, node)
        elif node.op_type == "Neg" or (node.op_type in ("Mul", "Div") and len(_float_values(ctx, node)) == 1):
            pending += _float_values(ctx, node)  # a sign or a constant scale
        else:
            return []
    allowed = set(found) | inside
    for node in found.values():  # a Shape beside them reads no values
        for out in node.output:
            if out and out != name and (out in ctx.outputs or any(
                    node_label(r) not in allowed and r.op_type != "Shape" for r in ctx.consumers.get(out, []))):
                return []
    if name in ctx.outputs or any(node_label(r) not in inside and r.op_type != "Shape"
                                  for r in ctx.consumers.get(name, [])):
        return []
    return _in_order(ctx, found)


def _log_spectra(ctx: GraphIndex) -> Iterator[list[onnx.NodeProto]]:
    """log(power) and log(magnitude), as an audio front end computes its log-mel or log spectrogram:
    every path into the Log (through a filterbank MatMul, a clamp, an epsilon, sums) ends in a square.
    The squares span twice the decades of the spectrum and the Log reads them relative to their size,
    where one int8 step of the loudest bin is tens of dB above the quiet ones; the weights of the
    transform that the squares read (an STFT written as a Conv or MatMul) are a window of int8 steps
    whose rounding leaks some 48 dB below the loudest bin into every other. All of it stays float,
    up to the Log and its scaling to decibels."""
    for log in (n for n in ctx.graph.node if n.op_type == "Log"):
        block: dict[str, onnx.NodeProto] = {node_label(log): log}
        pending, squared = [log.input[0]], []
        while pending and len(block) < 24:
            node = ctx.producer.get(pending.pop())
            if node is None:
                break
            square = _square_of(ctx, node)
            values = _float_values(ctx, node)
            if square is None and (node.op_type not in _SPECTRUM_OPS or (
                    node.op_type in ("Mul", "Div", "MatMul", "Gemm") and len(values) != 1)):
                break
            if node_label(node) not in block:
                block[node_label(node)] = node
                if square is not None:
                    squared.append(square)
                else:
                    pending += values
        else:
            if not squared:
                continue
            for name in dict.fromkeys(squared):
                readers = {node_label(r) for r in ctx.consumers.get(name, [])}
                for node in _transforms_of(ctx, name, readers & set(block)):
                    block[node_label(node)] = node
            last = log
            for _ in range(3):  # to decibels: * 10 / ln 10, a reference level subtracted
                scale = _next(ctx, last, "Mul", "Div", "Add", "Sub")
                if scale is None or not ctx.is_constant(_other_input(scale, last.output[0])):
                    break
                block[node_label(scale)] = last = scale
            yield _in_order(ctx, block)


def _magnitudes(ctx: GraphIndex) -> Iterator[list[onnx.NodeProto]]:
    """sqrt(a^2 + b^2 [+ eps]) and sqrt(ReduceSum/ReduceMean(x^2)): every path into the Sqrt through
    Add/ReduceSum/ReduceMean ends in a Pow 2 (outside a LayerNorm chain, which has its own rule).
    The squares span twice the decades of their inputs (an STFT's magnitude)."""
    in_norms = {node_label(chain[5]) for chain in layer_norm_chains(ctx)}
    in_norms |= {node_label(node) for rule in (normalizations, _log_spectra) for chain in rule(ctx) for node in chain}
    for sqrt in (n for n in ctx.graph.node if n.op_type == "Sqrt" and node_label(n) not in in_norms):
        chain, pending, squares = [sqrt], [sqrt.input[0]], 0
        while pending and len(chain) < 8:
            node = ctx.producer.get(pending.pop())
            if node is None or (node.op_type == "Pow" and ctx.scalar(node.input[1]) != 2.0) or (
                    node.op_type not in ("Pow", "Add", "ReduceSum", "ReduceMean")):
                break
            chain.append(node)
            if node.op_type == "Pow":
                squares += 1
            else:
                pending += [i for i in node.input[:1 if node.op_type.startswith("Reduce") else 2]
                            if not ctx.is_constant(i)]
        else:
            if squares and not pending:
                yield chain


_INTEGERS = {TensorProto.BOOL, TensorProto.INT8, TensorProto.UINT8, TensorProto.INT16, TensorProto.UINT16,
             TensorProto.INT32, TensorProto.UINT32, TensorProto.INT64, TensorProto.UINT64}
_FLOATS = {TensorProto.FLOAT, TensorProto.FLOAT16, TensorProto.DOUBLE, TensorProto.BFLOAT16}
# what keeps a value computed from integers one: arithmetic, and moves of whole values
_INTEGER_ARITHMETIC = ("Add", "Sub", "Mul", "Div", "Neg", "Abs", "Floor", "Ceil", "Round", "Min", "Max", "Mod",
                       "Clip", "Sign", "Concat", "Slice", "Gather", "Tile", "Split", "Where", *_MOVERS)


def _cast(node: onnx.NodeProto, into: set[int]) -> bool:
    return node.op_type == "Cast" and attribute(node, "to") in into


def _from_integers(ctx: GraphIndex) -> Iterator[list[onnx.NodeProto]]:
    """Per Cast of an integer tensor to float (or float Range) whose values, through arithmetic with
    constants alone, reach a Cast back to integers: the nodes on those paths, in graph order. (An
    image cast from uint8 and normalized for a Conv is data, not a count: it reaches no such Cast.)

    Exporters (Paddle's loops above all) compute step counters and indices this way: an int8 range
    over 0..500 has a step of 2, so a decoder loop would write each step's result to the wrong row."""
    nodes = list(ctx.graph.node)
    for start, seed in enumerate(nodes):
        if seed.op_type == "Range":
            if not (seed.output and ctx.elem_type.get(seed.output[0]) in _FLOATS):
                continue
        elif not (_cast(seed, _FLOATS) and ctx.elem_type.get(seed.input[0]) in _INTEGERS):
            continue
        values, made_by = {o for o in seed.output if o}, {o: seed for o in seed.output if o}
        ends = []
        for node in nodes[start + 1:]:
            floats = [i for i in node.input if i and ctx.is_float(i) and not ctx.is_constant(i)]
            if not floats or not all(i in values for i in floats):
                continue
            if _cast(node, _INTEGERS):
                ends.append(node)
            elif node.op_type in _INTEGER_ARITHMETIC and node.output:
                values.update(o for o in node.output if o)
                made_by.update({o: node for o in node.output if o})
        on_paths, pending = {}, [i for end in ends for i in end.input]
        while pending:
            node = made_by.get(pending.pop())
            if node is not None and node_label(node) not in on_paths:
                on_paths[node_label(node)] = node
                pending.extend(node.input)
        if on_paths:
            yield [n for n in nodes if node_label(n) in on_paths]


def _integer_values(ctx: GraphIndex) -> set[str]:
    return {o for chain in _from_integers(ctx) for node in chain for o in node.output if o and ctx.is_float(o)}


RULES = (
    BlockRule("LayerNorm chain", layer_norm_chains),
    BlockRule("normalization", normalizations),
    BlockRule("log spectrum", _log_spectra),
    BlockRule("magnitude", _magnitudes),
    BlockRule("GELU", gelu_chains),
    BlockRule("attention scores", _attention_scores),
    BlockRule("mask", _masks, never_quantized=lambda ctx: mask_tensors(ctx)[0]),
    BlockRule("residual Add", _residuals),
    BlockRule("count in float", _from_integers, never_quantized=_integer_values),
)
