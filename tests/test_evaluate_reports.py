"""qtool evaluate for people and CI: per-layer error, sensitivity, thresholds and the JSON/JUnit/HTML reports."""

from __future__ import annotations

import contextlib
import json
import re
import shutil
import subprocess
import tempfile
import xml.etree.ElementTree as ET

import cv2
import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import helper

from tests import graphs
from tests.conftest import CALIB_SAMPLES, EFFNET, EFFNET_CONFIG, RANGES_ONLY, run_qtool

REPORT_KEYS = ["qtool_version", "onnxruntime_version", "task", "models", "data", "outputs", "runtime", "classification",
               "size", "macs", "latency", "per_layer", "sensitivity", "thresholds", "passed"]


@pytest.fixture(scope="module")
def effnet(tmp_path_factory):
    """The shipped EfficientNet-Lite0 quantized on the ten shipped photos, with its table."""
    tmp = tmp_path_factory.mktemp("evaluate")
    table, int8 = tmp / "calib.json", tmp / "e.int8.onnx"
    result = run_qtool("quantize", EFFNET, "--data", CALIB_SAMPLES, "--config", EFFNET_CONFIG, *RANGES_ONLY,
                       "--save-table", table, "-o", int8)
    assert result.returncode == 0, result.stderr
    return tmp, table, int8


@pytest.fixture(scope="module")
def full_report(effnet):
    tmp, table, int8 = effnet
    paths = {kind: tmp / f"report.{kind}" for kind in ("json", "xml", "html")}
    result = run_qtool("evaluate", EFFNET, int8, "--data", CALIB_SAMPLES, "--config", EFFNET_CONFIG, "--per-layer",
                       "--sensitivity", "--table", table, "--layer-samples", "4", "--runs", "3",
                       "--min-sqnr", "0", "--min-cosine", "0.5", "--json", paths["json"], "--junit", paths["xml"],
                       "--html", paths["html"])
    assert result.returncode == 0, result.stderr
    return result, paths


def _effnet_activations(int8: onnx.ModelProto) -> int:
    return sum(n.op_type == "QuantizeLinear" for n in int8.graph.node)


def test_json_has_every_section_with_stable_keys(full_report, effnet):
    _, paths = full_report
    doc = json.loads(paths["json"].read_text())
    assert list(doc) == REPORT_KEYS
    assert doc["task"] == "classification" and doc["classification"]["samples"] == 10
    assert doc["macs"]["int8_fraction"] == 1.0 and doc["macs"]["counted_nodes"] == 50
    per_layer = doc["per_layer"]
    assert per_layer["samples"] == 4
    assert len(per_layer["tensors"]) == _effnet_activations(onnx.load(effnet[2]))
    assert list(per_layer["tensors"][0]) == ["tensor", "node", "op_type", "sqnr_db", "cosine", "max_abs_error",
                                             "mean_abs_error"]
    # JSON has no infinity: a tensor quantized without any error (the input: pixels (p - 127) / 128 sit exactly
    # on the uint8 grid) is written as "inf"
    by_sqnr = sorted(per_layer["tensors"], key=lambda t: float(t["sqnr_db"]))
    assert per_layer["worst"] == [t["tensor"] for t in by_sqnr[:10]]
    ranking = doc["sensitivity"]["layers"]
    assert len(ranking) == 60  # 49 Conv (with their ReLU6), 9 Add, 1 ReduceMean, 1 Gemm
    assert [r["sqnr_db"] for r in ranking] == sorted(r["sqnr_db"] for r in ranking)
    assert [v["name"] for v in doc["thresholds"]] == ["min_cosine", "min_sqnr"] and doc["passed"] is True


def test_terminal_table_shows_the_worst_layers(full_report):
    result, paths = full_report
    doc = json.loads(paths["json"].read_text())
    out = result.stdout
    assert "per-layer error on 4 samples" in out and "sensitivity on 4 samples" in out
    assert doc["per_layer"]["worst"][0] in out and doc["sensitivity"]["layers"][0]["node"] in out
    assert "in int8" in out and "PASS min_sqnr" in out


def test_junit_has_one_case_per_threshold(full_report):
    _, paths = full_report
    root = ET.parse(paths["xml"]).getroot()
    cases = root.findall("./testsuite/testcase")
    assert [c.get("name") for c in cases] == ["min_cosine", "min_sqnr"]
    assert root.get("failures") == "0" and not root.findall(".//failure")


