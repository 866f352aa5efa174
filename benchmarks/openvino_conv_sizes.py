"""The OpenVINO speed rule's threshold: qtool --target openvino with convolutions under T MACs float,
for several T, against NNCF's default int8, on OpenVINO.

    python benchmarks/openvino_conv_sizes.py --out DIR [--nncf-python PY] [--thresholds 0,65536,262144,1048576]
        [--min-share 0.5] [--rounds 200] [--models NAME,...]
    python benchmarks/openvino_conv_sizes.py --out DIR --layers [--rounds 200] [--models NAME,...]

For each kit model that has convolutions and each threshold T: `qtool quantize MODEL --data <calib>
--target openvino` in a child process whose qtool.plan.speed_openvino.MIN_CONV_MACS is T (0: every
convolution int8) and MIN_SHARE is --min-share (0: the threshold alone decides). NNCF's model is
DIR/<model>/nncf.onnx when benchmarks/openvino.py --out DIR made it, else made here with --nncf-python.
Then benchmarks/openvino.py's measure: fp32 at OpenVINO's default precision and every int8 model,
each alone in its own process, the processes taking turns (10 repetitions), 1 thread, batch 1,
medians of the CPU time per run; cosine as there. Prints one JSON line per model and a markdown table.

--layers: per heavy op instead (OpenVINO's PERF_COUNT), the fp32 model at the default precision
against the T=0 int8 model, both compiled in this process and run in turns: each op's median time
in both, the ops matched in the order of the two runtime models (a model whose heavy ops do not
match one to one is left out), summed per kind (convolutions, FullyConnected/MatMul) and per
power of four of the op's MACs; the speed is the fp32 sum over the int8 sum.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("ov_bench", Path(__file__).with_name("openvino.py"))
ov_bench = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(ov_bench)  # noqa: E305 - sets sys.path for qtool and openvino too

from qtool.evaluation.openvino_runtime import HEAVY_OPS  # noqa: E402 - the runtime model's heavy op kinds

CHILD = ("import sys; import qtool.plan.speed_openvino as rule; rule.MIN_CONV_MACS = int(sys.argv.pop(1)); "
         "rule.MIN_SHARE = float(sys.argv.pop(1)); from qtool.cli import main; sys.argv[0] = 'qtool'; main()")
MIN_SHARE = [0.5]  # the rule's share condition in the children (--min-share)


def quantize(model: Path, calib: Path, out: Path, threshold: int) -> dict:
    start = time.perf_counter()
    done = subprocess.run([sys.executable, "-c", CHILD, str(threshold), str(MIN_SHARE[0]), "quantize", str(model),
                           "--data", str(calib), "--target", "openvino", "-o", str(out),
                           "--json", str(out.with_suffix(".json"))],
                          capture_output=True, text=True, cwd=ROOT)
    if done.returncode:
        return {"error": (done.stderr.strip().splitlines() or ["?"])[-1]}
    decisions = json.loads(out.with_suffix(".json").read_text())["decisions"]
    floated = next((d["value"] for d in decisions if d["option"] == "quantization.advanced.float_nodes"), [])
    return {"path": out, "float": len(floated), "seconds": time.perf_counter() - start}


def _heavy(compiled) -> list[tuple[str, str, int]]:
    """(name, kind, MACs) of the runtime model's heavy ops, in order. A grouped Convolution's weight
    is [groups, out, in, ...] (5-D for 2-D images), a Deconvolution's [in, out, ...]."""
    rows = []
    for op in compiled.get_runtime_model().get_ordered_ops():
        kind = op.get_rt_info()["layerType"].astype(str)
        if kind in HEAVY_OPS:
            shapes = [list(op.input(i).get_partial_shape().to_shape()) for i in range(op.get_input_size())]
            out = list(op.get_output_partial_shape(0).to_shape())
            weight = shapes[1] if len(shapes) > 1 else [1]
            if kind == "Convolution":
                macs = int(np.prod(out)) * int(np.prod(weight[2:] if len(weight) == len(out) + 1 else weight[1:]))
            elif kind == "Deconvolution":
                macs = int(np.prod(shapes[0])) * int(np.prod(weight[1:]))
            else:
                macs = int(np.prod(out)) * int(shapes[0][-1])
            rows.append((op.get_friendly_name(), kind, macs))
    return rows


