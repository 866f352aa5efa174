"""Every kit model on OpenVINO: fp32 (bf16 and f32), qtool --target openvino, qtool --target ort-cpu
and NNCF's default int8, compared on the OpenVINO runtime.

    python benchmarks/openvino.py --nncf-python /work/nncf-venv/bin/python [--kit ../shared/bench]
        [--out DIR] [--rounds 40] [--reps 10] [--timing processes|turns] [--models NAME,...]
        [--batch N [--reuse]] [--variant LABEL=YAML ...]

For each model: qtool quantize --target openvino and --target ort-cpu (the kit's calibration
samples; EfficientNet-Lite0: 48 of the kit's calibration photos with its config, preprocessed to
.npz once so that every quantizer sees the same arrays), and NNCF's `nncf.quantize` with its
defaults on the ONNX model in NNCF's own virtual environment (benchmarks/openvino_nncf.py;
model_type TRANSFORMER for a model with LayerNormalization), each timed. Then every model
compiled with OpenVINO's CPU plugin, 1 inference thread: the fp32 model at the default precision
(bf16 on a CPU that has it) and at f32, the three int8 models at the default. Latency: batch 1,
one held-out sample; each model compiled alone in a process of its own that runs it `rounds` times
(medians), the processes taking turns in a fresh (seeded) order for `--reps` repetitions, the
median over them (`--timing turns`: all models in one process taking turns run by run, which
evicts each one's data from the caches between its runs). Each run's process CPU time is
taken beside its wall time (on a shared machine the CPU time is what preemption does not inflate),
and, timed the same way with the model compiled again with OpenVINO's per-layer counters on, the
sum of its runtime model's layer times per run: the kernels' own time, without what the machine
adds around them.
Fidelity: over held-out samples (the kit's eval/ folder, else every fourth calibration file held
back from calibration; EfficientNet: 32 dev photos), the mean of each sample's worst output
cosine to the fp32 model's on OpenVINO at f32 (for the DB detector also the IoU of its text
pixels, probability above 0.3, with the reference's, pooled; JSON only). From each int8 runtime
model: the heavy ops (Convolution, FullyConnected, MatMul, Deconvolution) that run in int8, and
the FakeQuantize ops left unfused. `--variant LABEL=YAML` adds a qtool row quantized with
`--target openvino --config YAML` (configs/openvino_asymmetric.yaml, for one). Prints JSON lines,
then a markdown table with the machine's load.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import onnx

ROOT = Path(__file__).resolve().parents[1]
# this file's folder comes first on sys.path when run as a script: this file would then be the
# `openvino` package that `import openvino` finds
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]
sys.path.insert(0, str(ROOT))

from qtool.evaluation.metrics import sample_cosines  # noqa: E402
from qtool.evaluation.openvino_runtime import CompiledModel, check_compiles, default_precision  # noqa: E402

QUANTIZERS = ("openvino", "ort-cpu", "nncf")
BATCH = [1]  # the timed batch, for the table's title
TIMING = ["processes"]  # how the models are timed: "processes" (each alone) or "turns" (together)
REPS = [10]  # repetitions of the processes' turns
DB_DETECTOR, DB_THRESH = "rapidocr_v4_det", 0.3  # its text-pixel IoU is reported beside the cosine


def _qtool(*args) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    return subprocess.run([sys.executable, "-m", "qtool", *map(str, args)], env=env, capture_output=True, text=True)


def _split(calib: Path, work: Path) -> tuple[Path, Path]:
    """Every fourth file held back: (calibration folder, held-back folder), as symlinks."""
    kept, held = work / "calib", work / "held"
    for folder in (kept, held):
        folder.mkdir(exist_ok=True)
    for i, sample in enumerate(sorted(calib.iterdir())):
        link = (held if i % 4 == 3 else kept) / sample.name
        if not link.exists():
            link.symlink_to(sample)
    return kept, held


def _photos_as_arrays(model: Path, folder: Path, config: Path, out: Path, count: int) -> Path:
    """`count` photos of `folder` preprocessed by the config, one .npz a sample."""
    from qtool.config import load_config
    from qtool.data.dataset import batches, open_data
    from qtool.graph.modelio import input_specs, load_model

    out.mkdir(exist_ok=True)
    if len(list(out.iterdir())) >= count:
        return out
    source = open_data(folder, input_specs(load_model(model)), load_config(config).preprocess)
    for i, batch in enumerate(batches(source, 1, count)):
        np.savez(out / f"s{i:03d}.npz", **batch.feeds)
    return out


def _feeds(folder: Path, names: list[str]) -> list[dict]:
    found = []
    for path in sorted(folder.iterdir()):
        with np.load(path) as archive:
            found.append({n: archive[n] for n in names if n in archive})
    return found


def _data(kit: Path, model: Path, work: Path) -> tuple[Path, Path, Path | None]:
    """(calibration folder, held-out folder, qtool config or None)."""
    name = model.stem
    if (kit / "inputs" / name).is_dir():
        held = kit / "inputs" / name / "eval"
        if held.is_dir():
            return kit / "inputs" / name / "calib", held, None
        return (*_split(kit / "inputs" / name / "calib", work), None)
    config = ROOT / "configs" / "efficientnet_lite0.yaml"
    calib = _photos_as_arrays(model, kit / "data" / "calib" / "images", config, work / "calib", 48)
    held = _photos_as_arrays(model, kit / "data" / "imagenet_dev" / "images", config, work / "held", 32)
    return calib, held, None  # the arrays are preprocessed already


def quantize(model: Path, calib: Path, work: Path, nncf_python: str, variants: dict[str, Path]) -> dict:
    """label -> {"path", "seconds"} or {"error"}. `variants`: label -> a config for --target openvino."""
    made = {}
    runs = [(target, ["--target", target]) for target in ("openvino", "ort-cpu")]
    runs += [(label, ["--target", "openvino", "--config", config]) for label, config in variants.items()]
    for label, extra in runs:
        out = work / f"qtool_{label}.onnx"
        start = time.perf_counter()
        done = _qtool("quantize", model, "--data", calib, *extra, "-o", out)
        made[label] = {"path": out, "seconds": time.perf_counter() - start} if done.returncode == 0 else \
            {"error": (done.stderr.strip().splitlines() or ["?"])[-1]}
    out = work / "nncf.onnx"
    done = subprocess.run([nncf_python, str(ROOT / "benchmarks" / "openvino_nncf.py"), str(model), str(calib), str(out)],
                          capture_output=True, text=True)
    if done.returncode == 0:
        made["nncf"] = {"path": out, **json.loads(done.stdout.strip().splitlines()[-1])}
    else:
        made["nncf"] = {"error": (done.stderr.strip().splitlines() or ["?"])[-1]}
    return made


def _worst_cosine(ref: list[np.ndarray], got: list[np.ndarray]) -> float:
    return min([1.0] + [float(sample_cosines(a.reshape(1, -1), b.reshape(1, -1))[0]) for a, b in zip(ref, got)])


def _text_iou(ref: list[list[np.ndarray]], got: list[list[np.ndarray]]) -> float:
    """The DB detector's text pixels (probability above DB_THRESH) against the reference's:
    intersection over union, pooled over the samples (as benchmarks/models.py)."""
    pairs = [(r[0] > DB_THRESH, g[0] > DB_THRESH) for r, g in zip(ref, got)]
    union = sum(int((a | b).sum()) for a, b in pairs)
    return sum(int((a & b).sum()) for a, b in pairs) / union if union else 1.0


def _stacked(samples: list[dict], batch: int) -> dict:
    """The first `batch` samples as one batch (samples of one shape)."""
    return {name: np.concatenate([s[name] for s in samples[:batch]]) for name in samples[0]}


def measure(model: Path, made: dict, held: Path, rounds: int, batch: int = 1) -> dict:
    proto = onnx.load(str(model), load_external_data=False)
    inits = {t.name for t in proto.graph.initializer}
    names = [i.name for i in proto.graph.input if i.name not in inits]
    samples = _feeds(held, names)
    compiled = {"fp32": CompiledModel(model, 1), "fp32_f32": CompiledModel(model, 1, "f32")}
    for label, entry in made.items():
        if "path" in entry:
            try:
                check_compiles(entry["path"])  # a model the plugin crashes on is a failed row, not the end
                compiled[label] = CompiledModel(entry["path"], 1)
            except Exception as exc:  # noqa: BLE001 - report it in the table
                entry["error"] = str(exc).splitlines()[0]
    figures: dict = {label: {} for label in compiled}
    references = [compiled["fp32_f32"].run(None, s) for s in samples]
    for label, model_ in compiled.items():
        outputs = [model_.run(None, s) for s in samples]
        figures[label]["cosine"] = float(np.mean([_worst_cosine(r, o) for r, o in zip(references, outputs)]))
        if model.stem == DB_DETECTOR:
            figures[label]["text_iou"] = _text_iou(references, outputs)
        figures[label].update(model_.layers())
    feeds = samples[0] if batch == 1 else _stacked(samples, batch)
    sources = {"fp32": (model, None), "fp32_f32": (model, "f32"),
               **{label: (made[label]["path"], None) for label in compiled if label in made}}
    if TIMING[0] == "processes":
        del compiled  # each timed model is compiled again in its own process
        for label, (ms, cpu_ms, layer_ms) in _process_times(sources, feeds, rounds).items():
            figures[label]["ms"], figures[label]["cpu_ms"], figures[label]["layer_ms"] = ms, cpu_ms, layer_ms
    else:
        _turn_times(compiled, sources, feeds, rounds, figures)
    for label, entry in made.items():
        figures.setdefault(label, {}).update({k: v for k, v in entry.items() if k != "path"})
    return figures


def _turn_times(compiled: dict, sources: dict, feeds: dict, rounds: int, figures: dict) -> None:
    """All models compiled in this process, taking turns run by run (medians); then again each
    compiled with the per-layer counters (`sources`: label -> (path, precision)), the sum of its
    layers' times per run."""
    times: dict[str, list[float]] = {label: [] for label in compiled}
    cpu: dict[str, list[float]] = {label: [] for label in compiled}
    for model_ in compiled.values():
        for _ in range(3):
            model_.run(None, feeds)
    # A fresh order each round: in a fixed cycle each model always runs after the same one, and
    # which one it follows moved two int8 models of the PP-OCR recognizer by 5% against each other.
    order, rng = list(compiled.items()), np.random.default_rng(0)
    for _ in range(rounds):
        for i in rng.permutation(len(order)):
            label, model_ = order[i]
            start, start_cpu = time.perf_counter(), time.process_time()
            model_.run(None, feeds)
            cpu[label].append(time.process_time() - start_cpu)
            times[label].append(time.perf_counter() - start)
    for label, values in times.items():
        figures[label]["ms"] = 1e3 * float(np.median(values))
        figures[label]["cpu_ms"] = 1e3 * float(np.median(cpu[label]))
    # the same models compiled with the plugin's per-layer counters, taking turns the same way
    counted = {label: CompiledModel(path, 1, precision, counters=True) for label, (path, precision) in sources.items()}
    layers: dict[str, list[float]] = {label: [] for label in counted}
    for round_ in range(rounds + 3):
        for i in rng.permutation(len(order)):
            label = order[i][0]
            counted[label].run(None, feeds)
            if round_ >= 3:
                layers[label].append(counted[label].layer_seconds())
    for label, values in layers.items():
        figures[label]["layer_ms"] = 1e3 * float(np.median(values))


