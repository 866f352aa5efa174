"""The task an evaluation measures (classification, detection, ctc, generic) and one batch's comparison."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import numpy as np

from qtool.config import DetectionConfig, EvaluateConfig
from qtool.data.dataset import Batch
from qtool.data.labels import Labels
from qtool.errors import QtoolError
from qtool.evaluation.ctc import CtcAccumulator
from qtool.evaluation.detection import DetectionAccumulator
from qtool.evaluation.metrics import ClassificationAccumulator, FidelityAccumulator, as_array


def looks_like_classifier(shape: tuple) -> bool:
    return len(shape) == 2 and shape[1] > 1


@dataclass
class Task:
    """The task-specific figures, fed the reference and test arrays of one output."""

    name: str
    output: str
    accumulator: Optional[ClassificationAccumulator | DetectionAccumulator | CtcAccumulator]

    def update(self, ref: dict[str, np.ndarray], test: dict[str, np.ndarray], labels: list) -> None:
        if isinstance(self.accumulator, ClassificationAccumulator):
            self.accumulator.update(ref[self.output], test[self.output], labels)
        elif isinstance(self.accumulator, CtcAccumulator):
            self.accumulator.update(ref[self.output], test[self.output], samples=len(labels))
        elif self.accumulator is not None:
            self.accumulator.update(ref[self.output], test[self.output])

    def result(self) -> Optional[dict]:
        return None if self.accumulator is None else {"output": self.output, **self.accumulator.result()}


def resolve_task(cfg: EvaluateConfig, outputs: list[str], first: np.ndarray, detection: DetectionConfig) -> Task:
    """Resolve `auto` from the first batch's first output and set up the task's figures.

    `auto` never picks ctc: an [N, T, C] distribution is also what token and frame classifiers
    output, where collapsing repeats and dropping class 0 would report texts that do not exist."""
    name = cfg.task
    if name == "auto":
        name = "classification" if looks_like_classifier(np.shape(as_array(first))) else "generic"
    if name != "classification" and (cfg.max_top1_drop is not None or cfg.min_agreement is not None):
        raise QtoolError(f"max_top1_drop and min_agreement are classification figures; the task is {name}")
    if name == "classification":
        return Task(name, outputs[0], ClassificationAccumulator(top_k=cfg.top_k))
    if name == "detection":
        output = detection.output or outputs[0]
        if output not in outputs:
            raise QtoolError(f"detection output '{output}' is not an output of the model ({', '.join(outputs)})",
                             cfg.task_config)
        return Task(name, output, DetectionAccumulator(detection))
    if name == "ctc":
        return Task(name, outputs[0], CtcAccumulator())
    return Task(name, outputs[0], None)


def compare_batch(task: Task, fidelity: dict[str, FidelityAccumulator], outputs: list[str], batch: Batch,
                  ref: list[np.ndarray], test: list[np.ndarray], labels: Optional[Labels]) -> None:
    """Feed one batch's fp32 (`ref`) and int8 (`test`) outputs to the figures."""
    for name, r, t in zip(outputs, ref, test):
        fidelity[name].update(r, t, len(batch))
    task.update(dict(zip(outputs, ref)), dict(zip(outputs, test)), [labels.get(k) if labels else None
                                                                    for k in batch.keys])