def test_html_is_self_contained_with_one_bar_per_layer(full_report):
    _, paths = full_report
    text = paths["html"].read_text()
    doc = json.loads(paths["json"].read_text())
    assert "<script" not in text.lower()
    assert not re.search(r"\b(src|href)\s*=", text, re.I)
    assert set(re.findall(r"https?://[^\s\"'<>]+", text)) <= {"http://www.w3.org/2000/svg"}  # a namespace only
    first_chart = text[text.index("<svg"):text.index("</svg>")]
    assert first_chart.count("<rect") == len(doc["per_layer"]["tensors"])
    assert f"<title>{doc['per_layer']['worst'][0]}:" in first_chart
    assert "All thresholds met" in text and "top-1 agreement" in text


def test_html_renders_in_headless_chromium(full_report, tmp_path):
    """A real browser draws the charts: red (worst ten) and blue bars appear in the screenshot."""
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    if chromium is None:
        pytest.skip("chromium is not installed (apt-get install chromium); README describes the manual check")
    _, paths = full_report
    shot = tmp_path / "report.png"
    subprocess.run([chromium, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                    "--disable-background-networking", "--disable-component-update", "--disable-sync",
                    f"--user-data-dir={tempfile.mkdtemp(dir=tmp_path)}", f"--screenshot={shot}",
                    "--window-size=1200,1600", paths["html"].resolve().as_uri()],
                   capture_output=True, timeout=120, check=False)
    image = cv2.imread(str(shot))
    assert image is not None and image.shape[:2] == (1600, 1200)

    def pixels(rgb: tuple[int, int, int]) -> np.ndarray:
        return np.all(np.abs(image.astype(int) - rgb[::-1]) <= 8, axis=2)

    red, blue = pixels((0xd6, 0x27, 0x28)), pixels((0x4c, 0x78, 0xa8))
    assert red.sum() > 500 and blue.sum() > 2000  # worst-ten bars and the others
    columns = np.nonzero((red | blue).any(axis=0))[0]
    assert columns.max() - columns.min() > 900  # the bars spread over the chart's width


def test_failed_thresholds_exit_1_with_one_line_each(effnet, tmp_path):
    _, _, int8 = effnet
    junit = tmp_path / "r.xml"
    result = run_qtool("evaluate", EFFNET, int8, "--data", CALIB_SAMPLES, "--config", EFFNET_CONFIG,
                       "--num-samples", "4", "--runs", "2", "--min-sqnr", "200", "--min-cosine", "0.5",
                       "--min-speedup", "1000", "--junit", junit)
    assert result.returncode == 1, result.stderr
    fails = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(fails) == 2 and fails[0].startswith("FAIL min_sqnr:") and fails[1].startswith("FAIL min_speedup:")
    assert "PASS min_cosine" in result.stdout
    root = ET.parse(junit).getroot()
    assert root.get("tests") == "3" and root.get("failures") == "2"
    assert [f.get("message") for f in root.iter("failure")] == fails


def test_thresholds_from_the_config_file(effnet, tmp_path):
    _, _, int8 = effnet
    config = tmp_path / "c.yaml"
    config.write_text(EFFNET_CONFIG.read_text() + "  min_agreement: 101\n")
    result = run_qtool("evaluate", EFFNET, int8, "--data", CALIB_SAMPLES, "--config", config, "--num-samples", "2")
    assert result.returncode == 2 and "min_agreement is in percent" in result.stderr
    config.write_text(EFFNET_CONFIG.read_text() + "  max_top1_drop: 1\n")
    result = run_qtool("evaluate", EFFNET, int8, "--data", CALIB_SAMPLES, "--config", config, "--num-samples", "2")
    assert result.returncode == 2 and "needs labels" in result.stderr
    config.write_text(EFFNET_CONFIG.read_text() + "  min_sqnr: 200\n")
    result = run_qtool("evaluate", EFFNET, int8, "--data", CALIB_SAMPLES, "--config", config, "--num-samples", "2",
                       "--runs", "1")
    assert result.returncode == 1 and result.stderr.startswith("FAIL min_sqnr:")


@pytest.mark.parametrize("args, fragment", [
    (["--max-top1-drop", "1"], "needs labels"),
    (["--sensitivity"], "needs the calibration table"),
    (["--task", "generic", "--min-agreement", "90"], "classification figures"),
])
def test_impossible_requests_are_input_errors(effnet, args, fragment):
    _, _, int8 = effnet
    result = run_qtool("evaluate", EFFNET, int8, "--data", CALIB_SAMPLES, "--config", EFFNET_CONFIG,
                       "--num-samples", "2", "--runs", "1", *args)
    assert result.returncode == 2, result.stderr
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and fragment in errors[0] and "Traceback" not in result.stderr


