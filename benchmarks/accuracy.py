"""Accuracy benchmark: EfficientNet-Lite0 fp32 vs qtool int8 vs onnxruntime's quantize_static.

Every int8 model is calibrated on the same photos (the kit's 256 calibration photos,
preprocessed once by qtool's own pipeline with configs/efficientnet_lite0.yaml) and
evaluated on the same dev images (500 labelled ImageNet photos): top-1, top-1
agreement with fp32, mean KL(fp32 softmax || int8 softmax). Latency is measured after
that, every model in ONE process taking turns run by run (batch 8, 1 thread), and the
speedup is fp32's median over the model's median.

    python benchmarks/accuracy.py            # the full run (about 10 minutes on 2 cores)
    python benchmarks/accuracy.py --quick    # 32 calibration photos, 100 dev images, 5 timed runs

onnxruntime variants: QDQ format, per-channel int8 weights, MinMax or Percentile
calibration, uint8 or int8 activations. Percentile keeps every activation of every
sample it is given, so it is fed in strides of 32 photos (onnxruntime's own
CalibStridedMinMax option, which merges the histograms stride by stride); its ranges
are cached and shared by the uint8 and int8 runs of the same method.
"""

from __future__ import annotations

import argparse
import inspect
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from qtool.calibration.calibrate import calibrate  # noqa: E402
from qtool.config import CalibrationConfig, load_config  # noqa: E402
from qtool.data.dataset import Batch, batches, open_data  # noqa: E402
from qtool.graph.runtime import time_models  # noqa: E402
from qtool.data.labels import read_label_file  # noqa: E402
from qtool.evaluation.metrics import ClassificationAccumulator, percentile_ms  # noqa: E402
from qtool.graph.modelio import input_specs, load_model, save_model  # noqa: E402
from qtool.quantization.quantize import quantize_model  # noqa: E402
from qtool.calibration.ranges import METHODS  # noqa: E402
from qtool.evaluation.report import write_json  # noqa: E402
from qtool.graph.runtime import create_session  # noqa: E402

CONFIG = ROOT / "configs" / "efficientnet_lite0.yaml"
BATCH = 8
ORT_STRIDE_SAMPLES = 32


class _Reader:
    """onnxruntime CalibrationDataReader over preprocessed batches, with the range API that
    CalibStridedMinMax needs."""

    def __init__(self, data: list[Batch]):
        self.data = data
        self.start, self.end = 0, len(data)
        self.position = 0

    def __len__(self) -> int:
        return len(self.data)

    def set_range(self, start_index: int, end_index: int) -> None:
        self.start, self.end, self.position = start_index, end_index, start_index

    def get_next(self):
        if self.position >= self.end:
            return None
        self.position += 1
        return self.data[self.position - 1].feeds

    def rewind(self) -> None:
        self.position = self.start


