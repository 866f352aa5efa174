"""The speed rule (qtool.plan.speed) against the timing search, on every kit model; and the fit of its costs.

    python benchmarks/speed_rules.py [--kit ../shared/bench] [--out DIR] [--models a,b] [--rows int8,latency,rule]
                                     [--rounds N] [--resume]
    python benchmarks/speed_rules.py --fit [--models a,b] [--out DIR]

Table: per kit model, the plain command of benchmarks/kit.py (EfficientNet-Lite0: the 256 calibration
photos and its config) three ways: `int8` with the speed rule off (`advanced.speed_rule: off`: every
node the plan quantizes), `latency` with --latency-aware and the speed rule off (the opt-in timing
search), and `rule`, the plain command as it is (the speed rule of qtool.choices.speed, on by default
for ort-cpu). Each is compared with fp32 on
benchmarks/models.py's held-out samples (worst output's cosine, mean / min over samples; the task) and
timed against it at batch 1, 1 thread (benchmarks/models.py's timed_medians: the models taking turns
in one process; --rounds N: N rounds, the median ratio).

--fit: per kit model, float/int8 mixes of the plain command's plan (all int8, all float, the first or
last part of the nodes, windows, the largest outputs, the elementwise nodes, the rule's choice) timed
against each other (the thread's CPU time, so that other processes' load is not counted; interleaved),
and the least-squares Costs over all of them (one intercept per model: its all-float time).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

ROWS = ("int8", "latency", "rule")
CAUGHT: dict = {}


def _patched(choice) -> None:
    """settle's latency step (run by --latency-aware) replaced by `choice` (same arguments)."""
    import qtool.choices as choices

    choices._latency = choice


def _candidates(model_path, specs, table, cfg, calib_data, shared):
    from qtool.quantization.quantize import candidates

    return candidates(model_path, table, cfg.quantization, calib_data, shared)


def _catching_choice(model_path, specs, table, cfg, calib_data, shared):
    from qtool.choices import Decision

    graph = _candidates(model_path, specs, table, cfg, calib_data, shared).prepared
    CAUGHT.update(model_path=graph.model_path, model=graph.model, plan=graph.plan,
                  kept=[*graph.unreached, *graph.kept], steps=graph.steps, options=graph.options)
    return Decision("quantization.advanced.float_nodes", (), "caught")


def _cli(argv: list[str], standalone: bool = True) -> None:
    """qtool's command line in this process (standalone: exits with its code)."""
    from qtool.cli import main

    try:
        main(argv, standalone_mode=standalone)
    except SystemExit as exit_:
        if standalone or exit_.code:
            raise


def _rule_off(args: tuple, out: Path) -> tuple:
    """`args` with `quantization.advanced.speed_rule: off` (merged into the config they give)."""
    import yaml

    args = tuple(map(str, args))
    config = {}
    if "--config" in args:
        at = args.index("--config")
        config = yaml.safe_load(Path(args[at + 1]).read_text()) or {}
        args = args[:at] + args[at + 2:]
    config.setdefault("quantization", {}).setdefault("advanced", {})["speed_rule"] = "off"
    path = out.with_suffix(".yaml")
    path.write_text(yaml.safe_dump(config))
    return (*args, "--config", str(path))


def quantize(row: str, model: Path, calib: Path, args: tuple, out: Path, cache: Path) -> tuple[float, str, int]:
    """(seconds, the notes about float-for-speed choices, exit code) of one plain command."""
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    args = _rule_off(args, out) if row in ("int8", "latency") else tuple(map(str, args))
    tuned = ("--latency-aware",) if row == "latency" else ()
    command = ["quantize", str(model), "--data", str(calib), *args, *tuned, "-o", str(out)]
    start = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "qtool", *command], env=env, capture_output=True, text=True)
    notes = [line for line in (done.stdout + done.stderr).splitlines()
             if ("latency-aware" in line and "cache" not in line) or "speed rule" in line]
    if done.returncode:
        notes.append((done.stderr.strip().splitlines() or [""])[-1])
    return time.perf_counter() - start, "\n".join(notes), done.returncode


