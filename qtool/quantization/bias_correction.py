"""Bias correction: remove the mean output shift that weight and activation rounding cause.

Two forms, `bias_correction: weights` and `fast`.

`weights` (asked for, or kept by `auto` where the target measures it): rounding a layer's
weights to int8 moves each output channel's mean by (W - W_q) . m, m the per-channel means of the
layer's input, which calibration measured in its one pass (qtool.calibration.statistics); the
bias takes that back before it is quantized (`WeightShifts`, read by the rewrite). A Conv's tap
that falls on padding at a border adds nothing there, so each tap counts for the share of output
positions where it reads the input (from the input's mean spatial size, which calibration also
keeps): on short maps (a few audio frames) that share is far from 1. Nothing runs: it costs the
means' reductions in the observing pass and a product per layer. It is the systematic part of
the shift, the same at every position of a map, so it holds on per-position outputs (detectors,
segmenters) as on classifiers.

`fast` measures the whole shift instead, activation rounding and what earlier layers pass on
included: for each Conv/Gemm with an int32 bias, in graph order, each sample's per-channel output
mean is measured in the fp32 model and in the quantized model (earlier layers already corrected);
the bias, whose scale s_in x s_w[c] stays exact, moves by the mean of those paired differences as
far as the samples agree on it (`_correction`): a shift measured on a few dozen samples over
hundreds of channels is often noise, which does not hold on other inputs. Each sample weighs the
same, whatever its size (text lines of different widths). Cost: one fp32 pass, and one pass of
the quantized model cut into slices ending at each corrected layer, each starting from the
tensors the previous left (kept for the correction samples only), so the quantized model runs
about once. Figures: benchmarks/README.md.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Iterable, Optional

import numpy as np
import onnx
from onnx import helper, numpy_helper

from qtool.data.dataset import Batch
from qtool.graph.edit import array_input, sub_model, with_outputs
from qtool.graph.index import GraphIndex, attribute, node_label, replace_nodes, scoped_nodes
from qtool.plan.planner import QuantPlan
from qtool.table.qparams import INT32_MAX
from qtool.quantization.rewrite import SCALE_SUFFIX, WEIGHT_SUFFIX
from qtool.graph.runtime import create_session
from qtool.graph.shapes import elem_types, inferred

CHANNEL_AXIS = {"Conv": 1, "ConvTranspose": 1, "Gemm": -1}


@dataclass(frozen=True)
class _Target:
    node: str
    output: str
    bias: str  # the float bias name; its int32 values are `bias + WEIGHT_SUFFIX`
    axis: int


@dataclass
class BiasCorrectionReport:
    layers: int = 0
    mean_abs_shift_before: float = 0.0  # mean |E[y] - E[y_q]| over channels, as measured
    samples: int = 0
    channels: int = 0
    channels_corrected: int = 0  # those whose bias moved: a significant shift (_correction)


class WeightShifts:
    """The `bias_shift` of qtool.quantization.rewrite.quantize_graph for the `weights` form: each
    layer with a bias whose input has channel means moves by weight_shift. A bias several layers
    read (an all-zero one stays shared: zero at any scale) is left as it is: each layer's shift
    differs."""

    def __init__(self, model: onnx.ModelProto, plan: QuantPlan, channel_means: dict[str, tuple[float, ...]],
                 spatial_sizes: dict[str, tuple[float, ...]]):
        nodes = list(scoped_nodes(model.graph))
        by_label = {node_label(n): n for n in nodes}
        readers = Counter(name for n in nodes for name in n.input)
        self._layers = {name: (by_label[b.node], np.asarray(channel_means[b.activation], np.float64),
                               spatial_sizes.get(b.activation, ()))
                        for name, b in plan.biases.items()
                        if b.node in by_label and b.activation in channel_means and readers[name] == 1}

    def __call__(self, bias: str, weight: np.ndarray, dequantized: np.ndarray) -> Optional[np.ndarray]:
        if bias not in self._layers:
            return None
        node, means, spatial = self._layers[bias]
        return weight_shift(node, weight, dequantized, means, spatial)


def weight_shift(node: onnx.NodeProto, weight: np.ndarray, dequantized: np.ndarray, means: np.ndarray,
                 spatial: tuple[float, ...] = ()) -> Optional[np.ndarray]:
    """Each output channel's mean shift over the output positions, fp32 minus int8, that
    `dequantized` in place of `weight` causes on an input whose channels average `means` and whose
    spatial size is `spatial`: (W - W_q) . m, each Conv tap weighted by tap_shares. For a Conv
    (any group count) and a Gemm without transA; None for another layer, a Conv whose spatial size
    or padding is not known, or means that do not match the weight's input channels."""
    error = weight.astype(np.float64) - dequantized
    if node.op_type == "Conv" and error.ndim >= 3:
        groups = attribute(node, "group", 1)
        out, per_group = error.shape[:2]
        shares = tap_shares(node, error.shape[2:], spatial)
        if means.shape != (per_group * groups,) or out % groups or shares is None:
            return None
        taps = (error * shares).reshape(out, per_group, -1).sum(axis=2)
        group_means = means.reshape(groups, per_group)[np.arange(out) // (out // groups)]
        return (taps * group_means).sum(axis=1)
    if node.op_type == "Gemm" and error.ndim == 2 and not attribute(node, "transA", 0):
        rows = error.T if attribute(node, "transB", 0) else error  # [inputs, outputs]
        # a sum in numpy's own order, not a BLAS product: BLAS kernels, picked by the CPU, add otherwise
        return (means[:, None] * rows).sum(axis=0) if means.shape == (rows.shape[0],) else None
    return None


def tap_shares(node: onnx.NodeProto, kernel: tuple[int, ...], spatial: tuple[float, ...]) -> Optional[np.ndarray]:
    """Per tap of a Conv's kernel, the share of its output positions at which the tap reads the
    input rather than padding, for an input of `spatial` size (a mean over samples, rounded);
    None where that size is unknown or the padding is not explicit (auto_pad SAME_*)."""
    if len(spatial) != len(kernel) or attribute(node, "auto_pad", b"NOTSET") not in (b"NOTSET", "NOTSET", b"VALID",
                                                                                       "VALID"):
        return None
    axes = len(kernel)
    strides = attribute(node, "strides", None) or [1] * axes
    dilations = attribute(node, "dilations", None) or [1] * axes
    pads = attribute(node, "pads", None) or [0] * (2 * axes)
    shares = np.ones(kernel)
    for a in range(axes):
        size = max(1, int(round(spatial[a])))
        span = dilations[a] * (kernel[a] - 1) + 1
        positions = (size + pads[a] + pads[a + axes] - span) // strides[a] + 1
        if positions < 1:
            return None
        start = np.arange(positions)[:, None] * strides[a] - pads[a] + np.arange(kernel[a])[None, :] * dilations[a]
        share = ((start >= 0) & (start < size)).mean(axis=0)
        shape = [1] * axes
        shape[a] = kernel[a]
        shares = shares * share.reshape(shape)
    return shares


class _SampleMeans:
    """Per-sample per-channel means ([samples, channels]); a sample weighs the same whatever its size."""

    def __init__(self):
        self.rows = []

    def update(self, array: np.ndarray, axis: int) -> None:
        axis = axis % array.ndim
        other = tuple(i for i in range(1, array.ndim) if i != axis)
        self.rows.append(array.mean(axis=other, dtype=np.float64) if other else array.astype(np.float64))

    @property
    def values(self) -> np.ndarray:
        return np.concatenate(self.rows, axis=0)


def _add_zero_biases(qmodel: onnx.ModelProto) -> list[_Target]:
    """Give int8 Convs without a bias (those followed by an unfolded BatchNormalization) an int32
    zero bias at scale s_in x s_w, so that they can be corrected too."""
    index = GraphIndex(qmodel)
    producers, inits = index.producer, index.initializers
    added, head = [], []
    for node in qmodel.graph.node:
        if node.op_type != "Conv" or (len(node.input) > 2 and node.input[2]) or len(node.input) < 2:
            continue
        dqs = [producers.get(name) for name in node.input[:2]]
        if any(dq is None or dq.op_type != "DequantizeLinear" or dq.input[1] not in inits for dq in dqs):
            continue
        s_in = numpy_helper.to_array(inits[dqs[0].input[1]])
        s_w = numpy_helper.to_array(inits[dqs[1].input[1]])
        if s_in.ndim != 0 or dqs[0].input[0] in inits:
            continue  # per-tensor activation scale only; a constant input is not an activation
        name = node_label(node) + "_corrected_bias"
        channels = inits[dqs[1].input[0]].dims[0]
        scale = (np.float32(s_in) * s_w.astype(np.float32)).astype(np.float32)
        axis = {"axis": 0} if scale.ndim else {}
        qmodel.graph.initializer.extend([
            numpy_helper.from_array(np.zeros(channels, np.int32), name + WEIGHT_SUFFIX),
            numpy_helper.from_array(scale, name + SCALE_SUFFIX),
            numpy_helper.from_array(np.zeros(scale.shape, np.int32), name + "_zero_point")])
        head.append(helper.make_node("DequantizeLinear", [name + WEIGHT_SUFFIX, name + SCALE_SUFFIX,
                                                          name + "_zero_point"], [name + "_DequantizeLinear_Output"],
                                     name=name + "_DequantizeLinear", **axis))
        while len(node.input) < 2:
            node.input.append("")
        node.input.append(name + "_DequantizeLinear_Output")
        added.append(_Target(node_label(node), node.output[0], name, CHANNEL_AXIS["Conv"]))
    if head:
        nodes = head + list(qmodel.graph.node)
        replace_nodes(qmodel.graph, nodes)
    return added


def _targets(qmodel: onnx.ModelProto, plan: QuantPlan) -> list[_Target]:
    inits = {t.name for t in qmodel.graph.initializer}
    by_label = {node_label(n): n for n in qmodel.graph.node}
    found = []
    for name, bias in plan.biases.items():
        node = by_label.get(bias.node)
        if node is None or node.op_type not in CHANNEL_AXIS or name + WEIGHT_SUFFIX not in inits:
            continue
        found.append(_Target(bias.node, node.output[0], name, CHANNEL_AXIS[node.op_type]))
    found += _add_zero_biases(qmodel)
    order = {node_label(n): i for i, n in enumerate(qmodel.graph.node)}
    return sorted(found, key=lambda t: order[t.node])


def _fp32_means(model: onnx.ModelProto, targets: list[_Target], data: list[Batch], threads: int) -> dict:
    names = [t.output for t in targets]
    session = create_session(with_outputs(model, names), threads, "fp32 model", batch_pass=True)
    means = {t.output: _SampleMeans() for t in targets}
    for batch in data:
        for target, array in zip(targets, session.run(names, batch.feeds)):
            means[target.output].update(array, target.axis)
    return {name: m.values for name, m in means.items()}


def _constants_read(part: list[onnx.NodeProto], const_nodes: dict[str, onnx.NodeProto],
                    nodes: list[onnx.NodeProto]) -> list[onnx.NodeProto]:
    """The constant nodes `part` reads, and the constant nodes those read in turn (a Pad's amounts
    built by a chain of Constant/Concat/Reshape/Cast nodes), in graph order."""
    needed: set[int] = set()
    stack = [name for node in part for name in node.input]
    while stack:
        node = const_nodes.get(stack.pop())
        if node is not None and id(node) not in needed:
            needed.add(id(node))
            stack.extend(node.input)
    return [node for node in nodes if id(node) in needed]


def correct_biases(model: onnx.ModelProto, qmodel: onnx.ModelProto, plan: QuantPlan, data: Iterable[Batch],
                   threads: int = 0) -> BiasCorrectionReport:
    """Correct the int32 biases of `qmodel` (the QDQ model of `model`) in place."""
    data = list(data)
    report = BiasCorrectionReport(samples=sum(len(b) for b in data))
    targets = _targets(qmodel, plan)
    if not targets or not data:
        return report
    reference = _fp32_means(model, targets, data, threads)
    inits = {t.name: t for t in qmodel.graph.initializer}

    nodes = list(qmodel.graph.node)
    types = elem_types(inferred(qmodel, data_prop=False))  # QuantizeLinear outputs are 8-bit
    constant = set(inits)
    const_nodes: dict[str, onnx.NodeProto] = {}
    for node in nodes:  # DequantizeLinear of weights and biases: recomputed inside each slice
        if all(not name or name in constant for name in node.input):
            constant.update(node.output)
            const_nodes.update({out: node for out in node.output})
    compute = [n for n in nodes if n.output[0] not in const_nodes]
    position = {node_label(n): i for i, n in enumerate(compute)}
    last_read: dict[str, int] = {}
    for i, node in enumerate(compute):
        for name in node.input:
            last_read[name] = i

    cache = [dict(batch.feeds) for batch in data]
    start = 0
    shifts, moved = [], []
    for target in targets:
        end = position[target.node] + 1
        part = compute[start:end]
        made = {o for n in part for o in n.output}
        needed_consts = _constants_read(part, const_nodes, nodes)
        inputs = {name: cache[0][name] for name in dict.fromkeys(x for n in part for x in n.input)
                  if name and name not in constant and name not in made}
        outputs = [o for o in dict.fromkeys(o for n in part for o in n.output)
                   if o and (last_read.get(o, -1) >= end or o == target.output)]
        piece = sub_model(qmodel, needed_consts + part, [array_input(name, a) for name, a in inputs.items()],
                          [helper.make_tensor_value_info(name, types.get(name, onnx.TensorProto.FLOAT), None)
                           for name in outputs], "slice")
        session = create_session(piece, threads, target.node, batch_pass=True)
        means = _SampleMeans()
        for entry in cache:
            entry.update(zip(outputs, session.run(outputs, {name: entry[name] for name in inputs})))
            means.update(entry[target.output], target.axis)
        del session
        measured = reference[target.output] - means.values
        shift = _correction(measured)
        applied = _shift_bias(inits, target.bias, shift)
        for entry in cache:  # later slices see the corrected layer
            out = entry[target.output]
            shape = [1] * out.ndim
            shape[target.axis % out.ndim] = -1
            out += applied.reshape(shape).astype(out.dtype)
        shifts.append(float(np.mean(np.abs(measured.mean(axis=0)))))
        moved.append(np.abs(applied) > 0)
        start = end
        for entry in cache:
            for name in [n for n in entry if last_read.get(n, -1) < end]:
                del entry[name]
    report.layers = len(targets)
    report.mean_abs_shift_before = float(np.mean(shifts))
    report.channels = int(sum(m.size for m in moved))
    report.channels_corrected = int(sum(m.sum() for m in moved))
    return report


SIGNIFICANCE = 1.0  # t at or below which a channel's shift is taken for noise and not applied


def _correction(differences: np.ndarray) -> np.ndarray:
    """The shift added to each channel's bias, from `differences` [samples, channels] (fp32 minus
    int8 per-sample channel means): their mean d, times max(0, 1 - 1/t^2) with t = d / (its
    standard error): the positive-part James-Stein estimate of the true shift, which minimises the
    expected squared error of what is applied (d^2 - se^2 estimates the shift's square). A layer
    has hundreds of channels and a few dozen samples, so many measured shifts are noise that does
    not hold on other inputs (|t| <= 1: none applied); a shift the samples agree on is applied nearly
    whole. A stricter threshold (|t| <= 2) lost most of the gain in cross-validation on the kit."""
    mean = differences.mean(axis=0)
    count = differences.shape[0]
    if count < 2:  # one sample: no spread to judge the shift by, applied whole
        return mean
    error2 = differences.var(axis=0, ddof=1) / count
    with np.errstate(divide="ignore", invalid="ignore"):
        t2 = np.where(error2 > 0, mean ** 2 / error2, np.inf)
    return mean * np.clip(1 - SIGNIFICANCE ** 2 / t2, 0, 1)


def _shift_bias(inits: dict[str, onnx.TensorProto], bias: str, shift: np.ndarray) -> np.ndarray:
    """Add `shift` to an int32 bias at its own scale; returns the shift actually applied."""
    q_tensor = inits[bias + WEIGHT_SUFFIX]
    q = numpy_helper.to_array(q_tensor).astype(np.int64)
    scale = numpy_helper.to_array(inits[bias + SCALE_SUFFIX]).astype(np.float64)
    new = np.clip(q + np.rint(shift / scale), -INT32_MAX, INT32_MAX)
    q_tensor.CopyFrom(numpy_helper.from_array(new.astype(np.int32), q_tensor.name))
    return ((new - q) * scale).astype(np.float32)
