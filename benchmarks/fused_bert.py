"""The kit's MiniLM as onnxruntime's transformer optimizer fuses it: qtool's plain command against
static int8 and onnxruntime's quantize_dynamic.

    python benchmarks/fused_bert.py [--kit ../shared/bench] [--rounds 5] [--out DIR]

optimum ships BERTs in this form (model_optimized.onnx): the embeddings and every LayerNorm are
com.microsoft EmbedLayerNormalization / SkipLayerNormalization ops, the attention with its Q/K/V
projection one com.microsoft Attention, GELU a BiasGelu; only the output and feed-forward
projections are MatMuls. The fusion runs at opt level 0 (pure graph rewriting, no onnxruntime
session). Calibration: the kit's calib/ (64 sentences); cosine: mean over eval/ (32) of each
output's cosine to the fused fp32 model; speedup: 1 thread, batch 1, the models taking turns in
one process, median of 100 runs per round on one eval sentence per round, median over the rounds;
file: the written model's size.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import numpy as np
import onnx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from kit import plain_static_dynamic  # noqa: E402
from qtool.graph.runtime import create_session, time_models  # noqa: E402

MODEL = "minilm_l6_v2_sentence"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kit", type=Path, default=ROOT.parent / "shared" / "bench")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    from onnxruntime.transformers import optimizer

    inputs = args.kit / "inputs" / MODEL
    held = [dict(np.load(f)) for f in sorted((inputs / "eval").glob("*.npz"))]
    with tempfile.TemporaryDirectory() as tmp:
        out = args.out or Path(tmp)
        out.mkdir(parents=True, exist_ok=True)
        fp32 = out / "fused.onnx"
        optimizer.optimize_model(str(args.kit / "models" / f"{MODEL}.onnx"), model_type="bert", num_heads=0,
                                 hidden_size=0, opt_level=0).save_model_to_file(str(fp32))
        # quantize_dynamic's own shape inference does not know the contrib ops' outputs: told they are float
        paths = plain_static_dynamic(fp32, inputs / "calib", out, "qtool plain command",
                                     extra_options={"DefaultTensorType": onnx.TensorProto.FLOAT})
        names = [o.name for o in onnx.load(fp32, load_external_data=False).graph.output]
        outputs = {label: [create_session(str(p), 1, label).run(names, f) for f in held] for label, p in paths.items()}
        sizes = {label: p.stat().st_size / 1e6 for label, p in paths.items()}
        rounds = []
        for r in range(args.rounds):
            times = time_models({label: str(p) for label, p in paths.items()}, held[r % len(held)], threads=1,
                                warmup=5, runs=100)
            rounds.append({label: float(np.median(t)) for label, t in times.items()})
    fp32_ms = np.median([r["fp32"] for r in rounds]) * 1e3
    print(f"{MODEL} fused by onnxruntime's transformer optimizer; fp32 {fp32_ms:.2f} ms, {sizes['fp32']:.1f} MB")
    print("| model | " + " | ".join(f"{n} cosine" for n in names) + " | speedup | file |")
    print("|---|" + "---|" * len(names) + "---|---|")
    for label in paths:
        if label == "fp32":
            continue
        cosines = []
        for i in range(len(names)):
            pairs = [(a[i].ravel().astype(np.float64), b[i].ravel().astype(np.float64))
                     for a, b in zip(outputs["fp32"], outputs[label])]
            cosines.append(np.mean([a @ b / (np.linalg.norm(a) * np.linalg.norm(b)) for a, b in pairs]))
        speed = np.median([r["fp32"] / r[label] for r in rounds])
        print(f"| {label} | " + " | ".join(f"{c:.4f}" for c in cosines) + f" | {speed:.2f}x | {sizes[label]:.1f} MB |")


if __name__ == "__main__":
    main()