def run_model(kit: Path, model: Path, work: Path, rows: list[str], rounds: int) -> dict:
    from models import _figures, _gold, _samples, data_split, timed_medians
    from qtool.graph.runtime import create_session

    name = model.stem
    calib, held, preprocess, args, limit = data_split(kit, model, work)
    paths = {"fp32": model}
    result = {"model": name, "notes": {}, "seconds": {}, "failed": {}}
    for row in rows:
        out = work / f"{row}.onnx"
        seconds, notes, code = quantize(row, model, calib, args, out, Path(tempfile.mkdtemp(dir=work)))
        result["seconds"][row], result["notes"][row] = seconds, notes
        if code:
            result["failed"][row] = notes
        else:
            paths[row] = out
    eval_feeds = _samples(held, model, preprocess, limit)
    outputs = {}
    for variant, path in paths.items():
        session = create_session(str(path), 1, str(path))
        names = [o.name for o in session.get_outputs() if o.type == "tensor(float)"]
        outputs[variant] = [session.run(names, feeds) for feeds in eval_feeds]
    try:
        result["figures"] = _figures(name, outputs, _gold(kit, name))
    except ImportError:  # MiniLM's task needs scipy
        result["figures"] = _figures("", outputs, [])
    ratios: dict[str, list[float]] = {v: [] for v in paths if v != "fp32"}
    cpu: dict[str, list[float]] = {v: [] for v in paths if v != "fp32"}
    for _ in range(rounds):
        medians = timed_medians(paths, eval_feeds)
        on_cpu = cpu_medians(paths, eval_feeds)
        for v in ratios:
            ratios[v].append(medians["fp32"] / medians[v])
            cpu[v].append(on_cpu["fp32"] / on_cpu[v])
        result["fp32_ms"] = medians["fp32"] * 1e3
    result["speedup"] = {v: float(np.median(r)) for v, r in ratios.items()}
    result["speedups"] = ratios
    result["cpu_speedup"] = {v: float(np.median(r)) for v, r in cpu.items()}
    result["cpu_speedups"] = cpu
    return result


def cpu_medians(paths: dict, samples: list[dict], count: int = 8, runs: int = 10) -> dict[str, float]:
    """timed_medians with the thread's CPU time: median over `runs` runs on each of the first `count`
    samples, the models taking turns, new sessions per sample in alternating order."""
    times: dict[str, list[float]] = {v: [] for v in paths}
    for i, feeds in enumerate(samples[:count]):
        order = {v: str(paths[v]) for v in (list(paths) if i % 2 == 0 else list(paths)[::-1])}
        for v, values in _cpu_times(order, feeds, rounds=1, runs=runs, each=True).items():
            times[v] += values
    return {v: float(np.median(t)) for v, t in times.items()}


def kept_float(notes: str) -> str:
    """What a row kept float for speed, from its notes."""
    rule = re.search(r"float_nodes = (.*?): speed rule", notes)
    if rule:
        return f"{len(rule.group(1).split(', '))} nodes"
    counts = [int(n) for n in re.findall(r"(\d+) (?:\w+ )?nodes?\b[^:\n]*kept float \(latency-aware", notes)]
    by_size = re.findall(r"(\d+) nodes whose outputs hold at least", notes)
    total = sum(counts) + (int(by_size[-1]) if by_size else 0)
    return f"{total} nodes" if total else "none"


def table(args) -> None:
    rows = [r for r in args.rows.split(",") if r]
    chosen = set(filter(None, args.models.split(",")))
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        out = args.out or Path(tmp)
        for model in sorted((args.kit / "models").glob("*.onnx")):
            if chosen and model.stem not in chosen:
                continue
            work = out / model.stem
            work.mkdir(parents=True, exist_ok=True)
            saved = work / "result.json"
            if args.resume and saved.is_file():
                results.append(json.loads(saved.read_text()))
                continue
            results.append(run_model(args.kit, model, work, rows, args.rounds))
            saved.write_text(json.dumps(results[-1]))
            r = results[-1]
            summary = {k: r[k] for k in ("model", "speedups", "cpu_speedups", "seconds", "failed")}
            print(json.dumps(summary), file=sys.stderr, flush=True)
            for row, notes in r["notes"].items():
                if notes:
                    print(f"  [{row}]\n    " + notes.replace("\n", "\n    "), file=sys.stderr, flush=True)
    print(f"load average {os.getloadavg()[0]:.2f}")
    print("| model (fp32 ms) | row | kept float for speed | cosine mean / min | task | speed vs fp32, wall (rounds) "
          "| CPU time (rounds) |")
    print("|---|---|---|---|---|---|---|")
    for r in results:
        for i, row in enumerate(rows):
            label = f"{r['model']} ({r.get('fp32_ms', 0):.2f} ms)" if i == 0 else ""
            if row in r["failed"]:
                print(f"| {label} | {row} | fails: {r['failed'][row][-90:]} | | | | |")
                continue
            f = r["figures"][row]
            each = " / ".join(f"{x:.2f}" for x in r["speedups"][row])
            on_cpu = " / ".join(f"{x:.2f}" for x in r["cpu_speedups"][row])
            print(f"| {label} | {row} | {kept_float(r['notes'][row])} | {f['cos_mean']:.4f} / {f['cos_min']:.4f} "
                  f"| {f['task']} | {r['speedup'][row]:.2f}x ({each}) | {r['cpu_speedup'][row]:.2f}x ({on_cpu}) |")


