"""SmoothQuant's measurement: per-channel maxima of |X| of every tensor qtool.plan.smooth_quant can
smooth (and of every Conv output qtool.prepare.equalize can equalize), in one onnxruntime pass over
the calibration data, turned into the scales that prepared_model folds (and the table keeps, for
quantization)."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import numpy as np
import onnx

from qtool.calibration.grid import CHANNEL_BITS, away_from_zero
from qtool.calibration.observer import run_batch
from qtool.config import CalibrationConfig, PreprocessConfig, QuantizeConfig
from qtool.data.dataset import DataLike, batches, open_data
from qtool.graph.edit import with_outputs
from qtool.graph.index import GraphIndex
from qtool.graph.modelio import input_specs
from qtool.graph.runtime import create_session
from qtool.plan.planner import QuantPlan
from qtool.plan.smooth_quant import find_sites, smooths_static, smoothing_alpha, smoothing_scales, weight_maxima
from qtool.prepare.equalize import activation_scales, activation_sites
from qtool.targets import target_of


# A tensor read through an inserted Mul is smoothed only when its largest channel maximum is at
# least this many times the median one (a per-tensor range then leaves the typical channel three
# bits fewer); below that the Mul costs more time than it gains (docs/accuracy.md, "SmoothQuant"),
# except on a runtime that folds the Mul into the quantizer after it (Target.smooth_inserts).
OUTLIER_RATIO = 8.0


def outlier_ratio(maxima: np.ndarray) -> float:
    """The largest per-channel maximum of |X| over the median one (1 for an empty tensor)."""
    median = float(np.median(maxima)) if maxima.size else 0.0
    return float(maxima.max()) / median if median > 0 else 1.0


def measured_smoothing(model_path: str | Path, model: onnx.ModelProto, plan: QuantPlan, data: DataLike,
                       preprocess: PreprocessConfig, calib: CalibrationConfig,
                       options: QuantizeConfig) -> QuantizeConfig:
    """`options` with smooth_scales measured on `data` (the calibration samples) when SmoothQuant is
    on: asked for (smooth_quant), or by default for dynamic int8 MatMuls (smooth_dynamic); and with
    the activation-equalization scales of Conv -> activation -> depthwise Conv chains
    (equalize_activations, qtool.prepare.equalize). Measured in one pass on `model` and `plan`, the
    prepared graph before smoothing; `options` itself when nothing is smoothed or equalized."""
    if options.smooth_scales:
        return options
    smoothing = options.smooth_quant is not None or options.advanced.smooth_dynamic is not None
    alpha = smoothing_alpha(options, bool(plan.dynamic_matmuls) or smooths_static(model, options)) \
        if smoothing else None
    insert = bool(plan.dynamic_matmuls) or target_of(options).smooth_inserts
    sites = find_sites(model, insert=insert) if alpha is not None else []
    equalized = activation_sites(model) if options.advanced.equalize_activations else []
    if not sites and not equalized:
        return options
    # (key, tensor measured): a hard-swish's input; a Relu's output (the int8 tensor, the fused
    # Conv's); and with an affine tail, the depthwise Conv's input for factors of its own
    measured = [(site.tensor, site.tensor if site.hard_swish else site.output) for site in equalized]
    measured += [(site.output, site.output) for site in equalized if site.tail]
    names = [site.tensor for site in sites] + [name for _, name in measured]
    axes = [-1] * len(sites) + [1] * len(measured)  # channels: last axis / NCHW's
    width = {site.tensor: site.channels for site in equalized} | {site.output: site.channels for site in equalized}
    channels = [site.channels for site in sites] + [width[name] for _, name in measured]
    session = create_session(with_outputs(model, names), label=str(model_path), batch_pass=True)
    source = open_data(data, input_specs(model), preprocess)
    maxima = {name: np.zeros(count) for name, count in zip(names, channels)}
    for batch in batches(source, run_batch(model, calib.batch_size), calib.num_samples):
        for name, axis, count, value in zip(names, axes, channels, session.run(names, batch.feeds)):
            if value.size:  # max |x| per channel as max(max, -min): no copy of the tensor
                others = tuple(a for a in range(value.ndim) if a != axis % value.ndim)
                np.maximum(maxima[name], np.maximum(value.max(axis=others), -value.min(axis=others)),
                           out=maxima[name])
    maxima = {name: away_from_zero(value, CHANNEL_BITS) for name, value in maxima.items()}  # calibration.grid
    equal = tuple((key, activation_scales(maxima[name])) for key, name in measured)
    # an inserted Mul costs a pass over the tensor: only where outlier channels stretch its range,
    # unless the runtime folds it into the quantizer after it (Target.smooth_inserts)
    folds = target_of(options).smooth_inserts
    sites = [site for site in sites
             if not site.readers or folds or outlier_ratio(maxima[site.tensor]) >= OUTLIER_RATIO]
    inits = GraphIndex(model).initializers
    scales = tuple((site.tensor, tuple(float(s) for s in smoothing_scales(
        maxima[site.tensor], weight_maxima(inits, site), alpha))) for site in sites) + equal
    if not scales:
        return options
    return replace(options, smooth_scales=scales)