def _two_in_two_out(rng) -> onnx.ModelProto:
    """a -> Conv, + b -> s; outputs Relu(s) [N,4,6,6] and GlobalAveragePool(s) [N,4,1,1]."""
    w = rng.normal(0, 0.4, (4, 4, 3, 3)).astype(np.float32)
    nodes = [helper.make_node("Conv", ["a", "w"], ["c"], name="conv", pads=[1, 1, 1, 1]),
             helper.make_node("Add", ["c", "b"], ["s"], name="add"),
             helper.make_node("Relu", ["s"], ["y1"], name="relu"),
             helper.make_node("GlobalAveragePool", ["s"], ["y2"], name="gap")]
    return graphs.model(nodes, [graphs.tensor("a", ["N", 4, 6, 6]), graphs.tensor("b", ["N", 4, 6, 6])],
                        [graphs.tensor("y1", None), graphs.tensor("y2", None)], [graphs.init("w", w)])


def test_generic_task_on_a_two_input_two_output_model(tmp_path):
    rng = np.random.default_rng(0)
    model, int8, report = tmp_path / "m.onnx", tmp_path / "m.int8.onnx", tmp_path / "r.json"
    onnx.save(_two_in_two_out(rng), model)
    data = tmp_path / "data"
    data.mkdir()
    for i in range(12):
        np.savez(data / f"s{i:02d}.npz", a=rng.normal(0, 1, (1, 4, 6, 6)).astype(np.float32),
                 b=rng.normal(0, 1, (1, 4, 6, 6)).astype(np.float32))
    assert run_qtool("quantize", model, "--data", data, "-o", int8).returncode == 0
    result = run_qtool("evaluate", model, int8, "--data", data, "--runs", "2", "--per-layer", "--json", report)
    assert result.returncode == 0, result.stderr
    doc = json.loads(report.read_text())
    assert doc["task"] == "generic" and "classification" not in doc  # auto: the first output is not [N, C]
    assert list(doc["outputs"]) == ["y1", "y2"]
    for figures in doc["outputs"].values():
        assert list(figures) == ["cosine", "sqnr_db", "max_abs_error", "mean_abs_error"]
        assert figures["cosine"] > 0.99 and figures["sqnr_db"] > 25 and 0 < figures["mean_abs_error"]
        assert figures["mean_abs_error"] <= figures["max_abs_error"]
    # the Add, Relu and pool after the Conv compute the outputs in float: only a and c are int8
    assert [t["tensor"] for t in doc["per_layer"]["tensors"]] == ["a", "c"]
    assert "y1: SQNR" in result.stdout and "y2: abs error max / mean" in result.stdout


def test_per_layer_needs_qdq_tensor_names_and_task_config_keys_are_checked(tmp_path):
    result = run_qtool("evaluate", EFFNET, EFFNET, "--data", CALIB_SAMPLES, "--config", EFFNET_CONFIG, "--per-layer")
    assert result.returncode == 2 and "per-layer error cannot pair" in result.stderr
    bad = tmp_path / "detect.yaml"
    bad.write_text("conf_treshold: 0.3\n")
    result = run_qtool("evaluate", EFFNET, EFFNET, "--data", CALIB_SAMPLES, "--task", "detection",
                       "--task-config", bad)
    assert result.returncode == 2 and "did you mean 'conf_threshold'" in result.stderr


def test_labels_from_class_folders(effnet, tmp_path):
    """One folder per class, named by class index: folders named after fp32's own predictions give it 100%."""
    from qtool.config import load_config
    from qtool.data.dataset import batches, open_data
    from qtool.graph.modelio import input_specs

    _, _, int8 = effnet
    model = onnx.load(EFFNET)
    source = open_data(CALIB_SAMPLES, input_specs(model), load_config(EFFNET_CONFIG).preprocess)
    session = ort.InferenceSession(str(EFFNET), providers=["CPUExecutionProvider"])
    data = tmp_path / "classes"
    for batch in batches(source, 8):
        for key, logits in zip(batch.keys, session.run(None, batch.feeds)[0]):
            folder = data / str(int(np.argmax(logits)))
            folder.mkdir(parents=True, exist_ok=True)
            shutil.copy(CALIB_SAMPLES / key, folder / key)
    report = tmp_path / "r.json"
    result = run_qtool("evaluate", EFFNET, int8, "--data", data, "--labels", "folders", "--config", EFFNET_CONFIG,
                       "--runs", "1", "--json", report)
    assert result.returncode == 0, result.stderr
    cls = json.loads(report.read_text())["classification"]
    assert cls["labelled"] == 10 and cls["top1"]["fp32"] == 1.0
    assert cls["top1"]["int8"] == cls["agreement"] and cls["top5"]["int8"] >= cls["top1"]["int8"]


