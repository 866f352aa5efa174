"""Multiply-accumulate counts per node, and how many of them a QDQ model runs in int8.

Only the ops that dominate inference cost are counted (Conv, ConvTranspose, Gemm,
MatMul, the recurrent LSTM, GRU and DynamicQuantizeLSTM, int8 by construction, and the Q/K/V
projection of onnxruntime's fused Attention and QAttention); elementwise ops are noise beside
them. Shapes come from shape inference (qtool.graph.shapes), optionally with the graph inputs
pinned to a real batch's shapes so that dynamic spatial sizes (OCR widths, detector resolutions)
resolve; a dimension that is still unknown counts as 1, so figures are per sample at the
model's static shapes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Mapping, Optional, Sequence

import numpy as np
import onnx

from qtool.graph.shapes import inferred
from qtool.graph.index import GraphIndex, attribute, node_label
from qtool.quantization.dynamic_matmul import DYNAMIC_KERNELS

COUNTED_OPS = ("Conv", "ConvTranspose", "Gemm", "MatMul", "MatMulInteger")  # MatMulInteger: dynamic int8 MatMul
RECURRENT_OPS = ("LSTM", "GRU")
INT8_RECURRENT = "DynamicQuantizeLSTM"  # com.microsoft: W and R int8 in [dirs, input, 4*hidden] layout
FUSED_ATTENTION = ("Attention", "QAttention")  # com.microsoft: its Q/K/V projection counted


@dataclass(frozen=True)
class MacSummary:
    total: int
    int8: int
    int8_nodes: int  # counted nodes that run in int8
    counted_nodes: int
    int16: int = 0  # of the nodes reading or writing a 16-bit activation (onnxruntime runs them in float)

    @property
    def fraction(self) -> float:
        return self.int8 / self.total if self.total else 0.0


def tensor_shapes(model: onnx.ModelProto, input_shapes: Optional[Mapping[str, Sequence[int]]]) -> dict[str, list[int]]:
    """Tensor name -> dims (unknown dims as 1) after shape inference (qtool.graph.shapes: the
    model is not copied, and a model over 2 GiB is inferred like any other). `input_shapes` may hold
    other tensors' dims too (qtool.graph.runtime.tensor_dims: a run's): those win over inference,
    which loses a map's height and width behind a Pad whose amounts are computed."""
    graph = inferred(model, input_shapes=input_shapes).graph
    shapes: dict[str, list[int]] = {}
    for value in list(graph.input) + list(graph.value_info) + list(graph.output):
        if value.type.HasField("tensor_type") and value.type.tensor_type.HasField("shape"):
            shapes[value.name] = [d.dim_value if d.HasField("dim_value") and d.dim_value > 0 else 1
                                  for d in value.type.tensor_type.shape.dim]
    for init in graph.initializer:
        shapes[init.name] = list(init.dims)
    shapes.update({name: list(dims) for name, dims in (input_shapes or {}).items()})
    return shapes


def _macs(node: onnx.NodeProto, shapes: dict[str, list[int]]) -> int:
    def shape(i: int) -> Optional[list[int]]:
        return shapes.get(node.input[i]) if i < len(node.input) else None

    out = shapes.get(node.output[0]) if node.output else None
    weight = shape(1)
    if node.op_type == "Conv" and out and weight:
        # every output element sums C_in/group * kernel products
        return math.prod(out) * math.prod(weight[1:])
    if node.op_type == "ConvTranspose" and weight and shape(0):
        # every input element scatters into C_out/group * kernel outputs
        return math.prod(shape(0)) * math.prod(weight[1:])
    if node.op_type == "Gemm" and out and shape(0):
        a = shape(0)
        k = a[0] if attribute(node, "transA", 0) else a[-1]
        return math.prod(out) * k
    if node.op_type in ("MatMul", "MatMulInteger") and out and shape(0):
        return math.prod(out) * shape(0)[-1]
    if node.op_type in FUSED_ATTENTION and shape(0) and weight:
        # the Q/K/V projection: every input row times the [hidden, 3 x hidden] weight
        return math.prod(shape(0)) * weight[-1]
    if node.op_type in (*RECURRENT_OPS, INT8_RECURRENT) and shape(0) and weight and shape(2):
        # every step of every direction: gates x (input + hidden) products; X is [steps, batch, input]
        transposed = node.op_type == INT8_RECURRENT
        gate_rows, recurrent = (weight[2], shape(2)[1]) if transposed else (weight[1], shape(2)[2])
        inputs = weight[1] if transposed else weight[2]
        return math.prod(shape(0)[:2]) * weight[0] * gate_rows * (inputs + recurrent)
    return 0