_CHILD = r"""
import json, sys, time
import numpy as np
sys.path.insert(0, sys.argv[1])
from qtool.evaluation.openvino_runtime import CompiledModel
path, feeds, runs, precision = sys.argv[2], np.load(sys.argv[3]), int(sys.argv[4]), sys.argv[5] or None
model = CompiledModel(path, 1, precision)
feeds = {name: feeds[name] for name in feeds.files}
for _ in range(10):
    model.run(None, feeds)
wall, cpu = [], []
for _ in range(runs):
    start, start_cpu = time.perf_counter(), time.process_time()
    model.run(None, feeds)
    cpu.append(time.process_time() - start_cpu)
    wall.append(time.perf_counter() - start)
# the same model compiled with the plugin's per-layer counters: each run's sum of its layers' times
counted = CompiledModel(path, 1, precision, counters=True)
layers = []
for i in range(runs + 10):
    counted.run(None, feeds)
    if i >= 10:
        layers.append(counted.layer_seconds())
print(json.dumps([1e3 * float(np.median(wall)), 1e3 * float(np.median(cpu)), 1e3 * float(np.median(layers))]))
"""


def _process_times(sources: dict, feeds: dict, runs: int) -> dict:
    """label -> (wall ms, CPU ms, layer ms): each model compiled alone in a process of its own that
    runs it `runs` times (medians), the processes taking turns in a fresh order for REPS
    repetitions, the median over them. Layer ms: the sum of the runtime model's per-layer times
    (the plugin's counters, the model compiled again with them on) per run, which leaves out what
    the machine adds around the kernels. Models compiled together in one process and taking turns run by run evict
    each other from the caches: the recognizer's fp32 model took 6.1 ms that way and 2.9 ms alone."""
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "feeds.npz"
        np.savez(path, **feeds)
        found: dict[str, list] = {label: [] for label in sources}
        rng = np.random.default_rng(0)
        labels = list(sources)
        for _ in range(REPS[0]):
            for i in rng.permutation(len(labels)):
                model, precision = sources[labels[i]]
                done = subprocess.run([sys.executable, "-c", _CHILD, str(ROOT), str(model), str(path), str(runs),
                                       precision or ""], capture_output=True, text=True, check=True)
                found[labels[i]].append(json.loads(done.stdout.strip().splitlines()[-1]))
    return {label: tuple(float(np.median(column)) for column in zip(*values)) for label, values in found.items()}


