"""Bias correction's significance threshold, cross-validated on a kit model's calibration samples.

    python benchmarks/bias_correction_cv.py MODEL [--thresholds 0,1,2] [--folds 4] [--kit ../shared/bench]

The model's calibration files are cut into `folds` folds; for each, the plain command's job
(qtool.quantize with bias correction off) runs on the other folds, then the same table and settled
config are built again with bias correction at each threshold T of
qtool.quantization.bias_correction (0: every measured shift applied whole; 1: the default), and
every int8 model is compared with fp32 on the held-out fold. The figures pool all folds (each
sample held out once): cosine mean / min, SQNR of the worst output, and models.py's task figure.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from dataclasses import replace
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from models import _figures, _gold, _samples  # noqa: E402
import qtool.api as api  # noqa: E402
import qtool.quantization.bias_correction as bias_correction  # noqa: E402
from qtool.config import PreprocessConfig  # noqa: E402
from qtool.graph.modelio import input_specs, load_model  # noqa: E402
from qtool.graph.runtime import create_session  # noqa: E402
from qtool.quantization.quantize import quantize_model  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model")
    parser.add_argument("--kit", type=Path, default=ROOT.parent / "shared" / "bench")
    parser.add_argument("--thresholds", default="0,1,2")
    parser.add_argument("--folds", type=int, default=4)
    args = parser.parse_args()
    model = args.kit / "models" / f"{args.model}.onnx"
    files = sorted((args.kit / "inputs" / args.model / "calib").iterdir())
    thresholds = [float(t) for t in args.thresholds.split(",")]
    outputs: dict[str, list] = {"fp32": [], "off": [], **{f"T={t:g}": [] for t in thresholds}}
    specs = input_specs(load_model(str(model)))
    with tempfile.TemporaryDirectory() as tmp:
        config = Path(tmp) / "off.yaml"
        config.write_text("quantization:\n  bias_correction: 'off'\n")
        for fold in range(args.folds):
            calib, held = Path(tmp) / f"calib{fold}", Path(tmp) / f"held{fold}"
            calib.mkdir()
            held.mkdir()
            for i, f in enumerate(files):
                (held if i % args.folds == fold else calib).joinpath(f.name).symlink_to(f)
            plain = api.quantize(str(model), data=str(calib), config=config, progress=False)
            feeds = _samples(held, model, PreprocessConfig())

            def run(m) -> list:
                session = create_session(m, 1, "model")
                names = [o.name for o in session.get_outputs() if o.type == "tensor(float)"]
                return [session.run(names, f) for f in feeds]

            outputs["fp32"] += run(str(model))
            outputs["off"] += run(plain.model)
            data = api._calibration_batches(str(calib), specs, plain.settled)
            for t in thresholds:
                bias_correction.SIGNIFICANCE = t
                built = quantize_model(str(model), plain.table, replace(plain.settled.quantization,
                                                                        bias_correction="fast"), data=data)
                outputs[f"T={t:g}"] += run(built.model)
            print(f"fold {fold} done", file=sys.stderr, flush=True)
    figures = _figures(args.model, outputs, _gold(args.kit, args.model))
    print(json.dumps({"model": args.model, "folds": args.folds, "samples": len(outputs["fp32"]), "figures": figures}))
    print(f"| {args.model} ({len(outputs['fp32'])} samples, {args.folds} folds) | cosine mean / min | SQNR dB | task |")
    print("|---|---|---|---|")
    for variant, f in figures.items():
        print(f"| {variant} | {f['cos_mean']:.4f} / {f['cos_min']:.4f} | {f['sqnr']:.1f} | {f['task']} |")


if __name__ == "__main__":
    main()
