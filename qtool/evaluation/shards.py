"""Evaluation on an executor's workers (evaluate --dask, the API's executor=): the same figures as one process.

The data is cut into runs of whole batches, sent as lists of sample files (with their labels). A
worker keeps both models' sessions per model hash and returns, per batch, the accumulators of that
batch alone (sums and counts); merged in batch order they give the very floats of a single pass
(FidelityAccumulator.merge). Latency is measured on one worker, alone, after the comparison, and
the report says so. The per-layer error splits the first `layer_samples` samples' batches the same
way; the sensitivity ranking gives each worker a run of consecutive layers on the same samples, and
the layers are ranked together exactly as in one run.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Union

import onnx

from qtool.config import DetectionConfig, EvaluateConfig, QuantizeConfig
from qtool.data.dataset import Batch, DataSource, MemorySource, batches, first_samples, split_shard
from qtool.data.labels import Labels
from qtool.evaluation.latency import measure_latency
from qtool.evaluation.layer_error import LayerError, batch_fidelity, summarize, twins
from qtool.evaluation.metrics import FidelityAccumulator
from qtool.evaluation.task import Task, compare_batch, resolve_task
from qtool.graph.executor import TASKS_PER_WORKER, Engine, model_cache, run_in_order
from qtool.graph.modelio import load_model, sha256_file
from qtool.graph.runtime import create_session
from qtool.evaluation.sensitivity import layers, measured, rank
from qtool.plan.planner import prepared_model
from qtool.table.table import CalibrationTable

Source = Union[DataSource, MemorySource]  # a shard: sample files, or a slice of samples in memory


@dataclass(frozen=True)
class ModelRef:
    """A model file as a worker reads it: its path and the sha256 it must have."""

    path: str
    sha256: str

    @classmethod
    def of(cls, path) -> "ModelRef":
        return cls(str(path), sha256_file(path))

    def session(self, threads: int):
        return model_cache(self.path, self.sha256, ("session", threads),
                           lambda: create_session(self.path, threads, self.path))

    def model(self) -> onnx.ModelProto:
        return model_cache(self.path, self.sha256, ("model",), lambda: load_model(self.path))


@dataclass(frozen=True)
class _CompareJob:
    fp32: ModelRef
    int8: ModelRef
    source: Source  # this shard's sample files (or in-memory samples) only
    labels: Optional[Labels]  # of those files only
    outputs: list[str]
    cfg: EvaluateConfig
    detection: DetectionConfig
    threads: int


@dataclass
class BatchFigures:
    """One batch's accumulators: per output fidelity, and the task's."""

    task: Task  # of this batch alone
    fidelity: dict[str, FidelityAccumulator]


def _compare(job: _CompareJob) -> list[BatchFigures]:
    fp32, int8 = job.fp32.session(job.threads), job.int8.session(job.threads)
    found = []
    for batch in batches(job.source, job.cfg.batch_size):
        ref, test = fp32.run(job.outputs, batch.feeds), int8.run(job.outputs, batch.feeds)
        figures = BatchFigures(resolve_task(job.cfg, job.outputs, ref[0], job.detection),
                               {name: FidelityAccumulator() for name in job.outputs})
        compare_batch(figures.task, figures.fidelity, job.outputs, batch, ref, test, job.labels)
        found.append(figures)
    return found


def compare_part(fp32: ModelRef, int8: ModelRef, part: Source, labels: Optional[Labels], outputs: list[str],
                 cfg: EvaluateConfig, detection: DetectionConfig, threads: int) -> list[BatchFigures]:
    """The per-batch figures of `part` in this process (evaluate --shard: qtool.evaluation.shard_files)."""
    return _compare(_CompareJob(fp32, int8, part, _labels_of(part, labels), outputs, cfg, detection, threads))


def compare_on(engine: Engine, fp32, int8, source: Source, labels: Optional[Labels], outputs: list[str],
               cfg: EvaluateConfig, detection: DetectionConfig, progress: bool):
    """(task, fidelity) over the first cfg.num_samples samples of `source`, batch by batch in order."""
    fp32, int8 = ModelRef.of(fp32), ModelRef.of(int8)
    parts = split_shard(source, cfg.batch_size, cfg.num_samples, 0, 1, engine.width * TASKS_PER_WORKER)
    jobs = [_CompareJob(fp32, int8, part, _labels_of(part, labels), outputs, cfg, detection, engine.threads)
            for part in parts]
    task, fidelity = None, {name: FidelityAccumulator() for name in outputs}
    for found in run_in_order(engine, _compare, jobs, "evaluating", progress):
        for figures in found:
            if task is None:
                task = figures.task
            elif task.accumulator is not None:
                task.accumulator.merge(figures.task.accumulator)
            for name, acc in fidelity.items():
                acc.merge(figures.fidelity[name])
    return task, fidelity


def _labels_of(part: Source, labels: Optional[Labels]) -> Optional[Labels]:
    if labels is None:
        return None
    keys = (part.key(path) for path in part.files)
    return Labels({key: label for key in keys if (label := labels.get(key)) is not None})


@dataclass(frozen=True)
class _LatencyJob:
    fp32: ModelRef
    int8: ModelRef
    source: Source  # the first batch's samples
    cfg: EvaluateConfig


def _latency(job: _LatencyJob) -> dict:
    first = next(iter(batches(job.source, job.cfg.batch_size)))
    return measure_latency(job.fp32.path, job.int8.path, first, job.cfg)


def latency_on(engine: Engine, fp32, int8, source: Source, first: Batch, cfg: EvaluateConfig) -> dict:
    """measure_latency on one worker, with a note saying where."""
    job = _LatencyJob(ModelRef.of(fp32), ModelRef.of(int8), first_samples(source, first.keys), cfg)
    (result,) = run_in_order(engine, _latency, [job], "timing", progress=False)
    return {**result, "measured_on": f"one worker ({engine.name})"}


@dataclass(frozen=True)
class _PerLayerJob:
    fp32: ModelRef
    int8: ModelRef
    source: Source  # a run of whole batches of the subset
    batch_size: int
    threads: int


def _per_layer(job: _PerLayerJob) -> list[dict]:
    fp32, int8 = job.fp32.model(), job.int8.model()
    return list(batch_fidelity(fp32, int8, batches(job.source, job.batch_size), job.threads))


def per_layer_on(engine: Engine, fp32_path, int8_path, fp32: onnx.ModelProto, int8: onnx.ModelProto,
                 source: Source, subset: list[Batch], batch_size: int, progress: bool) -> list[LayerError]:
    """layer_errors over `subset` with runs of its batches on the workers (one per worker), each
    returning per-batch sums, merged in batch order: the figures of one pass."""
    head = first_samples(source, [k for b in subset for k in b.keys])
    parts = split_shard(head, batch_size, None, 0, 1, engine.width)
    refs = ModelRef.of(fp32_path), ModelRef.of(int8_path)
    jobs = [_PerLayerJob(*refs, part, batch_size, engine.threads) for part in parts]
    return summarize(twins(fp32, int8), (fidelity for found in run_in_order(engine, _per_layer, jobs, "per layer", progress)
                                  for fidelity in found))


@dataclass(frozen=True)
class _SensitivityJob:
    model: ModelRef
    table: CalibrationTable
    options: QuantizeConfig
    source: Source  # the subset
    batch_size: int
    nodes: list[str]


def _sensitivity(job: _SensitivityJob) -> list:
    subset = list(batches(job.source, job.batch_size))
    return measured(job.model.path, job.table, job.options, subset, job.nodes, threads=1)


def sensitivity_on(engine: Engine, model_path, table: CalibrationTable, options: QuantizeConfig,
                   source: Source, subset: list[Batch], batch_size: int, progress: bool) -> list:
    """layer_sensitivity with runs of consecutive layers on the workers."""
    model, plan = prepared_model(model_path, options)
    names = [layer.node for layer in layers(model, plan)]
    count = max(1, min(len(names), engine.width))  # one run per worker: each first runs fp32 on the subset
    groups = [names[len(names) * j // count:len(names) * (j + 1) // count] for j in range(count)]
    head = first_samples(source, [k for b in subset for k in b.keys])
    ref = ModelRef.of(model_path)
    jobs = [_SensitivityJob(ref, table, options, head, batch_size, group)
            for group in groups if group]
    return rank([entry for found in run_in_order(engine, _sensitivity, jobs, "one layer at a time", progress)
                 for entry in found])
