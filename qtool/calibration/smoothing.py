"""SmoothQuant's measurement: per-channel maxima of |X| of every tensor qtool.plan.smooth_quant can
smooth, in one onnxruntime pass over the calibration data, turned into the scales that
prepared_model folds (and the table keeps, for quantization)."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import numpy as np
import onnx

from qtool.config import CalibrationConfig, PreprocessConfig, QuantizeConfig
from qtool.data.dataset import DataLike, batches, open_data
from qtool.graph.edit import with_outputs
from qtool.graph.index import GraphIndex
from qtool.graph.modelio import input_specs
from qtool.graph.runtime import create_session
from qtool.plan.planner import QuantPlan
from qtool.plan.smooth_quant import find_sites, smoothing_alpha, smoothing_scales, weight_maxima


# A tensor read through an inserted Mul is smoothed only when its largest channel maximum is at
# least this many times the median one (a per-tensor range then leaves the typical channel three
# bits fewer). Measured on MiniLM (ratios 2-17; the romanizer decoder's inputs 1-2): at 8, 10
# inputs smoothed, embedding cosine 0.9973, 3.07x fp32 speed; at 4, 17 inputs, 0.9983, 2.74x
# (the Muls on the 4-6x LayerNorm outputs cost more than they gain); none, 0.9917, 3.15x.
OUTLIER_RATIO = 8.0


def outlier_ratio(maxima: np.ndarray) -> float:
    """The largest per-channel maximum of |X| over the median one (1 for an empty tensor)."""
    median = float(np.median(maxima)) if maxima.size else 0.0
    return float(maxima.max()) / median if median > 0 else 1.0


def measured_smoothing(model_path: str | Path, model: onnx.ModelProto, plan: QuantPlan, data: DataLike,
                       preprocess: PreprocessConfig, calib: CalibrationConfig,
                       options: QuantizeConfig) -> QuantizeConfig:
    """`options` with smooth_scales measured on `data` (the calibration samples) when SmoothQuant is
    on: asked for (smooth_quant), or by default for dynamic int8 MatMuls (smooth_dynamic); measured
    on `model` and `plan`, the prepared graph before smoothing; `options` itself when nothing is
    smoothed."""
    if options.smooth_scales or (options.smooth_quant is None and options.smooth_dynamic is None):
        return options
    alpha = smoothing_alpha(options, bool(plan.dynamic_matmuls))
    sites = find_sites(model, insert=bool(plan.dynamic_matmuls)) if alpha is not None else []
    if not sites:
        return options
    names = [site.tensor for site in sites]
    session = create_session(with_outputs(model, names), label=str(model_path))
    source = open_data(data, input_specs(model), preprocess)
    maxima = {site.tensor: np.zeros(site.channels) for site in sites}
    for batch in batches(source, calib.batch_size, calib.num_samples):
        for site, value in zip(sites, session.run(names, batch.feeds)):
            if value.size:
                np.maximum(maxima[site.tensor], np.abs(value.reshape(-1, site.channels)).max(axis=0),
                           out=maxima[site.tensor])
    # an inserted Mul costs a pass over the tensor: only where outlier channels stretch its range
    sites = [site for site in sites if not site.readers or outlier_ratio(maxima[site.tensor]) >= OUTLIER_RATIO]
    inits = GraphIndex(model).initializers
    scales = tuple((site.tensor, tuple(float(s) for s in smoothing_scales(
        maxima[site.tensor], weight_maxima(inits, site), alpha))) for site in sites)
    if not scales:
        return options
    return replace(options, smooth_scales=scales)
