"""Quality gates for CI: compare report figures with the limits in EvaluateConfig.

Each limit that is set yields one Verdict with a one-line message; `qtool evaluate`
exits 1 when any verdict failed. Figures are read from the finished report, so the
terminal, JSON, JUnit and HTML outputs all show the same verdicts.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

from qtool.config import EvaluateConfig
from qtool.errors import QtoolError
from qtool.evaluation.report import EvaluationReport, Verdict


@dataclass(frozen=True)
class Threshold:
    name: str
    figure: str
    unit: str
    at_most: bool  # True: the value must not exceed the limit; False: must reach it
    read: Callable[[EvaluationReport], tuple[float, str]]  # report -> (value in the limit's unit, where measured)


def _classification(report: EvaluationReport, key: str) -> dict:
    cls = report.classification
    if not cls or key not in cls:
        need = "labels (--labels)" if key == "top1_drop" else "the classification task"
        raise QtoolError(f"this threshold needs {need}, and the report has no {key}")
    return cls


def _ctc(report: EvaluationReport) -> dict:
    if not report.ctc:
        raise QtoolError("this threshold needs the ctc task (--task ctc)")
    return report.ctc


def _worst_output(report: EvaluationReport, key: str) -> tuple[float, str]:
    name, figures = min(report.outputs.items(), key=lambda item: _ordered(item[1][key]))
    return figures[key], f"output '{name}'"


def _ordered(value: float) -> float:
    return -math.inf if math.isnan(value) else value  # a NaN counts as the worst


THRESHOLDS = (
    Threshold("max_top1_drop", "top-1 drop", "pts", True,
              lambda r: (100.0 * _classification(r, "top1_drop")["top1_drop"], "")),
    Threshold("min_agreement", "top-1 agreement", "%", False,
              lambda r: (100.0 * _classification(r, "agreement")["agreement"], "")),
    Threshold("min_texts_kept", "texts kept", "%", False,
              lambda r: (100.0 * _ctc(r)["texts_kept_fraction"], "")),
    Threshold("min_cosine", "cosine", "", False, lambda r: _worst_output(r, "cosine")),
    Threshold("min_sqnr", "SQNR", "dB", False, lambda r: _worst_output(r, "sqnr_db")),
    Threshold("min_speedup", "speedup", "x", False, lambda r: (r.latency["speedup"], "")),
)


def _text(value: float, unit: str) -> str:
    number = f"{value:.4f}" if unit == "" else f"{value:.2f}"
    return number + ("" if unit in ("", "%", "x") else " ") + unit


def check_thresholds(report: EvaluationReport, cfg: EvaluateConfig) -> list[Verdict]:
    verdicts = []
    for threshold in THRESHOLDS:
        limit = getattr(cfg, threshold.name)
        if limit is None:
            continue
        value, where = threshold.read(report)
        if math.isnan(value):
            passed = False
        else:
            passed = value <= limit if threshold.at_most else value >= limit
        sign = ("<=" if passed else ">") if threshold.at_most else (">=" if passed else "<")
        figure = f"{threshold.figure} of {where}" if where else threshold.figure
        message = (f"{'PASS' if passed else 'FAIL'} {threshold.name}: {figure} "
                   f"{_text(value, threshold.unit)} {sign} {_text(limit, threshold.unit)}")
        verdicts.append(Verdict(threshold.name, threshold.figure, float(limit), float(value), threshold.unit,
                                passed, message))
    return verdicts
