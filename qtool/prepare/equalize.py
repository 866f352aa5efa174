"""Cross-layer equalization (DFQ, Nagel et al. 2019): balance per-channel weight ranges.

For Conv1 -> act -> Conv2 with act positively homogeneous (Relu, LeakyRelu, or none), dividing
output channel c of Conv1 by s_c and multiplying input channel c of Conv2 by s_c leaves the model
unchanged; s_c = sqrt(r1_c / r2_c) gives both weight ranges sqrt(r1_c r2_c), so a channel whose
weights dwarf its neighbours' no longer rounds theirs to zero under one per-tensor scale. Behind a
Clip(0, M) (ReLU6) a channel is rescaled only where interval arithmetic proves the clip stays
inactive (s_c >= bound_c / M): the fp32 model stays exact for every input, where AIMET replaces
ReLU6 by ReLU. Pairs go in graph order, a few rounds. Activation equalization (below: the same
idea for activations, with factors measured on the calibration data) lives here too.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Collection, Optional

import numpy as np
import onnx
from onnx import helper, numpy_helper

from qtool.errors import QtoolError
from qtool.graph.edit import mark_rescaled
from qtool.graph.index import GraphIndex, attribute, node_label

HOMOGENEOUS = ("Relu", "LeakyRelu")
ROUNDS = 4
SCALE_LIMITS = (1e-4, 1e4)  # keeps weights well inside float32 even for near-empty channels


@dataclass(frozen=True)
class Pair:
    first: onnx.NodeProto
    act: Optional[onnx.NodeProto]
    second: onnx.NodeProto


@dataclass
class EqualizeReport:
    pairs: int = 0
    channels: int = 0  # channels that may move (s_c free or bounded)
    pinned: int = 0  # channels kept at s_c = 1 because their Clip could saturate


def _clip_bounds(node: onnx.NodeProto, inits: dict[str, onnx.TensorProto]) -> Optional[tuple[float, float]]:
    lo, hi = attribute(node, "min", -np.inf), attribute(node, "max", np.inf)
    for index in (1, 2):
        if index < len(node.input) and node.input[index]:
            if node.input[index] not in inits:
                return None
            value = float(numpy_helper.to_array(inits[node.input[index]]).reshape(-1)[0])
            lo, hi = (value, hi) if index == 1 else (lo, value)
    return float(lo), float(hi)


def find_pairs(model: onnx.ModelProto) -> list[Pair]:
    """Conv -> (Relu | LeakyRelu | Clip(0, M) | nothing) -> Conv chains that can be rescaled."""
    graph = model.graph
    index = GraphIndex(graph)
    inits, only_consumer = index.initializers, index.only_consumer

    pairs = []
    for node in graph.node:
        if not _own_conv(node, index) or not node.output:
            continue
        nxt = only_consumer(node.output[0])
        act = None
        if nxt is not None and (nxt.op_type in HOMOGENEOUS or nxt.op_type == "Clip"):
            if nxt.op_type == "Clip":
                bounds = _clip_bounds(nxt, inits)
                if bounds is None or bounds[0] != 0.0:
                    continue  # a lower bound other than 0 is not homogeneous at all
            act, nxt = nxt, only_consumer(nxt.output[0])
        if nxt is None or not _own_conv(nxt, index) or nxt.input[0] != (act or node).output[0]:
            continue
        w1 = inits[node.input[1]]
        w2 = inits[nxt.input[1]]
        channels = w1.dims[0]
        group = attribute(nxt, "group", 1)
        if group == 1 and w2.dims[1] == channels:
            pairs.append(Pair(node, act, nxt))
        elif group == channels and w2.dims[1] == 1 and w2.dims[0] % channels == 0:
            pairs.append(Pair(node, act, nxt))  # depthwise second conv (channel multiplier allowed)
    return pairs


def _input_interval(name: str, model: onnx.ModelProto, inits) -> Optional[tuple[float, float]]:
    """A proven range of tensor `name`, when a Clip made it; None when nothing is known."""
    for node in model.graph.node:
        if name in node.output and node.op_type == "Clip":
            bounds = _clip_bounds(node, inits)
            if bounds and np.isfinite(bounds[0]) and np.isfinite(bounds[1]):
                return bounds
    return None


def _upper_bounds(w1: np.ndarray, b1: np.ndarray, interval: Optional[tuple[float, float]]) -> np.ndarray:
    """Per output channel, the largest pre-activation any input inside `interval` can give.
    Zero padding is an input of value 0, so the interval is widened to contain 0."""
    if interval is None:
        return np.full(w1.shape[0], np.inf)
    lo, hi = min(interval[0], 0.0), max(interval[1], 0.0)
    flat = w1.reshape(w1.shape[0], -1).astype(np.float64)
    return b1.astype(np.float64) + np.maximum(flat * lo, flat * hi).sum(axis=1)


def _second_ranges(w2: np.ndarray, channels: int, depthwise: bool) -> np.ndarray:
    if depthwise:
        return np.abs(w2.reshape(channels, -1)).max(axis=1)
    return np.abs(np.moveaxis(w2, 1, 0).reshape(channels, -1)).max(axis=1)


def _scale_second(w2: np.ndarray, s: np.ndarray, depthwise: bool) -> np.ndarray:
    if depthwise:
        per_row = np.repeat(s, w2.shape[0] // s.size)
        return w2 * per_row.reshape(-1, *([1] * (w2.ndim - 1)))
    return w2 * s.reshape(1, -1, *([1] * (w2.ndim - 2)))


def _equalize_pair(pair: Pair, model: onnx.ModelProto, inits: dict[str, onnx.TensorProto],
                   report: EqualizeReport, count: bool) -> None:
    first, second = pair.first, pair.second
    w1 = numpy_helper.to_array(inits[first.input[1]]).astype(np.float64)
    has_bias = len(first.input) > 2 and bool(first.input[2])
    b1 = numpy_helper.to_array(inits[first.input[2]]).astype(np.float64) if has_bias else np.zeros(w1.shape[0])
    w2 = numpy_helper.to_array(inits[second.input[1]]).astype(np.float64)
    channels = w1.shape[0]
    depthwise = attribute(second, "group", 1) != 1
    r1 = np.abs(w1.reshape(channels, -1)).max(axis=1)
    r2 = _second_ranges(w2, channels, depthwise)
    with np.errstate(divide="ignore", invalid="ignore"):
        s = np.sqrt(r1 / r2)
    s = np.where(np.isfinite(s) & (s > 0), s, 1.0)
    s = np.clip(s, *SCALE_LIMITS)
    pinned = 0
    if pair.act is not None and pair.act.op_type == "Clip":
        top = _clip_bounds(pair.act, inits)[1]
        if np.isfinite(top):
            bound = _upper_bounds(w1, b1, _input_interval(first.input[0], model, inits))
            never_clips = bound <= top
            # never clips: any s >= bound / top keeps the clip inactive after the rescale
            s = np.where(never_clips, np.maximum(s, np.maximum(bound, 0.0) / top), 1.0)
            pinned = int(np.count_nonzero(~never_clips))
    if count:
        report.pairs += 1
        report.pinned += pinned
        report.channels += channels - pinned
    shape1 = (-1,) + (1,) * (w1.ndim - 1)
    _replace(inits[first.input[1]], w1 / s.reshape(shape1))
    if has_bias:
        _replace(inits[first.input[2]], b1 / s)
    _replace(inits[second.input[1]], _scale_second(w2, s, depthwise))


def _replace(tensor: onnx.TensorProto, values: np.ndarray) -> None:
    tensor.CopyFrom(numpy_helper.from_array(values.astype(np.float32), tensor.name))


def equalize(model: onnx.ModelProto, rounds: int = ROUNDS) -> EqualizeReport:
    """Rescale the weights of every equalizable pair of `model` in place."""
    pairs = find_pairs(model)
    inits = {t.name: t for t in model.graph.initializer}
    report = EqualizeReport()
    for round_ in range(rounds):
        for pair in pairs:
            _equalize_pair(pair, model, inits, report, count=round_ == 0)
    return report


# --- Activation equalization: Conv -> activation -> depthwise Conv, with measured ranges --------
#
# A pointwise Conv of a MobileNet-style backbone can write channels whose ranges lie 30 times apart,
# and the depthwise Conv after its hard-swish multiplies the small ones by up to 125: one per-tensor
# int8 range loses them (docs/accuracy.md, "Activation equalization"). Hard-swish is not
# homogeneous, so the rescale above does not apply, but an exact rewrite does. With x' = x / s
# (s_c folded into the first Conv's weights and bias) and s_c multiplied into the depthwise Conv's
# channel c:
#
#     hardswish(x) / s = x' * Clip(s * x' + 3, 0, 6) / 6
#
# and s * x' + 3 is a depthwise 1x1 Conv of x' (weight s_c, bias 3) that onnxruntime runs as an
# integer kernel in place of the "+ 3" Add it replaces. Both x' and the depthwise Conv's input then
# have their channels' ranges equal (s_c = range_c / largest range, at least 1 / MAX_GAIN), and the
# fp32 outputs do not change beyond float rounding. The HardSwish op and x * HardSigmoid(x) take the
# same form (Clip(s * alpha * x' + beta, 0, 1)). Per-channel activation weights cost nothing here:
# both Convs' weights are quantized per output channel, and the depthwise Conv's channel c reads
# only input channel c.
#
# Some backbones (PP-LCNetV3) put a learnable scalar affine between the hard-swish and the depthwise
# Conv: y = a * hardswish(x) + b. Its "+ b" cannot stay a scalar once the channels are rescaled,
# so the affine (with the hard-swish's "/ 6") becomes one depthwise 1x1 Conv, and since that Conv
# can scale each channel again, y gets factors t of its own, measured on y: y / t = a * s / (6 t) *
# (x' * Clip(s * x' + 3, 0, 6)) + b / t, and the depthwise Conv's channel c is multiplied by t_c.
#
# With a homogeneous activation (Relu, LeakyRelu) or none between the Convs (a stem of
# Conv + BatchNorm, then a depthwise Conv), act(x / s) = act(x) / s
# and the factors alone do it, measured on the depthwise Conv's input (a Relu's output is the int8
# tensor). Unlike cross-layer equalization above, which balances weight ranges for per-tensor
# weights, this balances the activation between two per-channel Convs, where it costs nothing.

MAX_GAIN = 256.0  # the most a channel is enlarged by (a dead channel's range is 0)
GATE_OPS = ("Add", "Clip", "HardSigmoid")  # a hard-swish's gate: its values do not change


@dataclass(frozen=True, eq=False)
class ActivationSite:
    tensor: str  # the first Conv's output: the activation's input
    channels: int
    first: onnx.NodeProto  # the Conv writing `tensor`
    swish: tuple[onnx.NodeProto, ...]  # the hard-swish's nodes, the gate first, the last writing its result;
    # for a homogeneous activation (Relu, LeakyRelu) its node, or nothing for none
    tail: tuple[onnx.NodeProto, ...]  # a scalar affine after it (Mul, Add, or both), or nothing
    affine: tuple[float, float]  # the tail's a and b (1, 0 without one)
    second: onnx.NodeProto  # the depthwise Conv reading the result

    @property
    def hard_swish(self) -> bool:
        """Whether the activation is a hard-swish (rewritten), not a homogeneous one (rescaled only)."""
        return bool(self.swish) and self.swish[0].op_type not in HOMOGENEOUS

    @property
    def rescaled(self) -> tuple[str, ...]:
        """The activation's tensors that equalization rescales: from its first node past the gate
        that reads x (the product) to its result. The gate's, / 6 included when it divides the
        gate (x * (Clip(x + 3, 0, 6) / 6)), keep their values."""
        start = next((i for i, n in enumerate(self.swish) if n.op_type not in GATE_OPS and self.tensor in n.input),
                     len(self.swish))
        return tuple(n.output[0] for n in self.swish[start:])

    @property
    def output(self) -> str:
        """The depthwise Conv's input: with a tail, equalized by factors of its own."""
        return self.second.input[0]


