"""ncnn's int8 calibration table (ncnn2table), keyed by layer.

    conv1_param_0 156.639840 93.315132 ...
    conv1 47.340626

`<layer>_param_0` lines hold the weight's per-output-channel scale factors and
`<layer>` lines the scale of the layer's input blob, both as ncnn multiplies by them:
127/amax, the inverse of a symmetric int8 scale. Only Convolution, ConvolutionDepthWise
and InnerProduct layers have entries, so tensors that feed no such layer (an Add's
other input, a graph output) have none; reading and writing say which. qtool maps ncnn
layer names to the ONNX node of the same name (or first output, onnx2ncnn's fallback).
ncnn prints %f; qtool writes full precision so a scale survives the inversion exactly.
Weight lines are written for ncnn's benefit and ignored on reading: qtool derives
weight scales from the weights themselves.
"""

from __future__ import annotations

import warnings

import numpy as np

from qtool.errors import QtoolError
from qtool.formats import FormatContext, TableFormat, register
from qtool.formats.common import (data_lines, decode_text, entry_from_symmetric, f64_text, imported_table,
                                  is_number, parse_float, symmetric_scale)
from qtool.formats.graph import shown, warn_uncovered
from qtool.table import CalibrationTable

WEIGHT_SUFFIX = "_param_0"


def _rows(text: str) -> list[list[str]]:
    return [line.split() for line in data_lines(text)]


def _detect(data: bytes) -> bool:
    try:
        rows = _rows(data.decode("utf-8-sig"))
    except UnicodeDecodeError:
        return False
    return bool(rows) and all(len(r) >= 2 and all(is_number(t) and not t.lstrip("+-").isdigit() for t in r[1:])
                              for r in rows)


def _read(data: bytes, ctx: FormatContext) -> CalibrationTable:
    view = ctx.require_model("ncnn")
    entries, unknown, conflicts = {}, [], []
    for row in _rows(decode_text(data, ctx.path)):
        name, values = row[0], [parse_float(t, ctx.path, " ".join(row)) for t in row[1:]]
        if "_param_" in name and view.layer(name) is None:
            continue  # weight scales: qtool quantizes weights from the weights themselves
        layer = view.layer(name)
        if layer is None:
            unknown.append(name)
            continue
        if values[0] <= 0:
            raise QtoolError(f"layer '{name}' has scale {values[0]}", ctx.path)
        entry = entry_from_symmetric(1.0 / values[0], ctx.options)
        previous = entries.setdefault(layer.input, entry)
        if previous.qparams != entry.qparams:
            conflicts.append(name)
    if unknown:
        warnings.warn(f"{ctx.path}: {len(unknown)} ncnn layers match no node of the model: {shown(unknown)}",
                      stacklevel=3)
    if conflicts:
        warnings.warn(f"{ctx.path}: layers sharing an input disagree on its scale; kept the first for "
                      f"{shown(conflicts)}", stacklevel=3)
    warn_uncovered(view, set(entries), "ncnn", ctx.path)
    return imported_table(entries, "ncnn", "ncnn", view)


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
    if widened:
        warnings.warn(f"{ctx.path}: ncnn scales are symmetric; {widened} asymmetric entries were written as "
                      "127/amax over their range", stacklevel=3)
    warn_uncovered(view, {layer.input for layer in view.layers}, "ncnn", ctx.path)
    return ("\n".join(weight_lines + blob_lines) + "\n").encode("utf-8")


register(TableFormat("ncnn", "ncnn int8 table (layer 127/amax, per layer)", _detect, _read, _write, by_layer=True))
