"""The Python front door (qtool.calibrate/quantize/evaluate) gives the CLI's bytes, from in-memory data too."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import onnx
import pytest
import yaml
from click.testing import CliRunner

import qtool
from qtool.cli import main
from qtool.data.preprocess import preprocess_image, read_image
from tests.conftest import CALIB_SAMPLES, EFFNET, EFFNET_CONFIG, RANGES_ONLY, ROOT
from tests.graphs import conv_model, write_samples

# The config's bias correction and adaptive rounding (auto: on with data) add seconds per job: off here, as RANGES_ONLY.
RANGES_ONLY_SECTION = {"bias_correction": "off", "weight_rounding": "nearest"}
FIXED_LATENCY = {"batch_size": 8, "threads": 1, "runs": 1, "fp32_ms": {"median": 2.0, "p90": 2.0},
                 "int8_ms": {"median": 1.0, "p90": 1.0}, "speedup": 2.0}


def _cli(*args) -> None:
    result = CliRunner().invoke(main, [str(a) for a in args])
    assert result.exit_code == 0, result.output


def _ranges_only_dict() -> dict:
    data = yaml.safe_load(EFFNET_CONFIG.read_text())
    data["quantization"] = {**data["quantization"], **RANGES_ONLY_SECTION}
    return data


@pytest.fixture(scope="module")
def images() -> list[dict[str, np.ndarray]]:
    """calib_samples as feed dicts, read and preprocessed here in the folder source's (sorted) order."""
    preprocess = qtool.load_config(EFFNET_CONFIG).preprocess
    files = sorted(p for p in CALIB_SAMPLES.iterdir() if p.suffix in (".jpg", ".png"))
    assert len(files) == 10
    feeds = [{"input": preprocess_image(read_image(f), preprocess, (224, 224))} for f in files]
    assert feeds[0]["input"].shape == (1, 3, 224, 224)
    return feeds


@pytest.fixture(scope="module")
def cli_outputs(tmp_path_factory):
    out = tmp_path_factory.mktemp("cli")
    _cli("calibrate", EFFNET, "--data", CALIB_SAMPLES, "--config", EFFNET_CONFIG, "-o", out / "table.json")
    _cli("quantize", EFFNET, "--data", CALIB_SAMPLES, "--config", EFFNET_CONFIG, *RANGES_ONLY, "-o", out / "m.onnx")
    return out


def test_the_face_is_lazy():
    code = ("import sys, qtool; heavy = [m for m in ('onnx', 'numpy', 'onnxruntime', 'qtool.api') if m in sys.modules];"
            "assert not heavy, heavy; assert callable(qtool.quantize) and 'qtool.api' in sys.modules")
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    subprocess.run([sys.executable, "-c", code], env=env, check=True)
    code = ("import sys; from qtool.cli import main\ntry: main(['--help'])\nexcept SystemExit: pass\n"
            "heavy = [m for m in ('onnx', 'numpy', 'onnxruntime') if m in sys.modules]; assert not heavy, heavy")
    subprocess.run([sys.executable, "-c", code], env=env, check=True, capture_output=True)
    assert "calibrate" in dir(qtool) and qtool.QuantizeResult.__module__ == "qtool.api"
    with pytest.raises(AttributeError):
        qtool.no_such_name  # noqa: B018


def test_calibrate_from_memory_equals_the_cli(tmp_path, images, cli_outputs):
    expected = (cli_outputs / "table.json").read_bytes()
    for data in (images, lambda: iter(images), str(CALIB_SAMPLES)):
        table = qtool.calibrate(EFFNET, data, config=EFFNET_CONFIG, progress=False)
        table.save(tmp_path / "t.json")
        assert (tmp_path / "t.json").read_bytes() == expected


def test_config_as_path_dict_or_typed_gives_the_same_table(tmp_path, images, cli_outputs):
    expected = (cli_outputs / "table.json").read_bytes()
    as_dict = yaml.safe_load(EFFNET_CONFIG.read_text())
    for config in (as_dict, qtool.load_config(EFFNET_CONFIG)):
        qtool.calibrate(EFFNET, images, config=config, progress=False).save(tmp_path / "t.json")
        assert (tmp_path / "t.json").read_bytes() == expected