def activation_sites(model: onnx.ModelProto) -> list[ActivationSite]:
    """Conv -> activation -> depthwise Conv chains whose activations can be equalized exactly: a
    hard-swish (HardSwish, x * HardSigmoid(x), or written out as x * Clip(x + 3, 0, 6) then / 6 or
    * (1/6), or as x * (Clip(x + 3, 0, 6) / 6)), optionally followed by a scalar affine (* a, + b);
    Relu; LeakyRelu; or none."""
    return _sites(GraphIndex(model.graph))


def _sites(index: GraphIndex) -> list[ActivationSite]:
    sites = []
    for node in index.graph.node:
        if not _own_conv(node, index) or not node.output:
            continue
        x = node.output[0]
        swish = _hard_swish(x, index)
        if swish is not None:
            tail, affine = _affine(swish[-1].output[0], index)
        else:  # Conv -> (Relu | LeakyRelu | nothing) -> depthwise Conv: the factors alone, no rewrite
            act = index.only_consumer(x)
            swish = [act] if act is not None and act.op_type in HOMOGENEOUS else []
            tail, affine = [], (1.0, 0.0)
        result = (tail or swish)[-1].output[0] if tail or swish else x
        second = index.only_consumer(result)
        channels = index.initializers[node.input[1]].dims[0]
        if (second is None or not _own_conv(second, index) or second.input[0] != result
                or attribute(second, "group", 1) != channels or index.initializers[second.input[1]].dims[1] != 1):
            continue
        sites.append(ActivationSite(x, channels, node, tuple(swish), tuple(tail), affine, second))
    return sites


