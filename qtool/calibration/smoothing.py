"""SmoothQuant's measurement: per-channel maxima of |X| of every tensor qtool.plan.smooth_quant can
smooth, in one onnxruntime pass over the calibration data, turned into the scales that
prepared_model folds (and the table keeps, for quantization)."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import numpy as np

from qtool.config import CalibrationConfig, PreprocessConfig, QuantizeConfig
from qtool.data.dataset import DataLike, batches, open_data
from qtool.graph.edit import with_outputs
from qtool.graph.modelio import input_specs
from qtool.graph.runtime import create_session
from qtool.plan.planner import prepared_model
from qtool.plan.smooth_quant import find_sites, smoothing_scales, weight_maxima


def with_smoothing(model_path: str | Path, data: DataLike, preprocess: PreprocessConfig, calib: CalibrationConfig,
                   options: QuantizeConfig) -> QuantizeConfig:
    """`options` with smooth_scales measured on `data` (the calibration samples) when SmoothQuant is on."""
    if options.smooth_quant is None or options.smooth_scales:
        return options
    model, _ = prepared_model(model_path, options)  # the graph before smoothing
    sites = find_sites(model)
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
    scales = tuple((site.tensor, tuple(float(s) for s in smoothing_scales(
        maxima[site.tensor], weight_maxima(model, site), options.smooth_quant))) for site in sites)
    return replace(options, smooth_scales=scales)
