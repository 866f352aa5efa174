"""TensorRT's INT8 calibration cache.

    TRT-8601-EntropyCalibration2
    data: 3c008912
    conv1: 3c88edfc

The first line names the TensorRT version and the calibrator; every other line is
`tensor: <8 hex digits>`, the big-endian IEEE float32 bits of the tensor's scale
amax/127 (symmetric int8). Hex is exact, so an int8 scale with zero point 0 survives bit
for bit; every other entry (uint8 ones included) is written as amax/127 over its range,
the scale `quantize --target tensorrt` computes from it (a warning says how many). qtool writes EntropyCalibration2, the calibrator trtexec and most TensorRT
applications read caches with; any calibrator name is accepted when reading.
"""

from __future__ import annotations

import re
import struct

from qtool.errors import QtoolError
from qtool.table.formats.base import FormatContext, TableFormat
from qtool.table.formats.common import decode_text, entry_from_symmetric, imported_table, symmetric_scale, warn_widened
from qtool.table.table import CalibrationTable

_HEADER = re.compile(r"^TRT-(\d+)-(\w+)$")
_LINE = re.compile(r"^(.*):\s*([0-9a-fA-F]{1,8})$")
WRITE_HEADER = "TRT-8601-EntropyCalibration2"


def scale_to_hex(scale: float) -> str:
    return struct.pack(">f", scale).hex()


def hex_to_scale(text: str) -> float:
    return struct.unpack(">f", bytes.fromhex(text.rjust(8, "0")))[0]


def _detect(data: bytes) -> bool:
    first = data.lstrip()[:64].split(b"\n", 1)[0].strip()
    return _HEADER.match(first.decode("ascii", "replace")) is not None


def _read(data: bytes, ctx: FormatContext) -> CalibrationTable:
    lines = decode_text(data, ctx.path).splitlines()
    header = _HEADER.match(lines[0].strip()) if lines else None
    if header is None:
        raise QtoolError("not a TensorRT calibration cache (first line is not TRT-<version>-<calibrator>)", ctx.path)
    entries = {}
    for line in lines[1:]:
        line = line.strip()
        if not line:
            continue
        match = _LINE.match(line)
        if match is None:
            raise QtoolError(f"malformed cache line '{line}' (expected 'tensor: <hex float32>')", ctx.path)
        name, scale = match.group(1).strip(), hex_to_scale(match.group(2))
        try:
            entries[name] = entry_from_symmetric(scale, ctx.options)
        except ValueError as exc:
            raise QtoolError(f"tensor '{name}': {exc}", ctx.path) from None
    return imported_table(entries, header.group(2), "tensorrt", ctx.model)


def _write(table: CalibrationTable, ctx: FormatContext) -> bytes:
    lines, widened = [WRITE_HEADER], 0
    for name, entry in table.tensors.items():
        scale, exact = symmetric_scale(entry)
        widened += not exact
        lines.append(f"{name}: {scale_to_hex(scale)}")
    warn_widened(ctx.path, widened, "TensorRT", "amax/127")
    return ("\n".join(lines) + "\n").encode("utf-8")


FORMATS = (TableFormat("tensorrt", "TensorRT calibration cache (hex float32 scales)", _detect, _read, _write),)
