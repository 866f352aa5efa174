"""A QDQ model read back as integer layers: what each quantized op computes on codes.

In QDQ form an integer layer is DequantizeLinear on each input, the float op, an
optional Relu/Clip, and one QuantizeLinear on the output; runtimes fuse that pattern
into an integer kernel (QLinearConv, QLinearAdd, ...). `find_layers` recovers, for each
such op, the integer tensors it reads and writes with their scales and zero points,
its integer weight and int32 bias, and the clamp a fused activation implies. The
fixed-point export and the integer-only check both start from here.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import numpy as np
import onnx

from qtool.graph.index import GraphIndex, attribute, node_label

LAYER_OPS = ("Conv", "ConvTranspose", "Gemm", "MatMul", "Add", "AveragePool", "GlobalAveragePool", "MaxPool",
             "LeakyRelu", "PRelu")
WEIGHTED = ("Conv", "ConvTranspose", "Gemm", "MatMul")
_NP_NAMES = {np.dtype(np.uint8): "uint8", np.dtype(np.int8): "int8"}


@dataclass(frozen=True)
class QTensor:
    """An integer activation: the QuantizeLinear output a runtime keeps as codes."""

    name: str
    scale: float
    zero_point: int
    dtype: str


@dataclass(frozen=True)
class QConst:
    """A constant stored as integers behind a DequantizeLinear (weight, bias, slope)."""

    name: str
    values: np.ndarray = field(repr=False)
    scale: np.ndarray = field(repr=False)
    zero_point: np.ndarray = field(repr=False)
    axis: Optional[int]  # None: per tensor

    def channels_first(self, axis: Optional[int] = None) -> np.ndarray:
        """Values with the quantization axis (or `axis`) moved first."""
        axis = self.axis if axis is None else axis
        return np.moveaxis(self.values, axis, 0) if axis is not None else self.values[None]

    def zero_point_per_channel(self) -> np.ndarray:
        zp = np.atleast_1d(self.zero_point.astype(np.int64))
        n = self.channels_first().shape[0]
        return np.broadcast_to(zp, (n,)).copy() if zp.size == 1 else zp

    def real(self) -> np.ndarray:
        if self.axis is None:
            return (self.values.astype(np.float64) - self.zero_point) * float(self.scale)
        shape = [1] * self.values.ndim
        shape[self.axis] = -1
        return (self.values.astype(np.float64) - self.zero_point.reshape(shape)) * self.scale.reshape(shape)


@dataclass
class QLayer:
    name: str
    op_type: str
    node: onnx.NodeProto = field(repr=False)
    inputs: list[QTensor]  # integer activation inputs, in the op's input order
    weight: Optional[QConst] = None
    bias: Optional[QConst] = None
    output: Optional[QTensor] = None  # None: the op's output stays float
    activation: Optional[tuple[Optional[float], Optional[float]]] = None  # fused Relu/Clip bounds (real)
    slope: Optional[QConst] = None  # PRelu slope stored as integers
    float_slope: Optional[np.ndarray] = field(default=None, repr=False)  # PRelu slope kept in float
    input_shape: Optional[tuple] = None
    constants: dict[str, np.ndarray] = field(default_factory=dict, repr=False)  # codes of constant inputs

    def attr(self, name: str, default=None):
        return attribute(self.node, name, default)

    def slopes(self) -> np.ndarray:
        if self.op_type == "LeakyRelu":
            return np.array([self.attr("alpha", 0.01)], np.float64)
        if self.slope is not None:
            return self.slope.real().reshape(-1)
        return np.asarray(self.float_slope, np.float64).reshape(-1)

    def window_area(self) -> Optional[int]:
        if self.op_type == "AveragePool":
            return int(np.prod(self.attr("kernel_shape")))
        if self.input_shape and all(isinstance(d, int) and d > 0 for d in self.input_shape[2:]):
            return int(np.prod(self.input_shape[2:]))
        return None


def _qparams(graph: GraphIndex, node: onnx.NodeProto) -> tuple[Optional[np.ndarray], Optional[np.ndarray]]:
    """A QuantizeLinear/DequantizeLinear node's constant scale and zero point (None where computed)."""
    scale = graph.const(node.input[1])
    zp = graph.const(node.input[2]) if len(node.input) > 2 and node.input[2] else np.zeros((), np.uint8)
    return scale, zp


