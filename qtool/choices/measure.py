"""How the measured choices score a candidate: the all-int8 model (ranges only: the data-driven
weight steps run once, on the choice) against fp32 on SAMPLES calibration samples spread over the
data, by the worst output's cosine; a distance in dB, the mean of -10 log10(1 - cosine), so that
a few samples a rounding moves a lot do not carry the mean."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from qtool.config import Config, QuantizeConfig
from qtool.data.dataset import DataLike, batches, open_data, spread_samples
from qtool.evaluation.mixed_precision import Evaluator
from qtool.graph.modelio import InputSpec
from qtool.targets import target_of

SAMPLES = 16  # calibration samples the candidates are measured on
KEEP = 0.99  # a mean cosine at which the first candidate is kept without measuring the others
MARGIN_DB = 0.5  # what another candidate must gain over the first to be chosen


def measurer(model_path: str | Path, specs: list[InputSpec], data: DataLike, cfg: Config) -> tuple[Evaluator, int]:
    """(the fidelity of a candidate int8 model to fp32 on `SAMPLES` calibration samples spread over
    them, how many samples that is); `specs`: the model's inputs."""
    source = spread_samples(open_data(data, specs, cfg.preprocess), cfg.calibration.num_samples, SAMPLES)
    samples = list(batches(source, cfg.calibration.batch_size, SAMPLES))
    return (Evaluator(Path(model_path), samples, None, cfg.evaluation.threads,
                      runtime=target_of(cfg.quantization).measured_on), sum(len(b) for b in samples))


def ranges_only(options: QuantizeConfig) -> QuantizeConfig:
    """The options of a measured candidate: the data-driven weight steps run once, on the choice."""
    return replace(options, bias_correction="off", weight_rounding="nearest")


def figures(measured: dict) -> dict:
    """The figures a Decision records of one candidate."""
    return {"cosine_db": round(float(measured["cosine_db"]), 3), "cosine": round(float(measured["cosine"]), 5)}
