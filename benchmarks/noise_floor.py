"""The fidelity figures of fp32 itself under one grey level of input noise: where the metrics of
benchmarks/models.py stop measuring quantization.

    python benchmarks/noise_floor.py [--kit ../shared/bench] [--models a,b] [--draws 3]

For every kit model whose input is an image (one 4-D float input), each held-out sample of
models.py (eval/, a held-back quarter of calib, or 64 dev photos) runs through the fp32 model twice:
as it is, and with every input value moved by -1, 0 or +1 grey level (equally likely), a grey
level being the sample's input range / 255 (one 8-bit pixel step of an image that spans the full
range after the model's normalisation). The noisy outputs are scored against the clean ones with
models.py's figures (cosine mean / min of the worst output, SQNR, the task kept), once per draw.
Nothing is quantized: a quantized model cannot be held to a figure that fp32 misses under a
perturbation the size of the image's own 8-bit rounding.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from models import _figures, _gold, _samples, data_split  # noqa: E402
from qtool.graph.modelio import input_specs, load_model  # noqa: E402
from qtool.graph.runtime import create_session  # noqa: E402


def _image_input(model: Path) -> str | None:
    specs = input_specs(load_model(model))
    if len(specs) == 1 and len(specs[0].shape) == 4 and specs[0].dtype == np.float32:
        return specs[0].name
    return None


def run_model(kit: Path, model: Path, work: Path, draws: int) -> dict | None:
    image = _image_input(model)
    if image is None:
        return None
    _, held, preprocess, _, limit = data_split(kit, model, work)
    feeds = _samples(held, model, preprocess, limit)
    session = create_session(str(model), 1, str(model))
    names = [o.name for o in session.get_outputs() if o.type == "tensor(float)"]
    outputs = {"fp32": [session.run(names, f) for f in feeds]}
    rng = np.random.default_rng(0)
    for draw in range(draws):
        noisy = []
        for f in feeds:
            x = f[image]
            step = np.float32((x.max() - x.min()) / 255)
            noisy.append(session.run(names, {**f, image: x + step * rng.integers(-1, 2, x.shape).astype(np.float32)}))
        outputs[f"draw {draw + 1}"] = noisy
    return {"model": model.stem, "samples": len(feeds), "figures": _figures(model.stem, outputs, _gold(kit, model.stem))}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kit", type=Path, default=ROOT.parent / "shared" / "bench")
    parser.add_argument("--models", default="", help="comma-separated model names (default: every image model)")
    parser.add_argument("--draws", type=int, default=3)
    args = parser.parse_args()
    chosen = set(filter(None, args.models.split(",")))
    print("| model | noise draw | cosine mean / min | SQNR dB | task kept |")
    print("|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as tmp:
        for model in sorted((args.kit / "models").glob("*.onnx")):
            if chosen and model.stem not in chosen:
                continue
            work = Path(tmp) / model.stem
            work.mkdir()
            row = run_model(args.kit, model, work, args.draws)
            if row is None:
                continue
            for i, (draw, f) in enumerate(row["figures"].items()):
                label = f"{row['model']} ({row['samples']} samples)" if i == 0 else ""
                print(f"| {label} | {draw} | {f['cos_mean']:.4f} / {f['cos_min']:.4f} | {f['sqnr']:.1f} | {f['task']} |",
                      flush=True)


if __name__ == "__main__":
    main()
