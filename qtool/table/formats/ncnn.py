"""ncnn's int8 calibration table (ncnn2table), keyed by layer.

    conv1_param_0 156.639840 93.315132 ...
    conv1 47.340626

`<layer>_param_0` holds the weight's per-output-channel scale factors, `<layer>` the scale of the
layer's input blob, both 127/amax as ncnn multiplies by them. Only Convolution,
ConvolutionDepthWise and InnerProduct layers have entries; reading and writing say which tensors
have none. Layer names map to the ONNX node of the same name (or first output, onnx2ncnn's
fallback). qtool writes full precision (ncnn prints %f), so a scale survives the inversion; weight
lines are ignored on reading (qtool derives weight scales from the weights).
"""

from __future__ import annotations

import numpy as np

from qtool.errors import QtoolError
from qtool.table.formats.base import FormatContext, TableFormat
from qtool.table.formats.common import (decode_text, entry_from_symmetric, f64_text, is_integer, is_number, parse_float,
                                  symmetric_scale, text_rows, warn_widened)
from qtool.table.formats.model_view import LayerEntries, warn_uncovered
from qtool.table.table import CalibrationTable

WEIGHT_SUFFIX = "_param_0"


def _detect(data: bytes) -> bool:
    rows = text_rows(data)
    return bool(rows) and all(len(r) >= 2 and all(is_number(t) and not is_integer(t) for t in r[1:]) for r in rows)


def _read(data: bytes, ctx: FormatContext) -> CalibrationTable:
    view = ctx.require_model("ncnn")
    decode_text(data, ctx.path)
    entries = LayerEntries(view, "ncnn", ctx.path)
    for row in text_rows(data):
        name, values = row[0], [parse_float(t, ctx.path, " ".join(row)) for t in row[1:]]
        if "_param_" in name and view.layer(name) is None:
            continue  # weight scales: qtool quantizes weights from the weights themselves
        if values[0] <= 0:
            raise QtoolError(f"layer '{name}' has scale {values[0]}", ctx.path)
        entries.add(name, entry_from_symmetric(1.0 / values[0], ctx.options))
    return entries.table()


def _write(table: CalibrationTable, ctx: FormatContext) -> bytes:
    view = ctx.require_model("ncnn")
    weight_lines, blob_lines, widened = [], [], 0
    for layer in view.layers:
        entry = table.tensors.get(layer.input)
        if entry is None:
            continue
        inverse = 1.0 / view.weight_scales(layer).astype(np.float64)
        weight_lines.append(f"{layer.name}{WEIGHT_SUFFIX} " + " ".join(f64_text(v) for v in inverse))
        scale, exact = symmetric_scale(entry)
        widened += not exact
        blob_lines.append(f"{layer.name} {f64_text(1.0 / scale)}")
    warn_widened(ctx.path, widened, "ncnn", "127/amax")
    warn_uncovered(view, {layer.input for layer in view.layers}, "ncnn", ctx.path)
    return ("\n".join(weight_lines + blob_lines) + "\n").encode("utf-8")


FORMATS = (TableFormat("ncnn", "ncnn int8 table (layer 127/amax, per layer)", _detect, _read, _write, by_layer=True),)
