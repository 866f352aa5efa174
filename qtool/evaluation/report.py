"""The evaluation report (a typed record of every figure) and its text for a terminal and JSON for machines."""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Optional

from qtool import atomic


@dataclass(frozen=True)
class Verdict:
    name: str  # the config key (the CLI flag is the same with dashes)
    figure: str
    limit: float
    value: float
    unit: str
    passed: bool
    message: str


@dataclass(frozen=True)
class EvaluationReport:
    """What `evaluate` measured. The sections are the JSON's: plain dicts of figures, so
    `to_dict()` and `to_json()` (the file `qtool evaluate --json` writes) show them as they are."""

    qtool_version: str
    onnxruntime_version: str
    task: str  # classification, detection, ctc or generic
    models: dict  # "fp32"/"int8" -> {"path", "size_bytes"}
    data: dict  # {"path" (None for in-memory data), "samples", "labels"}
    outputs: dict  # output name -> fidelity figures (cosine, sqnr_db, errors)
    task_figures: Optional[dict]  # the task's own figures (JSON key: the task's name); None for generic
    size: dict
    macs: dict
    latency: dict
    per_layer: Optional[dict] = None
    sensitivity: Optional[dict] = None
    thresholds: tuple[Verdict, ...] = ()
    passed: bool = True  # every threshold met (True when none was set)
    # {"name", "version"}: where fidelity and latency were measured; on onnxruntime also
    # "exact_int8_products" (qtool.graph.runtime.exact_int8_products: u8u8 kernels on an x86 CPU without VNNI);
    # on OpenVINO "int8_codes_lost_at_concat" (qtool.evaluation.openvino_runtime.codes_lost_at_concat)
    runtime: Optional[dict] = None

    @property
    def classification(self) -> Optional[dict]:
        return self.task_figures if self.task == "classification" else None

    @property
    def detection(self) -> Optional[dict]:
        return self.task_figures if self.task == "detection" else None

    @property
    def ctc(self) -> Optional[dict]:
        return self.task_figures if self.task == "ctc" else None

    @property
    def data_name(self) -> str:
        return self.data["path"] if self.data["path"] is not None else "in-memory data"

    def to_dict(self) -> dict:
        """The report as JSON-ready data, in the key order of the JSON file."""
        out = {"qtool_version": self.qtool_version, "onnxruntime_version": self.onnxruntime_version,
               "task": self.task, "models": self.models, "data": self.data, "outputs": self.outputs}
        if self.runtime is not None:
            out["runtime"] = self.runtime
        if self.task_figures is not None:
            out[self.task] = self.task_figures
        out.update(size=self.size, macs=self.macs, latency=self.latency)
        if self.per_layer is not None:
            out["per_layer"] = self.per_layer
        if self.sensitivity is not None:
            out["sensitivity"] = self.sensitivity
        out["thresholds"] = [asdict(v) for v in self.thresholds]
        out["passed"] = self.passed
        return out

    def to_json(self) -> str:
        return json_text(self.to_dict())


def fmt(value, digits: int = 4) -> str:
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


def summary_rows(report: EvaluationReport) -> list[tuple[str, str, str, str]]:
    """The summary as (figure, fp32, int8, int8 vs fp32) rows: the terminal table and the HTML share it."""
    rows: list[tuple[str, str, str, str]] = [("", "fp32", "int8", "int8 vs fp32")]
    cls = report.classification
    if cls:
        if "top1" in cls:
            rows.append(("top-1", _pct(cls["top1"]["fp32"]), _pct(cls["top1"]["int8"]),
                         f"drop {100 * cls['top1_drop']:+.2f} pts".replace("drop +", "drop ")))
            top_k = next(k for k in cls if k.startswith("top") and k not in ("top1", "top1_drop"))
            rows.append((f"top-{top_k[3:]}", _pct(cls[top_k]["fp32"]), _pct(cls[top_k]["int8"]), ""))
        rows.append(("top-1 agreement", "", "", _pct(cls["agreement"])))
        rows.append(("mean KL(fp32||int8)", "", "", fmt(cls["mean_kl"], 5)))
    det = report.detection
    if det:
        rows.append((f"boxes (score >= {det['settings']['conf_threshold']:g})", str(det["fp32_boxes"]),
                     str(det["int8_boxes"]), f"recall {_pct(det['recall'])}, precision {_pct(det['precision'])}"))
        rows.append((f"matched (same class, IoU >= {det['settings']['match_iou']:g}): mean IoU", "", "",
                     fmt(det["mean_iou"], 3)))
    ctc = report.ctc
    if ctc:
        rows.append(("texts kept (greedy CTC, identical)", "", "",
                     f"{ctc['texts_kept']} of {ctc['samples']} ({_pct(ctc['texts_kept_fraction'])})"))
        rows.append(("mean edit-distance ratio", "", "", fmt(ctc["mean_edit_ratio"], 4)))
    for name, out in report.outputs.items():
        rows.append((f"{name}: cosine", "", "", fmt(out["cosine"], 5)))
        rows.append((f"{name}: SQNR", "", "", f"{fmt(out['sqnr_db'], 2)} dB"))
        rows.append((f"{name}: abs error max / mean", "", "",
                     f"{out['max_abs_error']:.4g} / {out['mean_abs_error']:.4g}"))
    lat = report.latency
    if lat:
        rows.append((f"latency, batch {lat['batch_size']}, {lat['threads']} thread(s), median",
                     f"{lat['fp32_ms']['median']:.2f} ms", f"{lat['int8_ms']['median']:.2f} ms",
                     f"speedup {lat['speedup']:.2f}x"))
        rows.append(("latency p90", f"{lat['fp32_ms']['p90']:.2f} ms", f"{lat['int8_ms']['p90']:.2f} ms", ""))
        if "fp32_f32_ms" in lat:
            rows.append((f"latency, fp32 at f32 (default {lat['fp32_precision']}), median",
                         f"{lat['fp32_f32_ms']['median']:.2f} ms", "", f"speedup {lat['speedup_vs_f32']:.2f}x"))
        if "int8_layers" in lat:
            layers = lat["int8_layers"]
            rows.append(("heavy ops in int8 (runtime model)", "", f"{layers['int8_heavy_ops']} of "
                         f"{layers['heavy_ops']}", f"{layers['unfused_fake_quantize']} FakeQuantize unfused"))
    size = report.size
    rows.append(("file size", f"{size['fp32_bytes'] / 1e6:.2f} MB", f"{size['int8_bytes'] / 1e6:.2f} MB",
                 f"{size['ratio']:.2f}x smaller"))
    macs = report.macs
    if macs:
        rows.append(("MACs per sample (Conv, Gemm, MatMul, RNN)", f"{macs['total'] / 1e6:.1f} M",
                     f"{macs['int8'] / 1e6:.1f} M in int8", f"{_pct(macs['int8_fraction'])} in int8"))
    return rows


