"""Bias correction cross-validated on a kit model's calibration samples: the plain command's job with
each `bias_correction` value, every sample held out once.

    python benchmarks/bias_correction_cv.py MODEL [--variants off,weights,fast,measured] [--folds 4] [--kit ../shared/bench]

The model's calibration files are cut into `folds` folds; for each, the plain command's job
(qtool.quantize, every choice settled as the command settles it) runs on the other folds once per
variant (`quantization.bias_correction` set to it; `measured`: `auto` with onnxruntime CPU's rule
set to measure the weights form on each job's scored samples, as the OpenVINO target does), and
every int8 model is compared with fp32 on the held-out fold. The figures pool all folds: cosine
mean / min, SQNR of the worst output, models.py's task figure, the range method and bias
correction each job settled, and per sample against the first variant: on how many samples the
worst output's cosine is higher and lower (a paired count, which says whether a difference in the
pooled figures is more than a few samples); and each variant's
job time in this process, the variants taking turns within each fold: the median over the folds
(imports are in neither; the first fold's first job also warms the process up); where a job
measured the choice, its figures on the calibration samples it scored (cosine dB per candidate).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from models import _figures, _gold, _samples, worst_cosines  # noqa: E402
import qtool.api as api  # noqa: E402
import qtool.targets as targets  # noqa: E402
from qtool.config import PreprocessConfig  # noqa: E402
from qtool.graph.runtime import create_session  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model")
    parser.add_argument("--kit", type=Path, default=ROOT.parent / "shared" / "bench")
    parser.add_argument("--variants", default="off,weights")
    parser.add_argument("--folds", type=int, default=4)
    args = parser.parse_args()
    model = args.kit / "models" / f"{args.model}.onnx"
    files = sorted((args.kit / "inputs" / args.model / "calib").iterdir())
    variants = args.variants.split(",")
    outputs: dict[str, list] = {"fp32": [], **{v: [] for v in variants}}
    chosen: dict[str, list] = {v: [] for v in variants}
    seconds: dict[str, list] = {v: [] for v in variants}
    scored: dict[str, list] = {v: [] for v in variants}  # a measured choice's figures on its scored samples
    with tempfile.TemporaryDirectory() as tmp:
        for fold in range(args.folds):
            calib, held = Path(tmp) / f"calib{fold}", Path(tmp) / f"held{fold}"
            calib.mkdir()
            held.mkdir()
            for i, f in enumerate(files):
                (held if i % args.folds == fold else calib).joinpath(f.name).symlink_to(f)
            feeds = _samples(held, model, PreprocessConfig())

            def run(m) -> list:
                session = create_session(m, 1, "model")
                names = [o.name for o in session.get_outputs() if o.type == "tensor(float)"]
                return [session.run(names, f) for f in feeds]

            outputs["fp32"] += run(str(model))
            for variant in variants:
                start = time.perf_counter()
                result = _quantize(model, calib, variant)
                seconds[variant].append(time.perf_counter() - start)
                scored[variant] += [{label: figures["cosine_db"] for label, figures in d.measured}
                                    for d in result.decisions
                                    if d.option == "quantization.bias_correction" and d.measured]
                outputs[variant] += run(result.model)
                chosen[variant].append(f"{result.settled.calibration.method} "
                                       f"{result.settled.quantization.bias_correction}")
            print(f"fold {fold} done", file=sys.stderr, flush=True)
    figures = _figures(args.model, outputs, _gold(args.kit, args.model))
    cosines = {v: np.array(worst_cosines(outputs["fp32"], outputs[v])) for v in variants}
    first = cosines[variants[0]]
    paired = {v: {"higher": int(np.sum(c > first)), "lower": int(np.sum(c < first))} for v, c in cosines.items()}
    print(json.dumps({"model": args.model, "folds": args.folds, "samples": len(outputs["fp32"]),
                      "range_methods": chosen, "figures": figures, "paired": paired,
                      "job_seconds": {v: statistics.median(t) for v, t in seconds.items()},
                      "scored_cosine_db": {v: f for v, f in scored.items() if f}}))
    print(f"| {args.model} ({len(outputs['fp32'])} samples, {args.folds} folds) | cosine mean / min | SQNR dB | task "
          f"| range method, bias correction | samples higher / lower than {variants[0]} | job s |")
    print("|---|---|---|---|---|---|---|")
    for variant in variants:
        f = figures[variant]
        print(f"| {variant} | {f['cos_mean']:.4f} / {f['cos_min']:.4f} | {f['sqnr']:.1f} | {f['task']} "
              f"| {', '.join(chosen[variant])} | {paired[variant]['higher']} / {paired[variant]['lower']} "
              f"| {statistics.median(seconds[variant]):.2f} |")


def _quantize(model: Path, calib: Path, variant: str):
    """The plain command's job with bias_correction `variant`; `measured`: `auto` with the default
    target's rule set to measure the weights form (what the job would write if it did)."""
    if variant != "measured":
        return api.quantize(str(model), data=str(calib), progress=False,
                            config={"quantization": {"bias_correction": variant}})
    name = targets.DEFAULT_TARGET
    shipped = targets.TARGETS[name]
    targets.TARGETS[name] = dataclasses.replace(shipped, bias_correction="measured")
    try:
        return api.quantize(str(model), data=str(calib), progress=False)
    finally:
        targets.TARGETS[name] = shipped


if __name__ == "__main__":
    main()
