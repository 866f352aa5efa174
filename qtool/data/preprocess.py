"""Image preprocessing with OpenCV: the transform a model was trained with.

Every step mirrors a published eval recipe so users can match their training code:
`stretch` (plain resize), `shorter_side` (torchvision Resize(256) + CenterCrop(224)),
`crop_fraction` (TF/EfficientNet eval: centre crop of size/(size+32) of the shorter
side, then resize) and `letterbox` (YOLO: keep aspect ratio, pad the border).
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

from functools import lru_cache

import numpy as np

from qtool.config import PreprocessConfig

_INTERPOLATION = {"nearest": "INTER_NEAREST", "bilinear": "INTER_LINEAR", "bicubic": "INTER_CUBIC",
                  "area": "INTER_AREA"}


@lru_cache(maxsize=None)
def _cv2():
    """OpenCV, imported on first use (~35 ms): data given as .npy arrays never needs it."""
    import cv2

    # qtool reports undecodable images itself (one warning with a count); OpenCV's own
    # per-file warnings on stderr would only bury that line.
    cv2.utils.logging.setLogLevel(cv2.utils.logging.LOG_LEVEL_ERROR)
    return cv2


def read_image(path: str | Path) -> Optional[np.ndarray]:
    """Decode an image file to 8-bit BGR (H, W, 3); None when it cannot be decoded."""
    # np.fromfile + imdecode instead of imread: works with non-ASCII paths and never aborts.
    try:
        raw = np.fromfile(str(path), dtype=np.uint8)
    except OSError:
        return None
    if raw.size == 0:
        return None
    cv2 = _cv2()
    image = cv2.imdecode(raw, cv2.IMREAD_COLOR)
    if image is None or image.size == 0:
        return None
    return image


def _center_crop(image: np.ndarray, crop_h: int, crop_w: int) -> np.ndarray:
    h, w = image.shape[:2]
    crop_h, crop_w = min(crop_h, h), min(crop_w, w)
    # TF's offset rounding: ((h - crop) + 1) // 2
    top = (h - crop_h + 1) // 2
    left = (w - crop_w + 1) // 2
    return image[top : top + crop_h, left : left + crop_w]


def resize_image(image: np.ndarray, cfg: PreprocessConfig, size: tuple[int, int]) -> np.ndarray:
    """Geometric part: a BGR image in, the same of exactly `size` (height, width) out, its dtype kept."""
    cv2 = _cv2()
    out_h, out_w = size
    interp = getattr(cv2, _INTERPOLATION[cfg.interpolation])
    h, w = image.shape[:2]
    if cfg.resize == "stretch":
        return cv2.resize(image, (out_w, out_h), interpolation=interp)
    if cfg.resize == "crop_fraction":
        # The crop has the output's aspect ratio and covers crop_fraction of the shorter side.
        side = cfg.crop_fraction * min(h, w)
        longest = max(out_h, out_w)
        crop = _center_crop(image, max(1, int(side * out_h / longest)), max(1, int(side * out_w / longest)))
        return cv2.resize(crop, (out_w, out_h), interpolation=interp)
    if cfg.resize == "shorter_side":
        shorter = cfg.resize_shorter or int(round(max(out_h, out_w) / cfg.crop_fraction))
        ratio = shorter / min(h, w)
        new_w, new_h = max(out_w, int(round(w * ratio))), max(out_h, int(round(h * ratio)))
        resized = cv2.resize(image, (new_w, new_h), interpolation=interp)
        return _center_crop(resized, out_h, out_w)
    # letterbox: keep the aspect ratio, pad the rest with pad_value, image centred
    ratio = min(out_h / h, out_w / w)
    new_w, new_h = max(1, int(round(w * ratio))), max(1, int(round(h * ratio)))
    resized = cv2.resize(image, (new_w, new_h), interpolation=interp)
    top, left = (out_h - new_h) // 2, (out_w - new_w) // 2
    pad = float(np.clip(cfg.pad_value, 0, 255))
    return cv2.copyMakeBorder(resized, top, out_h - new_h - top, left, out_w - new_w - left,
                              cv2.BORDER_CONSTANT, value=(pad, pad, pad))


def to_tensor(image: np.ndarray, cfg: PreprocessConfig) -> np.ndarray:
    """Photometric part: BGR uint8 (H, W, 3) to a float32 batch of one in the configured layout."""
    if cfg.channel_order == "RGB":
        cv2 = _cv2()
        image = cv2.cvtColor(image, cv2.COLOR_BGR2RGB)
    x = image.astype(np.float32)
    if cfg.scale != 1.0:
        x *= np.float32(cfg.scale)
    mean = np.asarray(cfg.mean, dtype=np.float32)
    std = np.asarray(cfg.std, dtype=np.float32)
    x = (x - mean) / std
    if cfg.layout == "NCHW":
        x = x.transpose(2, 0, 1)
    return np.ascontiguousarray(x[None])


def preprocess_image(image: np.ndarray, cfg: PreprocessConfig, size: tuple[int, int]) -> np.ndarray:
    """resize_image then to_tensor, the pixels resized as float32 (kept in 0..255, as 8 bits
    saturate) and with OpenCV's IPP paths off. Both so that the same photo gives the same input on
    any CPU: OpenCV's 8-bit resize rounds its fixed-point sums to whole levels, and its kernels
    for ARM and x86 (IPP's for AVX-512 and AVX2 too) round some pixels one level apart, which
    moves ranges by percents; in float32 they differ at most in the last bits, which the measured
    values' grid absorbs (qtool.calibration.grid). The IPP switch is per thread, restored after."""
    cv2 = _cv2()
    was = cv2.ipp.useIPP()
    cv2.ipp.setUseIPP(False)
    try:
        resized = resize_image(image.astype(np.float32), cfg, size)
        return to_tensor(np.clip(resized, 0.0, 255.0, out=resized), cfg)
    finally:
        cv2.ipp.setUseIPP(was)
