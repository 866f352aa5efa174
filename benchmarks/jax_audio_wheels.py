"""Models from PyPI wheels exported from JAX and TensorFlow, and an audio front end: qtool's plain
command against onnxruntime's quantize_static and quantize_dynamic.

- magika 1.0.3 `standard_v3_3/model.onnx`: Google's file-type classifier (214 types), written in
  JAX and exported through jax2tf and tf2onnx: a one-hot byte embedding (Equal, Cast, MatMul), the
  tanh GELU written as x + x * (x * (0.044715 x)), two LayerNorms written as TensorFlow computes
  them (mean(x^2) - mean(x)^2 from ReduceSums, Max 0, Reciprocal of Sqrt), a Conv, a global max
  pool and a softmax written out. Samples: the first and last 1024 bytes of real files (one file
  per file-name suffix from this Python's standard library and site-packages, seeded), as magika
  reads them (whitespace stripped, padded with 256). Task: the fp32 top-1 type kept.
- openWakeWord 0.4.0 `melspectrogram.onnx`: a log-mel front end (PyTorch): an STFT written as two
  Convs, the power spectrum, a mel MatMul, Log and a dB floor 80 dB below the maximum.
- openWakeWord 0.4.0 `embedding_model.onnx`: its speech embedding, a TensorFlow CNN (LeakyReLU,
  Max, MaxPool) over 76 log-mel frames.
- openWakeWord 0.4.0 `hey_jarvis_v0.1.onnx`: a wake-word head (PyTorch): Gemms with decomposed
  LayerNorms, a sigmoid score, and an If that runs a verifier network when the score is 0.5 or more
  and otherwise returns the score. Task: the score's largest absolute error.

The three openWakeWord models are fed as openWakeWord streams audio: the kit's 13.9 s of speech in
chunks of 5120 samples (every 2560), the embeddings of 76-frame windows (every 8 frames) and the
head's 16 consecutive embeddings. The first two thirds of each model's samples calibrate, the last
third is held out. Per quantizer: the cosine of the worst output to fp32 (mean / min over the
held-out samples), the task, the speedup over fp32 (1 thread, batch 1, the models taking turns,
median) and the time to quantize (qtool's plain command).

    python benchmarks/jax_audio_wheels.py                # downloads magika (16 MB) and openwakeword (9 MB)
    python benchmarks/jax_audio_wheels.py --wheels DIR   # the two wheels, already downloaded
"""

from __future__ import annotations

import argparse
import random
import sys
import sysconfig
import tempfile
import wave
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from kit import model_files  # noqa: E402
from models import wheel_rows  # noqa: E402
from qtool.graph.runtime import create_session  # noqa: E402

MAGIKA, WAKE = "magika==1.0.3", "openwakeword==0.4.0"
OWW = "openwakeword/resources/models/"
MAGIKA_MODEL = "magika/models/standard_v3_3/model.onnx"
MODELS = {  # label -> (wheel, path in the wheel, input name)
    "magika file-type classifier (JAX)": (MAGIKA, MAGIKA_MODEL, "bytes"),
    "openWakeWord log-mel front end": (WAKE, OWW + "melspectrogram.onnx", "input"),
    "openWakeWord speech embedding (TF CNN)": (WAKE, OWW + "embedding_model.onnx", "input_1"),
    "openWakeWord hey_jarvis head": (WAKE, OWW + "hey_jarvis_v0.1.onnx", "x.1"),
}
FILES, BLOCK, PAD = 160, 1024, 256
CHUNK, HOP, WINDOW, STRIDE, HEAD = 5120 + 480, 2560, 76, 8, 16


def file_bytes(path: Path) -> np.ndarray:
    """magika's input: the first and last 1024 bytes (of the first and last 4096, whitespace stripped),
    padded with 256 at the end and at the start."""
    data = path.read_bytes()
    begin, end = data[:4 * BLOCK].lstrip()[:BLOCK], data[-4 * BLOCK:].rstrip()[-BLOCK:]
    x = np.full(2 * BLOCK, PAD, np.int32)
    x[:len(begin)] = np.frombuffer(begin, np.uint8)
    x[2 * BLOCK - len(end):] = np.frombuffer(end, np.uint8)
    return x[None]


def magika_samples() -> list[np.ndarray]:
    """One file per file-name suffix (seeded) from this Python's library folders."""
    by_suffix: dict[str, list[Path]] = {}
    for key in ("stdlib", "purelib"):
        for path in sorted(Path(sysconfig.get_paths()[key]).rglob("*")):
            if path.is_file() and not path.is_symlink() and path.stat().st_size > 64:
                by_suffix.setdefault(path.suffix.lower(), []).append(path)
    rng = random.Random(0)
    suffixes = sorted(by_suffix)
    rng.shuffle(suffixes)
    return [file_bytes(rng.choice(by_suffix[s])) for s in suffixes[:FILES]]


def wake_samples(folder: Path, kit: Path) -> dict[str, list[np.ndarray]]:
    """The three openWakeWord models' inputs from the kit's speech, computed with the fp32 front end
    (by the model's path in the wheel)."""
    with wave.open(str(kit / "data" / "audio" / "speech16k.wav")) as audio:
        pcm = np.frombuffer(audio.readframes(audio.getnframes()), np.int16).astype(np.float32)
    mel = create_session(str(folder / OWW / "melspectrogram.onnx"), 1)
    frames = mel.run(None, {"input": pcm[None]})[0].squeeze() / 10 + 2  # openWakeWord's scaling
    windows = [frames[i:i + WINDOW][None, :, :, None] for i in range(0, len(frames) - WINDOW, STRIDE)]
    embedding = create_session(str(folder / OWW / "embedding_model.onnx"), 1)
    embeddings = np.concatenate([embedding.run(None, {"input_1": w})[0].reshape(1, -1) for w in windows])
    return {OWW + "melspectrogram.onnx": [pcm[i:i + CHUNK][None] for i in range(0, len(pcm) - CHUNK, HOP)],
            OWW + "embedding_model.onnx": windows,
            OWW + "hey_jarvis_v0.1.onnx": [embeddings[i:i + HEAD][None] for i in range(len(embeddings) - HEAD)]}


def task(label: str, ref: list, got: list) -> str:
    if label.startswith("magika"):
        kept = sum(int(np.argmax(r[0]) == np.argmax(g[0])) for r, g in zip(ref, got))
        return f"{kept}/{len(ref)} types"
    if "head" in label:
        return f"score error {max(float(np.max(np.abs(r[0] - g[0]))) for r, g in zip(ref, got)):.1e}"
    return ""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kit", type=Path, default=ROOT.parent / "shared" / "bench")
    parser.add_argument("--wheels", type=Path, help="a folder holding the magika 1.0.3 and openwakeword 0.4.0 "
                                                     "wheels (else pip downloads them)")
    args = parser.parse_args()
    print("| model | quantizer | cosine mean / min | task | speedup | time to quantize |")
    print("|---|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        model_files(((r, path) for r, path, _ in MODELS.values()), args.wheels, folder)
        inputs = {MAGIKA_MODEL: magika_samples(), **wake_samples(folder, args.kit)}
        for i, (label, (_, path, input_name)) in enumerate(MODELS.items()):
            feeds = inputs[path]
            work = folder / f"model{i}"
            work.mkdir()
            rows = wheel_rows(label, folder / path, [{input_name: x} for x in feeds], 2 * len(feeds) // 3, work,
                              ("ort_static", "ort_dynamic"), lambda ref, got, label=label: task(label, ref, got))
            for row in rows:
                print(row, flush=True)


if __name__ == "__main__":
    main()