def test_shards_merged_give_the_single_report(effnet, tmp_path):
    """evaluate --shard K/N in separate commands, then --merge: the figures of one evaluate (only
    the latency, timed by the merge on random inputs, differs); incomplete or mixed sets are refused."""
    from click.testing import CliRunner

    from qtool.cli import main

    tmp, table, int8 = effnet
    base = ["evaluate", str(EFFNET), str(int8), "--config", str(EFFNET_CONFIG), "--batch-size", "2", "--runs", "2"]
    runner = CliRunner()
    single = runner.invoke(main, [*base, "--data", str(CALIB_SAMPLES), "--json", str(tmp_path / "single.json")])
    assert single.exit_code == 0, single.output
    parts = [tmp_path / f"e{k}.json" for k in range(3)]
    for k, part in enumerate(parts):
        result = runner.invoke(main, [*base, "--data", str(CALIB_SAMPLES), "--shard", f"{k}/3", "-o", str(part)])
        assert result.exit_code == 0 and f"shard {k}/3" in result.output, result.output
    merged = runner.invoke(main, [*base, "--merge", *map(str, reversed(parts)), "--json", str(tmp_path / "m.json")])
    assert merged.exit_code == 0, merged.output
    one, other = (json.loads((tmp_path / name).read_text()) for name in ("single.json", "m.json"))
    assert other.pop("latency")["measured_on"].startswith("the merging process")
    one.pop("latency")
    assert other == one and one["data"]["samples"] == 10
    for files, message in ((parts[:2], "shard(s) 2/3 missing"), ([parts[0], parts[0], parts[1], parts[2]],
                                                                  "the same shard is given twice")):
        result = runner.invoke(main, [*base, "--merge", *map(str, files)])
        assert result.exit_code == 2 and message in result.output, result.output
    other_model = runner.invoke(main, ["evaluate", str(EFFNET), str(EFFNET), "--merge", *map(str, parts)])
    assert other_model.exit_code == 2 and "other models" in other_model.output


def test_an_output_of_one_value_per_sample_has_its_cosine_over_the_samples(tmp_path):
    """A score output ([N, 1]) has no per-sample cosine: per sample it would be 1 wherever the sign
    holds. evaluate reports the cosine of its values over all samples, the same in one batch or
    many; here the "int8" model scores each sample from another input channel, keeping every sign."""
    from qtool import api

    def scorer(path, column):
        w = np.zeros((4, 1), np.float32)
        w[column] = 1.0
        nodes = [helper.make_node("MatMul", ["x", "w"], ["m"], name="mm"),
                 helper.make_node("Sigmoid", ["m"], ["score"], name="sig")]
        onnx.save(graphs.model(nodes, [graphs.tensor("x", ["N", 4])], [graphs.tensor("score", ["N", 1])],
                               [graphs.init("w", w)]), path)

    rng = np.random.default_rng(0)
    scorer(tmp_path / "fp32.onnx", 0)
    scorer(tmp_path / "other.onnx", 1)
    data = tmp_path / "data"
    data.mkdir()
    x = rng.normal(0, 3, (12, 4)).astype(np.float32)
    for i in range(12):
        np.save(data / f"s{i:02d}.npy", x[i:i + 1])
    ref, test = 1 / (1 + np.exp(-x[:, 0].astype(np.float64))), 1 / (1 + np.exp(-x[:, 1].astype(np.float64)))
    want = float(ref @ test / np.sqrt((ref @ ref) * (test @ test)))
    for batch in ("1", "4"):
        config = tmp_path / f"b{batch}.yaml"
        config.write_text(f"evaluation:\n  batch_size: {batch}\n  runs: 2\n")
        report = api.evaluate(tmp_path / "fp32.onnx", tmp_path / "other.onnx", data, config, progress=False)
        assert report.outputs["score"]["cosine"] == pytest.approx(want, abs=1e-6)
        assert report.outputs["score"]["cosine"] < 0.95


