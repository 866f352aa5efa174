"""Which layer costs the most accuracy: quantize one layer at a time, measure the output error.

For each quantizable layer L, the model is quantized with only L in int8 (its inputs,
weights, bias and output through Q/DQ, everything else fp32) and run on a few samples;
the SQNR of the model outputs against fp32 is L's sensitivity. Unlike the per-layer
error of the fully quantized model (qtool.layer_error), this isolates L from the error
its predecessors feed it, so the ranking says what keeping L in float would buy.

A layer is a compute node together with the Relu/Clip it absorbs (they run as one
fused kernel, as in the fully quantized model). Movement ops (MaxPool, Reshape, ...)
are not layers: alone they stay float because they only follow a quantized producer.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

import onnx

from qtool.config import QuantizeConfig
from qtool.dataset import Batch
from qtool.errors import QtoolError
from qtool.graph_prep import prepare
from qtool.macs import node_label, node_macs, sample_shapes
from qtool.metrics import FidelityAccumulator
from qtool.modelio import load_model
from qtool.ops import rule_for
from qtool.plan import QuantPlan, build_plan
from qtool.quantize import params_from_table
from qtool.rewrite import quantize_graph
from qtool.runtime import create_session
from qtool.table import CalibrationTable


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
    consumers: dict[str, onnx.NodeProto] = {}
    for node in model.graph.node:
        for name in node.input:
            consumers.setdefault(name, node)
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
            group.append(node_label(consumers[node.output[0]]))
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


def layer_sensitivity(model_path: str | Path, table: CalibrationTable, options: QuantizeConfig,
                      batches: list[Batch], nodes: Optional[list[str]] = None, threads: int = 0,
                      on_layer: Optional[Callable[[Layer], None]] = None) -> list[LayerSensitivity]:
    """Output SQNR with one layer at a time in int8, worst (lowest SQNR) first.

    `nodes` restricts the ranking to these layers (names as in `layers()`); `table` must
    hold the ranges of the layers' activations (a table made for the whole model does).
    """
    if not batches:
        raise QtoolError("sensitivity needs at least one batch of samples")
    model = prepare(load_model(model_path), options.upgrade_opset, model_path)
    selected = _select(layers(model, build_plan(model, options)), nodes)
    macs = node_macs(model, sample_shapes(batches[0].feeds))
    outputs = [o.name for o in model.graph.output]
    fp32 = create_session(model, threads, str(model_path))
    reference = [fp32.run(outputs, batch.feeds) for batch in batches]
    del fp32

    results = []
    for layer in selected:
        plan = build_plan(model, options, only=set(layer.nodes))
        params = params_from_table(plan, table, options, allow_missing=True)
        qmodel, _ = quantize_graph(model, plan, params, options.per_channel)
        session = create_session(qmodel, threads, layer.node)
        fidelity = [FidelityAccumulator() for _ in outputs]
        for batch, ref in zip(batches, reference):
            for acc, r, t in zip(fidelity, ref, session.run(outputs, batch.feeds)):
                acc.update(r, t)
        figures = [acc.result() for acc in fidelity]
        results.append(LayerSensitivity(layer.node, layer.op_type, min(f["sqnr_db"] for f in figures),
                                        macs.get(layer.node, 0), min(f["cosine"] for f in figures), layer.nodes))
        if on_layer:
            on_layer(layer)
    return sorted(results, key=lambda r: r.sqnr_db)
