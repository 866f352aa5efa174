"""Which kernels onnxruntime actually runs for a QDQ model.

A QDQ model is fast only if onnxruntime's graph optimizer turns each DQ -> Conv -> Q group
into one integer kernel (QLinearConv); a Q/DQ pair in the wrong place leaves the Conv in
float between a dequantize and a quantize, which is slower than plain fp32. The optimizer's
output (SessionOptions.optimized_model_filepath, at the level where the QDQ fusions run,
before hardware-specific layout changes) tells which happened; If/Loop/Scan bodies are counted
with the main graph.
"""

from __future__ import annotations

import os
import tempfile
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import onnx
import onnxruntime as ort

from qtool.graph.index import scoped_nodes
from qtool.graph.runtime import create_session

INTEGER_CONV = ("QLinearConv", "ConvInteger")
INTEGER_MATMUL = ("QGemm", "QLinearMatMul", "MatMulInteger", "MatMulIntegerToFloat", "DynamicQuantizeMatMul")


@dataclass(frozen=True)
class KernelCounts:
    quantized_convs: int  # Conv nodes of the QDQ model whose weight is a DequantizeLinear output
    integer_convs: int  # QLinearConv / ConvInteger in onnxruntime's optimized graph
    float_convs: int  # Conv left in float by onnxruntime
    ops: dict[str, int]  # every op type of the optimized graph

    @property
    def all_convs_integer(self) -> bool:
        return self.integer_convs >= self.quantized_convs


def optimized_ops(model: onnx.ModelProto | str | Path,
                  level: ort.GraphOptimizationLevel = ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED) -> Counter:
    """Op types of the graph onnxruntime's optimizer makes of `model` (a proto or a path) at
    `level`; the default is the level where the QDQ fusions run, before the layout changes."""
    with tempfile.TemporaryDirectory() as tmp:
        optimized = os.path.join(tmp, "optimized.onnx")
        source, label = (model, "model") if isinstance(model, onnx.ModelProto) else (str(model), str(model))
        create_session(source, 1, label, level=level, optimized_path=optimized)
        return Counter(n.op_type for n in scoped_nodes(onnx.load(optimized, load_external_data=False).graph))


def count_kernels(model: onnx.ModelProto | str | Path) -> KernelCounts:
    """The kernel counts of a QDQ model (a proto or a path)."""
    graph = (model if isinstance(model, onnx.ModelProto) else onnx.load(str(model), load_external_data=False)).graph
    dq_outputs = {n.output[0] for n in scoped_nodes(graph) if n.op_type == "DequantizeLinear"}
    quantized = sum(1 for n in scoped_nodes(graph)
                    if n.op_type == "Conv" and len(n.input) > 1 and n.input[1] in dq_outputs)
    ops = optimized_ops(model)
    return KernelCounts(quantized, sum(ops[o] for o in INTEGER_CONV), ops["Conv"] + ops["FusedConv"],
                        dict(sorted(ops.items())))


def kernel_summary(model: KernelCounts | str | Path) -> str:
    """One line on the kernels onnxruntime runs: from counts made already, or counted now from a model file."""
    try:
        counts = model if isinstance(model, KernelCounts) else count_kernels(model)
    except Exception as exc:  # advisory only: a model onnxruntime cannot load is reported, not fatal
        return f"onnxruntime kernels: not checked ({str(exc).splitlines()[0]})"
    ops = counts.ops
    matmuls = sum(ops.get(o, 0) for o in INTEGER_MATMUL)
    text = (f"onnxruntime kernels: {counts.integer_convs} integer Conv (QLinearConv/ConvInteger) for "
            f"{counts.quantized_convs} quantized Conv, {counts.float_convs} float Conv, {matmuls} integer "
            f"Gemm/MatMul, {ops.get('QuantizeLinear', 0)} QuantizeLinear, {ops.get('DequantizeLinear', 0)} "
            f"DequantizeLinear left")
    if ops.get("DynamicQuantizeLSTM"):
        text += f", {ops['DynamicQuantizeLSTM']} DynamicQuantizeLSTM (int8 weights)"
    if not counts.all_convs_integer:
        text += f" (warning: {counts.quantized_convs - counts.integer_convs} quantized Conv not fused)"
    return text
