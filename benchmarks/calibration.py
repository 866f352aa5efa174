"""Calibration cost benchmark: qtool's methods vs plain fp32 inference vs onnxruntime's calibrators.

EfficientNet-Lite0, the kit's 256 calibration photos preprocessed once by qtool's own
pipeline (configs/efficientnet_lite0.yaml), and 1024 samples made by cycling them with
random crops (75-100% of the side, resized back) and horizontal flips. Every
measurement runs in its own subprocess that streams the same raw float32 batches (8
samples) from a file and reports its wall time and its peak RSS
(getrusage(RUSAGE_SELF).ru_maxrss); the measurements of a round run in a rotated order,
and the table quotes the median of the rounds, with each time also as a ratio to the
plain inference of the same sample count: the median over rounds of the ratio to the same
round's plain inference (the JSON also has `x_plain`, the ratio of the medians).

    plain       onnxruntime session over the batches, outputs discarded
    qtool X     qtool's statistics pass + range choice with method X (in-graph reductions)
    ort X       onnxruntime.quantization create_calibrator(X): collect_data + compute_data

onnxruntime's Percentile calibrator keeps every activation of every sample: a watchdog
kills any measurement whose RSS passes --cap-gb (default 4) and the table says so.

    python benchmarks/calibration.py                 # 256 and 1024 samples, 3 rounds (~15 min)
    python benchmarks/calibration.py --quick         # 64 and 128 samples, 1 round
    python benchmarks/calibration.py --kinds "qtool minmax" --rounds 5 --json benchmarks/calibration_minmax.json
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

CONFIG = ROOT / "configs" / "efficientnet_lite0.yaml"
BATCH = 8
SHAPE = (3, 224, 224)
QTOOL_METHODS = ("minmax", "percentile", "entropy", "mse", "aciq")
ORT_METHODS = ("MinMax", "Percentile")


def _batches(path: Path, count: int):
    """Raw float32 samples read batch by batch with plain reads (no mmap: RSS stays one batch)."""
    per = int(np.prod(SHAPE))
    with open(path, "rb") as f:
        for start in range(0, count, BATCH):
            n = min(BATCH, count - start)
            yield np.fromfile(f, dtype=np.float32, count=n * per).reshape(n, *SHAPE)


def make_samples(kit: Path, out: Path, counts: list[int]) -> dict[int, Path]:
    import cv2

    from qtool.config import load_config
    from qtool.data.dataset import batches, open_data
    from qtool.graph.modelio import input_specs, load_model

    cfg = load_config(CONFIG)
    model = kit / "models" / "efficientnet_lite0_dyn.onnx"
    source = open_data(kit / "data" / "calib" / "images", input_specs(load_model(model)), cfg.preprocess)
    photos = np.concatenate([b.feeds["input"] for b in batches(source, BATCH)])
    rng = np.random.default_rng(0)
    files = {}
    for count in counts:
        path = out / f"samples_{count}.f32"
        with open(path, "wb") as f:
            for i in range(count):
                x = photos[i % len(photos)]
                if i >= len(photos):  # cycled copies: a random crop resized back, flipped half the time
                    side = int(rng.uniform(0.75, 1.0) * SHAPE[1])
                    y0, x0 = rng.integers(0, SHAPE[1] - side + 1, 2)
                    hwc = np.ascontiguousarray(x.transpose(1, 2, 0)[y0:y0 + side, x0:x0 + side])
                    hwc = cv2.resize(hwc, (SHAPE[2], SHAPE[1]), interpolation=cv2.INTER_LINEAR)
                    if rng.random() < 0.5:
                        hwc = hwc[:, ::-1]
                    x = np.ascontiguousarray(hwc.transpose(2, 0, 1))
                f.write(x.astype(np.float32).tobytes())
        files[count] = path
    return files


class _Reader:
    def __init__(self, path: Path, count: int):
        self.it = _batches(path, count)

    def get_next(self):
        batch = next(self.it, None)
        return None if batch is None else {"input": batch}


def measure(kind: str, model: Path, path: Path, count: int, scratch: Path) -> dict:
    """Runs in the subprocess: one measurement."""
    start = time.perf_counter()
    if kind == "plain":
        from qtool.graph.runtime import create_session
        session = create_session(str(model))
        for batch in _batches(path, count):
            session.run(None, {"input": batch})
    elif kind.startswith("qtool "):
        from qtool.calibration.calibrate import build_table
        from qtool.plan.planner import prepared_model
        from qtool.config import CalibrationConfig, load_config
        from qtool.data.dataset import Batch
        from qtool.calibration.method_rules import methods_for, needs_histogram
        from qtool.calibration.observer import observe

        cfg = load_config(CONFIG)
        calib = CalibrationConfig(method=kind.split()[1], batch_size=BATCH)
        prepared, plan = prepared_model(model, cfg.quantization)
        from qtool.calibration.saturation import saturable
        methods = methods_for(prepared, plan.activations, calib)
        histogram_for = needs_histogram(methods)
        data = (Batch([""] * len(b), {"input": b}) for b in _batches(path, count))
        stats = observe(prepared, plan.activations, data, histogram_for=histogram_for,
                        sample_limit=calib.histogram_sample,
                        saturate=saturable(methods, calib))
        build_table(plan, stats, calib, cfg.quantization, model, count, prepared)
    else:
        from onnxruntime.quantization.calibrate import CalibrationMethod, create_calibrator
        method = getattr(CalibrationMethod, kind.split()[1])
        calibrator = create_calibrator(str(model), augmented_model_path=str(scratch / f"aug_{os.getpid()}.onnx"),
                                       calibrate_method=method)
        calibrator.collect_data(_Reader(path, count))
        calibrator.compute_data()
    seconds = time.perf_counter() - start
    return {"seconds": seconds, "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}


def _rss_mb(pid: int) -> float:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return 0.0


def run_one(kind: str, model: Path, path: Path, count: int, scratch: Path, cap_mb: float) -> dict:
    cmd = [sys.executable, __file__, "--measure", kind, "--model", str(model), "--samples-file", str(path),
           "--count", str(count), "--scratch", str(scratch)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    start, peak = time.perf_counter(), 0.0
    while proc.poll() is None:
        peak = max(peak, _rss_mb(proc.pid))
        if peak > cap_mb:
            proc.kill()
            proc.wait()
            return {"error": f"over the {cap_mb / 1024:.0f} GB cap after {time.perf_counter() - start:.0f} s",
                    "peak_rss_mb": peak}
        time.sleep(0.05)
    out, err = proc.communicate()
    if proc.returncode != 0:
        return {"error": (err.strip().splitlines() or ["failed"])[-1][:200]}
    return json.loads(out.strip().splitlines()[-1])


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kit", type=Path, default=ROOT.parent / "shared" / "bench")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--cap-gb", type=float, default=4.0)
    parser.add_argument("--kinds", help="comma-separated subset of the measurements, e.g. 'plain,qtool minmax'")
    parser.add_argument("--counts", help="comma-separated sample counts (default 256,1024; --quick 64,128)")
    parser.add_argument("--json", type=Path, default=ROOT / "benchmarks" / "calibration.json")
    parser.add_argument("--measure", help=argparse.SUPPRESS)
    parser.add_argument("--model", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--samples-file", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--count", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--scratch", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.measure:
        print(json.dumps(measure(args.measure, args.model, args.samples_file, args.count, args.scratch)))
        return 0
    model = args.kit / "models" / "efficientnet_lite0_dyn.onnx"
    if not model.exists():
        parser.error(f"the bench kit is not at {args.kit} (--kit)")
    counts, rounds = ([64, 128], 1) if args.quick else ([256, 1024], args.rounds)
    if args.counts:
        counts = [int(c) for c in args.counts.split(",")]
    kinds = ["plain", *(f"qtool {m}" for m in QTOOL_METHODS), *(f"ort {m}" for m in ORT_METHODS)]
    if args.kinds:  # plain always: every ratio divides by it
        wanted = {k.strip() for k in args.kinds.split(",")}
        unknown = wanted - set(kinds)
        if unknown:
            parser.error(f"unknown --kinds {sorted(unknown)}; choose from {kinds}")
        kinds = [k for k in kinds if k in wanted or k == "plain"]
    results: dict[str, dict[str, list]] = {str(c): {k: [] for k in kinds} for c in counts}
    with tempfile.TemporaryDirectory(prefix="qtool-calbench-") as tmp:
        files = make_samples(args.kit, Path(tmp), counts)
        for r in range(rounds):
            for count in counts:
                shift = (r + counts.index(count)) % len(kinds)
                for kind in kinds[shift:] + kinds[:shift]:  # rotated order, round by round
                    res = run_one(kind, model, files[count], count, Path(tmp), args.cap_gb * 1024)
                    results[str(count)][kind].append(res)
                    print(f"  round {r + 1} {count:5d} {kind:18s} "
                          + (res.get("error") or f"{res['seconds']:.2f} s {res['peak_rss_mb']:.0f} MB"), flush=True)
    summary = summarize(results, counts, kinds)
    meta = {"model": model.name, "batch_size": BATCH, "rounds": rounds, "load_average": os.getloadavg(),
            "cpus": os.cpu_count(), "cap_gb": args.cap_gb}
    table = markdown(summary, counts, kinds)
    print(table)
    from qtool.evaluation.report import write_json
    write_json({"benchmark": "calibration", **meta, "summary": summary, "runs": results}, args.json)
    print(f"load average {meta['load_average']} -> {args.json}")
    return 0


def summarize(results, counts, kinds) -> dict:
    summary = {}
    for count in counts:
        rows = {}
        for kind in kinds:
            ok = [r for r in results[str(count)][kind] if "seconds" in r]
            if not ok:
                errors = [r for r in results[str(count)][kind]]
                rows[kind] = {"error": errors[0].get("error") if errors else "not run",
                              "peak_rss_mb": max((e.get("peak_rss_mb", 0) for e in errors), default=0)}
                continue
            rows[kind] = {"seconds": statistics.median(r["seconds"] for r in ok),
                          "peak_rss_mb": statistics.median(r["peak_rss_mb"] for r in ok), "runs": len(ok)}
        plain = rows["plain"].get("seconds")
        for kind, row in rows.items():
            if "seconds" in row and plain:
                row["x_plain"] = row["seconds"] / plain
            # each round's time over the same round's plain inference (the same load), then the median:
            # fairer than the ratio of medians on a machine whose load changes between rounds
            runs = zip(results[str(count)][kind], results[str(count)]["plain"])
            paired = [r["seconds"] / p["seconds"] for r, p in runs if "seconds" in r and "seconds" in p]
            if "seconds" in row and paired:
                row["x_plain_rounds"] = statistics.median(paired)
        summary[str(count)] = rows
    for kind in kinds:  # memory growth from the smaller to the larger sample count
        a, b = (summary[str(c)][kind].get("peak_rss_mb") for c in (counts[0], counts[-1]))
        if len(counts) > 1 and a and b and "seconds" in summary[str(counts[-1])][kind]:
            summary[str(counts[-1])][kind]["rss_growth"] = b / a
    return summary


def markdown(summary, counts, kinds) -> str:
    lines = ["| method | " + " | ".join(f"{c} samples: time, x plain (median of per-round ratios), peak RSS"
                                       for c in counts)
             + f" | RSS {counts[-1]}/{counts[0]} |", "|---|" + "---|" * (len(counts) + 1)]
    for kind in kinds:
        cells = []
        for c in counts:
            row = summary[str(c)][kind]
            if "seconds" in row:
                ratio = row.get("x_plain_rounds", 0)
                cells.append(f"{row['seconds']:.2f} s, {ratio:.2f}x, {row['peak_rss_mb']:.0f} MB")
            else:
                cells.append(f"did not fit: {row['error']}")
        growth = summary[str(counts[-1])][kind].get("rss_growth")
        lines.append(f"| {kind} | " + " | ".join(cells) + f" | {f'{growth:.2f}x' if growth else ''} |")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
