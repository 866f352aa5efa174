"""Statistics files and shards on workers: calibration data collected apart, merged by addition.

A shard K/N is a contiguous run of whole batches, so the shards' batches are exactly those of a
single run; min/max and histograms (sums of per-batch counts) merge exactly, and the merged table
equals a single-process run's (for models whose batches do not change shape mid-shard). A
statistics file (.npz, written atomically) holds a JSON header (model sha256, tensors in plan
order, samples, shard) and per tensor its extremes, counts and histogram, always, so the range
method can still be chosen at merge time. On an executor (qtool.graph.executor) the shards are
the same runs, sent as lists of sample files; each worker returns its statistics, no file in
between. Usage: docs/scale-out.md.
"""

from __future__ import annotations

import io
import json
import zipfile
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import onnx

from qtool import atomic
from qtool.calibration.collect import collect_statistics, keeps_channel_means, make_observer, warn_nonfinite
from qtool.calibration.statistics import TensorStats
from qtool.config import CalibrationConfig, PreprocessConfig, QuantizeConfig
from qtool.data.dataset import DataSource, MemorySource, check_shippable, open_data, split_shard
from qtool.errors import QtoolError
from qtool.graph.executor import TASKS_PER_WORKER, Engine, model_cache, run_in_order
from qtool.graph.modelio import input_specs, sha256_file
from qtool.plan.planner import prepared_model

FORMAT = "qtool-statistics"
VERSION = 1


def parse_shard(text: str) -> tuple[int, int]:
    """'K/N' with 0 <= K < N (0-based shard K of N)."""
    try:
        k, n = (int(part) for part in text.split("/"))
    except ValueError:
        raise QtoolError(f"--shard must be K/N, e.g. 0/4, got '{text}'") from None
    if n < 1 or not 0 <= k < n:
        raise QtoolError(f"--shard K/N needs 0 <= K < N, got '{text}'")
    return k, n


@dataclass(frozen=True)
class _CollectJob:
    """One shard as a worker receives it: references, not samples."""

    model_path: str
    model_sha256: str
    source: DataSource | MemorySource  # the shard's sample files (or its slice of samples in memory) only
    preprocess: PreprocessConfig
    calib: CalibrationConfig
    options: QuantizeConfig
    threads: int
    all_histograms: bool


def _collect(job: _CollectJob) -> tuple[dict[str, TensorStats], int]:
    """On a worker: one pass over one shard, with the prepared model and its observing sessions
    it keeps per model hash and options (each pass still starts from fresh statistics)."""
    model, plan = model_cache(job.model_path, job.model_sha256, ("prepared", job.options),
                              lambda: prepared_model(job.model_path, job.options))
    observer = model_cache(job.model_path, job.model_sha256,
                           ("observer", job.options, job.calib, job.threads, job.all_histograms),
                           lambda: make_observer(model, plan, job.calib, job.threads, job.all_histograms,
                                                 keeps_channel_means(job.options)))
    return collect_statistics(model, plan, job.source, job.preprocess, job.calib, progress=False, warn=False,
                              observer=observer)


def collect_parallel(engine: Engine, model_path, model: onnx.ModelProto, data, preprocess: PreprocessConfig,
                     calib: CalibrationConfig, options: QuantizeConfig, shard: tuple[int, int] = (0, 1),
                     force_histograms: bool = False, progress: bool = True) -> tuple[dict[str, TensorStats], int]:
    """Shard `shard` of the data cut into a few runs of whole batches per worker of `engine`, each
    collected on a worker with its own onnxruntime session; merged in shard order as they come in.
    `model`: the model at `model_path` as the caller holds it (its inputs read the data)."""
    source = open_data(data, input_specs(model), preprocess)
    check_shippable(source, "sharding over workers (--workers, --dask, executor=)")
    parts = split_shard(source, calib.batch_size, calib.num_samples, *shard, parts=engine.width * TASKS_PER_WORKER)
    whole = replace(calib, num_samples=None)  # each part lists exactly its files
    sha = sha256_file(model_path)
    jobs = [_CollectJob(str(model_path), sha, part, preprocess, whole, options, engine.threads, force_histograms)
            for part in parts]
    stats, seen = None, 0
    for part_stats, part_seen in run_in_order(engine, _collect, jobs, "calibrating", progress):
        stats = part_stats if stats is None else merge_all([stats, part_stats])
        seen += part_seen
    warn_nonfinite(stats)
    return stats, seen