def _affine(h: str, index: GraphIndex) -> tuple[list[onnx.NodeProto], tuple[float, float]]:
    """The nodes of a scalar affine a * h + b that alone read `h` (Mul then Add, or one of them), and
    (a, b); no nodes and (1, 0) when there is none."""
    nodes, a, b = [], 1.0, 0.0
    for op_type in ("Mul", "Add"):
        node = index.only_consumer(nodes[-1].output[0] if nodes else h)
        if node is None or node.op_type != op_type:
            continue
        inputs = list(node.input)
        current = nodes[-1].output[0] if nodes else h
        if len(inputs) != 2 or inputs.count(current) != 1:
            continue
        value = index.scalar(inputs[1 - inputs.index(current)])
        if value is None:
            continue
        nodes.append(node)
        if op_type == "Mul":
            a = value
        else:
            b = value
    return nodes, (a, b)


def _own_conv(node: onnx.NodeProto, index: GraphIndex) -> bool:
    names = [n for n in node.input[1:3] if n]
    return (node.op_type == "Conv" and node.domain in ("", "ai.onnx") and len(node.input) >= 2
            and all(n in index.initializers and len(index.consumers.get(n, [])) == 1 for n in names)
            and index.initializers[node.input[1]].data_type == onnx.TensorProto.FLOAT)


