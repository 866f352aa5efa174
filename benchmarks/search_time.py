"""Time of `qtool search` on kit models: wall and CPU time of the whole command, and what it chose.

    python benchmarks/search_time.py [--kit ../shared/bench] [--models a,b] [--target-cosine 0.995] [--repo DIR]

Each run is `qtool search MODEL --data <calib> --eval-data <eval> --target-cosine T -o out.onnx`
in a child process (calibration, the range choices, the search and the write included); its wall
time, CPU time (user + sys of the child, getrusage) and the float layers it chose are printed, with
the load average before and after (the machine is shared). Samples: the kit's inputs/<model>/calib,
every fourth file held back as evaluation data, as benchmarks/quantize_time.py does. --repo runs
another checkout's qtool (PYTHONPATH) for a before/after comparison; runs of the repos alternate.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TARGETS = {"rapidocr_v4_rec": 0.995, "rapidocr_v4_det": 0.999, "nudenet_yolov8n_320": 0.999}


def split(kit: Path, model: str, work: Path) -> tuple[Path, Path]:
    calib, held = work / model / "calib", work / model / "eval"
    calib.mkdir(parents=True, exist_ok=True)
    held.mkdir(parents=True, exist_ok=True)
    for i, f in enumerate(sorted((kit / "inputs" / model / "calib").iterdir())):
        (held if i % 4 == 3 else calib).joinpath(f.name).symlink_to(f)
    return calib, held


def run(repo: Path, kit: Path, model: str, calib: Path, held: Path, target: float, work: Path) -> dict:
    out = work / f"{model}_{repo.name}.onnx"
    cmd = [sys.executable, "-m", "qtool", "search", str(kit / "models" / f"{model}.onnx"), "--data", str(calib),
           "--eval-data", str(held), "--target-cosine", str(target), "-o", str(out)]
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    load = os.getloadavg()[0]
    start = time.perf_counter()
    done = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(repo)})
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return {"model": model, "repo": str(repo), "target": target, "wall_s": round(wall, 1), "cpu_s": round(cpu, 1),
            "load_before": round(load, 1), "load_after": round(os.getloadavg()[0], 1), "exit": done.returncode,
            "chosen": (done.stdout.strip().splitlines() or [""])[-1],
            "log": [line for line in done.stderr.splitlines() if line.strip()][-40:]}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--kit", default=str(ROOT.parent / "shared" / "bench"))
    parser.add_argument("--models", default=",".join(TARGETS))
    parser.add_argument("--target-cosine", type=float, default=None, help="one target for every model")
    parser.add_argument("--repo", action="append", default=[], help="checkouts to run (default: this one)")
    parser.add_argument("--repeat", type=int, default=1)
    args = parser.parse_args()
    kit = Path(args.kit)
    repos = [Path(r).resolve() for r in args.repo] or [ROOT]
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        for model in args.models.split(","):
            calib, held = split(kit, model, work)
            target = args.target_cosine or TARGETS[model]
            for _ in range(args.repeat):
                for repo in repos:
                    print(json.dumps(run(repo, kit, model, calib, held, target, work)), flush=True)


if __name__ == "__main__":
    main()