def test_quantize_from_memory_equals_the_cli(tmp_path, images, cli_outputs):
    expected = (cli_outputs / "m.onnx").read_bytes()
    config = _ranges_only_dict()
    # data only: calibrated here; a table and a callable; the table file the CLI wrote
    results = [qtool.quantize(EFFNET, data=images, config=config, progress=False),
               qtool.quantize(EFFNET, table=qtool.calibrate(EFFNET, images, config, progress=False),
                              data=lambda: images, config=qtool.load_config(config)),
               qtool.quantize(EFFNET, table=cli_outputs / "table.json", config=config)]
    for result in results:
        result.save(tmp_path / "m.onnx")
        assert (tmp_path / "m.onnx").read_bytes() == expected
    result = results[0]
    assert result.quantized_nodes > 50 and result.int8_weights > 40 and result.activations > 50
    assert result.float_nodes >= 0 and result.search is None and not result.external_data
    assert isinstance(result.model, onnx.ModelProto) and isinstance(result.notes, tuple)
    assert result.table.num_samples == 10 and not hasattr(result, "plan")


def test_save_is_atomic(tmp_path, images, monkeypatch):
    result = qtool.quantize(EFFNET, data=images[:2], config=_ranges_only_dict(), progress=False)
    target = tmp_path / "m.onnx"
    target.write_bytes(b"old")

    def broken_fsync(fd):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "fsync", broken_fsync)
    with pytest.raises(OSError):
        result.save(target)
    assert target.read_bytes() == b"old"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.onnx"]  # no temporary file left behind
    monkeypatch.undo()
    result.save(target)
    onnx.checker.check_model(onnx.load(str(target)))


def test_evaluate_report_json_equals_the_cli(tmp_path, images, cli_outputs, monkeypatch):
    # latency is measured, so both runs get the same figures; everything else is computed
    monkeypatch.setattr("qtool.evaluation.evaluate.measure_latency", lambda *args: FIXED_LATENCY)
    config = yaml.safe_load(EFFNET_CONFIG.read_text())
    config["evaluation"] = {**config["evaluation"], "min_agreement": 50.0, "per_layer": True, "layer_samples": 4}
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(config))
    int8 = cli_outputs / "m.onnx"
    result = CliRunner().invoke(main, ["evaluate", str(EFFNET), str(int8), "--data", str(CALIB_SAMPLES),
                                       "--config", str(tmp_path / "c.yaml"), "--json", str(tmp_path / "r.json")])
    assert result.exit_code == 0, result.output
    report = qtool.evaluate(EFFNET, int8, CALIB_SAMPLES, config=config, progress=False)
    written = (tmp_path / "r.json").read_text()
    report_json = report.to_json()
    seconds = report.per_layer["seconds"]  # timed too: the one figure that may differ
    assert report_json.replace(f'"seconds": {seconds}', '"seconds": X') == \
        written.replace(f'"seconds": {json.loads(written)["per_layer"]["seconds"]}', '"seconds": X')
    assert report.passed and report.thresholds[0].name == "min_agreement"
    assert report.task == "classification" and report.classification["agreement"] >= 0.5

    in_memory = qtool.evaluate(EFFNET, int8, images, config=config, progress=False)
    assert in_memory.data["path"] is None and in_memory.data["samples"] == 10
    assert in_memory.outputs == report.outputs and in_memory.classification == report.classification
    unsized = qtool.evaluate(EFFNET, int8, lambda: (x for x in images), config=config, progress=False)
    assert unsized.data["samples"] == 10


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    """A small conv model (input x: [N, 8, 12, 12] float) and a folder of its samples."""
    folder = tmp_path_factory.mktemp("small")
    path = folder / "m.onnx"
    onnx.save(conv_model(np.random.default_rng(0), activation="Relu"), str(path))
    return path, write_samples(folder / "data", np.random.default_rng(1), (8, 12, 12), count=6)


def _sample(**overrides):
    return {"x": np.zeros((1, 8, 12, 12), np.float32), **overrides}