def merge_all(parts: list[dict[str, TensorStats]]) -> dict[str, TensorStats]:
    merged = parts[0]
    for part in parts[1:]:
        merged = {name: merged[name].merge(part[name]) for name in merged}
    return merged


def save_stats(path: str | Path, stats: dict[str, TensorStats], meta: dict) -> None:
    arrays = {"header": np.frombuffer(json.dumps({"format": FORMAT, "version": VERSION, **meta,
                                                  "tensors": list(stats)}).encode(), dtype=np.uint8)}
    for i, s in enumerate(stats.values()):
        s.flush()
        arrays[f"f{i}"] = np.array([s.min, s.max, s.batch_min_sum, s.batch_max_sum], dtype=np.float64)
        arrays[f"i{i}"] = np.array([s.count, s.nonfinite, s.batches, s.sample_limit], dtype=np.int64)
        hist = s.hist
        if hist is not None:
            arrays[f"h{i}"] = hist
        if s.channel_sums is not None:
            arrays[f"c{i}"] = s.channel_sums
            arrays[f"n{i}"] = np.array([s.channel_samples, *s.spatial_sums], dtype=np.int64)
    buffer = io.BytesIO()
    np.savez_compressed(buffer, **arrays)
    atomic.write_bytes(path, buffer.getvalue())


def load_stats(path: str | Path) -> tuple[dict, dict[str, TensorStats]]:
    path = Path(path)
    try:
        with np.load(path, allow_pickle=False) as npz:
            header = json.loads(bytes(npz["header"]).decode())
            if header.get("format") != FORMAT or header.get("version") != VERSION:
                raise QtoolError(f"not a qtool statistics file (version {VERSION})", path)
            stats = {}
            for i, name in enumerate(header["tensors"]):
                lo, hi, bmin, bmax = (float(v) for v in npz[f"f{i}"])
                count, nonfinite, batches, limit = (int(v) for v in npz[f"i{i}"])
                fields = dict(min=lo, max=hi, count=count, nonfinite=nonfinite, batches=batches,
                              batch_min_sum=bmin, batch_max_sum=bmax, sample_limit=limit)
                if f"c{i}" in npz.files:
                    counts = npz[f"n{i}"].astype(np.int64)
                    fields.update(channel_sums=npz[f"c{i}"].astype(np.int64), channel_samples=int(counts[0]),
                                  spatial_sums=counts[1:])
                stats[name] = (TensorStats.with_histogram(npz[f"h{i}"], **fields) if f"h{i}" in npz.files
                               else TensorStats(**fields))
            return header, stats
    except QtoolError:
        raise
    except (OSError, ValueError, KeyError, EOFError, zipfile.BadZipFile, json.JSONDecodeError) as exc:
        raise QtoolError(f"not a readable qtool statistics file ({type(exc).__name__}: {exc})", path) from None


def merge_files(paths: list[Path], model_sha256: str) -> tuple[dict[str, TensorStats], int]:
    headers, parts = zip(*(load_stats(p) for p in paths))
    for path, header in zip(paths, headers):
        if header.get("model_sha256") != model_sha256:
            raise QtoolError("statistics were collected on a different model (sha256 differs)", path)
        if header["tensors"] != headers[0]["tensors"]:
            raise QtoolError("statistics cover different tensors than the first file "
                             "(different quantization options?)", path)
    shards = sorted(tuple(h.get("shard", (0, 1))) for h in headers)
    if len(set(shards)) != len(shards):
        raise QtoolError(f"the same shard is given twice: {shards}")
    return merge_all(list(parts)), sum(int(h["num_samples"]) for h in headers)

