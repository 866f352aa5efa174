"""silero VAD as its authors ship it in other forms: the plain command on each, against fp32.

The kit holds one silero model (16 kHz, opset 15). The `silero-vad` wheel on PyPI ships more
variants of the same network, each a form a user may bring: both sample rates behind an `If`
(`silero_vad`), float16 weights (`silero_vad_half`), opset 18 with the branch logic rewritten
(`silero_vad_op18_ifless`), OpenVINO's export with the 16 kHz branch inlined and the LSTM weights
built by Slice/Concat in the main graph (`silero_vad_openvino_16k`), and a whole sequence of
chunks per call with the LSTM state as h and c (`silero_vad_16k_sequence`).

Samples come from the kit's 13.9 s of speech: 512-sample chunks with the previous chunk's last 64
samples as context, the state fed back by each fp32 model in turn (the sequence model gets windows
of 8 chunks). Every 7th chunk (every other window) is a sample; every 4th sample is held out, the
rest calibrate. Per variant: the plain command's int8 model against fp32 on the held-out samples,
cosine of the worst output (mean over samples), speech decisions kept (probability on the same
side of 0.5), latency at batch 1 with 1 thread (the two models taking turns, median), file sizes.

    python benchmarks/silero_variants.py                    # downloads silero-vad 6.2.3 (11 MB)
    python benchmarks/silero_variants.py --wheel silero_vad-6.2.3-py3-none-any.whl
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import qtool  # noqa: E402
from qtool.graph.runtime import create_session, time_models  # noqa: E402
from kit import wheel_files  # noqa: E402
from recurrent import speech_chunks  # noqa: E402  (the kit's speech, chunked as silero streams it)

WHEEL = "silero-vad==6.2.3"
VARIANTS = ("silero_vad", "silero_vad_half", "silero_vad_op18_ifless", "silero_vad_openvino_16k",
            "silero_vad_16k_sequence")
EVERY, WINDOW = 7, 8


def wheel_models(wheel: Path | None, folder: Path) -> Path:
    wheel_files(WHEEL, wheel, folder, lambda name: name.endswith(".onnx"))
    return folder / "silero_vad" / "data"


def samples(model: Path, pieces: list[np.ndarray]) -> list[dict[str, np.ndarray]]:
    """The variant's inputs at every EVERY-th chunk (every other window), each with the state its own
    fp32 run carries there."""
    session = create_session(str(model), 1)
    names = {i.name for i in session.get_inputs()}
    taken = []
    if "h" in names:  # the sequence form: WINDOW chunks per call, LSTM state as h and c
        h = c = np.zeros((1, 1, 128), np.float32)
        for k, start in enumerate(range(0, len(pieces) - WINDOW, WINDOW)):
            feeds = {"input": np.concatenate(pieces[start:start + WINDOW]), "h": h, "c": c}
            if k % 2 == 0:
                taken.append(feeds)
            _, h, c = session.run(None, feeds)
        return taken
    state = np.zeros((2, 1, 128), np.float32)
    for k, piece in enumerate(pieces):
        feeds = {"input": piece, "state": state}
        if "sr" in names:
            feeds["sr"] = np.array(16000, np.int64)
        if k % EVERY == 0:
            taken.append(feeds)
        _, state = session.run(None, feeds)
    return taken


def cosine(a: np.ndarray, b: np.ndarray) -> float:
    a, b = a.ravel().astype(np.float64), b.ravel().astype(np.float64)
    norms = np.linalg.norm(a) * np.linalg.norm(b)
    return float(a @ b / norms) if norms else float(np.array_equal(a, b))


def measure(name: str, model: Path, pieces: list[np.ndarray], folder: Path, runs: int) -> dict:
    taken = samples(model, pieces)
    held, calib = taken[3::4], [s for i, s in enumerate(taken) if i % 4 != 3]
    out = folder / f"{name}.int8.onnx"
    start = time.perf_counter()
    result = qtool.quantize(model, data=calib, progress=False)
    seconds = time.perf_counter() - start
    result.save(out)
    fp32, int8 = create_session(str(model), 1), create_session(str(out), 1)
    worst, kept = [], []
    for feeds in held:
        ref, got = fp32.run(None, feeds), int8.run(None, feeds)
        worst.append(min(cosine(r, g) for r, g in zip(ref, got)))
        kept.append(bool(np.all((ref[0] > 0.5) == (got[0] > 0.5))))
    times = time_models({"fp32": str(model), "int8": str(out)}, held[0], 1, 20, runs)
    fp32_ms, int8_ms = (1000 * float(np.median(times[k])) for k in ("fp32", "int8"))
    return {"variant": name, "samples": len(held), "cosine_mean": float(np.mean(worst)),
            "cosine_min": float(np.min(worst)), "decisions_kept": float(np.mean(kept)),
            "fp32_ms": fp32_ms, "int8_ms": int8_ms, "speedup": fp32_ms / int8_ms, "quantize_s": seconds,
            "fp32_mb": model.stat().st_size / 1e6, "int8_mb": out.stat().st_size / 1e6,
            "notes": [n for n in result.notes if "latency-aware choice saved" not in n]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--wheel", type=Path, help="the silero-vad wheel (else pip downloads it)")
    parser.add_argument("--runs", type=int, default=400, help="timed runs per model")
    parser.add_argument("--json", type=Path, help="write the figures here")
    args = parser.parse_args()
    pieces = speech_chunks()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        models = wheel_models(args.wheel, Path(tmp))
        for name in VARIANTS:
            rows.append(measure(name, models / f"{name}.onnx", pieces, Path(tmp), args.runs))
            print(f"{name}: done", file=sys.stderr)
    print("| variant | held-out samples | cosine mean / min (worst output) | speech decisions kept | "
          "fp32 ms | int8 ms | speedup | size fp32 -> int8 |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['variant']} | {r['samples']} | {r['cosine_mean']:.4f} / {r['cosine_min']:.4f} | "
              f"{100 * r['decisions_kept']:.0f}% | {r['fp32_ms']:.3f} | {r['int8_ms']:.3f} | {r['speedup']:.2f}x | "
              f"{r['fp32_mb']:.2f} -> {r['int8_mb']:.2f} MB |")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1) + "\n")


if __name__ == "__main__":
    main()