@pytest.mark.parametrize("data, message", [
    ([_sample(y=np.zeros(1))], "in-memory sample 0: 'y' is not an input of the model (inputs: x)"),
    ([{}], "in-memory sample 0: no array for model input 'x'"),
    ([_sample(), _sample(x=np.zeros((1, 8, 12, 12), np.int64))], "in-memory sample 1: array 'x' has dtype int64"),
    ([_sample(x=np.zeros((1, 8, 5, 5), np.float32))], "in-memory sample 0: array 'x' has shape [1, 8, 5, 5]"),
    ([_sample(x=np.zeros((4, 8, 12, 12), np.float32))], "one sample per dict"),
    ([np.zeros((1, 8, 12, 12))], "in-memory sample 0: expected a dict of input name -> numpy array, got ndarray"),
    (_sample(), "data is one dict; pass a list of dicts"),
    (42, "data must be a folder path, an iterable of {input name: array} dicts or a callable"),
    (lambda: 42, "the data callable returned int"),
    ([], "no samples in the in-memory data"),
])
def test_wrong_in_memory_data_is_one_clear_error(small, data, message):
    with pytest.raises(qtool.QtoolError) as info:
        qtool.calibrate(small[0], data, progress=False)
    assert message in str(info.value) and "\n" not in str(info.value)


def test_in_memory_samples_follow_the_file_rules(small):
    path, folder = small
    arrays = [np.load(f) for f in sorted(folder.iterdir())]
    expected = qtool.calibrate(path, folder, progress=False).to_json_text()
    # no batch dimension, float64: both fitted as a tensor file's arrays are
    fitted = [{"x": a[0].astype(np.float64)} for a in arrays]
    assert qtool.calibrate(path, fitted, progress=False).to_json_text() == expected
    generator = ({"x": a} for a in arrays)
    assert qtool.calibrate(path, generator, progress=False).to_json_text() == expected
    with pytest.raises(qtool.QtoolError, match="a generator can be read only once"):
        qtool.calibrate(path, generator, progress=False)


def test_folder_only_features_say_so(small):
    path, folder = small
    arrays = [{"x": np.load(f)} for f in sorted(folder.iterdir())]
    generator = ({"x": np.load(f)} for f in sorted(folder.iterdir()))
    with pytest.raises(qtool.QtoolError, match="needs the data as a folder or a sequence"):
        qtool.calibrate(path, generator, config={"calibration": {"workers": 2}}, progress=False)
    table = qtool.calibrate(path, arrays, progress=False)
    result = qtool.quantize(path, table=table)
    result.save(path.parent / "m.int8.onnx")
    with pytest.raises(qtool.QtoolError, match="in-memory data has none"):
        qtool.evaluate(path, path.parent / "m.int8.onnx", arrays, labels="folders", progress=False)
    with pytest.raises(qtool.QtoolError, match="needs a calibration table"):
        qtool.quantize(path)
    with pytest.raises(qtool.QtoolError, match="unknown key 'calibraton'"):
        qtool.calibrate(path, arrays, config={"calibraton": {}})


def test_mixed_precision_search_from_memory(tmp_path, images, cli_outputs):
    lines: list[str] = []
    spec = qtool.MixedPrecisionSearch(images, agreement=50.0)
    result = qtool.search(EFFNET, spec, table=cli_outputs / "table.json", config=_ranges_only_dict(),
                          log=lines.append)
    assert lines[0] == "searching the fewest float layers for agreement >= 50% on 10 evaluation samples:"
    assert result.search.float_layers == () and result.search.figures["agreement"] >= 0.5
    assert result.search.describe().startswith("target met with 0 layer(s) in float; 100.0% of MACs in int8")
    result.save(tmp_path / "m.onnx")  # nothing kept float: the plain model
    assert (tmp_path / "m.onnx").read_bytes() == (cli_outputs / "m.onnx").read_bytes()
    with pytest.raises(qtool.QtoolError, match="needs a target"):
        qtool.search(EFFNET, qtool.MixedPrecisionSearch(images), table=cli_outputs / "table.json")