def sample_shapes(feeds: Mapping[str, np.ndarray]) -> dict[str, tuple[int, ...]]:
    """The shapes of one sample of a batch (batches stack samples on axis 0)."""
    return {name: (1, *array.shape[1:]) if array.ndim else () for name, array in feeds.items()}


def node_macs(model: onnx.ModelProto, input_shapes: Optional[Mapping[str, Sequence[int]]] = None) -> dict[str, int]:
    """MACs of every Conv/ConvTranspose/Gemm/MatMul/recurrent node, keyed by node name (or first output)."""
    shapes = tensor_shapes(model, input_shapes)
    return {node_label(n): _macs(n, shapes) for n in model.graph.node
            if (n.op_type in COUNTED_OPS + RECURRENT_OPS and n.domain in ("", "ai.onnx"))
            or (n.op_type in (INT8_RECURRENT, *FUSED_ATTENTION) and n.domain == "com.microsoft")}


def _runs_int8(node: onnx.NodeProto, index: GraphIndex) -> bool:
    """Activation (input 0) and weight (input 1) both come out of 8-bit DequantizeLinear nodes:
    the pattern onnxruntime and TensorRT fuse into an integer kernel. DynamicQuantizeLSTM and
    MatMulInteger (a dynamic int8 MatMul) and QAttention are int8 themselves."""
    if node.op_type in (INT8_RECURRENT, *DYNAMIC_KERNELS):
        return True
    if len(node.input) < 2:
        return False
    return all(_dequantized(name, index, _EIGHT_BITS) for name in node.input[:2])


_EIGHT_BITS = (onnx.TensorProto.UINT8, onnx.TensorProto.INT8)
_SIXTEEN_BITS = (onnx.TensorProto.UINT16, onnx.TensorProto.INT16)


def _dequantized(name: str, index: GraphIndex, types: tuple[int, ...]) -> bool:
    """Whether `name` comes out of a DequantizeLinear of one of these integer `types` (by its
    zero point; none means uint8)."""
    dq = index.producer.get(name)
    if dq is None or dq.op_type != "DequantizeLinear":
        return False
    zero = index.initializers.get(dq.input[2]) if len(dq.input) > 2 and dq.input[2] else None
    return (zero.data_type if zero is not None else onnx.TensorProto.UINT8) in types


def _sixteen_bit_io(node: onnx.NodeProto, index: GraphIndex) -> bool:
    """Whether the node reads a 16-bit activation or a 16-bit QuantizeLinear reads its output."""
    if node.input and _dequantized(node.input[0], index, _SIXTEEN_BITS):
        return True
    return any(_dequantized(dq.output[0], index, _SIXTEEN_BITS)
               for output in node.output[:1] for q in index.consumers.get(output, []) if q.op_type == "QuantizeLinear"
               for dq in index.consumers.get(q.output[0], []))


def int8_macs(qdq_model: onnx.ModelProto,
              input_shapes: Optional[Mapping[str, Sequence[int]]] = None) -> MacSummary:
    """Total MACs of a QDQ model and those of the nodes whose inputs are dequantized int8."""
    macs = node_macs(qdq_model, input_shapes)
    index = GraphIndex(qdq_model)
    total = int8 = int16 = nodes = 0
    for node in qdq_model.graph.node:
        label = node_label(node)
        if label not in macs:
            continue
        total += macs[label]
        if _sixteen_bit_io(node, index):
            int16 += macs[label]
        elif _runs_int8(node, index):
            int8 += macs[label]
            nodes += 1
    return MacSummary(total=total, int8=int8, int8_nodes=nodes, counted_nodes=len(macs), int16=int16)
