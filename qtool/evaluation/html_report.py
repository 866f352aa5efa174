"""One self-contained HTML file: summary, verdicts and per-layer charts as inline SVG.

No network, no scripts: the CSS is inline and the charts are plain SVG rectangles with
<title> tooltips, so the file opens the same in a browser, a CI artifact viewer or an
e-mail attachment, and can be archived with the model.
"""

from __future__ import annotations

import html
import math
import re
from pathlib import Path

from qtool import atomic
from qtool.evaluation.report import EvaluationReport, fmt, summary_rows

STYLE = """
body { font: 14px/1.4 system-ui, sans-serif; margin: 24px; color: #222; max-width: 1200px; }
h1 { font-size: 22px; } h2 { font-size: 17px; margin-top: 28px; border-bottom: 1px solid #ddd; }
table { border-collapse: collapse; margin: 8px 0; }
th, td { padding: 3px 10px; border-bottom: 1px solid #eee; text-align: left; }
.num { text-align: right; }
.meta { color: #555; } .pass { color: #17692b; font-weight: 600; } .fail { color: #b3261e; font-weight: 600; }
svg text { font: 11px system-ui, sans-serif; fill: #333; }
"""

GOOD, WORST = "#4c78a8", "#d62728"
NUMBER = re.compile(r"^(drop |speedup |recall )?[-+]?(\d|inf|nan)")
CHART_WIDTH, CHART_HEIGHT = 1100, 300
AXIS_CAP_DB = 60.0


def _e(value) -> str:
    return html.escape(str(value))


def _finite(values: list[float]) -> list[float]:
    return [v for v in values if isinstance(v, (int, float)) and math.isfinite(v)]


def _clip(value, lo: float, hi: float) -> float:
    if not isinstance(value, (int, float)) or math.isnan(value):
        return lo
    return min(max(value, lo), hi)


def _cell(text: str, tag: str = "td") -> str:
    numeric = bool(NUMBER.match(text))
    return f"<{tag}{' class=num' if numeric else ''}>{_e(text)}</{tag}>"


def _table(rows: list[tuple[str, ...]]) -> str:
    """Numbers right-aligned, text left-aligned; a column of numbers gets a right-aligned header."""
    numeric = [any(NUMBER.match(row[i]) for row in rows[1:]) for i in range(len(rows[0]))]
    head = "".join(f"<th{' class=num' if numeric[i] else ''}>{_e(c)}</th>" for i, c in enumerate(rows[0]))
    body = "".join("<tr>" + "".join(_cell(c) for c in row) + "</tr>" for row in rows[1:])
    return f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


def _axis(values: list[float]) -> tuple[float, float]:
    """Axis limits from 0 (or the lowest value) to the highest, rounded out to multiples of 5.

    Capped at AXIS_CAP_DB: above that a tensor is as good as lossless, and one near-exact
    graph input at 140 dB would otherwise squash every bar that matters."""
    finite = _finite(values) or [0.0]
    lo = 5.0 * math.floor(min(0.0, min(finite)) / 5.0)
    hi = min(5.0 * math.ceil(max(finite) / 5.0), AXIS_CAP_DB)
    return lo, hi if hi > lo else lo + 5.0


def column_chart(labels: list[str], values: list[float], highlight: set[str], unit: str = "dB") -> str:
    """Vertical bars in the given order (graph order), highlighted bars in red; tooltips name each bar."""
    lo, hi = _axis(values)
    left, bottom, top = 48, 24, 10
    plot_w, plot_h = CHART_WIDTH - left - 10, CHART_HEIGHT - bottom - top
    step = plot_w / max(1, len(values))

    def y(v: float) -> float:
        return top + plot_h * (hi - v) / (hi - lo)

    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{CHART_WIDTH}" height="{CHART_HEIGHT}" '
             f'role="img" aria-label="per-layer {unit} chart">']
    tick = 5.0 if hi - lo <= 40 else 10.0
    for i in range(int((hi - lo) / tick) + 1):  # grid lines and axis labels
        v = lo + tick * i
        parts.append(f'<line x1="{left}" x2="{CHART_WIDTH - 10}" y1="{y(v):.1f}" y2="{y(v):.1f}" stroke="#e5e5e5"/>')
        parts.append(f'<text x="{left - 6}" y="{y(v) + 4:.1f}" text-anchor="end">{v:.0f}</text>')
    for i, (label, value) in enumerate(zip(labels, values)):
        v = _clip(value, lo, hi)
        y0, y1 = sorted((y(0.0), y(v)))
        colour = WORST if label in highlight else GOOD
        parts.append(f'<rect x="{left + i * step:.2f}" y="{y0:.2f}" width="{max(step * 0.8, 0.5):.2f}" '
                     f'height="{max(y1 - y0, 0.5):.2f}" fill="{colour}"><title>{_e(label)}: {fmt(value, 2)} '
                     f'{unit}</title></rect>')
    parts.append(f'<text x="{left}" y="{CHART_HEIGHT - 6}">graph order &#8594; ({len(values)} tensors; '
                 f'red: worst ten)</text>')
    parts.append(f'<text x="4" y="{top + 10}">{unit}</text></svg>')
    return "".join(parts)


