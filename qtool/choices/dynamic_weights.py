"""Per-column or per-tensor weight scales for dynamic int8 MatMuls, chosen by measurement
(quantization option `advanced.dynamic_weights: auto`, the default).

onnxruntime rescales a product with per-column weight scales in an extra pass over its output,
a large share of a small layer's time at batch 1; per-tensor scales cost precision where the
columns' ranges differ. So both are measured (qtool.choices.measure) and per tensor is kept only
when the mean worst-output cosine falls by less than TOLERANCE. Not measured: a model without
dynamic MatMuls, and one where per-tensor scales would leave a weight's median column below
MIN_WEIGHT_SQNR (qtool.quantization.dynamic_matmul.per_tensor_sqnr), which keeps per column.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional


from qtool.choices.decision import Decision
from qtool.choices.measure import Scoring, figures
from qtool.config import Config, QuantizeConfig, with_options
from qtool.data.dataset import DataLike
from qtool.quantization.dynamic_matmul import per_tensor_sqnr
from qtool.quantization.quantize import ranges_only
from qtool.table.table import CalibrationTable, smoothed_options

TOLERANCE = 1e-4  # mean cosine per-tensor weights may lose against per-column ones
MIN_WEIGHT_SQNR = 20.0  # dB; per column about 40
OPTION = "quantization.advanced.dynamic_weights"


def choose_dynamic_weights(model_path: str | Path, strategy: str, data: DataLike, table: CalibrationTable,
                           cfg: Config, scoring: Optional[Scoring] = None
                           ) -> tuple[QuantizeConfig, Optional[Decision]]:
    """(cfg.quantization with `dynamic_weights` settled to column or tensor, the decision); the
    options unchanged and no decision when they already say column or tensor. `strategy`: the MatMul
    strategy settled for the model; `scoring`: the job's."""
    options = cfg.quantization
    if options.advanced.dynamic_weights != "auto":
        return options, None
    column = with_options(options, dynamic_weights="column")
    if not options.per_channel:
        return column, Decision(OPTION, "column", "weights per tensor already (per_channel off)")
    if strategy != "dynamic":
        return column, Decision(OPTION, "column", "no dynamic MatMul")
    evaluate = scoring if scoring is not None else Scoring(model_path, data, cfg)
    graph = evaluate.shared.graph(model_path, table, smoothed_options(ranges_only(column), table))  # the job's
    prepared, plan = graph.model, graph.plan
    layers = len(plan.dynamic_matmuls)
    if not layers:
        return column, Decision(OPTION, "column", "no dynamic MatMul")
    weight_sqnr = per_tensor_sqnr(prepared, set(plan.dynamic_matmuls))
    if weight_sqnr < MIN_WEIGHT_SQNR:
        return column, Decision(OPTION, "column", f"per tensor, a weight's median column of the {layers} dynamic "
                                f"MatMul(s) would keep an SQNR of {weight_sqnr:.1f} dB, below {MIN_WEIGHT_SQNR}")
    tensor = with_options(options, dynamic_weights="tensor")
    # in turn: the first candidate's fp32 reference and scoring runs go first on the background
    # thread, where a second candidate started beside it would queue them behind its own build
    per_column = evaluate(evaluate.build(table, column).model)
    per_tensor = evaluate(evaluate.build(table, tensor).model)
    count = evaluate.count
    chosen, kind = ((tensor, "tensor") if per_tensor["cosine"] >= per_column["cosine"] - TOLERANCE
                    else (column, "column"))
    return chosen, Decision(OPTION, kind, f"per tensor unless it loses {TOLERANCE} of mean cosine "
                            f"({layers} dynamic MatMuls)",
                            (("column", figures(per_column)), ("tensor", figures(per_tensor))), count)