def _hard_swish(x: str, index: GraphIndex) -> Optional[list[onnx.NodeProto]]:
    """The nodes computing hard-swish of `x` when they alone read it, the last writing the result."""
    if x in index.outputs:
        return None
    readers = index.consumers.get(x, [])
    if len(readers) == 1 and readers[0].op_type == "HardSwish":
        return readers
    if len(readers) != 2:
        return None
    by_type = {r.op_type: r for r in readers}
    mul = by_type.get("Mul")
    gate = by_type.get("HardSigmoid") or by_type.get("Add")
    if mul is None or gate is None or gate.input[0] != x:
        return None
    nodes, gate_divided = [gate], False
    if gate.op_type == "Add":  # x + 3 -> Clip(0, 6)
        if index.scalar(gate.input[1]) != 3.0:
            return None
        clip = index.only_consumer(gate.output[0])
        if clip is None or clip.op_type != "Clip" or index.clip_bounds(clip) != (0.0, 6.0):
            return None
        nodes.append(clip)
        scale = index.only_consumer(clip.output[0])
        gate_divided = scale is not mul and index.divides(scale, clip.output[0], 6.0)  # x * (Clip(...) / 6)
        if gate_divided:
            nodes.append(scale)
    if index.only_consumer(nodes[-1].output[0]) is not mul or sorted(mul.input) != sorted([x, nodes[-1].output[0]]):
        return None
    nodes.append(mul)
    if gate.op_type == "Add" and not gate_divided:  # x * Clip(...), then / 6 or * (1/6)
        scale = index.only_consumer(mul.output[0])
        if not index.divides(scale, mul.output[0], 6.0):
            return None
        nodes.append(scale)
    return nodes