def test_a_model_that_quantizes_at_run_time_is_evaluated_one_sample_at_a_time(tmp_path):
    """DynamicQuantizeLinear takes one range over its whole input: in a batch of 8 a sample's int8
    output would depend on the samples beside it. evaluate measures such a model one sample at a
    time (with a warning), so its figures are those of batch 1 whatever the configured batch."""
    from qtool import api

    rng = np.random.default_rng(0)
    nodes = [helper.make_node("MatMul", ["x", "w1"], ["h"], name="mm1"),
             helper.make_node("Relu", ["h"], ["r"], name="relu"),
             helper.make_node("MatMul", ["r", "w2"], ["y"], name="mm2")]
    inits = [graphs.init("w1", rng.normal(0, 0.3, (16, 32)).astype(np.float32)),
             graphs.init("w2", rng.normal(0, 0.3, (32, 8)).astype(np.float32))]
    model, int8 = tmp_path / "m.onnx", tmp_path / "m.int8.onnx"
    onnx.save(graphs.model(nodes, [graphs.tensor("x", ["N", 16])], [graphs.tensor("y", ["N", 8])], inits), model)
    data = tmp_path / "data"
    data.mkdir()
    for i in range(16):  # samples of very different scales: a shared range would coarsen the small ones
        np.save(data / f"s{i:02d}.npy", rng.normal(0, 10.0 ** (i % 4 - 2), (1, 16)).astype(np.float32))
    assert run_qtool("quantize", model, "--data", data, "--matmul", "dynamic", "-o", int8).returncode == 0
    assert any(n.op_type == "DynamicQuantizeLinear" for n in onnx.load(int8).graph.node)
    figures = {}
    for batch in (1, 8):
        config = tmp_path / f"b{batch}.yaml"
        config.write_text(f"evaluation:\n  batch_size: {batch}\n  runs: 2\n")
        with pytest.warns(UserWarning, match="one sample at a time") if batch > 1 else contextlib.nullcontext():
            report = api.evaluate(model, int8, data, config, progress=False)
        figures[batch] = report.outputs["y"]
    assert figures[8] == figures[1]


def test_kl_of_probability_outputs_that_sum_a_hair_over_one_is_never_negative():
    """A classifier that outputs probabilities: the int8 model's rounded rows may sum to 1.0004. KL
    is taken between the rows made to sum to 1 (it printed -0.00005 before), and is 0 for equal rows."""
    from qtool.evaluation.metrics import ClassificationAccumulator

    ref = np.array([[0.5, 0.5], [0.9, 0.1]], np.float32)
    test = np.array([[0.5, 0.5004], [0.9004, 0.1]], np.float32)
    acc = ClassificationAccumulator()
    acc.update(ref, test, [None, None])
    assert 0.0 <= acc.result()["mean_kl"] < 1e-6
    same = ClassificationAccumulator()
    same.update(ref, ref.copy(), [None, None])
    assert same.result()["mean_kl"] == 0.0


def test_macs_count_the_maps_behind_a_pad_whose_amounts_are_computed(tmp_path):
    """A TensorFlow export computes a Pad's amounts at run time; shape inference then loses the
    padded map's height and width, and the Conv after it counted one output pixel (5.9 M MACs for
    a ResNet of 1069 M). evaluate takes the dims of a run: here 8 x 8 x 3 x 3 x 4 x 4 per sample."""
    from qtool import api

    rng = np.random.default_rng(0)
    nodes = [helper.make_node("ReduceMax", ["x"], ["mx"], keepdims=0, name="max"),
             helper.make_node("Mul", ["mx", "zero"], ["z"], name="zero_it"),
             helper.make_node("Add", ["z", "ones"], ["pf"], name="pads_f"),
             helper.make_node("Cast", ["pf"], ["pads"], to=onnx.TensorProto.INT64, name="pads_i"),
             helper.make_node("Pad", ["x", "pads"], ["p"], name="pad"),
             helper.make_node("Conv", ["p", "w"], ["y"], name="conv")]
    inits = [graphs.init("zero", np.zeros((), np.float32)),
             graphs.init("ones", np.array([0, 0, 1, 1, 0, 0, 1, 1], np.float32)),
             graphs.init("w", rng.normal(0, 0.3, (4, 4, 3, 3)).astype(np.float32))]
    model = tmp_path / "m.onnx"
    onnx.save(graphs.model(nodes, [graphs.tensor("x", ["N", 4, 8, 8])], [graphs.tensor("y", ["N", 4, "H", "W"])],
                           inits), model)
    data = graphs.write_samples(tmp_path / "data", rng, (4, 8, 8), count=8)
    int8 = tmp_path / "int8.onnx"
    assert run_qtool("quantize", model, "--data", data, "-o", int8).returncode == 0
    report = api.evaluate(model, int8, data, {"evaluation": {"runs": 2}}, progress=False)
    assert report.macs["total"] == 8 * 8 * 3 * 3 * 4 * 4
