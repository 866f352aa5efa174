"""Held-out models on OpenVINO: benchmarks/heldout.py's twelve models (never used to build or tune
qtool) quantized by qtool --target openvino, qtool --target ort-cpu and NNCF's default, then run on
OpenVINO as benchmarks/openvino.py runs the kit's.

    python benchmarks/heldout_openvino.py --nncf-python PY [--cache /work/heldout] [--only a,b]
        [--rounds 40] [--timing turns|processes] [--json out.json] [--table-from out.json]

Sources, calibration and held-out samples are heldout.py's (the same cache); each quantizer gets
the calibration samples as .npz files. Per model and quantizer, as benchmarks/openvino.py
measures: speed against fp32 at OpenVINO's default precision (1 thread, batch 1), the mean
worst-output cosine to fp32 at f32 over the held-out samples on OpenVINO, unfused FakeQuantize
nodes and int8 heavy ops of the runtime model, time to quantize. NNCF runs in its own virtual
environment (benchmarks/openvino_nncf.py).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import re
from pathlib import Path

HERE = Path(__file__).resolve().parent


def _load(name: str, file: str):
    spec = importlib.util.spec_from_file_location(name, HERE / file)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


ov_bench = _load("ov_bench", "openvino.py")  # takes this folder off sys.path, puts qtool on it
try:  # the real package, cached before heldout puts this folder first on sys.path
    import openvino  # noqa: E402,F401
except ImportError:  # --help still works; measuring says OpenVINO is missing
    pass
heldout = _load("heldout", "heldout.py")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kit", type=Path, default=HERE.parents[1] / "shared" / "bench")
    parser.add_argument("--cache", type=Path, default=Path("/work/heldout"))
    parser.add_argument("--nncf-python", help="python of a virtual environment with nncf")
    parser.add_argument("--only", default="", help="comma-separated name prefixes")
    parser.add_argument("--rounds", type=int, default=40)
    parser.add_argument("--timing", choices=("processes", "turns"), default="turns")
    parser.add_argument("--json", type=Path, help="write the rows here")
    parser.add_argument("--table-from", type=Path, help="print the table of a --json file and stop")
    args = parser.parse_args()
    if args.table_from:
        saved = json.loads(args.table_from.read_text())
        print(ov_bench.table(saved["rows"], saved["load"]))
        return
    if not args.nncf_python:
        parser.error("--nncf-python is required")
    ov_bench.TIMING[0] = args.timing
    wanted = [p for p in args.only.split(",") if p]
    rows, loads = [], []
    for name, spec in heldout.models(args.kit, args.cache).items():
        if wanted and not any(name.startswith(p) for p in wanted):
            continue
        work = args.cache / "openvino" / re.sub(r"\W+", "_", name.split(" (")[0])
        calib = heldout.written(spec["calib"], work / "calib")
        held = heldout.written(spec["held"], work / "held")
        made = ov_bench.quantize(Path(spec["path"]), calib, work, args.nncf_python, {})
        loads.append(os.getloadavg()[0])
        try:
            figures = ov_bench.measure(Path(spec["path"]), made, held, args.rounds)
        except Exception as exc:  # noqa: BLE001 - the fp32 model itself fails on OpenVINO: say so
            print(json.dumps({"model": name, "error": str(exc).splitlines()[0]}), flush=True)
            continue
        loads.append(os.getloadavg()[0])
        row = {"model": name, "figures": figures}
        rows.append(row)
        print(json.dumps(row, default=str), flush=True)
    load = f"load average {min(loads):.1f}-{max(loads):.1f} on {os.cpu_count()} cores" if loads else ""
    if args.json:
        args.json.write_text(json.dumps({"rows": rows, "load": load}, default=str))
    print(ov_bench.table(rows, load))


if __name__ == "__main__":
    main()
