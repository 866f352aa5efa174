"""Latency: the models timed in one process, taking turns run by run."""

from __future__ import annotations

from qtool.config import EvaluateConfig
from qtool.data.dataset import Batch
from qtool.evaluation.metrics import percentile_ms
from qtool.graph.runtime import time_models


def measure_latency(fp32_path: str, int8_path: str, batch: Batch, cfg: EvaluateConfig) -> dict:
    """Median and p90 milliseconds per batch of each model, and the speedup of the medians."""
    times = time_models({"fp32": fp32_path, "int8": int8_path}, batch.feeds, cfg.threads, cfg.warmup, cfg.runs)
    result = {"batch_size": len(batch), "threads": cfg.threads, "runs": cfg.runs}
    for name, values in times.items():
        result[f"{name}_ms"] = {"median": percentile_ms(values, 50), "p90": percentile_ms(values, 90)}
    result["speedup"] = result["fp32_ms"]["median"] / result["int8_ms"]["median"]
    return result
