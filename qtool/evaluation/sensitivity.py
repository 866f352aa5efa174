"""Which layer costs the most accuracy: quantize one layer at a time, measure the output error.

For each layer L (a compute node with the Relu/Clip it absorbs; movement ops are no layers), the
model with only L in int8 runs on a few samples, and the output SQNR against fp32 is L's
sensitivity. Unlike the per-layer error of the fully quantized model
(qtool.evaluation.layer_error), this isolates L from the error its predecessors feed it, so the
ranking says what keeping L in float would buy. Everything before the first node L's quantization
changes computes as in fp32, so L's model runs from that node on, fed fp32 tensors cached from one
exposed run per chunk of layers: about half the work, the same figures. Usage: docs/evaluation.md.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

import numpy as np
import onnx

from qtool.config import QuantizeConfig
from qtool.data.dataset import Batch
from qtool.errors import QtoolError
from qtool.evaluation.macs import node_macs, sample_shapes, tensor_shapes
from qtool.graph.index import GraphIndex, node_label
from qtool.evaluation.metrics import FidelityAccumulator
from qtool.graph.edit import array_input, sub_model, with_outputs
from qtool.plan.ops import rule_for
from qtool.plan.planner import QuantPlan, build_plan, prepared_model
from qtool.table.resolve import params_from_table
from qtool.quantization.rewrite import quantize_with
from qtool.graph.runtime import create_session
from qtool.table.table import CalibrationTable

CACHE_BUDGET_BYTES = 256 * 2**20  # fp32 tensors kept at once to start the layers' runs mid-graph


@dataclass(frozen=True)
class LayerSensitivity:
    node: str  # the layer's compute node (name, or first output for unnamed nodes)
    op_type: str
    sqnr_db: float  # model output SQNR with only this layer in int8 (worst output of several)
    macs: int  # per sample; 0 for ops that are not Conv/ConvTranspose/Gemm/MatMul
    cosine: float = math.nan  # mean per-sample cosine of the model outputs (worst output)
    nodes: tuple[str, ...] = ()  # every node quantized for this layer (the node and its fused activation)


@dataclass(frozen=True)
class Layer:
    node: str
    op_type: str
    nodes: tuple[str, ...]


def layers(model: onnx.ModelProto, plan: QuantPlan) -> list[Layer]:
    """The layers of a prepared model that `plan` quantizes, in graph order."""
    quantized = set(plan.quantized_nodes)
    fused = set(plan.fused)
    consumers = GraphIndex(model).consumers
    found = []
    for node in model.graph.node:
        label = node_label(node)
        rule = rule_for(node.op_type, node.domain)
        if label not in quantized or rule is None or rule.output == "tie":
            continue
        if node.input and node.input[0] in fused:
            continue  # an absorbed activation: part of its producer's layer
        group = [label]
        if node.output and node.output[0] in fused:
            group.append(node_label(consumers[node.output[0]][0]))
        found.append(Layer(label, node.op_type, tuple(group)))
    return found


def _select(found: list[Layer], nodes: Optional[list[str]]) -> list[Layer]:
    if nodes is None:
        return found
    by_name = {layer.node: layer for layer in found}
    unknown = [n for n in nodes if n not in by_name]
    if unknown:
        raise QtoolError(f"not a quantizable layer of this model: {', '.join(unknown[:5])}")
    return [by_name[n] for n in nodes]


@dataclass
class _Job:
    """One layer's run: its plan, and where its quantized model starts to differ from fp32."""

    layer: Layer
    plan: QuantPlan
    before: set[str]  # tensors made before the first node the layer's quantization changes
    boundary: list[str]  # those of them read from there on
    start: int  # that first node's index


def _job(model: onnx.ModelProto, layer: Layer, options: QuantizeConfig) -> _Job:
    plan = build_plan(model, options, only=set(layer.nodes))
    nodes = list(model.graph.node)
    quantized, touched = set(plan.quantized_nodes), set(plan.activations)
    # The rewrite points every consumer of a quantized tensor at its DequantizeLinear output,
    # so the first changed node may come before the layer itself.
    start = next((i for i, node in enumerate(nodes)
                  if node_label(node) in quantized or any(name in touched for name in node.input)), len(nodes))
    before = {out for node in nodes[:start] for out in node.output if out}
    boundary = list(dict.fromkeys(name for node in nodes[start:] for name in node.input if name in before))
    return _Job(layer, plan, before, boundary, start)


def _chunks(jobs: list[_Job], sizes: dict[str, int], samples: int) -> list[list[_Job]]:
    """Consecutive jobs whose boundary tensors, for all samples, fit in CACHE_BUDGET_BYTES together."""
    chunks: list[list[_Job]] = []
    names: set[str] = set()
    for job in sorted(jobs, key=lambda j: j.start):
        wanted = names | set(job.boundary)
        if not chunks or samples * sum(sizes.get(n, 0) for n in wanted) > CACHE_BUDGET_BYTES:
            chunks.append([])
            wanted = set(job.boundary)
        chunks[-1].append(job)
        names = wanted
    return chunks