def _align(rows: list[tuple[str, ...]], header_rule: bool = True) -> list[str]:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = []
    for i, row in enumerate(rows):
        lines.append("  ".join(cell.ljust(widths[j]) if j == 0 else cell.rjust(widths[j])
                               for j, cell in enumerate(row)).rstrip())
        if i == 0 and header_rule:
            lines.append("  ".join("-" * w for w in widths))
    return lines


def _per_layer_lines(section: dict) -> list[str]:
    by_name = {t["tensor"]: t for t in section["tensors"]}
    rows = [("tensor", "producer", "SQNR dB", "cosine")]
    rows += [(name, by_name[name]["op_type"], fmt(by_name[name]["sqnr_db"], 2), fmt(by_name[name]["cosine"], 5))
             for name in section["worst"]]
    return ([f"per-layer error on {section['samples']} samples ({section['seconds']:.1f} s): "
             f"{len(section['tensors'])} quantized tensors, cumulative error vs fp32; worst {len(section['worst'])} "
             "(all, in graph order: --json, --html)"]
            + _align(rows))


def _sensitivity_lines(section: dict, count: int = 10) -> list[str]:
    rows = [("layer (only it in int8)", "op", "MACs", "output SQNR dB", "cosine")]
    rows += [(r["node"], r["op_type"], f"{r['macs'] / 1e6:.1f} M" if r["macs"] else "-", fmt(r["sqnr_db"], 2),
              fmt(r["cosine"], 5)) for r in section["layers"][:count]]
    return ([f"sensitivity on {section['samples']} samples ({section['seconds']:.1f} s): {len(section['layers'])} "
             f"layers, one at a time in int8; worst {min(count, len(section['layers']))}"] + _align(rows))


def render_table(report: EvaluationReport) -> str:
    header = f"{report.data['samples']} samples from {report.data_name}, task {report.task}"
    if report.runtime is not None:
        header += f", on {report.runtime['name']} {report.runtime['version']}"
        if report.runtime.get("exact_int8_products"):
            header += " (exact int8 products: session.x64quantprecision=1, as this CPU has no VNNI)"
        lost = report.runtime.get("int8_codes_lost_at_concat")
        if lost:
            header += (f" (on this CPU OpenVINO converts int8 codes for its Convolutions and loses the scale of "
                       f"{len(lost)} that reach a Concat, {', '.join(lost[:3])}{', ...' if len(lost) > 3 else ''}: "
                       f"written uint8 with zero point 128 they are computed right)")
        if report.latency and "fp32_precision" in report.latency:
            header += f" (fp32 baseline at its default precision {report.latency['fp32_precision']})"
    lines = [header] + _align(summary_rows(report))
    if report.per_layer is not None:
        lines += [""] + _per_layer_lines(report.per_layer)
    if report.sensitivity is not None:
        lines += [""] + _sensitivity_lines(report.sensitivity)
    return "\n".join(lines)


def _clean(value):
    """JSON has no inf/nan: write them as strings so the file stays standard JSON."""
    if isinstance(value, float) and not math.isfinite(value):
        return "inf" if value == math.inf else "-inf" if value == -math.inf else "nan"
    if isinstance(value, dict):
        return {k: _clean(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_clean(v) for v in value]
    return value


def json_text(report: dict) -> str:
    return json.dumps(_clean(report), indent=2) + "\n"


def write_json(report: dict, path: str | Path) -> None:
    """A report's figures as JSON (an EvaluationReport's: report.to_dict())."""
    atomic.write_text(path, json_text(report))