def bar_chart(labels: list[str], values: list[float], unit: str = "dB") -> str:
    """Horizontal bars, one row per label, in the given order (worst first)."""
    lo, hi = _axis(values)
    left, row = 260, 18
    plot_w = CHART_WIDTH - left - 70
    height = row * len(values) + 10
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{CHART_WIDTH}" height="{height}" role="img" '
             f'aria-label="sensitivity chart">']
    for i, (label, value) in enumerate(zip(labels, values)):
        v = _clip(value, lo, hi)
        width = plot_w * (v - lo) / (hi - lo)
        yy = 5 + i * row
        short = label if len(label) <= 40 else "..." + label[-37:]
        parts.append(f'<text x="{left - 6}" y="{yy + 12}" text-anchor="end">{_e(short)}</text>')
        parts.append(f'<rect x="{left}" y="{yy}" width="{max(width, 0.5):.2f}" height="{row - 4}" '
                     f'fill="{WORST if i < 10 else GOOD}"><title>{_e(label)}: {fmt(value, 2)} {unit}</title></rect>')
        parts.append(f'<text x="{left + width + 4:.2f}" y="{yy + 12}">{fmt(value, 1)}</text>')
    parts.append("</svg>")
    return "".join(parts)


def _verdicts(report: EvaluationReport) -> str:
    if not report.thresholds:
        return "<p class='meta'>No thresholds set.</p>"
    items = "".join(f"<li class='{'pass' if v.passed else 'fail'}'>{_e(v.message)}</li>"
                    for v in report.thresholds)
    overall = "<p class='pass'>All thresholds met.</p>" if report.passed else \
        "<p class='fail'>Threshold(s) violated.</p>"
    return overall + f"<ul>{items}</ul>"


def _per_layer(section: dict) -> str:
    tensors = section["tensors"]
    worst = section["worst"]
    by_name = {t["tensor"]: t for t in tensors}
    chart = column_chart([t["tensor"] for t in tensors], [t["sqnr_db"] for t in tensors], set(worst))
    worst_rows = [("tensor", "producer", "node", "SQNR dB", "cosine")]
    worst_rows += [(n, by_name[n]["op_type"], by_name[n]["node"], fmt(by_name[n]["sqnr_db"], 2),
                    fmt(by_name[n]["cosine"], 5)) for n in worst]
    all_rows = [("#", "tensor", "producer", "SQNR dB", "cosine", "max abs error")]
    all_rows += [(str(i), t["tensor"], t["op_type"], fmt(t["sqnr_db"], 2), fmt(t["cosine"], 5),
                  fmt(t["max_abs_error"], 4)) for i, t in enumerate(tensors)]
    return (f"<h2>Per-layer SQNR</h2><p class='meta'>{section['samples']} samples; each quantized tensor of the "
            f"int8 model against its fp32 twin (cumulative error up to that tensor), in graph order.</p>{chart}"
            f"<h3>Worst {len(worst)}</h3>{_table(worst_rows)}"
            f"<details><summary>All {len(tensors)} tensors in graph order</summary>{_table(all_rows)}</details>")


def _sensitivity(section: dict, count: int = 30) -> str:
    layers = section["layers"][:count]
    chart = bar_chart([f"{r['node']} ({r['op_type']})" for r in layers], [r["sqnr_db"] for r in layers])
    rows = [("layer", "op", "MACs", "output SQNR dB", "cosine")]
    rows += [(r["node"], r["op_type"], f"{r['macs'] / 1e6:.1f} M" if r["macs"] else "-", fmt(r["sqnr_db"], 2),
              fmt(r["cosine"], 5)) for r in section["layers"]]
    return (f"<h2>Sensitivity: one layer at a time</h2><p class='meta'>{section['samples']} samples; model output "
            f"SQNR when only that layer is int8 (lower is worse), worst first; {len(section['layers'])} layers."
            f"</p>{chart}<details><summary>All layers</summary>{_table(rows)}</details>")


def render_html(report: EvaluationReport) -> str:
    models = report.models
    title = f"qtool evaluate: {Path(models['int8']['path']).name} vs {Path(models['fp32']['path']).name}"
    meta = (f"fp32 {_e(models['fp32']['path'])}<br>int8 {_e(models['int8']['path'])}<br>"
            f"{report.data['samples']} samples from {_e(report.data_name)}; task {_e(report.task)}; "
            f"qtool {_e(report.qtool_version)}, onnxruntime {_e(report.onnxruntime_version)}")
    body = [f"<h1>{_e(title)}</h1><p class='meta'>{meta}</p>", "<h2>Verdict</h2>", _verdicts(report),
            "<h2>Summary</h2>", _table(summary_rows(report))]
    if report.per_layer is not None:
        body.append(_per_layer(report.per_layer))
    else:
        body.append("<p class='meta'>Run with --per-layer for the per-layer SQNR chart.</p>")
    if report.sensitivity is not None:
        body.append(_sensitivity(report.sensitivity))
    return (f"<!DOCTYPE html>\n<html lang='en'><head><meta charset='utf-8'><title>{_e(title)}</title>"
            f"<style>{STYLE}</style></head><body>{''.join(body)}</body></html>\n")


def write_html(report: EvaluationReport, path: str | Path) -> None:
    atomic.write_text(path, render_html(report))
