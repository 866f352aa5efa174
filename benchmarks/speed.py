"""Speed benchmark: fp32 vs qtool int8 (each target preset) vs onnxruntime's quantize_static,
on onnxruntime CPU, as ratios to fp32 (speedup = fp32 median / variant median).

Models (bench kit): EfficientNet-Lite0 (depthwise), YOLOv8n (nudenet, dense), PP-OCRv4 DB
text detector (rapidocr_v4_det, depthwise + Resize/Concat; opset 12 upgraded to 13 first).
Calibration on real inputs: the kit's calibration photos through configs/efficientnet_lite0.yaml
for EfficientNet, the kit's ready-made .npz samples for the others. Every variant of a model
is timed in ONE process, taking turns run by run (see qtool.graph.runtime.time_models), at batch 1
and 8 and 1 and 2 intra-op threads; the figures are medians.

onnxruntime's variant: quantize_static, QDQ format, per-channel QInt8 weights, QUInt8
activations, MinMax, on the same calibration samples, fed the same prepared fp32 graph
(opset upgraded, Constant weights as initializers, BatchNormalization folded) that qtool quantizes.

    python benchmarks/speed.py                  # about 10 minutes on 2 cores
    python benchmarks/speed.py --quick          # fewer runs
    python benchmarks/speed.py --models efficientnet_lite0_dyn --batches 8 --threads 1
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from qtool.calibration.calibrate import calibrate  # noqa: E402
from qtool.config import CalibrationConfig, QuantizeConfig, load_config  # noqa: E402
from qtool.data.dataset import batches, open_data  # noqa: E402
from qtool.graph.runtime import time_models  # noqa: E402
from qtool.prepare.graph_prep import prepare  # noqa: E402
from qtool.evaluation.metrics import percentile_ms  # noqa: E402
from qtool.graph.modelio import input_specs, load_model, save_model  # noqa: E402
from qtool.graph.kernels import count_kernels  # noqa: E402
from qtool.quantization.quantize import quantize_model  # noqa: E402

KIT = ROOT.parent / "shared" / "bench"
TARGETS = ("ort-cpu", "tensorrt", "litert")
MODELS = {
    # name: (calibration data, config, opset < 13 (qtool converts it), timing input H x W for image models or None)
    "efficientnet_lite0_dyn": (KIT / "data" / "calib" / "images", ROOT / "configs" / "efficientnet_lite0.yaml", False),
    "nudenet_yolov8n_320": (KIT / "inputs" / "nudenet_yolov8n_320" / "calib", None, False),
    "rapidocr_v4_det": (KIT / "inputs" / "rapidocr_v4_det" / "calib", None, True),
}
# The DB detector's samples have different sizes (longer side <= 960, multiples of 32);
# timing needs one shape: the samples at least this large are centre-cropped to it.
DET_TIMING_SIZE = (320, 320)


class _Reader:
    """onnxruntime CalibrationDataReader over a list of feeds."""

    def __init__(self, feeds: list[dict]):
        self.feeds, self.position = feeds, 0

    def get_next(self):
        if self.position >= len(self.feeds):
            return None
        self.position += 1
        return self.feeds[self.position - 1]


def _samples(model: str, model_path: Path, count: int) -> list[dict]:
    data, config, _ = MODELS[model]
    preprocess = load_config(config).preprocess
    source = open_data(data, input_specs(load_model(model_path)), preprocess)
    return [b.feeds for b in batches(source, 1, count)]


def _crop(array: np.ndarray, size: tuple[int, int]) -> np.ndarray:
    h, w = array.shape[-2:]
    th, tw = min(size[0], h), min(size[1], w)
    top, left = (h - th) // 2, (w - tw) // 2
    return array[..., top:top + th, left:left + tw]


def _timing_feeds(samples: list[dict], batch: int, model: str) -> dict:
    name = next(iter(samples[0]))
    arrays = [s[name] for s in samples]
    if model == "rapidocr_v4_det":  # the samples at least DET_TIMING_SIZE large, centre-cropped to it
        arrays = [_crop(a, DET_TIMING_SIZE) for a in arrays if a.shape[-2] >= DET_TIMING_SIZE[0]
                  and a.shape[-1] >= DET_TIMING_SIZE[1]]
    arrays = arrays[:batch]
    while len(arrays) < batch:
        arrays += arrays[:batch - len(arrays)]
    return {name: np.ascontiguousarray(np.concatenate(arrays))}


def build_variants(model: str, work: Path, calib_samples: int) -> tuple[dict[str, str], list[dict]]:
    data, config, upgrade = MODELS[model]
    source = KIT / "models" / f"{model}.onnx"
    cfg = load_config(config)
    # fp32 reference: the model as a user has it (opset-upgraded where onnxruntime's and qtool's QDQ need it)
    fp32_path = work / f"{model}_fp32.onnx"
    prepared_path = work / f"{model}_prepared.onnx"
    if upgrade:
        from qtool.prepare.graph_prep import settle_opset
        save_model(settle_opset(load_model(source), path=source)[0], fp32_path)
    else:
        fp32_path = source
    save_model(prepare(load_model(source), path=source).model, prepared_path)
    samples = _samples(model, fp32_path, calib_samples)
    variants = {"fp32": str(fp32_path)}
    calib = CalibrationConfig(batch_size=1, num_samples=calib_samples)
    for target in TARGETS:
        options = QuantizeConfig(target=target)
        table = calibrate(source, data, cfg.preprocess, calib, options, progress=False)
        out = work / f"{model}_qtool_{target}.onnx"
        save_model(quantize_model(source, table, options).model, out)
        variants[f"qtool {target}"] = str(out)
    from onnxruntime.quantization import CalibrationMethod, QuantFormat, QuantType, quantize_static
    ort_out = work / f"{model}_ort_u8s8.onnx"
    quantize_static(str(prepared_path), str(ort_out), _Reader(samples), quant_format=QuantFormat.QDQ,
                    per_channel=True, activation_type=QuantType.QUInt8, weight_type=QuantType.QInt8,
                    calibrate_method=CalibrationMethod.MinMax)
    variants["onnxruntime u8s8"] = str(ort_out)
    return variants, samples


def conv_kinds(fp32_path: str) -> dict[str, str]:
    """Profiler node name -> kind of Conv ("depthwise", "pointwise", "other conv"). onnxruntime names
    an int8 kernel after the fp32 Conv node (QLinearConv "<conv>_token_N"), an fp32 NCHWc kernel
    after the tensor it writes ("<conv or fused Clip output>_nchwc")."""
    import onnx

    from qtool.prepare.graph_prep import constants_to_initializers

    model = onnx.load(fp32_path)
    constants_to_initializers(model)  # Paddle exports keep weights in Constant nodes
    inits = {t.name: t for t in model.graph.initializer}
    readers: dict[str, list] = {}
    for node in model.graph.node:
        for name in node.input:
            readers.setdefault(name, []).append(node)
    kinds = {}
    for node in model.graph.node:
        if node.op_type != "Conv" or node.input[1] not in inits:
            continue
        dims = inits[node.input[1]].dims
        group = next((a.i for a in node.attribute if a.name == "group"), 1)
        kind = "depthwise" if group > 1 and dims[1] == 1 else "pointwise" if list(dims[2:]) == [1, 1] else "other conv"
        kinds[node.name] = kind
        for out in [node.output[0]] + [r.output[0] for r in readers.get(node.output[0], []) if r.op_type == "Clip"]:
            kinds[out + "_nchwc"] = kind
    return kinds


def by_conv_kind(events: list, kinds: dict[str, str], runs: int) -> dict[str, float]:
    totals: dict[str, float] = {}
    for event in events:
        name = event["name"][: -len("_kernel_time")]
        kind = kinds.get(name) or kinds.get(name.split("_token_")[0]) or "not a conv"
        totals[kind] = totals.get(kind, 0.0) + event["dur"] / 1000.0 / runs
    return totals


def kernel_events(path: str, feeds: dict, threads: int = 1, runs: int = 5) -> list[dict]:
    """onnxruntime's profiler events of every node kernel over one warm-up and `runs` runs."""
    import onnxruntime as ort

    with tempfile.TemporaryDirectory() as tmp:
        options = ort.SessionOptions()
        options.intra_op_num_threads = threads
        options.enable_profiling = True
        options.profile_file_prefix = os.path.join(tmp, "profile")
        options.log_severity_level = 3
        session = ort.InferenceSession(path, options, providers=["CPUExecutionProvider"])
        for _ in range(runs + 1):
            session.run(None, feeds)
        events = json.loads(Path(session.end_profiling()).read_text())
    return [e for e in events if e.get("cat") == "Node" and e["name"].endswith("_kernel_time")]


