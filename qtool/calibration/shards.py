"""Statistics files and the local worker pool: shards of calibration data collected apart, merged by addition.

A shard K/N is a contiguous run of whole batches (shard boundaries fall on multiples
of the batch size), so the batches of all shards are exactly the batches of a single
run. Min/max merge exactly; histograms are sums of per-batch counts of the same
per-batch samples, so they merge exactly too and the merged table equals a
single-process run (for models whose batches do not change shape mid-shard).

Statistics file (.npz, written atomically): a JSON header (model sha256, tensors in
plan order, samples, shard) and per tensor its extremes, counts and histogram. Shard
files always carry histograms, so the range method can still be chosen at merge time.
"""

from __future__ import annotations

import concurrent.futures
import io
import json
import multiprocessing
import os
import zipfile
from pathlib import Path
import numpy as np

from qtool import atomic
from qtool.calibration.collect import collect_statistics, warn_nonfinite
from qtool.calibration.statistics import TensorStats
from qtool.config import CalibrationConfig, PreprocessConfig, QuantizeConfig
from qtool.errors import QtoolError
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


def _collect(args) -> tuple[dict[str, TensorStats], int]:
    """Worker process: one session over one (sub-)shard."""
    model_path, data, preprocess, calib, options, shard, sub, threads, all_histograms = args
    try:
        model, plan = prepared_model(model_path, options)
        return collect_statistics(model, plan, data, preprocess, calib, progress=False, shard=shard,
                                  threads=threads, sub=sub, warn=False, all_histograms=all_histograms)
    except QtoolError as exc:  # sent back as text: exceptions with extra arguments do not unpickle
        raise RuntimeError(f"qtool-error:{exc}") from None


def collect_parallel(model_path, data, preprocess: PreprocessConfig, calib: CalibrationConfig,
                     options: QuantizeConfig, shard: tuple[int, int] = (0, 1),
                     force_histograms: bool = False) -> tuple[dict[str, TensorStats], int]:
    """calib.workers processes, each with its own onnxruntime session over a sub-shard; merged in memory."""
    workers = calib.workers
    threads = max(1, (os.cpu_count() or 1) // workers)
    jobs = [(str(model_path), str(data), preprocess, calib, options, shard, (j, workers), threads, force_histograms)
            for j in range(workers)]
    context = multiprocessing.get_context("spawn")  # no fork of a process that may hold onnxruntime threads
    try:
        with concurrent.futures.ProcessPoolExecutor(workers, mp_context=context) as pool:
            results = list(pool.map(_collect, jobs))
    except RuntimeError as exc:
        if str(exc).startswith("qtool-error:"):
            raise QtoolError(str(exc)[len("qtool-error:"):]) from None
        raise
    stats, seen = merge_all([r[0] for r in results]), sum(r[1] for r in results)
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
        if s.hist is not None:
            arrays[f"h{i}"] = s.hist
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
                hist = npz[f"h{i}"].astype(np.int64) if f"h{i}" in npz.files else None
                stats[name] = TensorStats(lo, hi, count, nonfinite, batches, bmin, bmax, hist, limit)
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

