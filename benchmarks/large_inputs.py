"""Time to quantize a U-Net-like detector at large inputs: qtool quantize against quantize_static.

    python benchmarks/large_inputs.py [--kit ../shared/bench] [--size 960] [--images 8] [--repeat 3] [--stages]

The kit's DB text detector (rapidocr_v4_det.onnx, dynamic H and W) on real text images of
data/ocr/images resized as the kit's DB samples are made (PaddleOCR's DB preprocessing: the longer
side to --size, both sides rounded to multiples of 32, RGB / 255, ImageNet mean and std, NCHW),
written as .npz samples. Each run is one child process (benchmarks/quantize_time.py's probe: wall
time, CPU time, peak RSS, imports included): `qtool quantize MODEL --data <samples> -o out.onnx`
and quantize_static (QDQ, per-channel, MinMax) over the same samples, interleaved, --repeat times;
the medians are printed as a table row. --stages adds one qtool run with timers around its stages.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
import quantize_time  # noqa: E402
from quantize_time import CHILD_ORT, CHILD_STAGES, STAGES, run_child  # noqa: E402

MEAN, STD = np.array([0.485, 0.456, 0.406], np.float32), np.array([0.229, 0.224, 0.225], np.float32)


def samples(kit: Path, size: int, count: int, folder: Path) -> list[tuple[int, int]]:
    """The first `count` images of data/ocr/images (sorted) as DB inputs with the longer side `size`."""
    import cv2

    folder.mkdir(parents=True, exist_ok=True)
    shapes = []
    for path in sorted((kit / "data" / "ocr" / "images").iterdir())[:count]:
        image = cv2.imread(str(path), cv2.IMREAD_COLOR)
        h, w = image.shape[:2]
        scale = size / max(h, w)
        h, w = max(32, int(round(h * scale / 32)) * 32), max(32, int(round(w * scale / 32)) * 32)
        image = cv2.resize(image, (w, h), interpolation=cv2.INTER_LINEAR)
        x = (cv2.cvtColor(image, cv2.COLOR_BGR2RGB).astype(np.float32) / 255.0 - MEAN) / STD
        np.savez(folder / f"{path.stem}.npz", x=x.transpose(2, 0, 1)[None].astype(np.float32))
        shapes.append((h, w))
    return shapes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kit", type=Path, default=ROOT.parent / "shared" / "bench")
    parser.add_argument("--size", type=int, default=960)
    parser.add_argument("--images", type=int, default=8)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--stages", action="store_true")
    parser.add_argument("--before", type=Path, default=None,
                        help="another checkout whose qtool runs too, interleaved (its 'before' column)")
    args = parser.parse_args()
    model = args.kit / "models" / "rapidocr_v4_det.onnx"
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        data = work / "samples"
        shapes = samples(args.kit, args.size, args.images, data)
        print(f"{len(shapes)} samples: {shapes}", file=sys.stderr)
        runs: dict[str, list[dict]] = {"qtool": [], "ort": [], "before": []}
        loads = [os.getloadavg()[0]]
        qtool = [sys.executable, "-m", "qtool", "quantize", str(model), "--data", str(data), "-o"]
        for _ in range(args.repeat):
            if args.before is not None:
                quantize_time.ROOT = args.before.resolve()  # run_child's PYTHONPATH
                runs["before"].append(run_child([*qtool, str(work / "before.onnx")]))
                quantize_time.ROOT = ROOT
            runs["qtool"].append(run_child([*qtool, str(work / "q.onnx")]))
            code = CHILD_ORT.format(root=str(ROOT), model=str(model), data=str(data), config="",
                                    out=str(work / "ort.onnx"))
            runs["ort"].append(run_child([sys.executable, "-c", code]))
            loads.append(os.getloadavg()[0])
            print(json.dumps({k: {x: round(y, 1) for x, y in v[-1].items() if isinstance(y, float)}
                              for k, v in runs.items() if v}), file=sys.stderr, flush=True)
        if args.stages:
            out = work / "stages.json"
            code = CHILD_STAGES.format(root=str(ROOT), stages=STAGES, out=str(out))
            run_child([sys.executable, "-c", code, "quantize", str(model), "--data", str(data), "-o",
                       str(work / "s.onnx")])
            stages = json.loads(out.read_text()) if out.exists() else {}
            for name, figures in sorted(stages.items(), key=lambda kv: -kv[1][1] if isinstance(kv[1], list) else 0):
                print(f"  {name}: {figures}", file=sys.stderr)

    def median(tool: str, key: str) -> float:
        return statistics.median(r[key] for r in runs[tool])

    print(f"load average {min(loads):.1f}-{max(loads):.1f} (1 min), {os.cpu_count()} cores; "
          f"{len(shapes)} images, longer side {args.size}; medians of {args.repeat}")
    tools = [t for t in ("before", "qtool", "ort") if runs[t]]
    names = {"before": "qtool before", "qtool": "qtool", "ort": "quantize_static"}
    print("| " + " | ".join(f"{names[t]}: wall / CPU s, peak RSS" for t in tools)
          + " | CPU qtool / quantize_static |" + (" before |" if runs["before"] else ""))
    print("|---" * (len(tools) + 1 + bool(runs["before"])) + "|")
    cells = [f"{median(t, 'wall'):.0f} / {median(t, 'cpu'):.1f}, {median(t, 'rss_mb'):.0f} MB" for t in tools]
    cells.append(f"{median('qtool', 'cpu') / median('ort', 'cpu'):.2f}x")
    if runs["before"]:
        cells.append(f"{median('before', 'cpu') / median('ort', 'cpu'):.2f}x")
    print("| " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
