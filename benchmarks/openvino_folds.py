"""A kit model's fidelity on OpenVINO with every calibration sample held out once: qtool --target
openvino, qtool --target ort-cpu and NNCF, each quantized on the other folds.

    python benchmarks/openvino_folds.py MODEL --nncf-python /path/to/nncf-venv/bin/python
        [--kit ../shared/bench] [--folds 4] [--config YAML] [--quantizers openvino,ort-cpu,nncf]

The held-back quarter of benchmarks/openvino.py (every fourth file in name order) can hold one kind
of sample only (the orientation classifiers' files go photo by photo, one per rotation: every
fourth is one rotation). Here the kit's calibration files are cut into `folds` folds by position
(file i goes to fold i % folds), and for each fold each quantizer runs on the others: the plain
command (`qtool quantize MODEL --data <the other folds> --target T [--config YAML]`), NNCF's default
(benchmarks/openvino_nncf.py, in its own venv). Each sample's worst output cosine to fp32 at f32: on
OpenVINO for the openvino and NNCF models, on onnxruntime for the ort-cpu one (the runtime each is
made for). Prints JSON, then a markdown row per quantizer: mean / min over all samples.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
# this file's folder comes first on sys.path when run as a script: benchmarks/openvino.py would then
# be the `openvino` package that `import openvino` finds
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]
sys.path.insert(0, str(ROOT))

from qtool.evaluation.metrics import sample_cosines  # noqa: E402
from qtool.evaluation.openvino_runtime import CompiledModel  # noqa: E402
from qtool.graph.runtime import create_session  # noqa: E402


def _worst(ref: list[np.ndarray], got: list[np.ndarray]) -> float:
    return min(float(sample_cosines(a.reshape(1, -1), b.reshape(1, -1))[0]) for a, b in zip(ref, got))


def _quantize(quantizer: str, model: Path, calib: Path, out: Path, nncf_python: str, config: str) -> None:
    if quantizer == "nncf":
        command = [nncf_python, str(ROOT / "benchmarks" / "openvino_nncf.py"), str(model), str(calib), str(out)]
    else:
        command = [sys.executable, "-m", "qtool", "quantize", str(model), "--data", str(calib),
                   "--target", quantizer, "-o", str(out), *(["--config", config] if config else [])]
    done = subprocess.run(command, capture_output=True, text=True, cwd=ROOT)
    if done.returncode:
        raise SystemExit(f"{quantizer}: {(done.stderr.strip().splitlines() or ['?'])[-1]}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model")
    parser.add_argument("--kit", type=Path, default=ROOT.parent / "shared" / "bench")
    parser.add_argument("--nncf-python", required=True)
    parser.add_argument("--folds", type=int, default=4)
    parser.add_argument("--config", default="", help="a qtool config for both qtool quantizers")
    parser.add_argument("--quantizers", default="openvino,ort-cpu,nncf")
    args = parser.parse_args()
    model = args.kit / "models" / f"{args.model}.onnx"
    files = sorted((args.kit / "inputs" / args.model / "calib").iterdir())
    quantizers = args.quantizers.split(",")
    reference = CompiledModel(model, 1, "f32")
    fp32 = create_session(str(model))
    cosines: dict[str, list[float]] = {q: [] for q in quantizers}
    for fold in range(args.folds):
        held = [f for i, f in enumerate(files) if i % args.folds == fold]
        with tempfile.TemporaryDirectory() as tmp:
            calib = Path(tmp) / "calib"
            calib.mkdir()
            for i, f in enumerate(files):
                if i % args.folds != fold:
                    (calib / f.name).symlink_to(f)
            for quantizer in quantizers:
                out = Path(tmp) / f"{quantizer}.onnx"
                _quantize(quantizer, model, calib, out, args.nncf_python, args.config)
                if quantizer == "ort-cpu":
                    session = create_session(str(out))
                    run, ref = (lambda feed: session.run(None, feed)), (lambda feed: fp32.run(None, feed))
                else:
                    compiled = CompiledModel(out, 1)
                    run, ref = (lambda feed: compiled.run(None, feed)), (lambda feed: reference.run(None, feed))
                for f in held:
                    with np.load(f) as archive:
                        feed = dict(archive)
                    cosines[quantizer].append(_worst(ref(feed), run(feed)))
    figures = {q: {"samples": len(c), "mean": float(np.mean(c)), "min": float(np.min(c))} for q, c in cosines.items()}
    print(json.dumps({"model": args.model, "folds": args.folds, "config": args.config, "figures": figures}))
    print(f"| quantizer ({args.model}, {len(files)} samples, {args.folds} folds) | worst-output cosine mean / min |")
    print("|---|---|")
    for q, f in figures.items():
        print(f"| {q} | {f['mean']:.4f} / {f['min']:.4f} |")


if __name__ == "__main__":
    main()
