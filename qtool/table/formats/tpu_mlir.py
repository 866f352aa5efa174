"""TPU-MLIR's calibration table (Sophgo run_calibration.py), after a `#` header:

    # op_name    threshold    min    max
    122_Conv 56.4281803 -102.5830231 97.6811752

`threshold` serves symmetric quantization (int8 scale threshold/127 when min < 0, uint8
threshold/255 otherwise, as TPU-MLIR's getScale does), min/max asymmetric; qtool reads the one its
options ask for. Sections after `#int4_th` or `#weight_scale` and QAT step/zero-point lines are
skipped with a warning. Names are the output tensors', which older releases suffix with
`_<OpType>` (mapped back with the model at hand). qtool writes Python's shortest round-trip repr
(TPU-MLIR writes %.7f), so a min/max range reads back exactly.
"""

from __future__ import annotations

import warnings

from qtool.errors import QtoolError
from qtool.table.formats.base import FormatContext, TableFormat
from qtool.table.formats.common import (decode_text, entry_from_qparams, entry_from_range, f64_text, imported_table,
                                  is_number, is_symmetric, parse_float)
from qtool.table.qparams import QParams
from qtool.table.table import CalibrationTable, TableEntry

_OTHER_SECTIONS = ("#int4_th", "#weight_scale")
_COLUMNS = "# op_name    threshold    min    max"


def _data_rows(text: str) -> tuple[list[list[str]], int, bool]:
    """(rows of the int8 section, lines skipped, whether any '#' line was seen)."""
    rows, skipped, comments, section_open = [], 0, False, True
    for raw in text.splitlines():
        line = raw.strip()
        if not line:
            continue
        if line.startswith("#"):
            comments = True
            if line.split()[0] in _OTHER_SECTIONS:
                section_open = False
            continue
        tokens = line.split()
        if section_open and len(tokens) == 4 and all(is_number(t) for t in tokens[1:]):
            rows.append(tokens)
        else:
            skipped += 1
    return rows, skipped, comments


def _detect(data: bytes) -> bool:
    text = data[:65536].decode("utf-8", "ignore")
    if "# op_name" in text and "threshold" in text:
        return True
    rows, skipped, comments = _data_rows(text)
    return comments and bool(rows) and skipped == 0


def _tensor_name(name: str, ctx: FormatContext) -> str:
    view = ctx.model
    if view is None or name in view.producers or name in view.activations:
        return name
    tensor, _, op_type = name.rpartition("_")
    return tensor if tensor and view.producers.get(tensor) == op_type else name


def _entry(threshold: float, lo: float, hi: float, ctx: FormatContext) -> TableEntry:
    if not ctx.options.symmetric_activations:
        return entry_from_range(lo, hi, ctx.options, observed=(lo, hi))
    signed = lo < 0
    params = QParams(threshold / (127.0 if signed else 255.0), 0, "int8" if signed else "uint8")
    entry = entry_from_qparams(params, ctx.options, observed=(lo, hi))
    return TableEntry(lo, hi, (-threshold if signed else 0.0, threshold), entry.qparams)


def _read(data: bytes, ctx: FormatContext) -> CalibrationTable:
    rows, skipped, _ = _data_rows(decode_text(data, ctx.path))
    if not rows:
        raise QtoolError("no 'op_name threshold min max' lines: not a TPU-MLIR calibration table", ctx.path)
    if skipped:
        warnings.warn(f"{ctx.path}: skipped {skipped} lines that are not int8 'op_name threshold min max' rows "
                      "(int4/weight sections, QAT step lists)", stacklevel=3)
    entries = {}
    for name, *numbers in rows:
        threshold, lo, hi = (parse_float(t, ctx.path, name) for t in numbers)
        try:
            entries[_tensor_name(name, ctx)] = _entry(threshold, lo, hi, ctx)
        except ValueError as exc:
            raise QtoolError(f"op '{name}': {exc}", ctx.path) from None
    return imported_table(entries, "tpu-mlir", "tpu-mlir", ctx.model)


def _threshold(entry: TableEntry) -> float:
    if is_symmetric(entry.qparams):
        return entry.qparams.scale * 127.0  # exact in float64: threshold / 127 gives the scale back
    return max(abs(entry.range[0]), abs(entry.range[1]))


def _write(table: CalibrationTable, ctx: FormatContext) -> bytes:
    lines = [f"# qtool calibration table: model {table.model_file or '?'}, method {table.method}",
             f"# sample number: {table.num_samples}", "###", _COLUMNS]
    for name, entry in table.tensors.items():
        lo, hi = entry.range
        lines.append(f"{name} {f64_text(_threshold(entry))} {f64_text(lo)} {f64_text(hi)}")
    return ("\n".join(lines) + "\n").encode("utf-8")


FORMATS = (TableFormat("tpu-mlir", "TPU-MLIR calibration table (name threshold min max)", _detect, _read, _write),)
