"""The ctc task: greedy CTC decoding of recognizer outputs, texts kept, edit-distance ratio, its threshold."""

from __future__ import annotations

import json
import xml.etree.ElementTree as ET

import numpy as np
import onnx
import pytest
from onnx import helper

from qtool.evaluation.ctc import CtcAccumulator, edit_distance, edit_ratio, greedy_decode
from tests import graphs
from tests.conftest import kit_path, run_qtool


def _scores(paths: list[list[int]], classes: int = 5) -> np.ndarray:
    """[N, T, classes] one-hot rows: sample i takes class paths[i][t] at step t."""
    out = np.zeros((len(paths), len(paths[0]), classes), np.float32)
    for i, path in enumerate(paths):
        out[i, np.arange(len(path)), path] = 1.0
    return out


def test_greedy_decode_collapses_repeats_and_drops_the_blank():
    texts = greedy_decode(_scores([[0, 1, 1, 0, 1, 2, 2, 0], [0, 0, 0, 0, 0, 0, 0, 0], [3, 3, 3, 4, 0, 0, 4, 4]]))
    assert texts == [(1, 1, 2), (), (3, 4, 4)]


def test_edit_distance_and_its_ratio():
    assert edit_distance((1, 2, 3), (1, 2, 3)) == 0
    assert edit_distance((1, 2, 3), (1, 3)) == 1
    assert edit_distance((1, 2, 3), (3, 2, 1)) == 2
    assert edit_distance((), (4, 4)) == 2
    assert edit_ratio((1, 2, 3, 4), (1, 2, 3)) == pytest.approx(0.25)
    assert edit_ratio((), ()) == 0.0 and edit_ratio((), (1,)) == 1.0


def test_accumulator_counts_and_merges_batch_by_batch():
    ref = _scores([[1, 0, 2], [3, 3, 0], [0, 0, 0], [1, 2, 3]])
    test = _scores([[1, 0, 2], [3, 0, 3], [0, 0, 0], [1, 2, 4]])
    whole = CtcAccumulator()
    whole.update(ref, test)
    merged = CtcAccumulator()
    for part in (slice(0, 1), slice(1, 4)):
        one = CtcAccumulator()
        one.update(ref[part], test[part])
        merged.merge(one)
    result = whole.result()
    assert result["samples"] == 4 and result["texts_kept"] == 2 and result["fp32_chars"] == 6
    assert result["mean_edit_ratio"] == pytest.approx((0.5 + 1 / 3) / 4)  # (3) vs (3,3); (1,2,3) vs (1,2,4)
    assert merged.result() == pytest.approx(result)
    with pytest.raises(Exception, match=r"\[N, T, classes\]"):
        greedy_decode(np.zeros((2, 5), np.float32))


def test_time_first_scores_are_read_by_the_batch_sample_count():
    paths = [[0, 1, 1, 0, 2], [3, 0, 3, 3, 0], [4, 4, 0, 0, 1]]
    batch_first = _scores(paths)
    time_first = batch_first.transpose(1, 0, 2)  # [T, N, C]
    assert greedy_decode(time_first, samples=3) == greedy_decode(batch_first, samples=3) == greedy_decode(batch_first)
    assert greedy_decode(time_first[:, :1], samples=1) == greedy_decode(batch_first[:1])  # [T, 1, C]


def _recognizer(rng, features=6, classes=7, time_first=False) -> onnx.ModelProto:
    """x [N, T, features] -> MatMul -> Softmax: per-step class probabilities [N, T, classes], or
    [T, N, classes] with `time_first` (a Transpose after the Softmax)."""
    w = rng.normal(0, 1.0, (features, classes)).astype(np.float32)
    nodes = [helper.make_node("MatMul", ["x", "w"], ["logits"], name="head"),
             helper.make_node("Softmax", ["logits"], ["p" if time_first else "y"], name="softmax", axis=-1)]
    if time_first:
        nodes.append(helper.make_node("Transpose", ["p"], ["y"], name="time_first", perm=[1, 0, 2]))
    return graphs.model(nodes, [graphs.tensor("x", ["N", 12, features])], [graphs.tensor("y", None)],
                        [graphs.init("w", w)])


def _decoded_kept(model, int8, data) -> tuple[int, int]:
    import onnxruntime as ort

    ref, test = (ort.InferenceSession(str(m), providers=["CPUExecutionProvider"]) for m in (model, int8))
    kept = count = 0
    for sample in sorted(data.iterdir()):
        x = np.load(sample)
        x = x["x"] if sample.suffix == ".npz" else x
        kept += greedy_decode(ref.run(None, {"x": x})[0], 1) == greedy_decode(test.run(None, {"x": x})[0], 1)
        count += 1
    return kept, count