def _cpu_times(models: dict, feeds: dict, rounds: int, runs: int, each: bool = False) -> dict:
    """Median thread CPU seconds per run of each model (1 thread), the models taking turns, new
    sessions each round: a neighbour's load preempts the thread but is not counted."""
    from qtool.graph.runtime import create_session

    per: dict[str, list[float]] = {name: [] for name in models}
    for r in range(rounds):
        names = list(models) if r % 2 == 0 else list(models)[::-1]
        sessions = {name: create_session(models[name], 1, name) for name in names}
        for session in sessions.values():
            for _ in range(3):
                session.run(None, feeds)
        times: dict[str, list[int]] = {name: [] for name in names}
        for turn in range(runs):
            for name in names[turn % len(names):] + names[:turn % len(names)]:
                start = time.thread_time_ns()
                sessions[name].run(None, feeds)
                times[name].append(time.thread_time_ns() - start)
        for name, values in times.items():
            if each:
                per[name] += [v * 1e-9 for v in values]
            else:
                per[name].append(statistics.median(values) * 1e-9)
    return per if each else {name: float(np.median(values)) for name, values in per.items()}


def candidates(name: str, kit: Path, out: Path) -> None:
    """--fit's measurement of one model (in a process of its own): float/int8 mixes, their features, times."""
    from models import _samples, data_split
    from qtool.graph.index import node_label
    from qtool.plan.planner import build_plan
    from qtool.graph.runtime import tensor_dims
    from qtool.plan.speed import _values, cost_terms, float_for_speed
    from qtool.quantization.quantize import _unequalize_float_chains

    model = kit / "models" / f"{name}.onnx"
    work = Path(tempfile.mkdtemp())
    calib, held, preprocess, args, _ = data_split(kit, model, work)
    if name == "efficientnet_lite0_dyn":  # the mixes' speed does not depend on the data-driven constants
        args = (*args, "--bias-correction", "off", "--weight-rounding", "nearest")
    _patched(_catching_choice)
    args = _rule_off(args, work / "int8.onnx")  # the mixes are of the plan with every node int8
    _cli(["quantize", str(model), "--data", str(calib), *map(str, args), "--latency-aware", "-o",
          str(work / "int8.onnx")], False)
    c = CAUGHT
    graph, plan = c["model"], c["plan"]
    feeds = _samples(held, model, preprocess, 1)[0]
    shapes = tensor_dims(graph, feeds)
    terms = cost_terms(graph, plan, shapes, c["options"])
    q = [label for label in plan.quantized_nodes if label in terms.nodes]
    n = len(q)
    rng = random.Random(0)
    mixes = {"int8": [], "float": list(q), "last30": q[int(0.7 * n):],
             "elementwise": [label for label in q if label not in terms.dense]}
    for share in (0.15, 0.3, 0.5, 0.7):
        mixes[f"first{int(share * 100)}"] = q[:max(1, int(share * n))]
    for i in range(6):
        width = max(1, int(n * rng.choice((0.1, 0.2, 0.35))))
        start = rng.randrange(0, max(1, n - width))
        mixes[f"window{i}"] = q[start:start + width]
    outputs = {node_label(node): _values(shapes.get(node.output[0])) for node in graph.graph.node if node.output}
    levels = sorted({outputs[label] for label in q}, reverse=True)
    for k in (1, 2, 3):
        if len(levels) > k:
            mixes[f"size{k}"] = [label for label in q if outputs[label] >= levels[k - 1]]
    mixes["rule"] = float_for_speed(graph, plan, shapes, c["options"])[0]

    def closed(labels):  # pairs joined by a tensor without a range go together
        chosen, changed = set(labels), True
        while changed:
            changed = False
            for a, b in terms.joined:
                if (a in chosen) != (b in chosen):
                    chosen |= {a, b}
                    changed = True
        return [label for label in q if label in chosen]

    unique, seen = {}, set()
    for key, labels in mixes.items():
        labels = closed(labels)
        if (labels or key == "int8") and tuple(labels) not in seen:
            seen.add(tuple(labels))
            unique[key] = labels
    built = {"fp32": str(model)}
    for key, labels in unique.items():
        keep = [*c["kept"], *labels]
        try:
            planned = build_plan(graph, c["options"], keep_float=keep)
            candidate, replanned = _unequalize_float_chains(c["model_path"], graph, planned, c["options"], keep)
            built[key] = c["steps"].structure(candidate, replanned)
        except Exception as exc:  # noqa: BLE001 - a mix onnxruntime cannot build is left out
            print(f"{name} {key}: {type(exc).__name__}: {str(exc)[:100]}", file=sys.stderr)
    slow = name in ("rapidocr_v4_det", "nudenet_yolov8n_320")
    times = [_cpu_times(built, feeds, rounds=2, runs=12 if slow else 30) for _ in range(2)]
    result = {"name": name, "times": {k: float(np.median([t[k] for t in times])) for k in built},
              "features": {k: terms.features(unique[k]) for k in built if k != "fp32"},
              "sets": {k: unique[k] for k in built if k != "fp32"}}
    out.write_text(json.dumps(result))


