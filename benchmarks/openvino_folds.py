"""A kit model's fidelity on OpenVINO with every calibration sample held out once: qtool --target
openvino, qtool --target ort-cpu and NNCF, each quantized on the other folds.

    python benchmarks/openvino_folds.py MODEL --nncf-python /path/to/nncf-venv/bin/python
        [--kit ../shared/bench] [--folds 4] [--variant LABEL=YAML ...]

The held-back quarter of benchmarks/openvino.py (every fourth file in name order) can hold one kind
of sample only (the orientation classifiers' files go photo by photo, one per rotation: every
fourth is one rotation). Here the kit's calibration files are cut into `folds` folds by position
(file i goes to fold i % folds), and for each fold the quantizers of benchmarks/openvino.py run on
the others (its `quantize`: the plain command with `--target openvino` and `--target ort-cpu`,
NNCF's default in its own venv, and a `--target openvino --config YAML` row per `--variant`). Each
sample's worst output cosine to fp32 at f32: on OpenVINO for the openvino, variant and NNCF models,
on onnxruntime for the ort-cpu one (the runtime each is made for). Prints JSON, then a markdown
row per quantizer: mean / min over all samples.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
import tempfile
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
# this file's folder comes first on sys.path when run as a script: benchmarks/openvino.py would then
# be the `openvino` package that `import openvino` finds
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]
sys.path.insert(0, str(ROOT))

from qtool.evaluation.openvino_runtime import CompiledModel  # noqa: E402
from qtool.graph.runtime import create_session  # noqa: E402

# benchmarks/openvino.py's quantizers and cosine (loaded by path: as `openvino` it would hide the package)
_spec = importlib.util.spec_from_file_location("openvino_bench", ROOT / "benchmarks" / "openvino.py")
bench = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model")
    parser.add_argument("--kit", type=Path, default=ROOT.parent / "shared" / "bench")
    parser.add_argument("--nncf-python", required=True)
    parser.add_argument("--folds", type=int, default=4)
    parser.add_argument("--variant", action="append", default=[], metavar="LABEL=YAML",
                        help="a further qtool row: --target openvino with --config YAML")
    args = parser.parse_args()
    model = args.kit / "models" / f"{args.model}.onnx"
    files = sorted((args.kit / "inputs" / args.model / "calib").iterdir())
    variants = {label: Path(config) for label, _, config in (v.partition("=") for v in args.variant)}
    reference = {"openvino": CompiledModel(model, 1, "f32"), "onnxruntime": create_session(str(model))}
    cosines: dict[str, list[float]] = {}
    for fold in range(args.folds):
        held = [f for i, f in enumerate(files) if i % args.folds == fold]
        with tempfile.TemporaryDirectory() as tmp:
            calib = Path(tmp) / "calib"
            calib.mkdir()
            for i, f in enumerate(files):
                if i % args.folds != fold:
                    (calib / f.name).symlink_to(f)
            for label, made in bench.quantize(model, calib, Path(tmp), args.nncf_python, variants).items():
                if "error" in made:
                    raise SystemExit(f"{label}: {made['error']}")
                runtime = "onnxruntime" if label == "ort-cpu" else "openvino"
                int8 = create_session(str(made["path"])) if runtime == "onnxruntime" else CompiledModel(made["path"], 1)
                for f in held:
                    with np.load(f) as archive:
                        feed = dict(archive)
                    cosines.setdefault(label, []).append(
                        bench._worst_cosine(reference[runtime].run(None, feed), int8.run(None, feed)))
    figures = {q: {"samples": len(c), "mean": float(np.mean(c)), "min": float(np.min(c))} for q, c in cosines.items()}
    print(json.dumps({"model": args.model, "folds": args.folds, "variants": {k: str(v) for k, v in variants.items()},
                      "figures": figures}))
    print(f"| quantizer ({args.model}, {len(files)} samples, {args.folds} folds) | worst-output cosine mean / min |")
    print("|---|---|")
    for q, f in figures.items():
        print(f"| {q} | {f['mean']:.4f} / {f['min']:.4f} |")


if __name__ == "__main__":
    main()