def test_ctc_task_reports_texts_kept_in_every_format(tmp_path):
    rng = np.random.default_rng(3)
    model, int8 = tmp_path / "rec.onnx", tmp_path / "rec.int8.onnx"
    onnx.save(_recognizer(rng), model)
    data = graphs.write_samples(tmp_path / "data", rng, (12, 6), count=10, scale=2.0)
    assert run_qtool("quantize", model, "--data", data, "-o", int8).returncode == 0
    paths = {kind: tmp_path / f"r.{kind}" for kind in ("json", "xml", "html")}
    result = run_qtool("evaluate", model, int8, "--data", data, "--task", "ctc", "--runs", "2", "--batch-size", "3",
                       "--min-texts-kept", "10", "--json", paths["json"], "--junit", paths["xml"],
                       "--html", paths["html"])
    assert result.returncode == 0, result.stderr
    doc = json.loads(paths["json"].read_text())
    kept, count = _decoded_kept(model, int8, data)
    assert doc["task"] == "ctc" and doc["ctc"]["samples"] == count == 10
    assert doc["ctc"]["texts_kept"] == kept and doc["ctc"]["texts_kept_fraction"] == pytest.approx(kept / count)
    assert 0.0 <= doc["ctc"]["mean_edit_ratio"] <= 1.0 and doc["ctc"]["fp32_chars"] > 0
    assert f"{kept} of {count}" in result.stdout and "mean edit-distance ratio" in result.stdout
    assert [v["name"] for v in doc["thresholds"]] == ["min_texts_kept"] and doc["passed"]
    case = ET.parse(paths["xml"]).getroot().find("testsuite/testcase")
    assert case.get("name") == "min_texts_kept" and case.find("failure") is None
    assert "texts kept (greedy CTC, identical)" in paths["html"].read_text()
    failed = run_qtool("evaluate", model, int8, "--data", data, "--task", "ctc", "--runs", "1",
                       "--min-texts-kept", "100.5")
    assert failed.returncode == 2 and "percent" in failed.stderr  # a percentage above 100 is a config error
    if kept < count:
        failed = run_qtool("evaluate", model, int8, "--data", data, "--task", "ctc", "--runs", "1",
                           "--min-texts-kept", "100")
        assert failed.returncode == 1 and failed.stderr.startswith("FAIL min_texts_kept: texts kept")


def test_min_texts_kept_needs_the_ctc_task(tmp_path):
    rng = np.random.default_rng(4)
    model = tmp_path / "rec.onnx"
    onnx.save(_recognizer(rng), model)
    data = graphs.write_samples(tmp_path / "data", rng, (12, 6), count=2)
    result = run_qtool("evaluate", model, model, "--data", data, "--min-texts-kept", "90")
    assert result.returncode == 2 and "figure of --task ctc" in result.stderr
    auto = run_qtool("evaluate", model, model, "--data", data, "--runs", "1", "--json", tmp_path / "r.json")
    assert auto.returncode == 0 and json.loads((tmp_path / "r.json").read_text())["task"] == "generic"


@pytest.mark.slow
def test_ctc_task_on_the_kit_recognizer(tmp_path):
    """PP-OCRv4's recognizer quantized on 12 samples, evaluated on 4 others: the report's texts kept are
    the decoded texts' own count, and the fp32 texts are not all empty."""
    model = kit_path("models", "rapidocr_v4_rec.onnx")
    files = sorted(kit_path("inputs", "rapidocr_v4_rec", "calib").iterdir())
    calib, held = tmp_path / "calib", tmp_path / "held"
    for folder, chosen in ((calib, files[:12]), (held, files[-8::2])):
        folder.mkdir()
        for sample in chosen:
            (folder / sample.name).symlink_to(sample)
    int8, report = tmp_path / "rec.int8.onnx", tmp_path / "r.json"
    assert run_qtool("quantize", model, "--data", calib, "-o", int8).returncode == 0
    result = run_qtool("evaluate", model, int8, "--data", held, "--task", "ctc", "--runs", "1", "--json", report)
    assert result.returncode == 0, result.stderr
    figures = json.loads(report.read_text())["ctc"]
    assert (figures["texts_kept"], figures["samples"]) == _decoded_kept(model, int8, held)
    assert figures["fp32_chars"] >= 4


def test_ctc_task_reads_a_time_first_output(tmp_path):
    """The same recognizer with its output transposed to [T, N, C]: the same texts, batch by batch."""
    model, first = tmp_path / "rec.onnx", tmp_path / "rec_t.onnx"
    onnx.save(_recognizer(np.random.default_rng(3)), model)
    onnx.save(_recognizer(np.random.default_rng(3), time_first=True), first)
    data = graphs.write_samples(tmp_path / "data", np.random.default_rng(4), (12, 6), count=10, scale=2.0)
    docs = {}
    for name, path in (("batch", model), ("time", first)):
        out, report = tmp_path / f"{name}.int8.onnx", tmp_path / f"{name}.json"
        assert run_qtool("quantize", path, "--data", data, "-o", out).returncode == 0
        result = run_qtool("evaluate", path, out, "--data", data, "--task", "ctc", "--runs", "1",
                           "--batch-size", "3", "--json", report)
        assert result.returncode == 0, result.stderr
        docs[name] = json.loads(report.read_text())["ctc"]
        kept, count = _decoded_kept(path, out, data)
        assert docs[name]["samples"] == count == 10 and docs[name]["texts_kept"] == kept
    assert docs["time"]["fp32_chars"] == docs["batch"]["fp32_chars"] > 0