def activation_scales(maxima: np.ndarray) -> tuple[float, ...]:
    """s_c: channel c's largest |x| over the largest channel's, at least 1 / MAX_GAIN."""
    top = float(maxima.max()) if maxima.size else 0.0
    if top <= 0:
        return tuple(1.0 for _ in maxima)
    return tuple(float(s) for s in np.clip(maxima / top, 1.0 / MAX_GAIN, 1.0))


def equalize_activations(model: onnx.ModelProto, scales: dict[str, tuple[float, ...]],
                         elementwise: bool = False) -> int:
    """Rewrite every site of `model` whose tensor `scales` names (module comment above) in place, and
    take those entries out of `scales`; the number rewritten. A hard-swish's gate (and a tail) is
    written as a depthwise 1x1 Conv, an int8 layer where every op is quantized; `elementwise`: as
    a per-channel Mul by a constant after the activation as exported (_rescaling_nodes), for a
    runtime that quantizes only its int8 layers' inputs and fuses such a Mul into the quantizer
    after it."""
    index = GraphIndex(model.graph)
    sites = []
    for site in _sites(index):
        if site.tensor in scales:
            sites.append(site)
        elif site.tail:
            scales.pop(site.output, None)  # a tail's factors go with their chain's
    inits = index.initializers
    replaced: dict[str, list[onnx.NodeProto]] = {}
    for site in sites:
        s = _factors(scales.pop(site.tensor), site.tensor, site)
        t = _factors(scales.pop(site.output), site.output, site) if site.tail and site.output in scales else s
        first, second = site.first, site.second
        w2 = numpy_helper.to_array(inits[second.input[1]]).astype(np.float64)
        _replace(inits[second.input[1]], _scale_second(w2, t, depthwise=True))
        spatial = w2.ndim - 2
        if elementwise and (site.hard_swish or site.tail):
            replaced.update(_rescaling_nodes(model, site, t, spatial))
            continue
        w1 = numpy_helper.to_array(inits[first.input[1]]).astype(np.float64)
        _replace(inits[first.input[1]], w1 / s.reshape((-1,) + (1,) * (w1.ndim - 1)))
        if len(first.input) > 2 and first.input[2]:
            _replace(inits[first.input[2]], numpy_helper.to_array(inits[first.input[2]]).astype(np.float64) / s)
        if site.hard_swish:
            replaced.update(_gate_nodes(model, site, s, spatial))
        if site.tail:
            replaced.update(_tail_nodes(model, site, s, t, spatial))
    if replaced:
        nodes = []
        for node in model.graph.node:
            nodes.extend(replaced.get(node.output[0], [node]) if node.output else [node])
        del model.graph.node[:]
        model.graph.node.extend(nodes)
    # x, the hard-swish's product and result (its gate's tensors keep their values), the tail's result;
    # in the elementwise form only the result (x and the activation keep their values)
    mark_rescaled(model, [name for site in sites for name in
                          ((site.output,) if elementwise and (site.hard_swish or site.tail) else
                           (site.tensor, site.output, *site.rescaled))])
    return len(sites)