def table(rows: list[dict], load: str, variants: tuple[str, ...] = ()) -> str:
    """The markdown table of `rows`: a column group per quantizer, then per --variant label."""
    labels = (*QUANTIZERS, *variants)
    lines = [f"OpenVINO {_ov_version()} CPU, 1 inference thread, batch {BATCH[0]}; fp32 baseline at the default precision "
             f"({default_precision()}); {load}",
             "",
             f"| model | fp32 ms (default / f32) | int8: qtool {' / qtool '.join(QUANTIZERS[:2])} / NNCF"
             f"{''.join(' / ' + label for label in variants)}: speed vs fp32 default "
             "| same, by CPU time | same, by the sum of layer times | worst-output cosine on OpenVINO "
             "| unfused FakeQuantize | int8 heavy ops | quantize s |",
             "|---|---|---|---|---|---|---|---|---|"]
    for row in rows:
        f = row["figures"]
        cells = {k: [] for k in ("speed", "cpu", "layers", "cos", "fq", "int8", "secs")}
        for label in labels:
            entry = f.get(label, {})
            if "ms" not in entry:
                for k in cells:
                    cells[k].append("failed" if k == "speed" else "-")
                continue
            cells["speed"].append(f"{f['fp32']['ms'] / entry['ms']:.2f}x")
            cells["cpu"].append(f"{f['fp32']['cpu_ms'] / entry['cpu_ms']:.2f}x")
            cells["layers"].append(f"{f['fp32']['layer_ms'] / entry['layer_ms']:.3f}x" if "layer_ms" in entry else "-")
            cells["cos"].append(f"{entry['cosine']:.4f}")
            cells["fq"].append(str(entry["unfused_fake_quantize"]))
            cells["int8"].append(f"{entry['int8_heavy_ops']}/{entry['heavy_ops']}")
            cells["secs"].append(f"{entry['seconds']:.0f}" if "seconds" in entry else "-")
        lines.append(f"| {row['model']} | {f['fp32']['ms']:.2f} / {f['fp32_f32']['ms']:.2f} | "
                     + " | ".join(" / ".join(cells[k]) for k in ("speed", "cpu", "layers", "cos", "fq", "int8", "secs"))
                     + " |")
    return "\n".join(lines)


