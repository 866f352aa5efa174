"""The calibration table: qtool's canonical JSON format.

Layout (keys in this order, tensors in graph order, floats written with the shortest
text that round-trips, no timestamps), so identical inputs give a byte-identical file
that diffs well in review:

    {"format": "qtool-calibration", "version": 1,
     "model": {"file": ..., "sha256": ...},
     "method": "minmax", "settings": {...}, "num_samples": 256,
     "tensors": {"name": {"min", "max", "range": [lo, hi], "dtype", "scale", "zero_point"}},
     "smoothing": {"name": [s_0, s_1, ...]}}   (only with SmoothQuant: qtool.plan.smooth_quant)
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
from qtool.table.qparams import QParams

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
            tensors[name] = TableEntry(item.get("min"), item.get("max"), (float(lo), float(hi)), qp)
        model = document["model"]
        smoothing = {str(name): tuple(float(v) for v in values)
                     for name, values in document.get("smoothing", {}).items()}
        return CalibrationTable(str(model.get("file", "")), str(model["sha256"]), str(document["method"]),
                                dict(document.get("settings", {})), int(document["num_samples"]), tensors,
                                smoothing=smoothing)
    except (KeyError, TypeError, ValueError) as exc:
        raise QtoolError(f"malformed calibration table: {type(exc).__name__} {exc}", path) from None
