"""The OpenVINO speed rule's threshold: qtool --target openvino with convolutions under T MACs float,
for several T, against NNCF's default int8, on OpenVINO.

    python benchmarks/openvino_conv_sizes.py --out DIR [--nncf-python PY] [--thresholds 0,65536,262144,1048576]
        [--rounds 200] [--models NAME,...]

For each kit model that has convolutions and each threshold T: `qtool quantize MODEL --data <calib>
--target openvino` in a child process whose qtool.plan.speed_openvino.MIN_CONV_MACS is T (0: every
convolution int8). NNCF's model is DIR/<model>/nncf.onnx when benchmarks/openvino.py --out DIR made it,
else made here with --nncf-python. Then benchmarks/openvino.py's measure: fp32 at OpenVINO's default
precision and every int8 model, each alone in its own process, the processes taking turns (10
repetitions), 1 thread, batch 1, medians of the CPU time per run; cosine as there. Prints one JSON
line per model and a markdown table.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("ov_bench", Path(__file__).with_name("openvino.py"))
ov_bench = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(ov_bench)  # noqa: E305 - sets sys.path for qtool and openvino too

CHILD = ("import sys; import qtool.plan.speed_openvino as rule; rule.MIN_CONV_MACS = int(sys.argv.pop(1)); "
         "from qtool.cli import main; sys.argv[0] = 'qtool'; main()")


def quantize(model: Path, calib: Path, out: Path, threshold: int) -> dict:
    start = time.perf_counter()
    done = subprocess.run([sys.executable, "-c", CHILD, str(threshold), "quantize", str(model), "--data", str(calib),
                           "--target", "openvino", "-o", str(out), "--json", str(out.with_suffix(".json"))],
                          capture_output=True, text=True, cwd=ROOT)
    if done.returncode:
        return {"error": (done.stderr.strip().splitlines() or ["?"])[-1]}
    decisions = json.loads(out.with_suffix(".json").read_text())["decisions"]
    floated = next((d["value"] for d in decisions if d["option"] == "quantization.advanced.float_nodes"), [])
    return {"path": out, "float": len(floated), "seconds": time.perf_counter() - start}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kit", type=Path, default=ROOT.parent / "shared" / "bench")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--nncf-python", default=None)
    parser.add_argument("--thresholds", default="0,65536,262144,1048576")
    parser.add_argument("--rounds", type=int, default=200)
    parser.add_argument("--models", default="")
    args = parser.parse_args()
    thresholds = [int(t) for t in args.thresholds.split(",")]
    wanted = {m for m in args.models.split(",") if m}
    rows = []
    for model in sorted((args.kit / "models").glob("*.onnx")):
        if (wanted and model.stem not in wanted) or not any(
                n.op_type == "Conv" for n in ov_bench.onnx.load(str(model), load_external_data=False).graph.node):
            continue
        work = args.out / model.stem
        work.mkdir(parents=True, exist_ok=True)
        calib, held, _ = ov_bench._data(args.kit, model, work)
        made = {f"T={t}": quantize(model, calib, work / f"conv_sizes_{t}.onnx", t) for t in thresholds}
        if (work / "nncf.onnx").exists():
            made["nncf"] = {"path": work / "nncf.onnx"}
        elif args.nncf_python:
            made["nncf"] = ov_bench.quantize(model, calib, work, args.nncf_python, {})["nncf"]
        try:
            figures = ov_bench.measure(model, made, held, args.rounds)
        except Exception as exc:  # noqa: BLE001 - the fp32 model itself fails on OpenVINO: say so
            print(json.dumps({"model": model.stem, "error": str(exc).splitlines()[0]}), flush=True)
            continue
        base = figures["fp32"]["cpu_ms"]
        row = {"model": model.stem, "load": ov_bench.os.getloadavg()[0],
               "figures": {label: {"speed": base / f["cpu_ms"], "cosine": f["cosine"], "float": f.get("float")}
                           for label, f in figures.items() if "cpu_ms" in f and label not in ("fp32", "fp32_f32")}}
        rows.append(row)
        print(json.dumps(row), flush=True)
    labels = [f"T={t}" for t in thresholds] + ["nncf"]
    print("| model | " + " | ".join(labels) + " |")
    print("|---" * (len(labels) + 1) + "|")
    for row in rows:
        cells = []
        for label in labels:
            f = row["figures"].get(label)
            cells.append("-" if f is None else f"{f['speed']:.2f}x / {f['cosine']:.4f}"
                         + (f" ({f['float']} float)" if f.get("float") else ""))
        print(f"| {row['model']} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
