"""Calibration: model + data -> statistics -> calibration table."""

from __future__ import annotations

import warnings
from dataclasses import asdict, replace
from pathlib import Path
from typing import Optional

import onnx

from qtool.calibration.collect import collect_statistics, keeps_channel_means, refuse_nonfinite, warn_nonfinite
from qtool.calibration.grid import away_from_zero, outward
from qtool.calibration.method_rules import methods_for
from qtool.calibration.ranges import check_method, choose_range, resolve_method
from qtool.calibration.smoothing import measured_smoothing
from qtool.calibration.shards import collect_parallel, merge_files, save_stats
from qtool.calibration.statistics import TensorStats
from qtool.config import AdvancedConfig, CalibrationConfig, PreprocessConfig, QuantizeConfig, with_options
from qtool.data.batching import batch_refusal
from qtool.data.dataset import DataLike, open_data
from qtool.errors import QtoolError
from qtool.graph.executor import Engine
from qtool.graph.modelio import input_specs, load_model, sha256_file
from qtool.plan.planner import QuantPlan, prepared_model, unreached_bodies
from qtool.table.resolve import resolve_qparams
from qtool.table.table import CalibrationTable, TableEntry


def build_table(plan: QuantPlan, stats: dict[str, TensorStats], calib: CalibrationConfig, options: QuantizeConfig,
                model_path: str | Path, num_samples: int, model: onnx.ModelProto,
                model_sha256: Optional[str] = None) -> CalibrationTable:
    """The table of `stats`; `model_sha256`: the model file's, when the caller has it already."""
    methods = methods_for(model, plan.activations, calib)
    method = resolve_method(calib.method)
    # widened onto a coarse grid (qtool.calibration.grid): another CPU's last bits stay out of the bytes
    ranges = {name: outward(*choose_range(stats[name], methods.get(name, method), calib)) for name in plan.activations}
    final, params = resolve_qparams(plan, ranges, options)
    settings = {"batch_size": calib.batch_size, **_range_settings(calib), **_quantize_settings(options)}
    settings = {k: list(v) if isinstance(v, tuple) else v for k, v in settings.items()}
    unreached = unreached_bodies(model.graph, plan.activations, lambda t: stats[t].seen)[1]
    table = CalibrationTable(Path(model_path).name, model_sha256 or sha256_file(model_path), method, settings,
                             num_samples, notes=tuple(plan.notes + unreached), smoothing=dict(options.smooth_scales))
    if keeps_channel_means(options):
        table.channel_means, table.spatial_sizes = {}, {}  # kept: none where no layer has a bias
    for name in plan.activations:
        s = stats[name]
        qp = params[name]
        table.tensors[name] = TableEntry(s.min if s.seen else None, s.max if s.seen else None, final[name], qp)
        means = s.channel_mean
        if means is not None and table.channel_means is not None:
            # on the grid of the ranges (qtool.calibration.grid): another CPU pools them in another order
            table.channel_means[name] = tuple(float(m) for m in away_from_zero(means))
            table.spatial_sizes[name] = tuple(float(f"{m:.7g}") for m in s.spatial_mean)
    return table


def _quantize_settings(options: QuantizeConfig) -> dict:
    """The quantization options, those of `advanced` among them (one flat mapping); keep_opset,
    `embeddings` (it never changes the table: embedding tables are weights) and `matmul` only where
    they differ from the default, so tables of default settings keep their bytes; `smooth_quant` where
    on. `latency_aware`, `speed_rule`, `embedding_tables` and `float_nodes` never: they are settled when
    quantizing, from the table's ranges and the graph; nor `int16_activations`: 16-bit activations take
    the table's ranges as they are."""
    settings = asdict(replace(options, smooth_scales=()))  # not deep-copied only to be dropped
    settings.update(settings.pop("advanced"))
    defaults = AdvancedConfig()
    del settings["latency_aware"]
    del settings["speed_rule"]
    del settings["embedding_tables"]
    del settings["float_nodes"]
    del settings["int16_activations"]
    del settings["smooth_scales"]  # the table's "smoothing"
    if options.smooth_quant is None:
        del settings["smooth_quant"]
    if options.advanced.smooth_dynamic == defaults.smooth_dynamic:
        del settings["smooth_dynamic"]
    if options.advanced.equalize_activations == defaults.equalize_activations:
        del settings["equalize_activations"]
    if not options.keep_opset:
        del settings["keep_opset"]
    if options.advanced.embeddings == defaults.embeddings:
        del settings["embeddings"]
    if options.matmul == QuantizeConfig.matmul:
        del settings["matmul"]
    return settings


def _range_settings(calib: CalibrationConfig) -> dict:
    """The calibration options that shape ranges, where they differ from the defaults
    (so tables of default settings keep their bytes)."""
    defaults = CalibrationConfig()
    keys = ("percentile", "symmetric", "moving_average", "aciq_distribution", "method_by_op_type",
            "method_by_tensor", "histogram_sample")
    return {k: [list(p) for p in v] if isinstance(v, tuple) else v
            for k in keys if (v := getattr(calib, k)) != getattr(defaults, k)}


