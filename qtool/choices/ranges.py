"""The range method chosen by measurement (calibration method `auto`, the default).

No one range method suits every model (docs/accuracy.md, "Range methods"). One calibration pass
keeps a histogram of every tensor and builds the table of each candidate method from it; the
model is quantized with each (qtool.choices.measure) and the table whose int8 model is closest
to fp32 is kept. Min-max comes first and stays when it already reaches a mean cosine of KEEP
(the others are then not quantized at all) or when no other method gains MARGIN_DB over it: it
clips nothing, and the rare large values other methods clip can matter more to a task than to
the cosine.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Optional

from qtool.calibration.calibrate import calibrate_methods
from qtool.choices.decision import Decision
from qtool.choices.measure import KEEP, MARGIN_DB, Scoring, figures
from qtool.config import Config
from qtool.data.dataset import DataLike
from qtool.graph.executor import Engine
from qtool.table.table import CalibrationTable

CANDIDATES = ("minmax", "mse", "percentile")  # the first is kept on ties
OPTION = "calibration.method"


def choose_ranges(model_path: str | Path, data: DataLike, cfg: Config, progress: bool = True,
                  engine: Optional[Engine] = None, scoring: Optional[Scoring] = None
                  ) -> tuple[CalibrationTable, list[CalibrationTable], Decision]:
    """(the table of the candidate method whose int8 model measures closest to fp32 on the
    calibration data, its notes saying what was measured; every candidate's table; the decision).
    `scoring`: the job's (the later choices share its evaluator and prepared graph)."""
    tables = calibrate_methods(model_path, data, cfg.preprocess, cfg.calibration, cfg.quantization,
                               list(CANDIDATES), progress, engine)
    first = tables[0]
    if all(t.tensors == first.tensors for t in tables[1:]):  # no activation ranges, or all methods agree
        return first, tables, Decision(OPTION, first.method, "every candidate method gives the same ranges")
    evaluate = scoring if scoring is not None else Scoring(model_path, data, cfg)
    count = evaluate.count
    measured = evaluate.measured([(first, cfg.quantization)])
    if measured[0]["cosine"] >= KEEP:
        decision = Decision(OPTION, first.method, f"the first candidate reaches a mean cosine of {KEEP}",
                            ((first.method, figures(measured[0])),), count)
        return first, tables, decision
    measured += evaluate.measured([(table, cfg.quantization) for table in tables[1:]])
    best = 0
    for i, candidate in enumerate(measured[1:], 1):
        if candidate["cosine_db"] > measured[best]["cosine_db"] + MARGIN_DB:
            best = i
    decision = Decision(OPTION, tables[best].method,
                        f"closest to fp32 (another method must gain {MARGIN_DB} dB over {first.method})",
                        tuple((t.method, figures(f)) for t, f in zip(tables, measured)), count)
    notes = [decision.note()] if best else []
    if measured[best]["cosine"] < KEEP:
        notes.append(f"the all-int8 model's mean cosine to fp32 on {count} calibration samples is "
                     f"{measured[best]['cosine']:.4f}, below {KEEP}: qtool search MODEL --data DIR --eval-data DIR "
                     f"--target-cosine {KEEP} keeps the layers that need it in float")
    return replace(tables[best], notes=tables[best].notes + tuple(notes)), tables, decision
