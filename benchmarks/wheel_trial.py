"""A folder of models tried once each as a new user would: the plain command and evaluate.

    python benchmarks/wheel_trial.py FOLDER [--runs 30]

FOLDER holds `m/NAME.onnx` and, per model, `data/NAME/calib/` (calibration samples) and
`data/NAME/eval/` or `data/NAME/held/` (held-out samples), in qtool's --data formats. Per model it
runs `qtool quantize m/NAME.onnx --data data/NAME/calib -o OUT` (nothing else) and, where that exits
0, `qtool evaluate` of fp32 against int8 on the held-out samples, and prints one JSON line: the
exit, the wall seconds to quantize, the last line on stderr, and from evaluate's JSON the worst
output's cosine and SQNR, the outputs' count and the speedup. Outputs go to a temporary folder.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def trial(folder: Path, name: str, out: Path, runs: int) -> dict:
    model, calib = folder / "m" / f"{name}.onnx", folder / "data" / name / "calib"
    held = next((p for p in (folder / "data" / name / "eval", folder / "data" / name / "held") if p.exists()), None)
    int8 = out / f"{name}.onnx"
    start = time.perf_counter()
    run = subprocess.run([sys.executable, "-m", "qtool", "quantize", str(model), "--data", str(calib), "-o", str(int8)],
                         capture_output=True, text=True)
    row = {"model": name, "exit": run.returncode, "seconds": round(time.perf_counter() - start, 1),
           "last": (run.stderr.strip().splitlines() or [""])[-1][:160]}
    if run.returncode == 0 and held is not None:
        report = out / f"{name}.json"
        subprocess.run([sys.executable, "-m", "qtool", "evaluate", str(model), str(int8), "--data", str(held),
                        "--json", str(report), "--runs", str(runs)], capture_output=True, text=True)
        if report.exists():
            doc = json.loads(report.read_text())
            outputs = doc["outputs"].values()
            row.update(outputs=len(doc["outputs"]), cosine=round(min(float(o["cosine"]) for o in outputs), 5),
                       sqnr_db=round(min(float(o["sqnr_db"]) for o in outputs), 2),
                       speedup=round(doc["latency"]["speedup"], 2))
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("folder", type=Path)
    parser.add_argument("--runs", type=int, default=30)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        for model in sorted((args.folder / "m").glob("*.onnx")):
            if (args.folder / "data" / model.stem / "calib").exists():
                print(json.dumps(trial(args.folder, model.stem, Path(tmp), args.runs)), flush=True)


if __name__ == "__main__":
    main()
