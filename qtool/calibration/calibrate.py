"""Calibration: model + data -> statistics -> calibration table."""

from __future__ import annotations

import warnings
from dataclasses import asdict
from pathlib import Path

import onnx
from tqdm import tqdm

from qtool.config import CalibrationConfig, PreprocessConfig, QuantizeConfig
from qtool.data.dataset import DataLike, batches, count_samples, folder_only, open_data
from qtool.prepare.equalize import equalize
from qtool.prepare.graph_prep import prepare
from qtool.graph.modelio import input_specs, load_model, sha256_file
from qtool.calibration.method_rules import methods_for, needs_histogram
from qtool.calibration.observer import observe
from qtool.plan.planner import QuantPlan, build_plan
from qtool.table.qparams import QParams, activation_qparams, include_zero
from qtool.calibration.ranges import choose_range
from qtool.calibration.saturation import saturable
from qtool.calibration.statistics import TensorStats
from qtool.table.table import CalibrationTable, TableEntry


def collect_statistics(model: onnx.ModelProto, plan: QuantPlan, data: DataLike, preprocess: PreprocessConfig,
                       calib: CalibrationConfig, progress: bool = True, shard: tuple[int, int] = (0, 1),
                       threads: int = 0, sub: tuple[int, int] = (0, 1), warn: bool = True,
                       all_histograms: bool = False) -> tuple[dict[str, TensorStats], int]:
    """One streaming pass over shard `shard` = (k, n) of the data (the whole data for (0, 1)),
    sub-shard `sub` of it; histograms for the tensors whose method needs one (all_histograms: every tensor)."""
    from qtool.calibration.shards import select_shard

    source = open_data(data, input_specs(model), preprocess)
    if (shard, sub) != ((0, 1), (0, 1)):
        folder_only(data, "sharding")
    limit = select_shard(source, calib, *shard, sub=sub)
    total = count_samples(source, limit)
    methods = methods_for(model, plan.activations, calib)
    histogram_for = set(plan.activations) if all_histograms else needs_histogram(methods)
    # may stop being observed once saturated; shard files keep every statistic (a merge may average them)
    saturate = set() if all_histograms else saturable(methods, calib)
    seen = 0
    with tqdm(total=total, desc="calibrating", unit="sample", disable=None if progress else True, leave=False) as bar:
        def advance(batch):
            nonlocal seen
            seen += len(batch)
            bar.update(len(batch))

        stats = observe(model, plan.activations, batches(source, calib.batch_size, limit),
                        histogram_for=histogram_for, threads=threads, on_batch=advance,
                        sample_limit=calib.histogram_sample, saturate=saturate)
    if warn:
        warn_nonfinite(stats)
    return stats, seen


def warn_nonfinite(stats: dict[str, TensorStats]) -> None:
    for name, s in stats.items():
        if s.nonfinite:
            warnings.warn(f"tensor '{name}': {s.nonfinite} NaN/Inf values excluded from its statistics",
                          stacklevel=3)


