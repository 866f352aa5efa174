"""Per-column or per-tensor weight scales for dynamic int8 MatMuls, chosen by measurement
(quantization option `dynamic_weights: auto`, the default).

onnxruntime's DynamicQuantizeMatMul rescales a product with per-column weight scales in an
extra pass over its output, a large share of a small layer's time at batch 1 (1.3 of 6 us for
[1, 256] x [256, 768]): the kit's GRU decoder runs about 8% faster with per-tensor scales.
Per-tensor scales cost precision wherever the columns' ranges differ: MiniLM's feed-forward
weights have columns 10-100x larger than their median one, and per-tensor scales drop its mean
worst-output cosine on the calibration samples from 0.997 to 0.79.

So both are measured like the range methods (qtool.evaluation.range_choice): the model is
quantized twice (ranges only), per column and per tensor, and per tensor is kept only when the
mean worst-output cosine to fp32 on the first calibration samples falls by less than
`TOLERANCE`. Not measured: a model without dynamic MatMuls, and one where per-tensor scales
would leave a weight's median column below `MIN_WEIGHT_SQNR` (qtool.quantization.dynamic_matmul.
per_tensor_sqnr; MiniLM: 1 dB), which keeps per column.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import onnx

from qtool.config import Config, QuantizeConfig
from qtool.data.dataset import DataLike
from qtool.evaluation.range_choice import measurer, ranges_only
from qtool.graph.index import GraphIndex
from qtool.graph.modelio import input_specs
from qtool.plan.dynamic import matmul_strategy
from qtool.plan.planner import prepared_model
from qtool.quantization.dynamic_matmul import per_tensor_sqnr
from qtool.quantization.quantize import quantize_model
from qtool.table.table import CalibrationTable, smoothed_options

TOLERANCE = 1e-4  # mean cosine per-tensor weights may lose against per-column ones
MIN_WEIGHT_SQNR = 20.0  # dB; per column about 40; per tensor the kit's GRU decoder keeps 26, the encoder 37


def choose_dynamic_weights(model_path: str | Path, model: onnx.ModelProto, data: DataLike, table: CalibrationTable,
                           cfg: Config) -> tuple[QuantizeConfig, tuple[str, ...]]:
    """(cfg.quantization with `dynamic_weights` settled to column or tensor, the note saying what was
    measured); the options unchanged when they already say column or tensor. `model`: the one at
    `model_path`, loaded."""
    options = cfg.quantization
    if options.dynamic_weights != "auto" or not options.per_channel:
        return options, ()
    column = replace(options, dynamic_weights="column")
    if matmul_strategy(model, GraphIndex(model), options)[0] != "dynamic":
        return column, ()  # a Conv net: no dynamic MatMul to choose for
    prepared, plan = prepared_model(model_path, smoothed_options(column, table))  # the graph quantize_model makes
    layers = len(plan.dynamic_matmuls)
    if not layers:
        return column, ()
    weight_sqnr = per_tensor_sqnr(prepared, set(plan.dynamic_matmuls))
    if weight_sqnr < MIN_WEIGHT_SQNR:
        return column, (f"weight scales per column for the {layers} dynamic MatMul(s): per tensor, a weight's median "
                        f"column would keep an SQNR of {weight_sqnr:.1f} dB",)
    graph = quantize_model(model_path, table, ranges_only(column), allow_missing=True)
    evaluate, count = measurer(model_path, input_specs(model), data, cfg)
    tensor = replace(options, dynamic_weights="tensor")
    per_column = evaluate(graph.model)[0]["cosine"]
    per_tensor = evaluate(quantize_model(model_path, table, ranges_only(tensor), allow_missing=True).model)[0]["cosine"]
    chosen, kind = (tensor, "tensor") if per_tensor >= per_column - TOLERANCE else (column, "column")
    return chosen, (f"weight scales per {kind} for the {layers} dynamic MatMul(s): mean cosine to fp32 on "
                    f"{count} calibration samples per column {per_column:.5f}, per tensor {per_tensor:.5f}",)
