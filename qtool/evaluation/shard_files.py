"""Evaluation shard files: `evaluate --shard K/N` in separate jobs, then `evaluate --merge`.

The engine-independent form of evaluation on workers (qtool.evaluation.shards), for a batch system
or a CI pipeline that fans out. Shard K/N is the same run of whole batches as `calibrate --shard`;
its file (JSON, written atomically) holds both models' sha256, the shard, the task, the first
batch's input shapes and types, and per batch the accumulators of that batch alone. Merged in shard
and batch order they are the floats of one pass, so the report's figures equal one `evaluate`'s.
Merging refuses files of other models, of another N, a repeated or a missing shard; it has no data,
so latency is timed on random inputs of the first batch's shapes. Usage: docs/scale-out.md.
"""

from __future__ import annotations

import json
from dataclasses import asdict, fields, replace
from pathlib import Path
from typing import Optional

import numpy as np

from qtool import atomic
from qtool.config import DetectionConfig, EvaluateConfig, PreprocessConfig
from qtool.data.dataset import Batch, batches, folder_only, open_data, split_shard
from qtool.data.labels import labels_for
from qtool.errors import QtoolError
from qtool.evaluation.ctc import CtcAccumulator
from qtool.evaluation.detection import DetectionAccumulator
from qtool.evaluation.evaluate import (EvaluateInputs, build_report, detection_config, open_models,
                                      runnable_batch_size)
from qtool.evaluation.latency import measure_latency
from qtool.evaluation.metrics import ClassificationAccumulator, FidelityAccumulator
from qtool.evaluation.report import EvaluationReport
from qtool.evaluation.shards import ModelRef, compare_part
from qtool.evaluation.task import Task

FORMAT = "qtool-evaluation-shard"
VERSION = 1


def _refuse_layer_runs(cfg: EvaluateConfig) -> None:
    if cfg.per_layer or cfg.sensitivity:
        raise QtoolError("--per-layer and --sensitivity run on the first samples in one evaluate: "
                         "not with --shard/--merge")


def evaluate_shard(inputs: EvaluateInputs, preprocess: PreprocessConfig, cfg: EvaluateConfig,
                   shard: tuple[int, int], output: Path) -> int:
    """Compare both models over shard `shard` of the data and write its per-batch figures; the samples read."""
    _refuse_layer_runs(cfg)
    folder_only(inputs.data, "evaluate --shard")
    _, _, specs, outputs = open_models(inputs, cfg)
    source = open_data(inputs.data, specs, preprocess)
    cfg = runnable_batch_size(inputs.fp32, source, cfg)  # every shard probes the same first batch
    labels = labels_for(source, inputs.labels) if inputs.labels else None
    (part,) = split_shard(source, cfg.batch_size, cfg.num_samples, *shard, parts=1)
    fp32, int8 = ModelRef.of(inputs.fp32), ModelRef.of(inputs.int8)
    found = compare_part(fp32, int8, part, labels, outputs, cfg, detection_config(cfg), threads=0)
    first = found[0].task
    header = {"format": FORMAT, "version": VERSION, "fp32_sha256": fp32.sha256, "int8_sha256": int8.sha256,
              "shard": list(shard), "samples": len(part),
              "data": str(inputs.data), "labels": inputs.labels, "task": first.name, "task_output": first.output,
              "outputs": outputs, "first_batch": _first_batch(part, cfg)}
    per_batch = [{"task": None if f.task.accumulator is None else _fields(f.task.accumulator),
                  "fidelity": {name: asdict(acc) for name, acc in f.fidelity.items()}} for f in found]
    atomic.write_text(output, json.dumps({**header, "batches": per_batch}) + "\n")
    return header["samples"]


def _first_batch(part, cfg: EvaluateConfig) -> dict:
    """The first batch's input shapes and dtypes (the MACs and the merge's latency inputs)."""
    batch = next(iter(batches(part, cfg.batch_size)))
    return {name: {"shape": list(array.shape), "dtype": str(array.dtype)} for name, array in batch.feeds.items()}