def calibrate(model_path: str | Path, data: DataLike, preprocess: PreprocessConfig, calib: CalibrationConfig,
              options: QuantizeConfig, progress: bool = True, engine: Optional[Engine] = None) -> CalibrationTable:
    """The table of `data`; with an engine, its shards are collected on the engine's workers."""
    model, plan, options, stats, seen = _statistics(model_path, data, preprocess, calib, options, progress, engine,
                                                    all_histograms=False)
    return build_table(plan, stats, calib, options, model_path, seen, model)


def calibrate_methods(model_path: str | Path, data: DataLike, preprocess: PreprocessConfig, calib: CalibrationConfig,
                      options: QuantizeConfig, methods: list[str], progress: bool = True,
                      engine: Optional[Engine] = None) -> list[CalibrationTable]:
    """One table per range method in `methods`, from one pass over `data` that keeps a histogram
    of every tensor (each table is byte-identical to `calibrate` with that method)."""
    for method in methods:
        check_method(method)
    model, plan, options, stats, seen = _statistics(model_path, data, preprocess, calib, options, progress, engine,
                                                    all_histograms=True)
    sha = sha256_file(model_path)
    return [build_table(plan, stats, replace(calib, method=method), options, model_path, seen, model, sha)
            for method in methods]


def _statistics(model_path, data: DataLike, preprocess: PreprocessConfig, calib: CalibrationConfig,
                options: QuantizeConfig, progress: bool, engine: Optional[Engine], all_histograms: bool):
    """(prepared model, plan, options with their smoothing scales, statistics, samples seen) of one
    pass over `data`, here or on the engine's workers."""
    options = with_options(options, float_nodes=())  # settled from the table's ranges: the table has them all
    model, plan = prepared_model(model_path, options)  # before smoothing: what smoothing measures on
    smoothed = measured_smoothing(model_path, model, plan, data, preprocess, calib, options)
    if smoothed is not options:
        options = smoothed
        model, plan = prepared_model(model_path, options)
    if engine is not None:
        stats, seen = collect_parallel(engine, model_path, model, data, preprocess, calib, options,
                                       force_histograms=all_histograms, progress=progress)
    else:
        stats, seen = collect_statistics(model, plan, data, preprocess, calib, progress, all_histograms=all_histograms,
                                         channel_means=keeps_channel_means(options))
    refuse_nonfinite(stats, data)
    return model, plan, options, stats, seen


def calibrate_shard(model_path, data, preprocess: PreprocessConfig, calib: CalibrationConfig,
                    options: QuantizeConfig, shard: tuple[int, int], output: Path,
                    engine: Optional[Engine] = None) -> tuple[int, int]:
    """Collect one shard's statistics (with histograms for every tensor) and write them to `output`."""
    resolve_method(calib.method)  # the shard file serves any method, but a typo should fail now
    _no_smoothing(options, "--shard")
    # every shard probes the same first batch, so all of them settle the same batch size
    reason = batch_refusal(str(model_path), open_data(data, input_specs(load_model(model_path)), preprocess),
                           calib.batch_size) if calib.batch_size > 1 else None
    if reason is not None:
        warnings.warn(f"calibrating one sample at a time: the model does not take the batches its "
                      f"dynamic first axis declares: {reason}", stacklevel=2)
        calib = replace(calib, batch_size=1)
    if engine is not None:
        stats, seen = collect_parallel(engine, model_path, load_model(model_path), data, preprocess, calib, options,
                                       shard, force_histograms=True)
    else:
        model, plan = prepared_model(model_path, options)
        stats, seen = collect_statistics(model, plan, data, preprocess, calib, shard=shard, all_histograms=True,
                                         channel_means=keeps_channel_means(options))
    save_stats(output, stats, {"model_file": Path(model_path).name, "model_sha256": sha256_file(model_path),
                               "num_samples": seen, "shard": list(shard), "batch_size": calib.batch_size,
                               "histogram_sample": calib.histogram_sample})
    return len(stats), seen


def _no_smoothing(options: QuantizeConfig, what: str) -> None:
    """Shards would each measure their own SmoothQuant scales: the union of their ranges would fit none."""
    if options.smooth_quant is not None:
        raise QtoolError(f"SmoothQuant (smooth_quant) is not supported with {what}: calibrate in one run "
                         "(--workers and --dask still share the work)")


def merge_tables(model_path, paths: list[Path], calib: CalibrationConfig, options: QuantizeConfig):
    """The calibration table of the union of the shards' data."""
    _no_smoothing(options, "--merge")
    model, plan = prepared_model(model_path, options)
    stats, seen = merge_files(paths, sha256_file(model_path))
    missing = [t for t in plan.activations if t not in stats]
    if missing:
        raise QtoolError(f"the statistics lack tensor '{missing[0]}' that this quantization needs "
                         "(collected with other quantization options?)", paths[0])
    warn_nonfinite(stats)
    refuse_nonfinite(stats, ", ".join(map(str, paths)))
    return build_table(plan, stats, calib, options, model_path, seen, model)
