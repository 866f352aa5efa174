"""The form of HardSigmoid/HardSwish between uint8 tensors, chosen by measurement (quantization
option `advanced.hard_activations: auto`, the default, on a target that writes them: Target.form_passes).

onnxruntime has no int8 HardSigmoid or HardSwish; qtool writes them as QLinearAdd (+ QLinearMul)
integer kernels (qtool.quantization.ort_cpu.hard_activations), faster, with the gate rounded to 1/255,
which many such layers in a row can feel. The all-int8 model with the integer forms is measured
(qtool.choices.measure); at a mean cosine of KEEP it stays; below, the same model with the float
forms is measured too and kept when MARGIN_DB closer to fp32. A model without such nodes in its
fp32 graph, or without calibration data, keeps the integer forms unmeasured.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import onnx

from qtool.choices.decision import Decision
from qtool.choices.measure import KEEP, MARGIN_DB, Scoring, figures, ranges_only
from qtool.config import Config, QuantizeConfig, with_options
from qtool.data.dataset import DataLike
from qtool.graph.index import attribute
from qtool.quantization.ort_cpu.hard_activations import HARD
from qtool.quantization.quantize import kernel_forms
from qtool.table.table import CalibrationTable
from qtool.targets import target_of

OPTION = "quantization.advanced.hard_activations"


def _hard_nodes(model: onnx.ModelProto) -> int:
    return sum(node.op_type in HARD and node.domain in ("", "ai.onnx") for node in model.graph.node)


def _may_have_hard_nodes(model: onnx.ModelProto) -> bool:
    """The fp32 model has a main-graph HardSigmoid/HardSwish, as an op or as the activation of
    onnxruntime's FusedConv/FusedGemm (written out when the model is prepared): the only ones the
    integer forms rewrite."""
    return any(node.op_type in HARD or attribute(node, "activation", b"") == b"HardSigmoid"
               for node in model.graph.node)


def choose_hard_forms(model_path: str | Path, model: onnx.ModelProto, data: Optional[DataLike],
                      table: CalibrationTable, cfg: Config, scoring: Optional[Scoring] = None
                      ) -> tuple[QuantizeConfig, Optional[Decision]]:
    """(cfg.quantization with `hard_activations` settled to integer or float, the decision); the
    options unchanged and no decision when they already say integer or float. `model`: the one at
    `model_path`, loaded; `data` None: nothing to measure on; `scoring`: the job's."""
    options = cfg.quantization
    if options.advanced.hard_activations != "auto":
        return options, None
    integer = with_options(options, hard_activations="integer")
    if "hard_activations" not in target_of(options).form_passes or not _may_have_hard_nodes(model):
        return integer, Decision(OPTION, "integer", "no HardSigmoid/HardSwish written as onnxruntime kernels")
    if data is None:
        return integer, Decision(OPTION, "integer", "no calibration data to measure the float form on")
    evaluate = scoring if scoring is not None else Scoring(model_path, data, cfg)
    graph = evaluate.build(table, integer)
    written = _hard_nodes(graph.canonical) - _hard_nodes(graph.model)
    if written <= 0:
        return integer, Decision(OPTION, "integer", "no HardSigmoid/HardSwish between uint8 tensors")
    with_integer = evaluate(graph.model)
    count = evaluate.count
    if with_integer["cosine"] >= KEEP:
        return integer, Decision(OPTION, "integer", f"the integer forms reach a mean cosine of {KEEP}",
                                 (("integer", figures(with_integer)),), count)
    floats = with_options(options, hard_activations="float")
    float_model = onnx.ModelProto()
    float_model.CopyFrom(graph.canonical)  # the same int8 model before its kernel forms
    kernel_forms(float_model, ranges_only(floats))
    with_float = evaluate(float_model)
    chosen, kind = ((floats, "float") if with_float["cosine_db"] >= with_integer["cosine_db"] + MARGIN_DB
                    else (integer, "integer"))
    return chosen, Decision(OPTION, kind, f"{written} node(s); the float form must be {MARGIN_DB} dB closer to fp32",
                            (("integer", figures(with_integer)), ("float", figures(with_float))), count)
