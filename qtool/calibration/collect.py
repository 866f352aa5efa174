"""One streaming pass of calibration data through the observing model: statistics per planned tensor."""

from __future__ import annotations

import os
import warnings
from typing import Optional

import onnx

from qtool.calibration.method_rules import methods_for, needs_histogram
from qtool.calibration.observer import Observer
from qtool.calibration.saturation import saturable
from qtool.calibration.statistics import TensorStats
from qtool.config import CalibrationConfig, PreprocessConfig, QuantizeConfig
from qtool.data.dataset import DataLike, batches, count_samples, folder_only, open_data, select_shard
from qtool.errors import QtoolError
from qtool.graph.modelio import input_specs
from qtool.plan.planner import QuantPlan
from qtool.progress import bar as progress_bar
from qtool.targets import measures_bias_correction


def collect_statistics(model: onnx.ModelProto, plan: QuantPlan, data: DataLike, preprocess: PreprocessConfig,
                       calib: CalibrationConfig, progress: bool = True, shard: tuple[int, int] = (0, 1),
                       warn: bool = True,
                       all_histograms: bool = False,
                       observer: Optional[Observer] = None,
                       channel_means: bool = False) -> tuple[dict[str, TensorStats], int]:
    """One streaming pass over shard `shard` = (k, n) of the data (the whole data for (0, 1));
    histograms for the tensors whose method needs one (all_histograms: every tensor), channel
    means where asked (keeps_channel_means). `observer`: one make_observer built of the same
    arguments, kept for several passes."""
    source = open_data(data, input_specs(model), preprocess)
    if shard != (0, 1):
        folder_only(data, "sharding")
    limit = select_shard(source, calib, *shard)
    total = count_samples(source, limit)
    observer = observer or make_observer(model, plan, calib, all_histograms=all_histograms,
                                         channel_means=channel_means)
    seen = 0
    with progress_bar("calibrating", "sample", total, progress) as bar:
        def advance(batch):
            nonlocal seen
            seen += len(batch)
            bar.update(len(batch))

        stats = observer.run(batches(source, observer.batch_size(calib.batch_size), limit), on_batch=advance)
    if warn:
        warn_nonfinite(stats)
    return stats, seen


def make_observer(model: onnx.ModelProto, plan: QuantPlan, calib: CalibrationConfig, threads: int = 0,
                  all_histograms: bool = False, channel_means: bool = False) -> Observer:
    """The observer of the plan's activations: histograms for the tensors whose method needs one
    (all_histograms: every tensor); with `channel_means`, the channel means of the inputs of
    layers with a bias (bias_inputs)."""
    methods = methods_for(model, plan.activations, calib)
    histogram_for = set(plan.activations) if all_histograms else needs_histogram(methods)
    # may stop being observed once saturated; shard files keep every statistic (a merge may average them)
    saturate = set() if all_histograms else saturable(methods, calib)
    return Observer(model, plan.activations, histogram_for=histogram_for, threads=threads,
                    sample_limit=calib.histogram_sample, saturate=saturate,
                    means_for=bias_inputs(model, plan) if channel_means else None)


def keeps_channel_means(options: QuantizeConfig) -> bool:
    """Whether calibration keeps the channel means: only for the bias correction that reads them
    (its weights form, asked for or measured by `auto` on the target), since their reductions cost
    every other job time."""
    return options.bias_correction == "weights" or measures_bias_correction(options)


def bias_inputs(model: onnx.ModelProto, plan: QuantPlan) -> dict[str, int]:
    """The activations whose channel means bias correction reads, the inputs of the layers with a
    bias whose weight is a main-graph initializer, with their rank (a Conv's input's is its
    weight's, a Gemm's 2, whatever shape inference finds)."""
    ranks = {t.name: len(t.dims) for t in model.graph.initializer}
    return {b.activation: ranks[b.weight] for b in plan.biases.values() if b.weight in ranks}


def warn_nonfinite(stats: dict[str, TensorStats]) -> None:
    for name, s in stats.items():
        if s.nonfinite:
            warnings.warn(f"tensor '{name}': {s.nonfinite} NaN/Inf values excluded from its statistics",
                          stacklevel=3)


def refuse_nonfinite(stats: dict[str, TensorStats], data: object) -> None:
    """A planned tensor whose every calibration value was NaN/Inf has no range (it would be [0, 0]
    and quantize to zeros): an error naming the data and the tensors."""
    dead = [name for name, s in stats.items() if not s.seen and s.nonfinite]
    if dead:
        names = ", ".join(f"'{name}'" for name in dead[:5]) + (f" and {len(dead) - 5} more" if len(dead) > 5 else "")
        where = data if isinstance(data, (str, os.PathLike)) else None
        raise QtoolError(f"no finite value of tensor{'s' if len(dead) > 1 else ''} {names} in the calibration data "
                         "(every value NaN/Inf): check the data and its preprocessing", where)
