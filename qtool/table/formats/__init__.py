"""Calibration tables of other toolchains: read and write them all.

One module per format, each defining its TableFormat (`FORMATS`): how to recognise the
file from its content, how to read it into qtool's CalibrationTable, and how to write a
table out; FORMATS below lists them in detection order. `read_table` detects the format
unless one is forced; `write_table` writes the named one. Formats keyed by layer rather
than tensor (ncnn, AMCT) need the model to map layers to tensors; so does writing them.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

from qtool import atomic
from qtool.config import QuantizeConfig
from qtool.errors import QtoolError
from qtool.table.formats import amct, ncnn, ort, qtool_json, tengine, tensorrt, tpu_mlir
from qtool.table.formats.base import FormatContext, TableFormat
from qtool.table.formats.model_view import model_view
from qtool.table.table import CalibrationTable, check_values


def by_name(*formats: TableFormat) -> dict[str, TableFormat]:
    """The formats keyed by name, in the order given; one format per name."""
    table: dict[str, TableFormat] = {}
    for fmt in formats:
        if fmt.name in table:
            raise ValueError(f"two table formats named {fmt.name}")
        table[fmt.name] = fmt
    return table


# Detection order: the first format whose signature matches a file reads it, so the most specific
# signatures come first: qtool's JSON header before onnxruntime's JSON, and last the bare rows of
# numbers of Tengine and ncnn.
FORMATS: dict[str, TableFormat] = by_name(
    *qtool_json.FORMATS, *ort.FORMATS, *tensorrt.FORMATS, *amct.FORMATS, *tpu_mlir.FORMATS, *tengine.FORMATS,
    *ncnn.FORMATS,
)


def format_names() -> list[str]:
    return list(FORMATS)


def detect_format(data: bytes, path: object = None) -> TableFormat:
    for fmt in FORMATS.values():  # detection order
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