def profile_ops(path: str, feeds: dict, threads: int = 1, runs: int = 5,
                kinds: dict[str, str] | None = None) -> dict[str, float]:
    """Milliseconds per run spent in each op type of onnxruntime's optimized graph (its profiler),
    and with `kinds` per kind of Conv ("conv: depthwise", ...)."""
    events = kernel_events(path, feeds, threads, runs)
    timed = events[len(events) // (runs + 1):]  # the first run warms up
    totals: dict[str, float] = {}
    for event in timed:
        op = event["args"]["op_name"]
        totals[op] = totals.get(op, 0.0) + event["dur"] / 1000.0 / runs
    result = dict(sorted(totals.items(), key=lambda kv: -kv[1]))
    if kinds:
        result.update({f"conv: {k}": v for k, v in by_conv_kind(timed, kinds, runs).items()})
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--batches", nargs="+", type=int, default=[1, 8])
    parser.add_argument("--threads", nargs="+", type=int, default=[1, 2])
    parser.add_argument("--runs", type=int, default=20)
    parser.add_argument("--calib-samples", type=int, default=32)
    parser.add_argument("--quick", action="store_true", help="5 timed runs, 8 calibration samples")
    parser.add_argument("--json", type=Path, default=ROOT / "benchmarks" / "speed.json")
    parser.add_argument("--profile", action="store_true",
                        help="also print where each variant's time goes (ms per op type, batch 8, 1 thread)")
    args = parser.parse_args()
    runs, calib_samples = (5, 8) if args.quick else (args.runs, args.calib_samples)
    results = {"load_average": os.getloadavg(), "runs": runs, "calib_samples": calib_samples, "models": {}}
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        for model in args.models:
            variants, samples = build_variants(model, work, calib_samples)
            kernels = {}
            for name, path in variants.items():
                k = count_kernels(path)
                kernels[name] = {"integer_conv": k.integer_convs, "float_conv": k.float_convs,
                                 "quantize_linear": k.ops.get("QuantizeLinear", 0),
                                 "dequantize_linear": k.ops.get("DequantizeLinear", 0)}
            entry = {"kernels": kernels, "latency": []}
            if args.profile:
                feeds = _timing_feeds(samples, 8, model)
                kinds = conv_kinds(variants["fp32"])
                entry["profile_ms"] = {name: profile_ops(path, feeds, kinds=kinds) for name, path in variants.items()}
                for name, ops in entry["profile_ms"].items():
                    plain = {op: ms for op, ms in ops.items() if not op.startswith("conv: ")}
                    top = ", ".join(f"{op} {ms:.1f}" for op, ms in list(plain.items())[:6])
                    split = ", ".join(f"{op} {ms:.1f}" for op, ms in ops.items() if op.startswith("conv: "))
                    print(f"{model} {name}: {sum(plain.values()):.1f} ms in kernels: {top} | {split}", flush=True)
            for batch in args.batches:
                feeds = _timing_feeds(samples, batch, model)
                for threads in args.threads:
                    times = time_models(variants, feeds, threads, warmup=3, runs=runs)
                    medians = {name: percentile_ms(t, 50) for name, t in times.items()}
                    row = {"batch": batch, "threads": threads, "median_ms": medians,
                           "speedup": {name: medians["fp32"] / ms for name, ms in medians.items()}}
                    entry["latency"].append(row)
                    print(f"{model} b{batch} t{threads}: " + ", ".join(
                        f"{name} {ms:.1f} ms ({row['speedup'][name]:.2f}x)" for name, ms in medians.items()),
                        flush=True)
            results["models"][model] = entry
    results["load_average_end"] = os.getloadavg()
    args.json.write_text(json.dumps(results, indent=1))
    print()
    print(markdown_table(results))


def markdown_table(results: dict) -> str:
    names = None
    lines = []
    for model, entry in results["models"].items():
        for row in entry["latency"]:
            if names is None:
                names = [n for n in row["speedup"] if n != "fp32"]
                lines.append("| model | batch | threads | fp32 ms | " + " | ".join(names) + " |")
                lines.append("|---" * (4 + len(names)) + "|")
            cells = " | ".join(f"{row['speedup'][n]:.2f}x" for n in names)
            lines.append(f"| {model} | {row['batch']} | {row['threads']} | {row['median_ms']['fp32']:.1f} | {cells} |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
