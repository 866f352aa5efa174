"""The model as the format modules see it: which tensors qtool quantizes, and the
layers that layer-keyed formats (ncnn, AMCT) name instead of tensors.

A layer is a quantized Conv/ConvTranspose/Gemm/MatMul with a constant weight; its
key is the ONNX node name (or its first output when the node is unnamed, which is
what onnx2ncnn and AMCT fall back to), and its entry holds the quantization of the
activation at its data input plus its weight scales.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import numpy as np
from onnx import numpy_helper

from qtool.config import QuantizeConfig
from qtool.table.formats.common import imported_table
from qtool.prepare.graph_prep import prepare_file
from qtool.graph.index import node_label
from qtool.graph.modelio import sha256_file
from qtool.plan.ops import rule_for
from qtool.plan.planner import build_plan
from qtool.table.qparams import weight_scales
from qtool.table.table import CalibrationTable, TableEntry

_SHOWN = 5


@dataclass(frozen=True)
class Layer:
    name: str
    output: str
    op_type: str
    input: str  # the activation quantized at the layer's data input
    weight: str
    weight_axis: Optional[int]


@dataclass
class ModelView:
    file: str
    sha256: str
    activations: list[str]  # tensors the plan quantizes, graph order
    producers: dict[str, str]  # tensor -> op type of the node producing it
    layers: list[Layer]
    weights: dict[str, np.ndarray] = field(repr=False, default_factory=dict)

    def layer(self, key: str) -> Optional[Layer]:
        for layer in self.layers:
            if key in (layer.name, layer.output):
                return layer
        return None

    def weight_scales(self, layer: Layer) -> np.ndarray:
        """Per-output-channel symmetric int8 scales, as qtool's rewrite computes them (before it
        widens a near-zero channel whose int32 bias would overflow)."""
        return np.atleast_1d(weight_scales(self.weights[layer.weight], layer.weight_axis))


def model_view(model_path: str | Path, options: QuantizeConfig) -> ModelView:
    model = prepare_file(model_path, options.keep_opset, options.per_channel).model
    plan = build_plan(model, options)
    quantized = set(plan.quantized_nodes)
    inits = {t.name: t for t in model.graph.initializer}
    producers, layers = {}, []
    for node in model.graph.node:
        for out in node.output:
            producers[out] = node.op_type
        rule = rule_for(node.op_type, node.domain)
        label = node_label(node)
        if rule is None or rule.weight is None or label not in quantized or rule.weight >= len(node.input):
            continue
        weight = node.input[rule.weight]
        if weight in plan.weights:
            data_input = node.input[(rule.activations or (0,))[0]]
            layers.append(Layer(label, node.output[0], node.op_type, data_input, weight, plan.weights[weight].axis))
    weights = {layer.weight: numpy_helper.to_array(inits[layer.weight]) for layer in layers}
    return ModelView(Path(model_path).name, sha256_file(model_path), list(plan.activations), producers, layers,
                     weights)


class LayerEntries:
    """Entries read from a layer-keyed file, gathered per input tensor, and what did not fit."""

    def __init__(self, view: ModelView, format_name: str, path: object):
        self.view, self.format_name, self.path = view, format_name, path
        self.entries: dict[str, TableEntry] = {}
        self.unknown: list[str] = []
        self.conflicts: list[str] = []

    def add(self, key: str, entry: TableEntry) -> None:
        layer = self.view.layer(key)
        if layer is None:
            self.unknown.append(key)
        elif self.entries.setdefault(layer.input, entry).qparams != entry.qparams:
            self.conflicts.append(key)

    def table(self) -> CalibrationTable:
        if self.unknown:
            warnings.warn(f"{self.path}: {len(self.unknown)} {self.format_name} layers match no node of the model: "
                          f"{shown(self.unknown)}", stacklevel=3)
        if self.conflicts:
            warnings.warn(f"{self.path}: layers sharing an input disagree on its scale; kept the first for "
                          f"{shown(self.conflicts)}", stacklevel=3)
        warn_uncovered(self.view, set(self.entries), self.format_name, self.path)
        return imported_table(self.entries, self.format_name.lower(), self.format_name.lower(), self.view)


def shown(names: list[str]) -> str:
    more = f" and {len(names) - _SHOWN} more" if len(names) > _SHOWN else ""
    return ", ".join(names[:_SHOWN]) + more


def warn_uncovered(view: ModelView, covered: set[str], format_name: str, path: object) -> None:
    """Say which quantized tensors a layer-keyed file has no entry for."""
    missing = [name for name in view.activations if name not in covered]
    if missing:
        warnings.warn(f"{path}: {format_name} entries are per layer (the data input of Conv/Gemm/MatMul), so "
                      f"{len(missing)} of {len(view.activations)} quantized tensors have no entry: {shown(missing)}",
                      stacklevel=3)
