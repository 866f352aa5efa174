"""Turning an evaluation report (a dict) into text for a terminal and JSON for machines."""

from __future__ import annotations

import json
import math
from pathlib import Path

from qtool import atomic


def _fmt(value, digits: int = 4) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        if math.isinf(value):
            return "inf" if value > 0 else "-inf"
        if math.isnan(value):
            return "nan"
        return f"{value:.{digits}f}"
    return str(value)


def _pct(value) -> str:
    return "-" if value is None else f"{100.0 * value:.2f}%"


def render_table(report: dict) -> str:
    rows: list[tuple[str, str, str, str]] = [("", "fp32", "int8", "int8 vs fp32")]
    cls = report.get("classification")
    if cls:
        if "top1" in cls:
            rows.append(("top-1", _pct(cls["top1"]["fp32"]), _pct(cls["top1"]["int8"]),
                         f"drop {100 * cls['top1_drop']:+.2f} pts".replace("drop +", "drop ")))
            top_k = next(k for k in cls if k.startswith("top") and k not in ("top1", "top1_drop"))
            rows.append((f"top-{top_k[3:]}", _pct(cls[top_k]["fp32"]), _pct(cls[top_k]["int8"]), ""))
        rows.append(("top-1 agreement", "", "", _pct(cls["agreement"])))
        rows.append(("mean KL(fp32||int8)", "", "", _fmt(cls["mean_kl"], 5)))
    for name, out in report["outputs"].items():
        rows.append((f"{name}: cosine", "", "", _fmt(out["cosine"], 5)))
        rows.append((f"{name}: SQNR", "", "", f"{_fmt(out['sqnr_db'], 2)} dB"))
    lat = report.get("latency")
    if lat:
        rows.append((f"latency, batch {lat['batch_size']}, {lat['threads']} thread(s), median",
                     f"{lat['fp32_ms']['median']:.2f} ms", f"{lat['int8_ms']['median']:.2f} ms",
                     f"speedup {lat['speedup']:.2f}x"))
        rows.append(("latency p90", f"{lat['fp32_ms']['p90']:.2f} ms", f"{lat['int8_ms']['p90']:.2f} ms", ""))
    size = report["size"]
    rows.append(("file size", f"{size['fp32_bytes'] / 1e6:.2f} MB", f"{size['int8_bytes'] / 1e6:.2f} MB",
                 f"{size['ratio']:.2f}x smaller"))
    widths = [max(len(r[i]) for r in rows) for i in range(4)]
    lines = []
    for i, row in enumerate(rows):
        lines.append("  ".join(cell.ljust(widths[j]) if j == 0 else cell.rjust(widths[j]) for j, cell in enumerate(row)))
        if i == 0:
            lines.append("  ".join("-" * w for w in widths))
    header = f"{report['data']['samples']} samples from {report['data']['path']}"
    return header + "\n" + "\n".join(line.rstrip() for line in lines)


def _clean(value):
    """JSON has no inf/nan: write them as strings so the file stays standard JSON."""
    if isinstance(value, float) and not math.isfinite(value):
        return "inf" if value == math.inf else "-inf" if value == -math.inf else "nan"
    if isinstance(value, dict):
        return {k: _clean(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_clean(v) for v in value]
    return value


def write_json(report: dict, path: str | Path) -> None:
    atomic.write_text(path, json.dumps(_clean(report), indent=2) + "\n")
