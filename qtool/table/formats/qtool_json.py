"""qtool's own JSON table (qtool/table/table.py): canonical and lossless."""

from __future__ import annotations

import json

from qtool.table.formats.base import FormatContext, TableFormat
from qtool.table.formats.common import decode_text
from qtool.errors import QtoolError
from qtool.table.table import FORMAT, CalibrationTable, table_from_document


def _json_document(data: bytes):
    try:
        return json.loads(data.decode("utf-8-sig"))
    except (UnicodeDecodeError, json.JSONDecodeError):
        return None


def _detect(data: bytes) -> bool:
    if not data.lstrip().startswith(b"{"):
        return False
    document = _json_document(data)
    return isinstance(document, dict) and document.get("format") == FORMAT


def _read(data: bytes, ctx: FormatContext) -> CalibrationTable:
    try:
        document = json.loads(decode_text(data, ctx.path))
    except json.JSONDecodeError as exc:
        raise QtoolError(f"not a qtool calibration table (invalid JSON: {exc})", ctx.path) from None
    return table_from_document(document, ctx.path)


def _write(table: CalibrationTable, ctx: FormatContext) -> bytes:
    return table.to_json_text().encode("utf-8")


FORMATS = (TableFormat("qtool", "qtool's JSON table (canonical, lossless)", _detect, _read, _write),)