def layers(model: Path, int8: Path, held: Path, rounds: int, sums: dict) -> None:
    """Adds each matched heavy op's fp32 and int8 median microseconds to sums[(kind, bucket)]."""
    import openvino as ov

    proto = ov_bench.onnx.load(str(model), load_external_data=False)
    inits = {t.name for t in proto.graph.initializer}
    feeds = ov_bench._feeds(held, [i.name for i in proto.graph.input if i.name not in inits])[0]
    core = ov.Core()
    compiled = {}
    for label, path in (("fp32", model), ("int8", int8)):
        read = core.read_model(str(path))
        read.reshape({i.get_any_name(): list(feeds[i.get_any_name()].shape) for i in read.inputs})
        compiled[label] = core.compile_model(read, "CPU", {"INFERENCE_NUM_THREADS": 1, "PERF_COUNT": True})
    heavy = {label: _heavy(c) for label, c in compiled.items()}
    if len(heavy["fp32"]) != len(heavy["int8"]):
        return
    requests = {label: c.create_infer_request() for label, c in compiled.items()}
    times: dict = {label: {} for label in compiled}
    for _ in range(rounds):
        for label, request in requests.items():
            request.infer(feeds)
            for info in request.profiling_info:
                times[label].setdefault(info.node_name, []).append(info.real_time.total_seconds() * 1e6)
    for (name_f, kind, macs), (name_i, _, _) in zip(heavy["fp32"], heavy["int8"]):
        if name_f in times["fp32"] and name_i in times["int8"]:
            key = ("fc" if kind in ("FullyConnected", "MatMul") else "conv", int(np.log2(max(macs, 1)) // 2 * 2))
            entry = sums.setdefault(key, [0, 0.0, 0.0])
            entry[0] += 1
            entry[1] += float(np.median(times["fp32"][name_f]))
            entry[2] += float(np.median(times["int8"][name_i]))


def layer_table(args) -> None:
    """--layers: every kit model's heavy ops, fp32 against the T=0 int8 model, by kind and MACs."""
    sums: dict = {}
    for model in sorted((args.kit / "models").glob("*.onnx")):
        if args.models and model.stem not in args.models.split(","):
            continue
        work = args.out / model.stem
        work.mkdir(parents=True, exist_ok=True)
        calib, held, _ = ov_bench._data(args.kit, model, work)
        int8 = work / "conv_sizes_0.onnx"
        if not int8.exists() and "error" in quantize(model, calib, int8, 0):
            continue
        try:
            layers(model, int8, held, args.rounds, sums)
        except Exception as exc:  # noqa: BLE001 - a model OpenVINO cannot compile
            print(f"{model.stem}: {str(exc).splitlines()[0]}")
    print("| kind | MACs | ops | fp32 us | int8 us | speed |\n|---|---|---|---|---|---|")
    for (kind, bucket), (count, fp32, int8) in sorted(sums.items()):
        print(f"| {kind} | 2^{bucket}-2^{bucket + 2} | {count} | {fp32:.0f} | {int8:.0f} | {fp32 / int8:.2f}x |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kit", type=Path, default=ROOT.parent / "shared" / "bench")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--nncf-python", default=None)
    parser.add_argument("--thresholds", default="0,65536,262144,1048576")
    parser.add_argument("--rounds", type=int, default=200)
    parser.add_argument("--models", default="")
    parser.add_argument("--layers", action="store_true", help="per heavy op, by kind and MACs (see above)")
    parser.add_argument("--min-share", type=float, default=0.5,
                        help="the rule's MIN_SHARE in the children (0: every small convolution float)")
    args = parser.parse_args()
    MIN_SHARE[0] = args.min_share
    if args.layers:
        layer_table(args)
        return
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
