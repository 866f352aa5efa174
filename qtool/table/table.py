"""The calibration table: qtool's canonical JSON format.

Layout (keys in this order, tensors in graph order, floats written with the shortest
text that round-trips, no timestamps), so identical inputs give a byte-identical file
that diffs well in review:

    {"format": "qtool-calibration", "version": 1,
     "model": {"file": ..., "sha256": ...},
     "method": "minmax", "settings": {...}, "num_samples": 256,
     "tensors": {"name": {"min", "max", "range": [lo, hi], "dtype", "scale", "zero_point"}},
     "smoothing": {"name": [s_0, s_1, ...]},   (only with SmoothQuant: qtool.plan.smooth_quant)
     "channel_means": {"name": [m_0, m_1, ...]},   (the inputs of layers with a bias: their
         per-channel means, 7 significant digits, which bias correction reads,
     "spatial_sizes": {"name": [h, w]}}            and their mean spatial size over the samples)
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Optional

from qtool import atomic
from qtool.config import QuantizeConfig
from qtool.errors import QtoolError
from qtool.table.qparams import INT_RANGES, MIN_SCALE, QParams, include_zero

FORMAT = "qtool-calibration"
VERSION = 1


@dataclass
class TableEntry:
    min: Optional[float]  # observed extremes (None when imported from a format without them)
    max: Optional[float]
    range: tuple[float, float]  # the range chosen for quantization
    qparams: QParams

    def to_json(self) -> dict[str, Any]:
        return {"min": _num(self.min), "max": _num(self.max), "range": [_num(self.range[0]), _num(self.range[1])],
                "dtype": self.qparams.dtype, "scale": _num(self.qparams.scale),
                "zero_point": int(self.qparams.zero_point)}


@dataclass
class CalibrationTable:
    model_file: str
    model_sha256: str
    method: str
    settings: dict[str, Any]
    num_samples: int
    tensors: dict[str, TableEntry] = field(default_factory=dict)
    notes: tuple[str, ...] = field(default=(), compare=False)  # how it was made, for the user (not saved)
    # SmoothQuant's per-channel scales of each smoothed tensor: the ranges above are those of the
    # smoothed graph, so quantization must fold the same scales
    smoothing: dict[str, tuple[float, ...]] = field(default_factory=dict)
    # the per-channel means of the inputs of layers with a bias, over the calibration samples
    # (qtool.quantization.bias_correction), and their mean spatial sizes; None where calibration did
    # not keep them (not asked for, or a table read from another format)
    channel_means: Optional[dict[str, tuple[float, ...]]] = None
    spatial_sizes: Optional[dict[str, tuple[float, ...]]] = None

    def to_json_text(self) -> str:
        document = {
            "format": FORMAT,
            "version": VERSION,
            "model": {"file": self.model_file, "sha256": self.model_sha256},
            "method": self.method,
            "settings": self.settings,
            "num_samples": self.num_samples,
            "tensors": {name: entry.to_json() for name, entry in self.tensors.items()},
        }
        if self.smoothing:
            document["smoothing"] = {name: list(values) for name, values in self.smoothing.items()}
        if self.channel_means is not None:
            document["channel_means"] = {name: list(values) for name, values in self.channel_means.items()}
            document["spatial_sizes"] = {name: list(values) for name, values in self.spatial_sizes.items()}
        return json.dumps(document, indent=1, allow_nan=False) + "\n"

    def save(self, path: str | Path) -> None:
        atomic.write_text(path, self.to_json_text())


def smoothed_options(options: QuantizeConfig, table: CalibrationTable) -> QuantizeConfig:
    """`options` with the table's SmoothQuant alpha and scales, so quantization folds what calibration
    measured: the alpha the table records is the default (smooth_quant not given). SmoothQuant on one
    side only, or another alpha, would quantize a graph with the ranges of another: an error."""
    made_with = table.settings.get("smooth_quant")
    if options.smooth_quant is None and made_with is not None:
        options = replace(options, smooth_quant=made_with)
    elif made_with != options.smooth_quant:
        if made_with is None:
            raise QtoolError("SmoothQuant needs a qtool calibration table calibrated with it (its scales are in "
                             "the table's \"smoothing\"): calibrate with --smooth-quant")
        raise QtoolError(f"the calibration table was made with SmoothQuant alpha {made_with}, not the "
                         f"{options.smooth_quant} asked for (--smooth-quant, quantization.smooth_quant): leave it "
                         f"out to use the table's, or calibrate again with {options.smooth_quant}")
    return replace(options, smooth_scales=tuple(table.smoothing.items()))


def _num(value: Optional[float]):
    if value is None:
        return None
    value = float(value)
    if not math.isfinite(value):
        return None
    return value


def check_values(table: CalibrationTable, path: object) -> CalibrationTable:
    """Refuse a table whose numbers cannot be quantized with: told when it is read, naming the
    tensor, rather than failing deep in the rewrite or quietly zeroing a tensor."""
    for name, entry in table.tensors.items():
        problem = _entry_problem(entry)
        if problem:
            raise QtoolError(f"unusable calibration table: tensor '{name}' {problem}", path)
    return table


def _entry_problem(entry: TableEntry) -> Optional[str]:
    """What is wrong with an entry, or None. The scale and zero point must describe a grid that
    holds the entry's range to within a step, and is at most twice as wide (a symmetric grid
    over a one-sided range) plus two steps."""
    params = entry.qparams
    if params.dtype not in INT_RANGES:
        return f"has unknown integer type '{params.dtype}' (known: {', '.join(INT_RANGES)})"
    values = [*entry.range] + [v for v in (entry.min, entry.max) if v is not None]
    if not all(math.isfinite(float(v)) for v in values):
        return f"has a NaN/Inf value in its range [{entry.range[0]}, {entry.range[1]}] or extremes"
    if entry.range[0] > entry.range[1]:
        return f"has range [{entry.range[0]}, {entry.range[1]}], whose low end is above its high end"
    if not (math.isfinite(params.scale) and params.scale > 0):
        return f"has scale {params.scale}: it must be a positive number"
    qmin, qmax = INT_RANGES[params.dtype]
    if not qmin <= params.zero_point <= qmax:
        return f"has zero point {params.zero_point}, outside {params.dtype}'s [{qmin}, {qmax}]"
    lo, hi = include_zero(*entry.range)
    step, width = float(params.scale), hi - lo
    slack = 1.001 * step + 1e-6 * max(abs(lo), abs(hi))
    grid_lo, grid_hi = step * (qmin - params.zero_point), step * (qmax - params.zero_point)
    clips = grid_lo > lo + slack or grid_hi < hi - slack
    coarse = width > 0 and step > MIN_SCALE and grid_hi - grid_lo > 2 * width + 2 * slack
    if clips or coarse:
        return (f"has scale {params.scale:.6g} and zero point {params.zero_point}, which contradict its range "
                f"[{entry.range[0]:.6g}, {entry.range[1]:.6g}] ({params.dtype} over that range: scale about "
                f"{width / (qmax - qmin):.6g})")
    return None


def load_table(path: str | Path) -> CalibrationTable:
    path = Path(path)
    try:
        document = json.loads(path.read_text(encoding="utf-8"))
    except OSError as exc:
        raise QtoolError(f"cannot read calibration table: {exc.strerror}", path) from None
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise QtoolError(f"not a qtool calibration table (invalid JSON: {exc})", path) from None
    return table_from_document(document, path)


def table_from_document(document: Any, path: Path) -> CalibrationTable:
    if not isinstance(document, dict) or document.get("format") != FORMAT:
        raise QtoolError(f"not a qtool calibration table (no \"format\": \"{FORMAT}\" header)", path)
    if document.get("version") != VERSION:
        raise QtoolError(f"unsupported calibration table version {document.get('version')!r} "
                         f"(this qtool reads version {VERSION})", path)
    try:
        tensors = {}
        for name, item in document["tensors"].items():
            qp = QParams(float(item["scale"]), int(item["zero_point"]), str(item["dtype"]))
            if not (math.isfinite(qp.scale) and qp.scale > 0):
                raise ValueError(f"tensor '{name}' has scale {item['scale']}")
            lo, hi = item["range"]
            extremes = [None if item.get(k) is None else float(item[k]) for k in ("min", "max")]
            tensors[name] = TableEntry(*extremes, (float(lo), float(hi)), qp)
        model = document["model"]
        smoothing = {str(name): tuple(float(v) for v in values)
                     for name, values in document.get("smoothing", {}).items()}
        means = sizes = None
        if "channel_means" in document:
            means = {str(name): tuple(float(v) for v in values) for name, values in document["channel_means"].items()}
            sizes = {str(name): tuple(float(v) for v in values)
                     for name, values in document.get("spatial_sizes", {}).items()}
            if not all(math.isfinite(v) for values in [*means.values(), *sizes.values()] for v in values):
                raise ValueError("a channel mean or spatial size is not a finite number")
        table = CalibrationTable(str(model.get("file", "")), str(model["sha256"]), str(document["method"]),
                                 dict(document.get("settings", {})), int(document["num_samples"]), tensors,
                                 smoothing=smoothing, channel_means=means, spatial_sizes=sizes)
    except (KeyError, TypeError, ValueError, OverflowError) as exc:
        raise QtoolError(f"malformed calibration table: {type(exc).__name__} {exc}", path) from None
    return check_values(table, path)
