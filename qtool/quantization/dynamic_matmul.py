"""Back end of dynamic int8 MatMul/Gemm (qtool.plan.dynamic): onnxruntime's integer pattern.

    x -> DynamicQuantizeLinear -> (x_q uint8, x_scale, x_zero_point)
    Mul(x_scale, w_scale[N]) -> scales
    MatMulInteger(x_q, w_q int8 [K, N], x_zero_point, 0) -> Cast(float) -> Mul(scales) [-> Add(C): Gemm]

the pattern onnxruntime's own quantize_dynamic writes, which its CPU session fuses into
DynamicQuantizeMatMul (quantize the rows, u8s8 GEMM, rescale). The weight scale is per output
column (a column of small weights keeps its precision) or one per tensor (the kernel skips a
rescaling pass); the integer product is the same. Several MatMuls reading one tensor share its
DynamicQuantizeLinear. A fused Attention becomes QAttention (`DynamicMatMuls.rewrite`).
"""

from __future__ import annotations

from typing import Callable, Collection, Optional

import numpy as np
import onnx
from onnx import helper, numpy_helper

from qtool.graph.index import GraphIndex, attribute, node_label
from qtool.table import qparams as qp

DYNAMIC_SUFFIX = "_dynamic"
DYNAMIC_KERNELS = ("MatMulInteger", "QAttention")  # named after the node they replace
CODES, SCALE = "_quantized", "_scale"  # suffixes of a weight's int8 codes and scales
GATHERED = "_gathered_codes"  # suffix of rows gathered as uint8 codes

# tensor -> (the Gather writing it, its float table) when the tensor is rows of a constant table
Gathered = Callable[[str], Optional[tuple[onnx.NodeProto, np.ndarray]]]


def inner_tensors(label: str) -> tuple[str, str, str, str]:
    """The tensors the rewrite of node `label` makes between its input and its output (scales,
    int32 product, product as float, rescaled product before a Gemm's bias); the float fallback
    finds a rewritten layer's nodes by them."""
    return label + "_scales", label + "_int32", label + "_int32_float", label + "_product"