def _stride(batch_count: int) -> int:
    """The largest number of batches <= ORT_STRIDE_SAMPLES worth that divides the total (ORT requires it)."""
    best = 1
    for k in range(1, max(1, ORT_STRIDE_SAMPLES // BATCH) + 1):
        if batch_count % k == 0:
            best = k
    return best


def qtool_variants(model: Path, calib_dir: Path, samples: int, out: Path) -> dict[str, dict]:
    cfg = load_config(CONFIG)
    # Every range method alone (ranges only: quantize from the table, as `quantize --table` does),
    # then the config's full job (`quantize --data`: its data-driven steps, bias correction and
    # adaptive rounding when the config turns them on).
    settings = [(f"qtool {m}, u8 act, ranges only", m, "uint8", False) for m in METHODS]
    settings.append((f"qtool {cfg.calibration.method}, s8 act, ranges only", cfg.calibration.method, "int8", False))
    settings.append((f"qtool default (config: {_steps(cfg)}), u8 act", cfg.calibration.method, "uint8", True))
    variants = {}
    for name, method, dtype, with_data in settings:
        start = time.perf_counter()
        options = replace(cfg.quantization, activation_dtype=dtype)
        calib = CalibrationConfig(method=method, num_samples=samples, batch_size=BATCH)
        table = calibrate(model, calib_dir, cfg.preprocess, calib, options, progress=False)
        path = out / f"qtool_{method}_{dtype}{'_data' if with_data else ''}.onnx"
        specs = input_specs(load_model(model))
        data = (lambda limit: batches(open_data(calib_dir, specs, cfg.preprocess), BATCH, min(limit, samples))) \
            if with_data else None
        save_model(quantize_model(model, table, options, data=data).model, path)
        variants[name] = {"path": str(path), "seconds_to_quantize": time.perf_counter() - start}
        print(f"  {name}: {variants[name]['seconds_to_quantize']:.1f} s", flush=True)
    return variants


def _steps(cfg) -> str:
    """The config's method and the data-driven steps it turns on."""
    steps = [cfg.calibration.method]
    if cfg.quantization.bias_correction != "off":
        steps.append("bias correction")
    if cfg.quantization.weight_rounding != "nearest":
        steps.append("adaptive rounding")
    if cfg.quantization.equalize:
        steps.append("equalization")
    return " + ".join(steps)


def ort_variants(model: Path, calib: list[Batch], out: Path) -> dict[str, dict]:
    from onnxruntime.quantization import CalibrationMethod, QuantFormat, QuantType, quantize_static

    can_cache = "calibration_cache_path" in inspect.signature(quantize_static).parameters  # onnxruntime >= 1.32
    variants = {}
    for method in (CalibrationMethod.MinMax, CalibrationMethod.Percentile):
        # the u8 and s8 runs of a method share its ranges
        cached = {"calibration_cache_path": str(out / f"ort_{method.name}_ranges.json")} if can_cache else {}
        for dtype, qtype in (("u8", QuantType.QUInt8), ("s8", QuantType.QInt8)):
            name = f"onnxruntime {method.name}, {dtype} act"
            path = out / f"ort_{method.name}_{dtype}.onnx"
            start = time.perf_counter()
            quantize_static(str(model), str(path), _Reader(calib), quant_format=QuantFormat.QDQ, per_channel=True,
                            activation_type=qtype, weight_type=QuantType.QInt8, calibrate_method=method,
                            extra_options={"CalibStridedMinMax": _stride(len(calib))}, **cached)
            variants[name] = {"path": str(path), "seconds_to_quantize": time.perf_counter() - start,
                              "ranges_cached": bool(cached) and dtype == "s8"}
            print(f"  {name}: {variants[name]['seconds_to_quantize']:.1f} s", flush=True)
    return variants


def accuracy(paths: dict[str, str], dev: list[Batch], labels) -> dict[str, dict]:
    """Top-1 of every model; agreement and KL against fp32 (the first entry)."""
    names = list(paths)
    logits = {}
    for name in names:
        session = create_session(paths[name], 0, name)
        logits[name] = [session.run(None, batch.feeds)[0] for batch in dev]
    results = {}
    for name in names:
        acc = ClassificationAccumulator()
        for batch, ref, test in zip(dev, logits[names[0]], logits[name]):
            acc.update(ref, test, [labels.get(k) for k in batch.keys])
        r = acc.result()
        results[name] = {"top1": r["top1"]["int8"], "agreement": r["agreement"], "mean_kl": r["mean_kl"],
                         "samples": r["samples"]}
    return results


def latency(paths: dict[str, str], feeds: dict[str, np.ndarray], runs: int) -> dict[str, dict]:
    times = time_models(paths, feeds, threads=1, warmup=3, runs=runs)
    fp32 = percentile_ms(times["fp32"], 50)
    return {name: {"median_ms": percentile_ms(t, 50), "p90_ms": percentile_ms(t, 90),
                   "speedup": fp32 / percentile_ms(t, 50)} for name, t in times.items()}


def markdown(rows: dict[str, dict], meta: dict) -> str:
    lines = [f"| EfficientNet-Lite0 ({meta['calibration_samples']} calibration photos, {meta['dev_samples']} dev "
             f"images) | top-1 | agreement | mean KL | latency (batch {BATCH}, 1 thread) | speedup | "
             "quantize time |",
             "|---|---|---|---|---|---|---|"]
    for name, r in rows.items():
        if name == "fp32":
            lines.append(f"| fp32 | {100 * r['top1']:.1f} | | | {r['median_ms']:.0f} ms | | |")
            continue
        seconds = f"{r['seconds_to_quantize']:.0f} s" + (" (ranges cached)" if r.get("ranges_cached") else "")
        lines.append(f"| {name} | {100 * r['top1']:.1f} | {100 * r['agreement']:.1f}% | {r['mean_kl']:.4f} | "
                     f"{r['median_ms']:.0f} ms | {r['speedup']:.2f}x | {seconds} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kit", type=Path, default=ROOT.parent / "shared" / "bench", help="the bench kit")
    parser.add_argument("--quick", action="store_true", help="32 calibration photos, 100 dev images, 5 runs")
    parser.add_argument("--json", type=Path, default=ROOT / "benchmarks" / "accuracy.json", help="results file")
    args = parser.parse_args(argv)
    calib_samples, dev_samples, runs = (32, 100, 5) if args.quick else (256, 500, 20)
    model = args.kit / "models" / "efficientnet_lite0_dyn.onnx"
    calib_dir = args.kit / "data" / "calib" / "images"
    dev_dir = args.kit / "data" / "imagenet_dev"
    if not model.exists():
        parser.error(f"the bench kit is not at {args.kit} (--kit)")

    cfg = load_config(CONFIG)
    specs = input_specs(load_model(model))
    calib = list(batches(open_data(calib_dir, specs, cfg.preprocess), BATCH, calib_samples))
    dev = list(batches(open_data(dev_dir / "images", specs, cfg.preprocess), BATCH, dev_samples))
    labels = read_label_file(dev_dir / "labels.tsv")
    with tempfile.TemporaryDirectory(prefix="qtool-bench-") as tmp:
        print("quantizing:", flush=True)
        variants = {"fp32": {"path": str(model)}}
        variants.update(qtool_variants(model, calib_dir, calib_samples, Path(tmp)))
        variants.update(ort_variants(model, calib, Path(tmp)))
        paths = {name: v["path"] for name, v in variants.items()}
        print("evaluating on the dev images, then timing (interleaved) ...", flush=True)
        acc = accuracy(paths, dev, labels)
        lat = latency(paths, dev[0].feeds, runs)
    rows = {name: {**acc[name], **lat[name], **{k: v for k, v in variants[name].items() if k != "path"}}
            for name in variants}
    meta = {"model": model.name, "calibration_samples": sum(len(b) for b in calib),
            "dev_samples": sum(len(b) for b in dev), "batch_size": BATCH, "threads": 1, "timed_runs": runs,
            "quick": args.quick}
    table = markdown(rows, meta)
    print(table)
    write_json({"benchmark": "accuracy", **meta, "results": rows}, args.json)
    print(f"-> {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
