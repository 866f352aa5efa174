"""Tengine's calibration table (quant_tool_uint8 / quant_tool_int8, table_*.scale): one
`<tensor> <scale> <zero_point>` per line.

Tengine prints the scale with %f, which turns a small scale into 0.000000 or a digit or two; qtool
writes the shortest text that reads back as the same float32, which Tengine's strtof takes as is.
The file does not say whether it is uint8 (the asymmetric tool) or int8 (the symmetric per-channel
tool, zero point 0): a negative zero point means int8, one above 127 uint8, and a file whose zero
points are all 0 is read as int8, the only Tengine tool that writes such files.
"""

from __future__ import annotations

from qtool.errors import QtoolError
from qtool.table.formats.base import FormatContext, TableFormat
from qtool.table.formats.common import (decode_text, entry_from_qparams, f32_text, imported_table, is_integer, is_number,
                                  parse_float, text_rows)
from qtool.table.qparams import QParams
from qtool.table.table import CalibrationTable


def _plausible(row: list[str]) -> bool:
    return len(row) == 3 and is_integer(row[2]) and is_number(row[1]) and not is_integer(row[1])


def _detect(data: bytes) -> bool:
    rows = text_rows(data)
    return bool(rows) and all(_plausible(row) for row in rows)


def _dtype(zero_points: list[int]) -> str:
    if any(z < 0 for z in zero_points):
        return "int8"
    return "uint8" if any(z > 0 for z in zero_points) else "int8"


def _read(data: bytes, ctx: FormatContext) -> CalibrationTable:
    decode_text(data, ctx.path)
    rows = text_rows(data)
    for row in rows:
        if len(row) != 3 or not is_integer(row[2]):
            raise QtoolError(f"malformed line '{' '.join(row)}' (expected 'tensor scale zero_point')", ctx.path)
    dtype = _dtype([int(row[2]) for row in rows])
    entries = {}
    for name, scale, zero_point in rows:
        try:
            params = QParams(parse_float(scale, ctx.path, name), int(zero_point), dtype)
            entries[name] = entry_from_qparams(params, ctx.options)
        except ValueError as exc:
            raise QtoolError(f"tensor '{name}': {exc}", ctx.path) from None
    return imported_table(entries, "tengine", "tengine", ctx.model)


def _write(table: CalibrationTable, ctx: FormatContext) -> bytes:
    lines = [f"{name} {f32_text(e.qparams.scale)} {e.qparams.zero_point}" for name, e in table.tensors.items()]
    return ("\n".join(lines) + "\n").encode("utf-8")


FORMATS = (TableFormat("tengine", "Tengine calibration table (tensor scale zero_point)", _detect, _read, _write),)
