"""Detection fidelity: decode YOLO-style outputs of both models, then match int8 boxes to fp32 boxes.

The fp32 model's detections are the reference (no ground truth is needed): an int8 box
is a hit when an fp32 box of the same class overlaps it by IoU >= match_iou. Recall
says how many fp32 boxes the int8 model still finds, precision how many of its boxes
the fp32 model agrees with. Decoding is plain numpy: score threshold, then greedy
non-maximum suppression per class, as Ultralytics' predictor does.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from qtool.config import DetectionConfig
from qtool.errors import QtoolError
from qtool.evaluation.metrics import add_counts


@dataclass
class Detections:
    boxes: np.ndarray  # [K, 4] x1, y1, x2, y2
    scores: np.ndarray  # [K]
    classes: np.ndarray  # [K] int


def _rows(output: np.ndarray, cfg: DetectionConfig) -> np.ndarray:
    """[N, A, values] whatever the model's layout."""
    if output.ndim != 3:
        raise QtoolError(f"detection expects an output [N, 4+classes, anchors], got shape {list(output.shape)}")
    channels_first = output.shape[1] < output.shape[2] if cfg.layout == "auto" else cfg.layout == "channels_first"
    rows = np.transpose(output, (0, 2, 1)) if channels_first else output
    if rows.shape[2] < 5 + int(cfg.objectness):
        raise QtoolError(f"detection output has {rows.shape[2]} values per anchor: too few for a box and a class")
    return rows


def _xyxy(boxes: np.ndarray, box_format: str) -> np.ndarray:
    if box_format == "xyxy":
        return boxes.astype(np.float64)
    cx, cy, w, h = (boxes[:, i].astype(np.float64) for i in range(4))
    return np.stack([cx - w / 2, cy - h / 2, cx + w / 2, cy + h / 2], axis=1)


def iou_matrix(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """IoU of every box of `a` [K, 4] with every box of `b` [M, 4] (x1, y1, x2, y2)."""
    lt = np.maximum(a[:, None, :2], b[None, :, :2])
    rb = np.minimum(a[:, None, 2:], b[None, :, 2:])
    inter = np.prod(np.clip(rb - lt, 0, None), axis=2)
    area_a = np.prod(np.clip(a[:, 2:] - a[:, :2], 0, None), axis=1)
    area_b = np.prod(np.clip(b[:, 2:] - b[:, :2], 0, None), axis=1)
    union = area_a[:, None] + area_b[None, :] - inter
    return np.where(union > 0, inter / np.where(union > 0, union, 1.0), 0.0)


def nms(boxes: np.ndarray, scores: np.ndarray, iou_threshold: float) -> np.ndarray:
    """Indices kept by greedy non-maximum suppression, highest score first."""
    order = np.argsort(-scores, kind="stable")
    keep = []
    while order.size:
        best = order[0]
        keep.append(best)
        overlap = iou_matrix(boxes[best:best + 1], boxes[order[1:]])[0]
        order = order[1:][overlap <= iou_threshold]
    return np.asarray(keep, dtype=np.int64)


def decode(output: np.ndarray, cfg: DetectionConfig) -> list[Detections]:
    """One Detections per image of the batch."""
    result = []
    first_class = 5 if cfg.objectness else 4
    for rows in _rows(output, cfg):
        scores_all = rows[:, first_class:].astype(np.float64)
        if cfg.objectness:
            scores_all = scores_all * rows[:, 4:5]
        classes = scores_all.argmax(axis=1)
        scores = scores_all[np.arange(len(rows)), classes]
        keep = scores >= cfg.conf_threshold
        boxes, scores, classes = _xyxy(rows[keep, :4], cfg.box_format), scores[keep], classes[keep]
        if cfg.class_agnostic_nms or not len(boxes):
            shifted = boxes
        else:
            # boxes of different classes never overlap once shifted apart by class
            shifted = boxes + (classes * (np.abs(boxes).max() + 1.0))[:, None]
        kept = nms(shifted, scores, cfg.iou_threshold)[:cfg.max_detections]
        result.append(Detections(boxes[kept], scores[kept], classes[kept]))
    return result


def match(ref: Detections, test: Detections, min_iou: float) -> list[tuple[int, int, float]]:
    """Greedy one-to-one matching, test boxes in score order: (test index, ref index, IoU)."""
    if not len(ref.boxes) or not len(test.boxes):
        return []
    iou = iou_matrix(test.boxes, ref.boxes)
    iou[test.classes[:, None] != ref.classes[None, :]] = -1.0
    pairs = []
    taken = np.zeros(len(ref.boxes), dtype=bool)
    for t in np.argsort(-test.scores, kind="stable"):
        candidates = np.where(taken, -1.0, iou[t])
        r = int(candidates.argmax())
        if candidates[r] >= min_iou:
            taken[r] = True
            pairs.append((int(t), r, float(candidates[r])))
    return pairs


@dataclass
class DetectionAccumulator:
    """Counts over all images: fp32 boxes, int8 boxes, matched pairs and their IoU."""

    cfg: DetectionConfig
    images: int = 0
    ref_boxes: int = 0
    test_boxes: int = 0
    matched: int = 0
    iou_sum: float = 0.0

    def update(self, ref: np.ndarray, test: np.ndarray) -> None:
        """One batch; its IoUs are summed before they join the total, so a batch's accumulator
        merged into the total (evaluation on workers) gives the same float as updating the total."""
        batch_iou = 0.0
        for r, t in zip(decode(ref, self.cfg), decode(test, self.cfg)):
            pairs = match(r, t, self.cfg.match_iou)
            self.images += 1
            self.ref_boxes += len(r.boxes)
            self.test_boxes += len(t.boxes)
            self.matched += len(pairs)
            batch_iou += sum(p[2] for p in pairs)
        self.iou_sum += batch_iou

    def merge(self, other: "DetectionAccumulator") -> None:
        add_counts(self, other, ("images", "ref_boxes", "test_boxes", "matched", "iou_sum"))

    def result(self) -> dict:
        # With nothing to find (or nothing found) there is nothing to miss: 1.0, not a division by zero.
        return {
            "images": self.images,
            "fp32_boxes": self.ref_boxes,
            "int8_boxes": self.test_boxes,
            "matched": self.matched,
            "recall": self.matched / self.ref_boxes if self.ref_boxes else 1.0,
            "precision": self.matched / self.test_boxes if self.test_boxes else 1.0,
            "mean_iou": self.iou_sum / self.matched if self.matched else None,
            "settings": {"conf_threshold": self.cfg.conf_threshold, "iou_threshold": self.cfg.iou_threshold,
                         "match_iou": self.cfg.match_iou, "box_format": self.cfg.box_format},
        }
