"""Latency: the models timed in one process, taking turns run by run."""

from __future__ import annotations

import time

import numpy as np

from qtool.config import EvaluateConfig
from qtool.data.dataset import Batch
from qtool.evaluation.metrics import percentile_ms
from qtool.graph.runtime import create_session


def time_models(paths: dict[str, str], feeds: dict[str, np.ndarray], threads: int, warmup: int,
                runs: int) -> dict[str, list[float]]:
    """Seconds per run of each model: warm-up, then the models take turns run by run, so a
    slowdown from a noisy neighbour hits all of them alike. Same session options for all."""
    sessions = {name: create_session(path, threads, path) for name, path in paths.items()}
    times: dict[str, list[float]] = {name: [] for name in sessions}
    for _ in range(warmup):
        for session in sessions.values():
            session.run(None, feeds)
    for _ in range(runs):
        for name, session in sessions.items():
            start = time.perf_counter()
            session.run(None, feeds)
            times[name].append(time.perf_counter() - start)
    return times


def measure_latency(fp32_path: str, int8_path: str, batch: Batch, cfg: EvaluateConfig) -> dict:
    """Median and p90 milliseconds per batch of each model, and the speedup of the medians."""
    times = time_models({"fp32": fp32_path, "int8": int8_path}, batch.feeds, cfg.threads, cfg.warmup, cfg.runs)
    result = {"batch_size": len(batch), "threads": cfg.threads, "runs": cfg.runs}
    for name, values in times.items():
        result[f"{name}_ms"] = {"median": percentile_ms(values, 50), "p90": percentile_ms(values, 90)}
    result["speedup"] = result["fp32_ms"]["median"] / result["int8_ms"]["median"]
    return result