def _fields(accumulator) -> dict:
    """An accumulator's counts and sums (a detection accumulator's settings come from the config)."""
    return {f.name: getattr(accumulator, f.name) for f in fields(accumulator) if f.name != "cfg"}


def merge_evaluations(inputs: EvaluateInputs, paths: list[Path], cfg: EvaluateConfig) -> EvaluationReport:
    """The report of the union of the shards' batches: their accumulators merged in shard and batch order."""
    _refuse_layer_runs(cfg)
    _, int8_model, _, outputs = open_models(inputs, cfg)
    shards = sorted((_load(path) for path in paths), key=lambda item: item[1]["shard"][0])
    _check(shards, ModelRef.of(inputs.fp32).sha256, ModelRef.of(inputs.int8).sha256, outputs)
    header = shards[0][1]
    inputs = replace(inputs, data=header["data"], labels=header["labels"])
    detection = detection_config(cfg)
    task = _task(header, None, cfg, detection)
    fidelity = {name: FidelityAccumulator() for name in outputs}
    for _, data in shards:
        for entry in data["batches"]:
            if task.accumulator is not None:
                task.accumulator.merge(_task(header, entry["task"], cfg, detection).accumulator)
            for name, acc in fidelity.items():
                acc.merge(FidelityAccumulator(**entry["fidelity"][name]))
    first = header["first_batch"]
    rng = np.random.default_rng(0)
    feeds = {name: rng.normal(size=spec["shape"]).astype(spec["dtype"]) for name, spec in first.items()}
    size = next(iter(first.values()))["shape"][0]
    latency = measure_latency(str(inputs.fp32), str(inputs.int8), Batch([""] * size, feeds), cfg)
    latency["measured_on"] = "the merging process, on random inputs of the first batch's shapes"
    shapes = {name: (1, *spec["shape"][1:]) for name, spec in first.items()}
    return build_report(inputs, int8_model, True, task, fidelity, sum(d["samples"] for _, d in shards), shapes,
                        latency, cfg)


def _task(header: dict, values: Optional[dict], cfg: EvaluateConfig, detection: DetectionConfig) -> Task:
    """The shards' task with one batch's counts (`values`), or with none yet."""
    name, output = header["task"], header["task_output"]
    if name == "classification":
        return Task(name, output, ClassificationAccumulator(**(values or {"top_k": cfg.top_k})))
    if name == "detection":
        return Task(name, output, DetectionAccumulator(detection, **(values or {})))
    if name == "ctc":
        return Task(name, output, CtcAccumulator(**(values or {})))
    return Task(name, output, None)


def _load(path: Path) -> tuple[Path, dict]:
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, ValueError) as exc:
        raise QtoolError(f"not a readable evaluation shard file ({type(exc).__name__}: {exc})", path) from None
    if not isinstance(data, dict) or data.get("format") != FORMAT or data.get("version") != VERSION:
        raise QtoolError(f"not a qtool evaluation shard file (version {VERSION})", path)
    return Path(path), data


def _check(shards: list[tuple[Path, dict]], fp32_sha256: str, int8_sha256: str, outputs: list[str]) -> None:
    for path, data in shards:
        if (data["fp32_sha256"], data["int8_sha256"]) != (fp32_sha256, int8_sha256):
            raise QtoolError("this shard was evaluated with other models (sha256 differs)", path)
        if data["outputs"] != outputs or data["shard"][1] != shards[0][1]["shard"][1]:
            raise QtoolError(f"this shard is of another run than {shards[0][0].name} (outputs or N differ)", path)
    found = [data["shard"][0] for _, data in shards]
    count = shards[0][1]["shard"][1]
    if len(set(found)) != len(found):
        raise QtoolError(f"the same shard is given twice: {sorted(found)}")
    if sorted(found) != list(range(count)):
        missing = sorted(set(range(count)) - set(found))
        raise QtoolError(f"shard(s) {', '.join(f'{k}/{count}' for k in missing)} missing: the report needs all {count}")