def _rescaling_nodes(model: onnx.ModelProto, site: ActivationSite, t: np.ndarray,
                     spatial: int) -> dict[str, list[onnx.NodeProto]]:
    """The elementwise form of a rewritten chain: the first Conv, the activation and its tail compute
    as exported, and their result times 1 / t is the depthwise Conv's equalized input: one
    per-channel Mul by a constant, which a runtime that fuses elementwise ops folds into the
    quantizer after it (that quantizer becomes one with a range per channel). x itself is not
    rescaled: no int8 layer reads it, and a per-channel Mul after the first Conv would be a step
    the runtime computes on every output of that Conv."""
    shrink = numpy_helper.from_array((1.0 / t).astype(np.float32).reshape((1, -1) + (1,) * spatial),
                                     _tail_weight(site.tensor))
    model.graph.initializer.append(shrink)
    result = site.output
    unscaled = f"{result}_unscaled"
    last = [*site.swish, *site.tail][-1]
    copy = onnx.NodeProto()
    copy.CopyFrom(last)
    for i, name in enumerate(copy.output):
        if name == result:
            copy.output[i] = unscaled
    return {last.output[0]: [copy, helper.make_node("Mul", [unscaled, shrink.name], [result],
                                                    name=f"{node_label(site.first)}_equalized_out")]}


def _factors(values: tuple[float, ...], tensor: str, site: ActivationSite) -> np.ndarray:
    """The table's factors for `tensor` of `site`, checked against its channels."""
    factors = np.asarray(values, dtype=np.float64)
    if factors.size != site.channels:
        raise QtoolError(f"the calibration table equalizes tensor '{tensor}' over {factors.size} channels, "
                         f"this graph has {site.channels} (the table was made for another model)")
    return factors


def _tail_nodes(model: onnx.ModelProto, site: ActivationSite, s: np.ndarray, t: np.ndarray,
                spatial: int) -> dict[str, list[onnx.NodeProto]]:
    """The scalar affine after the hard-swish (and the written-out form's "/ 6") as one depthwise 1x1
    Conv from hardswish(x) / s, or 6 hardswish(x) / s, to y / t; the nodes it replaces go."""
    a, b = site.affine
    first = site.swish[-1]
    if site.swish[0].op_type == "Add" and site.tensor not in first.input:  # x' * Clip(...) then / 6:
        # the Conv takes the / 6 (in x' * (Clip(...) / 6) the gate keeps it) and reads the product
        a /= 6.0
        source = site.swish[-2].output[0]
        gone = [first, *site.tail[:-1]]
    else:
        source = first.output[0]
        gone = list(site.tail[:-1])
    weight = numpy_helper.from_array((a * s / t).astype(np.float32).reshape((-1, 1) + (1,) * spatial),
                                     _tail_weight(site.tensor))
    bias = numpy_helper.from_array((b / t).astype(np.float32), f"{site.tensor}_equalized_tail_b")
    model.graph.initializer.extend([weight, bias])
    last = site.tail[-1]
    conv = helper.make_node("Conv", [source, weight.name, bias.name], [last.output[0]],
                            name=last.name or last.output[0], group=s.size, kernel_shape=[1] * spatial)
    return {**{node.output[0]: [] for node in gone}, last.output[0]: [conv]}