def _dequantized(graph: GraphIndex, name: str):
    """A QTensor or QConst for a DequantizeLinear output; None for anything else."""
    dq = graph.producer.get(name)
    if dq is None or dq.op_type != "DequantizeLinear":
        return None
    scale, zp = _qparams(graph, dq)
    if scale is None or zp is None:
        return None
    values = graph.const(dq.input[0])
    if values is not None:
        axis = attribute(dq, "axis", 1) if scale.ndim else None
        if axis is not None and axis < 0:
            axis += values.ndim
        return QConst(dq.input[0], values, scale.astype(np.float32), zp, axis)
    if scale.ndim or zp.dtype not in _NP_NAMES:
        return None
    return QTensor(dq.input[0], float(scale), int(zp), _NP_NAMES[zp.dtype])


def _quantized_output(graph: GraphIndex, node: onnx.NodeProto):
    """(output QTensor, fused activation bounds) following `node`'s output, or (None, None)."""
    user = graph.only_consumer(node.output[0])
    bounds = None
    if user is not None and user.op_type in ("Relu", "Clip"):
        bounds = _activation_bounds(graph, user)
        if bounds is None:
            return None, None
        user = graph.only_consumer(user.output[0])
    if user is None or user.op_type != "QuantizeLinear":
        return None, None
    scale, zp = _qparams(graph, user)
    if scale is None or zp is None or scale.ndim or zp.dtype not in _NP_NAMES:
        return None, None
    return QTensor(user.output[0], float(scale), int(zp), _NP_NAMES[zp.dtype]), bounds


def _activation_bounds(graph: GraphIndex, node: onnx.NodeProto):
    return (0.0, None) if node.op_type == "Relu" else graph.clip_bounds(node)


def _weight_axis(node: onnx.NodeProto, rank: int) -> int:
    if node.op_type == "ConvTranspose":
        return 1
    if node.op_type == "Gemm":
        return 0 if attribute(node, "transB", 0) else 1
    if node.op_type == "MatMul":
        return rank - 1
    return 0


def _layer(graph: GraphIndex, node: onnx.NodeProto) -> Optional[QLayer]:
    name = node_label(node)
    parts = [_dequantized(graph, i) if i else None for i in node.input]
    if not parts or not isinstance(parts[0], QTensor):
        return None
    layer = QLayer(name, node.op_type, node, [parts[0]], input_shape=graph.shapes.get(parts[0].name))
    if node.op_type in WEIGHTED:
        if len(parts) < 2 or not isinstance(parts[1], QConst):
            return None
        weight = parts[1]
        axis = _weight_axis(node, weight.values.ndim)
        if weight.axis is not None and weight.axis != axis:
            return None
        layer.weight = QConst(weight.name, weight.values, weight.scale, weight.zero_point, axis)
        if len(parts) > 2 and node.input[2]:
            if not isinstance(parts[2], QConst) or (node.op_type == "Gemm" and attribute(node, "beta", 1.0) != 1.0):
                return None
            layer.bias = parts[2]
        if node.op_type == "Gemm" and (attribute(node, "transA", 0) or attribute(node, "alpha", 1.0) != 1.0):
            return None
    elif node.op_type == "Add":
        if len(parts) != 2:
            return None
        second = parts[1]
        if isinstance(second, QConst):  # a bias vector or HardSwish's "+ 3", stored like an activation
            if second.axis is not None or second.zero_point.dtype not in _NP_NAMES:
                return None
            layer.constants[second.name] = second.values
            second = QTensor(second.name, float(second.scale), int(second.zero_point), _NP_NAMES[second.zero_point.dtype])
        if not isinstance(second, QTensor):
            return None
        layer.inputs.append(second)
    elif node.op_type == "PRelu":
        if isinstance(parts[1], QConst):
            layer.slope = parts[1]
        elif graph.const(node.input[1]) is not None:
            layer.float_slope = graph.const(node.input[1])
        else:
            return None
    layer.output, layer.activation = _quantized_output(graph, node)
    return layer


def find_layers(model: onnx.ModelProto) -> tuple[list[QLayer], list[str]]:
    """Integer layers in graph order, and the candidate ops that are not in QDQ form."""
    graph = GraphIndex(model)
    layers, skipped = [], []
    for node in model.graph.node:
        if node.op_type not in LAYER_OPS or node.domain not in ("", "ai.onnx"):
            continue
        layer = _layer(graph, node)
        if layer is None:
            skipped.append(f"{node_label(node)} ({node.op_type})")
        else:
            layers.append(layer)
    return layers, skipped