def _suffix(qmodel: onnx.ModelProto, before: set[str], arrays: dict[str, np.ndarray]) -> onnx.ModelProto:
    """`qmodel` without the nodes that compute as in fp32: the tensors they made become inputs."""
    graph = qmodel.graph
    kept = [n for n in graph.node if not {o for o in n.output if o} <= before]
    made = {o for n in kept for o in n.output}
    read = {name for n in kept for name in n.input}
    boundary = [name for name in dict.fromkeys(name for n in kept for name in n.input) if name in before]
    inputs = [i for i in graph.input if i.name in read] + [array_input(name, arrays[name]) for name in boundary]
    return sub_model(qmodel, kept, inputs, [o for o in graph.output if o.name in made], graph.name)


def layer_sensitivity(model_path: str | Path, table: CalibrationTable, options: QuantizeConfig,
                      batches: list[Batch], nodes: Optional[list[str]] = None, threads: int = 0,
                      on_layer: Optional[Callable[[Layer], None]] = None) -> list[LayerSensitivity]:
    """Output SQNR with one layer at a time in int8, worst (lowest SQNR) first.

    `nodes` restricts the ranking to these layers (names as in `layers()`); `table` must
    hold the ranges of the layers' activations (a table made for the whole model does).
    """
    return rank(measured(model_path, table, options, batches, nodes, threads, on_layer))


def rank(entries: list[tuple[tuple[int, int], LayerSensitivity]]) -> list[LayerSensitivity]:
    """Worst SQNR first; ties in the order the layers start to differ from fp32, then in graph
    order, so layers measured apart (on workers) rank exactly as in one run."""
    return [r for _, r in sorted(entries, key=lambda entry: (entry[1].sqnr_db, entry[0]))]


def measured(model_path: str | Path, table: CalibrationTable, options: QuantizeConfig, batches: list[Batch],
             nodes: Optional[list[str]] = None, threads: int = 0,
             on_layer: Optional[Callable[[Layer], None]] = None) -> list[tuple[tuple[int, int], LayerSensitivity]]:
    """Each layer's sensitivity with its sort key for `rank` (see layer_sensitivity)."""
    if not batches:
        raise QtoolError("sensitivity needs at least one batch of samples")
    model, plan = prepared_model(model_path, options)
    found = layers(model, plan)
    position = {layer.node: i for i, layer in enumerate(found)}
    selected = _select(found, nodes)
    shapes = sample_shapes(batches[0].feeds)
    macs = node_macs(model, shapes)
    sizes = {name: 4 * math.prod(dims) for name, dims in tensor_shapes(model, shapes).items()}
    outputs = [o.name for o in model.graph.output]
    graph_inputs = {i.name for i in model.graph.input}
    fp32 = create_session(model, threads, str(model_path))
    reference = [dict(zip(outputs, fp32.run(outputs, batch.feeds))) for batch in batches]
    del fp32

    results = []
    samples = sum(len(b) for b in batches)
    jobs = [_job(model, layer, options) for layer in selected]
    for chunk in _chunks(jobs, sizes, samples):
        exposed = sorted({n for job in chunk for n in job.boundary} - graph_inputs)
        session = create_session(with_outputs(model, exposed), threads, str(model_path)) if exposed else None
        cache = [{**batch.feeds, **dict(zip(exposed, session.run(exposed, batch.feeds)))} if session else batch.feeds
                 for batch in batches]
        del session
        for job in chunk:
            result = _measure(model, job, table, options, reference, cache, threads, macs)
            results.append(((job.start, position[job.layer.node]), result))
            if on_layer:
                on_layer(job.layer)
        del cache
    return results


def _measure(model: onnx.ModelProto, job: _Job, table: CalibrationTable, options: QuantizeConfig,
             reference: list[dict[str, np.ndarray]], cache: list[dict[str, np.ndarray]], threads: int,
             macs: dict[str, int]) -> LayerSensitivity:
    """Run the layer's quantized model from its first changed node; outputs it does not
    reach (made before that node) equal the reference."""
    params = params_from_table(job.plan, table, options, allow_missing=True)
    qmodel, _ = quantize_with(model, job.plan, params, options)
    suffix = _suffix(qmodel, job.before, cache[0])
    produced = [o.name for o in suffix.graph.output]
    session = create_session(suffix, threads, job.layer.node) if produced else None
    feeds_names = [i.name for i in suffix.graph.input]
    fidelity = {name: FidelityAccumulator() for name in reference[0]}
    for ref, feeds in zip(reference, cache):
        test = dict(ref)
        if session is not None:
            test.update(zip(produced, session.run(produced, {n: feeds[n] for n in feeds_names})))
        for name, acc in fidelity.items():
            acc.update(ref[name], test[name])
    figures = [acc.result() for acc in fidelity.values()]
    return LayerSensitivity(job.layer.node, job.layer.op_type, min(f["sqnr_db"] for f in figures),
                            macs.get(job.layer.node, 0), min(f["cosine"] for f in figures), job.layer.nodes)