def fit(args) -> None:
    from qtool.plan.speed import COSTS, FEATURES

    chosen = set(filter(None, args.models.split(",")))
    out = args.out or Path(tempfile.mkdtemp())
    out.mkdir(parents=True, exist_ok=True)
    data = []
    for model in sorted((args.kit / "models").glob("*.onnx")):
        if chosen and model.stem not in chosen:
            continue
        path = out / f"mixes_{model.stem}.json"
        if not (args.resume and path.is_file()):
            subprocess.run([sys.executable, __file__, "--candidates", model.stem, str(args.kit), str(path)],
                           env=dict(os.environ, PYTHONPATH=str(ROOT)), check=True, capture_output=True)
        data.append(json.loads(path.read_text()))
        d = data[-1]
        print(d["name"], {k: round(d["times"]["fp32"] / v, 3) for k, v in d["times"].items()}, file=sys.stderr)
    rows, y, weights = [], [], []
    for i, d in enumerate(data):
        for key, feats in d["features"].items():
            x = np.zeros(len(data) + len(FEATURES))
            x[i] = 1.0
            x[len(data):] = [feats.get(f, 0.0) for f in FEATURES]
            rows.append(x)
            y.append(d["times"][key] * 1e9)
            weights.append(1.0 / (d["times"]["float"] * 1e9))  # relative errors
    X, y, w = np.array(rows), np.array(y), np.array(weights)
    A, b = X * w[:, None], y * w
    scale = np.maximum(np.abs(A).max(axis=0), 1e-30)
    coef = _nonnegative(A / scale, b, free=len(data)) / scale
    fitted = dict(zip(FEATURES, (float(v) for v in coef[len(data):])))
    current = np.array([d["times"]["float"] * 1e9 for d in data] + [getattr(COSTS, f) for f in FEATURES])
    for label, c in (("fitted", coef), ("qtool.plan.speed.COSTS", current)):
        rel = np.abs(X @ c - y) / y
        print(f"{label}: median relative error {np.median(rel):.3f}, max {np.max(rel):.3f} over {len(y)} mixes")
    print("fitted Costs:", json.dumps({k: float(f"{v:.4g}") for k, v in fitted.items()}))


def _nonnegative(A: np.ndarray, b: np.ndarray, free: int, sweeps: int = 20000) -> np.ndarray:
    """Least squares with every coefficient after the first `free` (the intercepts) kept >= 0
    (coordinate descent)."""
    x = np.linalg.lstsq(A, b, rcond=None)[0]
    x[free:] = np.maximum(x[free:], 0.0)
    gram, rhs = A.T @ A, A.T @ b
    for _ in range(sweeps):
        for i in range(len(x)):
            if gram[i, i]:
                value = x[i] - (gram[i] @ x - rhs[i]) / gram[i, i]
                x[i] = value if i < free else max(0.0, value)
    return x


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--candidates":
        candidates(sys.argv[2], Path(sys.argv[3]), Path(sys.argv[4]))
        return
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kit", type=Path, default=ROOT.parent / "shared" / "bench")
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--models", default="", help="comma-separated model names (default: every kit model)")
    parser.add_argument("--rows", default=",".join(ROWS))
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--resume", action="store_true", help="reuse the results saved in --out")
    parser.add_argument("--fit", action="store_true", help="time float/int8 mixes and fit the Costs")
    args = parser.parse_args()
    (fit if args.fit else table)(args)


if __name__ == "__main__":
    main()