def _ov_version() -> str:
    from qtool.evaluation.openvino_runtime import version

    return version()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kit", type=Path, default=ROOT.parent / "shared" / "bench")
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--nncf-python", required=True, help="python of a virtual environment with nncf")
    parser.add_argument("--rounds", type=int, default=40)
    parser.add_argument("--models", default="", help="comma-separated model stems (default: every kit model)")
    parser.add_argument("--batch", type=int, default=1, help="samples per timed run (held-out samples stacked)")
    parser.add_argument("--variant", action="append", default=[], metavar="LABEL=YAML",
                        help="a further qtool row: --target openvino with --config YAML")
    parser.add_argument("--timing", choices=("processes", "turns"), default="processes",
                        help="each model alone in its own process, the processes taking turns --reps times "
                             "(--rounds runs each); or all in this process, taking turns run by run")
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--reuse", action="store_true",
                        help="time the int8 models already in --out instead of quantizing again")
    args = parser.parse_args()
    BATCH[0] = args.batch
    TIMING[0], REPS[0] = args.timing, args.reps
    variants = {label: Path(config) for label, _, config in (v.partition("=") for v in args.variant)}
    wanted = {m for m in args.models.split(",") if m}
    rows = []
    loads = []
    with tempfile.TemporaryDirectory() as tmp:
        out = args.out or Path(tmp)
        for model in sorted((args.kit / "models").glob("*.onnx")):
            if wanted and model.stem not in wanted:
                continue
            work = out / model.stem
            work.mkdir(parents=True, exist_ok=True)
            calib, held, _ = _data(args.kit, model, work)
            files = [(label, f"qtool_{label}.onnx") for label in ("openvino", "ort-cpu", *variants)]
            made = {label: {"path": work / name} for label, name in files + [("nncf", "nncf.onnx")]
                    if (work / name).exists()} if args.reuse else quantize(model, calib, work, args.nncf_python,
                                                                           variants)
            loads.append(os.getloadavg()[0])
            try:
                figures = measure(model, made, held, args.rounds, args.batch)
            except Exception as exc:  # noqa: BLE001 - the fp32 model itself fails on OpenVINO: say so
                print(json.dumps({"model": model.stem, "error": str(exc).splitlines()[0]}), flush=True)
                continue
            loads.append(os.getloadavg()[0])
            row = {"model": model.stem, "figures": figures}
            rows.append(row)
            print(json.dumps(row, default=str), flush=True)
    load = f"load average {min(loads):.1f}-{max(loads):.1f} on {os.cpu_count()} cores" if loads else ""
    print(table(rows, load, tuple(variants)))


if __name__ == "__main__":
    main()
