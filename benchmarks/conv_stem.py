"""A Whisper-like speech encoder (Conv1d front end, pre-LN transformer blocks): static int8 against
the dynamic strategy `auto` takes behind a Conv stem, and onnxruntime's quantize_dynamic.

    python benchmarks/conv_stem.py [--width 384] [--layers 4] [--frames 400] [--out DIR]

The kit has no speech or vision transformer, so this one is built: two Conv1d layers (80 mel
bins -> width, the second with stride 2 and three output channels 30x larger than the rest, the
outlier channels a real residual stream carries), GELU (Erf form) after each, then pre-LN blocks
(LayerNormalization, Q/K/V, softmax attention, output projection, residual, Erf-GELU FFN of 4x
width) and a final LayerNorm; random weights, random N(0, 1) inputs (16 to calibrate, 8 held out).
Cosine: the output's, mean over the held-out inputs; speedup: 1 thread, batch 1, the models taking
turns in one process, median of 30 runs.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from kit import plain_static_dynamic  # noqa: E402
from qtool.graph.runtime import create_session, time_models  # noqa: E402

MELS, HEADS, OUTLIER = 80, 6, 30.0


class _Graph:
    def __init__(self, rng):
        self.rng, self.nodes, self.inits = rng, [], []

    def const(self, name: str, value, dtype=np.float32) -> str:
        self.inits.append(numpy_helper.from_array(np.asarray(value, dtype), name))
        return name

    def weight(self, name: str, shape: tuple, fan_in: int) -> str:
        return self.const(name, self.rng.normal(0, 1 / np.sqrt(fan_in), shape))

    def op(self, op_type: str, inputs: list, output: str, **attrs) -> str:
        self.nodes.append(helper.make_node(op_type, inputs, [output], name=output, **attrs))
        return output

    def gelu(self, x: str, p: str) -> str:
        erf = self.op("Erf", [self.op("Div", [x, self.const(p + "sqrt2", 1.4142135)], p + "div")], p + "erf")
        inner = self.op("Mul", [x, self.op("Add", [erf, self.const(p + "one", 1.0)], p + "add")], p + "mul")
        return self.op("Mul", [inner, self.const(p + "half", 0.5)], p + "gelu")

    def layer_norm(self, x: str, p: str, width: int) -> str:
        return self.op("LayerNormalization", [x, self.const(p + "g", np.ones(width)),
                                              self.const(p + "b", np.zeros(width))], p, axis=-1)


def build(width: int, layers: int, frames: int, seed: int = 0) -> onnx.ModelProto:
    g = _Graph(np.random.default_rng(seed))
    g.op("Conv", ["mel", g.weight("conv1_w", (width, MELS, 3), MELS * 3)], "conv1", kernel_shape=[3], pads=[1, 1])
    stem = g.rng.normal(0, 1 / np.sqrt(width * 3), (width, width, 3)).astype(np.float32)
    stem[:3] *= OUTLIER
    g.op("Conv", [g.gelu("conv1", "g1_"), g.const("conv2_w", stem)], "conv2", kernel_shape=[3], pads=[1, 1],
         strides=[2])
    x = g.op("Transpose", [g.gelu("conv2", "g2_")], "tokens", perm=[0, 2, 1])
    head = width // HEADS
    for i in range(layers):
        p = f"l{i}_"
        h = g.layer_norm(x, p + "ln1", width)
        split = g.const(p + "heads", [1, -1, HEADS, head], np.int64)
        qkv = {}
        for n in "qkv":
            y = g.op("Add", [g.op("MatMul", [h, g.weight(p + "w" + n, (width, width), width)], p + n + "_mm"),
                             g.const(p + "b" + n, g.rng.normal(0, 0.1, width))], p + n)
            qkv[n] = g.op("Transpose", [g.op("Reshape", [y, split], p + n + "_split")], p + n + "_heads",
                          perm=[0, 2, 3, 1] if n == "k" else [0, 2, 1, 3])
        scores = g.op("Mul", [g.op("MatMul", [qkv["q"], qkv["k"]], p + "qk"), g.const(p + "scale", head ** -0.5)],
                      p + "scores")
        context = g.op("MatMul", [g.op("Softmax", [scores], p + "probs", axis=-1), qkv["v"]], p + "context")
        merged = g.op("Reshape", [g.op("Transpose", [context], p + "context_t", perm=[0, 2, 1, 3]),
                                  g.const(p + "merge", [1, -1, width], np.int64)], p + "context_m")
        out = g.op("Add", [g.op("MatMul", [merged, g.weight(p + "wo", (width, width), width)], p + "o_mm"),
                           g.const(p + "bo", np.zeros(width))], p + "o")
        x = g.op("Add", [x, out], p + "res1")
        up = g.op("Add", [g.op("MatMul", [g.layer_norm(x, p + "ln2", width),
                                          g.weight(p + "w1", (width, 4 * width), width)], p + "fc1_mm"),
                          g.const(p + "b1", np.zeros(4 * width))], p + "fc1")
        down = g.op("MatMul", [g.gelu(up, p + "act_"), g.weight(p + "w2", (4 * width, width), 4 * width)],
                    p + "fc2_mm")
        x = g.op("Add", [x, g.op("Add", [down, g.const(p + "b2", np.zeros(width))], p + "fc2")], p + "res2")
    g.layer_norm(x, "y", width)
    graph = helper.make_graph(g.nodes, "conv_stem_encoder",
                              [helper.make_tensor_value_info("mel", TensorProto.FLOAT, [1, MELS, frames])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, frames // 2, width])],
                              g.inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.checker.check_model(model)
    return model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--width", type=int, default=384)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--frames", type=int, default=400)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        out = args.out or Path(tmp)
        out.mkdir(parents=True, exist_ok=True)
        fp32 = out / "fp32.onnx"
        onnx.save(build(args.width, args.layers, args.frames), fp32)
        rng = np.random.default_rng(1)
        (out / "calib").mkdir(exist_ok=True)
        for i in range(16):
            np.save(out / "calib" / f"{i:03d}.npy", rng.normal(0, 1, (1, MELS, args.frames)).astype(np.float32))
        held = [{"mel": rng.normal(0, 1, (1, MELS, args.frames)).astype(np.float32)} for _ in range(8)]
        paths = plain_static_dynamic(fp32, out / "calib", out, "qtool auto")
        outputs = {label: [create_session(str(p), 1, label).run(None, f)[0] for f in held] for label, p in paths.items()}
        times = time_models({label: str(p) for label, p in paths.items()}, held[0], threads=1, warmup=3, runs=30)
    medians = {label: float(np.median(t)) for label, t in times.items()}
    print(f"encoder: width {args.width}, {args.layers} blocks, {args.frames} frames; fp32 {medians['fp32'] * 1e3:.2f} ms")
    print("| model | output cosine (mean of 8) | speedup |")
    print("|---|---|---|")
    for label in paths:
        if label == "fp32":
            continue
        cos = [float(a.ravel() @ b.ravel() / (np.linalg.norm(a) * np.linalg.norm(b)))
               for a, b in zip(outputs["fp32"], outputs[label])]
        print(f"| {label} | {np.mean(cos):.4f} | {medians['fp32'] / medians[label]:.2f}x |")


if __name__ == "__main__":
    main()