def _gate_nodes(model: onnx.ModelProto, site: ActivationSite, s: np.ndarray,
                spatial: int) -> dict[str, list[onnx.NodeProto]]:
    """Output of the node to replace -> the nodes replacing it: the gate of hard-swish as a
    depthwise 1x1 Conv of x' (weight s * slope, bias offset) and, for the HardSwish op, the Clip and
    Mul it computed inside."""
    x, gate = site.tensor, site.swish[0]
    if gate.op_type == "Add":
        slope, offset, top = 1.0, 3.0, None  # the Clip after it stays
    elif gate.op_type == "HardSigmoid":
        slope, offset, top = attribute(gate, "alpha", 0.2), attribute(gate, "beta", 0.5), 1.0
    else:  # HardSwish: x * HardSigmoid(x) with alpha 1/6, beta 0.5
        slope, offset, top = 1.0 / 6.0, 0.5, 1.0
    name = f"{x}_equalized"
    weight = numpy_helper.from_array((s * slope).astype(np.float32).reshape((-1, 1) + (1,) * spatial),
                                     _gate_weight(x))
    bias = numpy_helper.from_array(np.full(s.size, offset, np.float32), f"{name}_gate_b")
    model.graph.initializer.extend([weight, bias])
    label = gate.name or gate.output[0]
    if top is None:
        return {gate.output[0]: [helper.make_node("Conv", [x, weight.name, bias.name], [gate.output[0]],
                                                  name=label, group=s.size, kernel_shape=[1] * spatial)]}
    bounds = [numpy_helper.from_array(np.array(v, np.float32), f"{name}_gate_{k}") for k, v in (("lo", 0.0), ("hi", top))]
    model.graph.initializer.extend(bounds)
    linear, gated = f"{name}_gate_linear", f"{name}_gate"
    rewritten = [helper.make_node("Conv", [x, weight.name, bias.name], [linear], name=f"{label}_gate",
                                  group=s.size, kernel_shape=[1] * spatial),
                 helper.make_node("Clip", [linear, bounds[0].name, bounds[1].name], [gated], name=f"{label}_clip")]
    if gate.op_type == "HardSigmoid":
        rewritten[-1].output[0] = gate.output[0]
        return {gate.output[0]: rewritten}
    rewritten.append(helper.make_node("Mul", [x, gated], [gate.output[0]], name=label))
    return {gate.output[0]: rewritten}


def _gate_weight(tensor: str) -> str:
    """The name of an equalized chain's gate weight: how a rewritten graph shows which chains it has."""
    return f"{tensor}_equalized_gate_w"


def _tail_weight(tensor: str) -> str:
    """The name of the weight of the depthwise 1x1 Conv that replaces an equalized chain's tail."""
    return f"{tensor}_equalized_tail_w"


def equalized_chains(model: onnx.ModelProto, tensors: Collection[str]) -> dict[str, set[str]]:
    """For each of `tensors` whose hard-swish equalize_activations rewrote in `model` (its gate's
    or its rescaling Mul's weight is there), the labels of its chain's nodes: the Conv writing the
    tensor, the gate and the rest of the hard-swish, its tail, and the depthwise Conv reading the
    result. (A chain through a homogeneous activation keeps its nodes: rescaled, it costs nothing
    in float.)"""
    names = {t.name for t in model.graph.initializer}
    rewritten = [tensor for tensor in tensors if _gate_weight(tensor) in names or _tail_weight(tensor) in names]
    if not rewritten:
        return {}
    index = GraphIndex(model.graph)
    chains = {}
    for tensor in rewritten:
        found = {node_label(index.producer[tensor])} if tensor in index.producer else set()
        frontier = list(index.consumers.get(tensor, []))
        while frontier and len(found) < 16:
            node = frontier.pop()
            if node_label(node) in found:
                continue
            found.add(node_label(node))
            if node.op_type == "Conv" and node.input[1] not in (_gate_weight(tensor), _tail_weight(tensor)):
                continue  # the depthwise Conv ends the chain
            frontier.extend(r for name in node.output for r in index.consumers.get(name, []))
        chains[tensor] = found
    return chains
