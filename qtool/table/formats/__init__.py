"""Calibration tables of other toolchains: read and write them all.

One module per format, each registering a TableFormat: how to recognise the file
from its content, how to read it into qtool's CalibrationTable, and how to write a
table out. `read_table` detects the format unless one is forced; `write_table`
writes the named one. Formats keyed by layer rather than tensor (ncnn, AMCT) need
the model to map layers to tensors; so does writing them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional

from qtool import atomic
from qtool.config import QuantizeConfig
from qtool.errors import QtoolError
from qtool.table.formats.model_view import ModelView, model_view
from qtool.table.table import CalibrationTable, check_values


@dataclass(frozen=True)
class FormatContext:
    options: QuantizeConfig = field(default_factory=QuantizeConfig)
    model: Optional[ModelView] = None
    path: object = None  # the file being read or written, for messages

    def require_model(self, format_name: str) -> ModelView:
        if self.model is None:
            raise QtoolError(f"{format_name} tables name layers, not tensors: give the model (--model) "
                             "to map them", self.path)
        return self.model


@dataclass(frozen=True)
class TableFormat:
    name: str
    description: str
    detect: Callable[[bytes], bool]
    read: Callable[[bytes, FormatContext], CalibrationTable]
    write: Callable[[CalibrationTable, FormatContext], bytes]
    by_layer: bool = False


FORMATS: dict[str, TableFormat] = {}


def register(fmt: TableFormat) -> None:
    FORMATS[fmt.name] = fmt


def format_names() -> list[str]:
    return list(FORMATS)


def detect_format(data: bytes, path: object = None) -> TableFormat:
    for fmt in FORMATS.values():  # registration order: most specific signature first
        if fmt.detect(data):
            return fmt
    raise QtoolError(f"unrecognised calibration table; known formats: {', '.join(FORMATS)} "
                     "(force one with --table-format)", path)


def get_format(name: str) -> TableFormat:
    if name not in FORMATS:
        raise QtoolError(f"unknown table format '{name}'; known: {', '.join(FORMATS)}")
    return FORMATS[name]


def _context(path, model_path, options, wanted: bool) -> FormatContext:
    view = model_view(model_path, options) if model_path is not None and wanted else None
    return FormatContext(options, view, path)


def read_table(path: str | Path, format_name: Optional[str] = None, model_path: Optional[str | Path] = None,
               options: Optional[QuantizeConfig] = None) -> tuple[CalibrationTable, TableFormat]:
    """Read any known table; the model (optional) maps layer names and resolves aliases."""
    options = options or QuantizeConfig()
    try:
        data = Path(path).read_bytes()
    except OSError as exc:
        raise QtoolError(f"cannot read calibration table: {exc.strerror}", path) from None
    fmt = get_format(format_name) if format_name else detect_format(data, path)
    # foreign tables use the model to map names and to record which model they now describe
    ctx = _context(path, model_path, options, fmt.name != "qtool")
    return check_values(fmt.read(data, ctx), path), fmt


def write_table(table: CalibrationTable, path: str | Path, format_name: str,
                model_path: Optional[str | Path] = None, options: Optional[QuantizeConfig] = None) -> TableFormat:
    fmt = get_format(format_name)
    ctx = _context(path, model_path, options or QuantizeConfig(), fmt.by_layer)
    atomic.write_bytes(path, fmt.write(table, ctx))
    return fmt


# Importing the format modules fills FORMATS, in detection order.
from qtool.table.formats import qtool_json, ort, tensorrt, amct, tpu_mlir, tengine, ncnn  # noqa: E402,F401
