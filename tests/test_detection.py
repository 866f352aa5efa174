"""Detection: decoding YOLO-style outputs, NMS, and matching int8 boxes to fp32 boxes."""

from __future__ import annotations

import json

import numpy as np
import pytest

from qtool.config import DetectionConfig
from qtool.evaluation.detection import DetectionAccumulator, Detections, decode, iou_matrix, match

from tests.conftest import ROOT, kit_path, run_qtool

CLASSES = 3


def _yolo_output(rows: list[tuple]) -> np.ndarray:
    """[1, 4 + classes, anchors] from rows (cx, cy, w, h, class, score); other anchors score 0."""
    out = np.zeros((1, 4 + CLASSES, 50), np.float32)
    for a, (cx, cy, w, h, cls, score) in enumerate(rows):
        out[0, :4, a] = (cx, cy, w, h)
        out[0, 4 + cls, a] = score
    return out


def test_iou_matrix_known_values():
    a = np.array([[0, 0, 10, 10], [20, 20, 30, 30]], np.float64)
    b = np.array([[5, 0, 15, 10], [0, 0, 10, 10]], np.float64)
    assert iou_matrix(a, b) == pytest.approx(np.array([[50 / 150, 1.0], [0.0, 0.0]]))


def test_decode_thresholds_and_per_class_nms():
    out = _yolo_output([
        (50, 50, 20, 20, 0, 0.9),  # kept
        (51, 50, 20, 20, 0, 0.8),  # same class, IoU ~0.9 with the first: suppressed
        (51, 50, 20, 20, 1, 0.7),  # overlaps but another class: kept
        (150, 150, 10, 10, 2, 0.2),  # below the 0.25 score threshold
    ])
    (det,) = decode(out, DetectionConfig())
    assert det.classes.tolist() == [0, 1]
    assert det.scores.tolist() == pytest.approx([0.9, 0.7])
    assert det.boxes[0].tolist() == pytest.approx([40, 40, 60, 60])
    (agnostic,) = decode(out, DetectionConfig(class_agnostic_nms=True))
    assert agnostic.classes.tolist() == [0]


def test_decode_layouts_formats_and_objectness_agree():
    rows = [(50, 50, 20, 20, 0, 0.9), (120, 80, 30, 10, 2, 0.6)]
    first = decode(_yolo_output(rows), DetectionConfig())[0]
    anchors_first = np.transpose(_yolo_output(rows), (0, 2, 1))
    assert decode(anchors_first, DetectionConfig())[0].boxes == pytest.approx(first.boxes)
    xyxy = _yolo_output(rows)
    xyxy[0, :4, :2] = np.array([[40, 40, 60, 60], [105, 75, 135, 85]], np.float32).T
    assert decode(xyxy, DetectionConfig(box_format="xyxy"))[0].boxes == pytest.approx(first.boxes)
    # YOLOv5 layout: objectness 0.5 halves the class scores, so 0.6 * 0.5 falls below 0.4
    v5 = np.concatenate([_yolo_output(rows)[:, :4], np.full((1, 1, 50), 0.5, np.float32),
                         _yolo_output(rows)[:, 4:]], axis=1)
    det = decode(v5, DetectionConfig(objectness=True, conf_threshold=0.4))[0]
    assert det.classes.tolist() == [0] and det.scores.tolist() == pytest.approx([0.45])


def _det(boxes, classes, scores) -> Detections:
    return Detections(np.asarray(boxes, np.float64), np.asarray(scores, np.float64), np.asarray(classes))


def test_match_needs_same_class_and_enough_overlap():
    ref = _det([[0, 0, 10, 10], [20, 20, 30, 30], [40, 40, 50, 50]], [0, 1, 2], [0.9, 0.9, 0.9])
    test = _det([[1, 0, 11, 10],  # class 0, IoU 0.82: match
                 [20, 20, 30, 30],  # right place, wrong class: no match
                 [40, 44, 50, 54],  # class 2, IoU 0.43 < 0.5: no match
                 [0, 0, 10, 10]],  # a duplicate of the first: the fp32 box is taken already
                [0, 2, 2, 0], [0.8, 0.8, 0.8, 0.7])
    pairs = match(ref, test, 0.5)
    assert [(t, r) for t, r, _ in pairs] == [(0, 0)]
    assert pairs[0][2] == pytest.approx(90 / 110)


def test_accumulator_recall_and_precision():
    ref = _yolo_output([(50, 50, 20, 20, 0, 0.9), (150, 150, 20, 20, 1, 0.9)])
    test = _yolo_output([(52, 50, 20, 20, 0, 0.8), (300, 300, 20, 20, 1, 0.9), (400, 50, 10, 10, 2, 0.5)])
    acc = DetectionAccumulator(DetectionConfig())
    acc.update(np.concatenate([ref, ref]), np.concatenate([test, ref]))
    result = acc.result()
    assert (result["images"], result["fp32_boxes"], result["int8_boxes"], result["matched"]) == (2, 4, 5, 3)
    assert result["recall"] == pytest.approx(3 / 4) and result["precision"] == pytest.approx(3 / 5)


@pytest.mark.slow
def test_kit_yolov8_detection_report(tmp_path):
    """The kit's YOLOv8n detector through quantize and evaluate --task detection."""
    model = kit_path("models", "nudenet_yolov8n_320.onnx")
    data = kit_path("inputs", "nudenet_yolov8n_320", "calib")
    int8, report = tmp_path / "y.int8.onnx", tmp_path / "y.json"
    result = run_qtool("quantize", model, "--data", data, "--num-samples", "16", "-o", int8)
    assert result.returncode == 0, result.stderr
    result = run_qtool("evaluate", model, int8, "--data", data, "--task", "detection", "--task-config",
                       ROOT / "configs" / "yolov8_detection.yaml", "--runs", "2", "--json", report)
    assert result.returncode == 0, result.stderr
    doc = json.loads(report.read_text())
    det = doc["detection"]
    assert doc["task"] == "detection" and det["output"] == "output0" and det["images"] == 64
    assert det["fp32_boxes"] >= 20  # faces and people in ImageNet photos
    assert 0.7 <= det["recall"] <= 1.0 and 0.7 <= det["precision"] <= 1.0
    assert "recall" in result.stdout and "classification" not in doc
    # known answer: the fp32 model against itself finds every box again, and only those
    result = run_qtool("evaluate", model, model, "--data", data, "--task", "detection", "--task-config",
                       ROOT / "configs" / "yolov8_detection.yaml", "--num-samples", "16", "--runs", "1",
                       "--json", tmp_path / "self.json")
    assert result.returncode == 0, result.stderr
    same = json.loads((tmp_path / "self.json").read_text())["detection"]
    assert same["images"] == 16 and same["fp32_boxes"] > 0
    assert same["matched"] == same["fp32_boxes"] == same["int8_boxes"]
    assert same["recall"] == same["precision"] == 1.0
