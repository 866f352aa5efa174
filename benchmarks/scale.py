"""Scale-out benchmark: one process vs a Dask LocalCluster, for calibration and evaluation.

EfficientNet-Lite0 (configs/efficientnet_lite0.yaml) on 1,024 kit photos: the 256
calibration photos and the 500 ImageNet dev photos, cycled (a folder of symbolic links,
so every configuration decodes JPEGs as a user's run does). Three configurations of
the same CLI command, each in its own subprocess:

    1 process, 1 thread    pinned to one core (taskset -c 0): onnxruntime and the decoders get one core
    1 process, 2 threads   today's default: onnxruntime uses both cores
    dask local:2           --dask local:2: two single-threaded worker processes (cluster start-up included)

and three jobs: `calibrate --method minmax`, `calibrate --method percentile`, and
`evaluate` (fp32 vs the int8 model, --runs 5). A round runs every (job, configuration)
pair in a rotated order; the table quotes the median wall time of the rounds (default 3)
and the largest resident set of each process of the run (sampled every 50 ms from
/proc: the coordinator, and for Dask each worker), with the speedup over one
single-threaded process. On a multi-machine cluster the figure that carries over is
the per-worker throughput (samples per second per single-threaded worker).

    python benchmarks/scale.py                      # 1,024 samples, 3 rounds
    python benchmarks/scale.py --quick              # 64 samples, 1 round (does it work?)
    python benchmarks/scale.py --json benchmarks/scale.json
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
KIT = ROOT.parent / "shared" / "bench"
CONFIG = ROOT / "configs" / "efficientnet_lite0.yaml"
CONFIGS = {
    "1 process, 1 thread": (["taskset", "-c", "0"], []),
    "1 process, 2 threads": ([], []),
    "dask local:2": ([], ["--dask", "local:2"]),
}
JOBS = ("calibrate minmax", "calibrate percentile", "evaluate")


def make_data(out: Path, count: int) -> Path:
    """`count` symbolic links to the kit's photos, cycled in a fixed order."""
    photos = sorted((KIT / "data" / "calib" / "images").iterdir()) + \
        sorted((KIT / "data" / "imagenet_dev" / "images").iterdir())
    folder = out / f"photos_{count}"
    folder.mkdir()
    for i in range(count):
        source = photos[i % len(photos)]
        (folder / f"{i:05d}{source.suffix.lower()}").symlink_to(source)
    return folder


def _qtool(*args) -> list[str]:
    return [sys.executable, "-m", "qtool", *map(str, args)]


def command(job: str, model: Path, int8: Path, data: Path, out: Path) -> list[str]:
    if job.startswith("calibrate"):
        return _qtool("calibrate", model, "--data", data, "--config", CONFIG, "--method", job.split()[1],
                      "-o", out / "table.json")
    return _qtool("evaluate", model, int8, "--data", data, "--config", CONFIG, "--runs", 5,
                  "--json", out / "report.json")


def _tree(pid: int) -> list[int]:
    """pid and its descendants (from /proc)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                parent = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(parent, []).append(int(entry.name))
    found, todo = [], [pid]
    while todo:
        p = todo.pop()
        found.append(p)
        todo.extend(children.get(p, []))
    return found


def _rss_mb(pid: int) -> float:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return 0.0


def run(cmd: list[str]) -> dict:
    """Wall time and the peak RSS of each process of the run (the largest first)."""
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    peaks: dict[int, float] = {}
    while proc.poll() is None:
        for pid in _tree(proc.pid):
            peaks[pid] = max(peaks.get(pid, 0.0), _rss_mb(pid))
        time.sleep(0.05)
    seconds = time.perf_counter() - start
    _, stderr = proc.communicate()
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed ({proc.returncode}): {stderr.strip()[-500:]}")
    # the interpreter itself, dask's helpers (a resource tracker) stay small: keep the real processes
    rss = sorted((mb for mb in peaks.values() if mb > 100), reverse=True)
    return {"seconds": seconds, "peak_rss_mb": rss}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--count", type=int, default=1024)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="64 samples, 1 round")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    count, rounds = (64, 1) if args.quick else (args.count, args.rounds)
    model = KIT / "models" / "efficientnet_lite0_dyn.onnx"
    if not model.exists():
        raise SystemExit(f"the bench kit is not at {KIT}")
    if shutil.which("taskset") is None:
        raise SystemExit("taskset (util-linux) is needed to pin the single-threaded run to one core")
    results: dict[str, dict[str, list[dict]]] = {job: {name: [] for name in CONFIGS} for job in JOBS}
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        data = make_data(tmp, count)
        int8 = tmp / "int8.onnx"
        subprocess.run(_qtool("quantize", model, "--data", KIT / "data" / "calib" / "images", "--config", CONFIG,
                              "--bias-correction", "off", "--weight-rounding", "nearest", "-o", int8),
                       env=dict(os.environ, PYTHONPATH=str(ROOT)), check=True, capture_output=True)
        pairs = [(job, name) for job in JOBS for name in CONFIGS]
        for r in range(rounds):
            for job, name in pairs[r % len(pairs):] + pairs[:r % len(pairs)]:  # rotated: drift hits all alike
                prefix, extra = CONFIGS[name]
                res = run(prefix + command(job, model, int8, data, tmp) + extra)
                results[job][name].append(res)
                print(f"round {r + 1} {job:22s} {name:22s} {res['seconds']:7.1f} s  "
                      f"RSS {' + '.join(f'{mb:.0f}' for mb in res['peak_rss_mb'])} MB", flush=True)
    summary = summarize(results, count)
    print(markdown(summary, count))
    if args.json:
        args.json.write_text(json.dumps({"samples": count, "rounds": rounds, "cpus": os.cpu_count(),
                                         "summary": summary, "runs": results}, indent=2) + "\n")
    return 0


def summarize(results: dict, count: int) -> dict:
    summary = {}
    for job, by_config in results.items():
        base = statistics.median(r["seconds"] for r in by_config["1 process, 1 thread"])
        summary[job] = {}
        for name, runs in by_config.items():
            seconds = statistics.median(r["seconds"] for r in runs)
            workers = 2 if name.startswith("dask") else 1
            summary[job][name] = {
                "seconds": seconds, "speedup": base / seconds,
                "samples_per_s_per_worker": count / seconds / workers,
                "peak_rss_mb": [statistics.median(mbs) for mbs in zip(*(r["peak_rss_mb"] for r in runs))]}
    return summary


def markdown(summary: dict, count: int) -> str:
    lines = [f"| job ({count} samples) | configuration | wall s | vs 1 thread | samples/s per worker | "
             "peak RSS per process (MB) |", "|---|---|---:|---:|---:|---|"]
    for job, by_config in summary.items():
        for name, s in by_config.items():
            rss = " + ".join(f"{mb:.0f}" for mb in s["peak_rss_mb"])
            lines.append(f"| {job} | {name} | {s['seconds']:.1f} | {s['speedup']:.2f}x | "
                         f"{s['samples_per_s_per_worker']:.1f} | {rss} |")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
