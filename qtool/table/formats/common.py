"""What the format modules share: number text that round-trips, scale conversions, and building
table entries from what a foreign file holds, which is one of three things per tensor:

- a scale and a zero point (Tengine, AMCT): taken exactly, shifted by 128 between int8 and uint8
  when the options ask for the other type (the real-valued grid stays identical);
- a symmetric scale amax/127 or its inverse (TensorRT, ncnn, TPU-MLIR's threshold): the owning
  toolchain's int8 grid with zero point 0, shifted likewise, with the range (-amax, amax);
- a min/max range (TPU-MLIR, onnxruntime): scale and zero point recomputed with qtool's own
  formula for the options, exactly as a qtool calibration would.
"""

from __future__ import annotations

import math
import warnings
from typing import Optional

import numpy as np

from qtool.config import QuantizeConfig
from qtool.errors import QtoolError
from qtool.table.qparams import INT_RANGES, QParams, activation_qparams
from qtool.table.table import CalibrationTable, TableEntry
from qtool.targets import target_of

SYMMETRIC_QMAX = 127  # the int8 grid of TensorRT, ncnn, TPU-MLIR thresholds: scale = amax / 127
_ZERO_SHIFT = {("int8", "uint8"): 128, ("uint8", "int8"): -128}


def f32_text(value: float) -> str:
    """Shortest decimal text that reads back as the same float32."""
    return str(np.float32(value))


def f64_text(value: float) -> str:
    """Shortest decimal text that reads back as the same float64."""
    return repr(float(value))


def decode_text(data: bytes, path: object) -> str:
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError:
        raise QtoolError("not a text calibration table (bytes are not UTF-8)", path) from None


def data_lines(text: str) -> list[str]:
    return [line.strip() for line in text.splitlines() if line.strip()]


def text_rows(data: bytes) -> Optional[list[list[str]]]:
    """Whitespace-separated tokens of each non-empty line; None if the bytes are not UTF-8."""
    try:
        return [line.split() for line in data_lines(data.decode("utf-8-sig"))]
    except UnicodeDecodeError:
        return None


def is_integer(token: str) -> bool:
    return token.lstrip("+-").isdigit()


def warn_widened(path: object, count: int, format_label: str, how: str) -> None:
    if count:
        warnings.warn(f"{path}: {format_label} scales are symmetric; {count} asymmetric entries were written as "
                      f"{how} over their range", stacklevel=3)


def parse_float(token: str, path: object, line: str) -> float:
    try:
        value = float(token)
    except ValueError:
        raise QtoolError(f"expected a number, got '{token}' in line '{line}'", path) from None
    if not math.isfinite(value):
        raise QtoolError(f"non-finite value '{token}' in line '{line}'", path)
    return value


def is_number(token: str) -> bool:
    try:
        return math.isfinite(float(token))
    except ValueError:
        return False


def to_dtype(params: QParams, dtype: str) -> Optional[QParams]:
    """The same real-valued grid in the other 8-bit type, or None if the zero point leaves it."""
    if params.dtype == dtype:
        return params
    zero_point = params.zero_point + _ZERO_SHIFT[(params.dtype, dtype)]
    qmin, qmax = INT_RANGES[dtype]
    return QParams(params.scale, zero_point, dtype) if qmin <= zero_point <= qmax else None


def is_symmetric(params: QParams) -> bool:
    return to_dtype(params, "int8") is not None and to_dtype(params, "int8").zero_point == 0


def symmetric_scale(entry: TableEntry) -> tuple[float, bool]:
    """The int8 symmetric scale of an entry, and whether it is exact.

    An int8 entry with zero point 0 gives its own scale bit for bit. Any other (a uint8 one too,
    even with zero point 128 and a range that looks symmetric) gets amax/127 over its range, as
    quantize computes it for an int8 symmetric target: its own scale would be (max - min)/255.
    """
    params = entry.qparams
    if params.dtype == "int8" and params.zero_point == 0:
        return params.scale, True
    return activation_qparams(*entry.range, "int8", symmetric=True, symmetric_qmax=SYMMETRIC_QMAX).scale, False


def entry_from_qparams(params: QParams, options: QuantizeConfig, observed: tuple = (None, None)) -> TableEntry:
    """Take a file's scale and zero point as they are, in the options' type when exact."""
    params = QParams(float(np.float32(params.scale)), int(params.zero_point), params.dtype)
    if not (math.isfinite(params.scale) and params.scale > 0):
        raise ValueError(f"scale {params.scale} is not positive")
    params = to_dtype(params, options.activation_dtype) or params
    return TableEntry(observed[0], observed[1], params.range, params)


def entry_from_symmetric(scale: float, options: QuantizeConfig) -> TableEntry:
    """A symmetric int8 scale (amax/127); its range is (-amax, amax)."""
    entry = entry_from_qparams(QParams(scale, 0, "int8"), options)
    amax = float(np.float32(scale)) * SYMMETRIC_QMAX
    return TableEntry(None, None, (-amax, amax), entry.qparams)


def entry_from_range(lo: float, hi: float, options: QuantizeConfig, observed: tuple = (None, None)) -> TableEntry:
    params = activation_qparams(lo, hi, options.activation_dtype, options.symmetric_activations,
                                target_of(options).symmetric_qmax)
    return TableEntry(observed[0], observed[1], (min(lo, 0.0), max(hi, 0.0)), params)


def imported_table(tensors: dict[str, TableEntry], method: str, format_name: str, model=None) -> CalibrationTable:
    """A table read from another format; it names the model only when one was given to map it."""
    file, sha = (model.file, model.sha256) if model is not None else ("", "")
    return CalibrationTable(file, sha, method, {"imported_from": format_name}, 0, dict(tensors))
