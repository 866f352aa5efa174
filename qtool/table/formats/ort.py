"""onnxruntime's calibration cache: the JSON of its TensorsData, as
onnxruntime.quantization.calibrate.save_tensors_data / write_calibration_table write it:

    {"CLS": "TensorsData", "data": {"<tensor>": {"lowest": L, "highest": H, "CLS": "TensorData"}},
     "calibration_method": {"CLS": "CalibrationMethod", "value": "CalibrationMethod.MinMax"}}

L and H are float32 numpy values, {"data": x, "dtype": "float32", "CLS": "numpy.array"} (older
releases omit "CLS" or write plain numbers; the oldest write {"<tensor>": [min, max]}). The file
holds ranges only: scale and zero point are computed from them with the options, as onnxruntime and
qtool both do. Numbers are written with Python's shortest repr, so they read back exactly.
"""

from __future__ import annotations

import json
from typing import Any

from qtool.errors import QtoolError
from qtool.table.formats.base import FormatContext, TableFormat
from qtool.table.formats.common import entry_from_range
from qtool.table.formats.common import imported_table
from qtool.table.table import CalibrationTable

_METHODS = {"minmax": "MinMax", "entropy": "Entropy", "percentile": "Percentile", "distribution": "Distribution"}


def _load(data: bytes) -> Any:
    try:
        return json.loads(data.decode("utf-8-sig"))
    except (UnicodeDecodeError, json.JSONDecodeError):
        return None


def _tensors(document: Any) -> dict | None:
    if not isinstance(document, dict):
        return None
    if document.get("CLS") == "TensorsData" or ("data" in document and "calibration_method" in document):
        document = document.get("data")
    if not isinstance(document, dict) or not document:
        return None
    if all(isinstance(v, dict) and "lowest" in v and "highest" in v for v in document.values()):
        return document
    if all(isinstance(v, list) and len(v) == 2 for v in document.values()):
        return document
    return None


def _detect(data: bytes) -> bool:
    return data.lstrip().startswith(b"{") and _tensors(_load(data)) is not None


def _scalar(value: Any) -> float:
    """A number, a numpy-array dict {"data": ...}, or a one-element list of either."""
    if isinstance(value, dict):
        value = value.get("data")
    while isinstance(value, list) and len(value) == 1:
        value = value[0]
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"expected a number, got {value!r}")
    return float(value)


def _method(document: Any) -> str:
    method = document.get("calibration_method") if isinstance(document, dict) else None
    if isinstance(method, dict):
        method = method.get("value") or method.get("CalibrationMethod")
    return str(method).split(".")[-1] if method else "onnxruntime"


def _read(data: bytes, ctx: FormatContext) -> CalibrationTable:
    document = _load(data)
    tensors = _tensors(document)
    if tensors is None:
        raise QtoolError("not an onnxruntime calibration cache (no TensorsData with lowest/highest)", ctx.path)
    entries = {}
    for name, item in tensors.items():
        try:
            lo, hi = (item["lowest"], item["highest"]) if isinstance(item, dict) else item
            lo, hi = _scalar(lo), _scalar(hi)
            entries[name] = entry_from_range(lo, hi, ctx.options, observed=(lo, hi))
        except (ValueError, TypeError) as exc:
            raise QtoolError(f"tensor '{name}': {exc}", ctx.path) from None
    return imported_table(entries, _method(document), "onnxruntime", ctx.model)


def _array(value: float) -> dict:
    return {"data": value, "dtype": "float32", "CLS": "numpy.array"}


def _write(table: CalibrationTable, ctx: FormatContext) -> bytes:
    # The range, not the observed min/max: it is what the scale was computed from
    # (after including zero and sharing across tied tensors), so onnxruntime and qtool
    # recompute the very same scale from it.
    data = {name: {"lowest": _array(entry.range[0]), "highest": _array(entry.range[1]), "CLS": "TensorData"}
            for name, entry in table.tensors.items()}
    method = _METHODS.get(table.method, "MinMax")
    document = {"CLS": "TensorsData", "data": data,
                "calibration_method": {"CLS": "CalibrationMethod", "value": f"CalibrationMethod.{method}"}}
    return json.dumps(document).encode("utf-8")


FORMATS = (TableFormat("onnxruntime", "onnxruntime's calibration cache (TensorsData JSON)", _detect, _read, _write),)