def resolve_qparams(plan: QuantPlan, ranges: dict[str, tuple[float, float]],
                    options: QuantizeConfig) -> tuple[dict[str, tuple[float, float]], dict[str, QParams]]:
    """Ranges -> (final ranges, scale/zero point), honouring fixed outputs and shared parameters.

    Tensors tied together (a MaxPool's input and output, a Concat's inputs and output)
    get the union of their ranges; a fixed-range output (Softmax) imposes its range on
    its whole group, unless a member's range does not fit in it (a Concat of x*sigmoid(x)
    and sigmoid(x)): then that member would be clipped, so the fixed tensors keep their
    parameters and the others share the union of their own ranges.
    """
    dtype = options.activation_dtype
    final = {name: include_zero(*ranges[name]) for name in plan.activations if name in ranges}
    for name, value in plan.include_values.items():  # a Pad's constant border must not be clipped
        if name in final:
            final[name] = (min(final[name][0], value), max(final[name][1], value))
    imposed = {name: _fixed_params(plan, name, dtype, options.symmetric_activations)
               for name in plan.fixed if name in final}
    for group in plan.tie_groups:
        members = [n for n in group if n in final]
        free = [n for n in members if n not in plan.fixed]
        fixed = [n for n in members if n in plan.fixed]
        if fixed:
            lo, hi = imposed[fixed[0]].range
            if all(lo <= final[n][0] and final[n][1] <= hi for n in free):
                imposed.update({n: imposed[fixed[0]] for n in free})
                continue
        if free:
            shared = (min(final[n][0] for n in free), max(final[n][1] for n in free))
            final.update({n: shared for n in free})
    params = {name: activation_qparams(*final[name], dtype, options.symmetric_activations) for name in final}
    for name, fixed_params in imposed.items():
        params[name] = fixed_params
        final[name] = fixed_params.range
    return final, params


def _fixed_params(plan: QuantPlan, name: str, dtype: str, symmetric: bool = False) -> QParams:
    scale, zero_point = plan.fixed[name].fixed(dtype)
    fixed = QParams(scale, zero_point, dtype)
    if symmetric and zero_point != (0 if dtype == "int8" else 128):
        # a symmetric target (TensorRT: zero point 0 only) gets the symmetric grid over the fixed range
        return activation_qparams(*fixed.range, dtype, symmetric=True)
    return fixed


def build_table(plan: QuantPlan, stats: dict[str, TensorStats], calib: CalibrationConfig, options: QuantizeConfig,
                model_path: str | Path, num_samples: int, model: onnx.ModelProto | None = None) -> CalibrationTable:
    methods = methods_for(model, plan.activations, calib) if model is not None else {}
    ranges = {name: choose_range(stats[name], methods.get(name, calib.method), calib) for name in plan.activations}
    final, params = resolve_qparams(plan, ranges, options)
    settings = {"batch_size": calib.batch_size, **_range_settings(calib), **asdict(options)}
    settings = {k: list(v) if isinstance(v, tuple) else v for k, v in settings.items()}
    table = CalibrationTable(Path(model_path).name, sha256_file(model_path), calib.method, settings, num_samples)
    for name in plan.activations:
        s = stats[name]
        qp = params[name]
        table.tensors[name] = TableEntry(s.min if s.seen else None, s.max if s.seen else None, final[name], qp)
    return table


def _range_settings(calib: CalibrationConfig) -> dict:
    """The calibration options that shape ranges, where they differ from the defaults
    (so tables of default settings keep their bytes)."""
    defaults = CalibrationConfig()
    keys = ("percentile", "symmetric", "moving_average", "aciq_distribution", "method_by_op_type",
            "method_by_tensor", "histogram_sample")
    return {k: [list(p) for p in v] if isinstance(v, tuple) else v
            for k in keys if (v := getattr(calib, k)) != getattr(defaults, k)}


def prepared_model(model_path: str | Path, options: QuantizeConfig) -> tuple[onnx.ModelProto, QuantPlan]:
    model = prepare(load_model(model_path), options.upgrade_opset, model_path, options.per_channel)
    if options.equalize:  # before calibration, so the table matches the equalized graph
        equalize(model)
    return model, build_plan(model, options)


def calibrate(model_path: str | Path, data: DataLike, preprocess: PreprocessConfig, calib: CalibrationConfig,
              options: QuantizeConfig, progress: bool = True) -> CalibrationTable:
    from qtool.calibration.shards import collect_parallel

    model, plan = prepared_model(model_path, options)
    if calib.workers > 1:
        folder_only(data, "calibration.workers (--workers)")
        stats, seen = collect_parallel(model_path, data, preprocess, calib, options)
    else:
        stats, seen = collect_statistics(model, plan, data, preprocess, calib, progress)
    return build_table(plan, stats, calib, options, model_path, seen, model)