class DynamicMatMuls:
    """Rewrites planned nodes one by one, in graph order; `add_init(array, name)` stores a constant."""

    def __init__(self, add_init: Callable[[np.ndarray, str], str], weight_qmax: int, per_column: bool = True,
                 gathered: Optional[Gathered] = None):
        self.add_init = add_init
        self.weight_qmax = weight_qmax
        self.axis = 1 if per_column else None
        self.gathered = gathered
        self.activations: dict[str, tuple[str, str, str]] = {}  # tensor -> (codes, scale, zero point)
        self.weights: dict[str, tuple[str, str, str]] = {}  # (initializer, transposed) key -> names
        self.tables = 0  # tables read as gathered codes

    def rewrite(self, node: onnx.NodeProto, weight: np.ndarray) -> list[onnx.NodeProto]:
        """The nodes replacing MatMul/Gemm (or fused Attention) `node` whose weight initializer holds `weight`.

        A com.microsoft Attention (qtool.plan.dynamic.fused_attention) becomes
        x -> DynamicQuantizeLinear -> QAttention(x_q, w_q int8 [K, 3N], bias, x_scale, w_scale, mask,
        x_zero_point, 0): the Q/K/V projection in int8, the scores and the Softmax in float as before.
        Where x is rows gathered from a constant float table nothing else reads (an RNN decoder's
        token embedding, smaller than the tables `embeddings` stores as int8 rows), the table is
        stored as uint8 codes and MatMulInteger reads the gathered codes: no DynamicQuantizeLinear at
        run time, as onnxruntime's quantize_dynamic does it."""
        label = node_label(node)
        nodes: list[onnx.NodeProto] = []
        data = node.input[0]
        source = self.gathered(data) if self.gathered is not None and data not in self.activations else None
        if source is not None:  # rows of a constant table: its uint8 codes, gathered
            gather, table = source
            codes = data + GATHERED
            scale, zero = self._table(gather.input[0], table)
            nodes.append(helper.make_node("Gather", [gather.input[0] + CODES, gather.input[1]], [codes],
                                          name=node_label(gather) + GATHERED, axis=0))
            self.activations[data] = (codes, scale, zero)
            self.tables += 1
        elif data not in self.activations:
            self.activations[data] = (data + DYNAMIC_SUFFIX + "_quantized", data + DYNAMIC_SUFFIX + "_scale",
                                      data + DYNAMIC_SUFFIX + "_zero_point")
            nodes.append(helper.make_node("DynamicQuantizeLinear", [data], list(self.activations[data]),
                                          name=data + DYNAMIC_SUFFIX + "_DynamicQuantizeLinear"))
        codes, scale, zero = self.activations[data]
        w_codes, w_scale, w_zero = self._weight(node, weight)
        if node.op_type == "Attention":
            mask = node.input[3] if len(node.input) > 3 else ""
            inputs = [codes, w_codes, node.input[2], scale, w_scale, mask, zero, w_zero]
            attention = helper.make_node("QAttention", inputs, [node.output[0]], name=label, domain=node.domain)
            attention.attribute.extend(node.attribute)
            return nodes + [attention]
        scales, product, as_float, result = inner_tensors(label)
        gemm_bias = node.op_type == "Gemm" and len(node.input) > 2 and node.input[2]
        result = result if gemm_bias else node.output[0]
        nodes += [
            helper.make_node("Mul", [scale, w_scale], [scales], name=label + "_scales"),
            helper.make_node("MatMulInteger", [codes, w_codes, zero, w_zero], [product], name=label),
            helper.make_node("Cast", [product], [as_float], name=label + "_cast", to=onnx.TensorProto.FLOAT),
            helper.make_node("Mul", [as_float, scales], [result], name=label + "_rescale"),
        ]
        if gemm_bias:
            nodes.append(helper.make_node("Add", [result, node.input[2]], [node.output[0]], name=label + "_bias"))
        return nodes

    def _table(self, name: str, table: np.ndarray) -> tuple[str, str]:
        """A float table as uint8 codes (stored as `name` + CODES), asymmetric with one scale over
        the table's range (0 included), as DynamicQuantizeLinear would quantize its rows: (scale,
        zero point) names."""
        lo, hi = min(0.0, float(table.min())), max(0.0, float(table.max()))
        scale = (hi - lo) / 255.0 if hi > lo else 1.0
        zero = int(np.clip(np.round(-lo / scale), 0, 255))
        codes = np.clip(np.round(table.astype(np.float64) / scale) + zero, 0, 255).astype(np.uint8)
        self.add_init(codes, name + CODES)
        return (self.add_init(np.array(scale, np.float32), name + SCALE),
                self.add_init(np.array(zero, np.uint8), name + "_zero_point"))

    def _weight(self, node: onnx.NodeProto, weight: np.ndarray) -> tuple[str, str, str]:
        """int8 [K, N] (a Gemm's transB weight transposed), symmetric per column or per tensor, zero point 0."""
        transposed = node.op_type == "Gemm" and bool(attribute(node, "transB", 0))
        name = node.input[1] + ("_transposed" if transposed else "")
        if name not in self.weights:
            matrix = weight.T if transposed else weight
            scales = qp.weight_scales(matrix, self.axis, self.weight_qmax)
            self.weights[name] = (
                self.add_init(qp.quantize_weight(matrix, scales, self.axis, self.weight_qmax), name + CODES),
                self.add_init(scales, name + SCALE),
                self.add_init(np.array(0, np.int8), name + "_zero_point"))
        return self.weights[name]


def per_tensor_sqnr(model: onnx.ModelProto, labels: Collection[str]) -> float:
    """What one scale per tensor would cost the weights of the MatMul/Gemm `labels` of the prepared
    `model`: quantized with one scale for the whole weight, the SQNR (dB) of a weight's median
    output column, lowest over the weights. A column far larger than the rest coarsens every other
    column's grid."""
    inits = GraphIndex(model).initializers
    worst = np.inf
    for node in model.graph.node:
        if node_label(node) not in labels or node.input[1] not in inits:
            continue
        weight = numpy_helper.to_array(inits[node.input[1]]).astype(np.float64)
        if node.op_type == "Gemm" and attribute(node, "transB", 0):
            weight = weight.T
        energy = np.sum(weight ** 2, axis=0)
        if energy.any():  # all-zero columns have no SQNR to lose
            scale = qp.weight_scales(weight, None)
            noise = np.sum((weight - qp.quantize_weight(weight, scale, None) * scale.astype(np.float64)) ** 2, axis=0)
            columns = 10 * np.log10(energy[energy > 0] / np.maximum(noise[energy > 0], 1e-30))
            worst = min(worst, float(np.median(columns)))
    return float(worst)
