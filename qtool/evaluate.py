"""Evaluation: fp32 and int8 side by side on the same data -> a report (a plain dict).

Both models see exactly the same batches. Latency is measured afterwards on one
batch, warm-up first, then the two models alternate run by run in this process so
that a noisy neighbour slows both alike; medians and p90 are reported.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import numpy as np
from tqdm import tqdm

from qtool.config import EvaluateConfig, PreprocessConfig
from qtool.dataset import Batch, batches, count_samples, open_data
from qtool.errors import QtoolError
from qtool.labels import FOLDERS, Labels, labels_from_folders, read_label_file
from qtool.metrics import ClassificationAccumulator, FidelityAccumulator, percentile_ms
from qtool.modelio import input_specs, load_model, output_names
from qtool.runtime import create_session


@dataclass(frozen=True)
class EvaluateInputs:
    fp32: Path
    int8: Path
    data: Path
    labels: Optional[str] = None  # a label file, or "folders"


def _looks_like_classifier(shape: tuple) -> bool:
    return len(shape) == 2 and shape[1] > 1


def evaluate(inputs: EvaluateInputs, preprocess: PreprocessConfig, cfg: EvaluateConfig,
             progress: bool = True) -> dict:
    fp32_model = load_model(inputs.fp32)
    int8_model = load_model(inputs.int8)
    specs = input_specs(fp32_model)
    if [s.name for s in input_specs(int8_model)] != [s.name for s in specs]:
        raise QtoolError("the int8 model's inputs differ from the fp32 model's", inputs.int8)
    outputs = output_names(fp32_model)
    source = open_data(inputs.data, specs, preprocess)
    labels = _labels(inputs, source)

    fp32 = create_session(str(inputs.fp32), label=str(inputs.fp32))
    int8 = create_session(str(inputs.int8), label=str(inputs.int8))
    fidelity = {name: FidelityAccumulator() for name in outputs}
    classification: Optional[ClassificationAccumulator] = None
    first_batch: Optional[Batch] = None
    total = count_samples(source, cfg.num_samples)
    with tqdm(total=total, desc="evaluating", unit="sample", disable=None if progress else True, leave=False) as bar:
        for batch in batches(source, cfg.batch_size, cfg.num_samples):
            if first_batch is None:
                first_batch = batch
            ref = fp32.run(outputs, batch.feeds)
            test = int8.run(outputs, batch.feeds)
            for name, r, t in zip(outputs, ref, test):
                fidelity[name].update(r, t)
            if classification is None and _looks_like_classifier(ref[0].shape):
                classification = ClassificationAccumulator(top_k=cfg.top_k)
            if classification is not None:
                classification.update(ref[0], test[0], [labels.get(k) if labels else None for k in batch.keys])
            bar.update(len(batch))

    report: dict = {
        "models": {"fp32": {"path": str(inputs.fp32), "size_bytes": _size(inputs.fp32)},
                   "int8": {"path": str(inputs.int8), "size_bytes": _size(inputs.int8)}},
        "data": {"path": str(inputs.data), "samples": total, "labels": inputs.labels},
        "outputs": {name: acc.result() for name, acc in fidelity.items()},
    }
    if classification is not None:
        report["classification"] = {"output": outputs[0], **classification.result()}
    report["size"] = {"fp32_bytes": _size(inputs.fp32), "int8_bytes": _size(inputs.int8),
                      "ratio": _size(inputs.fp32) / max(1, _size(inputs.int8))}
    report["latency"] = measure_latency(str(inputs.fp32), str(inputs.int8), first_batch, cfg)
    return report


def _labels(inputs: EvaluateInputs, source) -> Optional[Labels]:
    if not inputs.labels:
        return None
    if inputs.labels == FOLDERS:
        return labels_from_folders([source.key(p) for p in source.files], source.root)
    labels = read_label_file(inputs.labels)
    keys = [source.key(p) for p in source.files]
    if not any(labels.get(k) is not None for k in keys):
        raise QtoolError(f"no file of {inputs.data} has a label in this file", inputs.labels)
    return labels


def _size(path: Path) -> int:
    size = os.path.getsize(path)
    data = Path(str(path) + ".data")
    return size + (os.path.getsize(data) if data.exists() else 0)


def measure_latency(fp32_path: str, int8_path: str, batch: Batch, cfg: EvaluateConfig) -> dict:
    """Median and p90 seconds per batch of each model, runs interleaved, same session options."""
    sessions = {"fp32": create_session(fp32_path, cfg.threads, fp32_path),
                "int8": create_session(int8_path, cfg.threads, int8_path)}
    times: dict[str, list[float]] = {name: [] for name in sessions}
    for _ in range(cfg.warmup):
        for session in sessions.values():
            session.run(None, batch.feeds)
    for _ in range(cfg.runs):
        for name, session in sessions.items():
            start = time.perf_counter()
            session.run(None, batch.feeds)
            times[name].append(time.perf_counter() - start)
    result = {"batch_size": len(batch), "threads": cfg.threads, "runs": cfg.runs}
    for name, values in times.items():
        result[f"{name}_ms"] = {"median": percentile_ms(values, 50), "p90": percentile_ms(values, 90)}
    result["speedup"] = result["fp32_ms"]["median"] / result["int8_ms"]["median"]
    return result
