"""On a real Dask LocalCluster (2 worker processes, no mocks): the same tables and reports as one process."""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time

import numpy as np
import pytest
from click.testing import CliRunner

import qtool
from qtool.cli import main
from qtool.errors import QtoolError
from qtool.graph.executor import INSTALL_HINT, parse_dask
from tests.conftest import CALIB_SAMPLES, EFFNET, EFFNET_CONFIG, kit_path

distributed = pytest.importorskip("distributed")

CONFIG = {"calibration": {"batch_size": 2}}


@pytest.fixture(scope="module")
def client():
    with distributed.LocalCluster(n_workers=2, threads_per_worker=1, processes=True, dashboard_address=":0",
                                  silence_logs=50) as cluster, distributed.Client(cluster) as client:
        yield client


def _config(method: str) -> dict:
    return {"calibration": {"batch_size": 2, "method": method}}


def _table_bytes(tmp_path, name, **kwargs) -> bytes:
    table = qtool.calibrate(EFFNET, CALIB_SAMPLES, kwargs.pop("config"), progress=False, **kwargs)
    table.save(tmp_path / name)
    return (tmp_path / name).read_bytes()


def test_minmax_table_is_byte_identical(tmp_path, client):
    single = _table_bytes(tmp_path, "single.json", config=_config("minmax"))
    assert _table_bytes(tmp_path, "dask.json", config=_config("minmax"), executor=client.get_executor()) == single


def test_percentile_table_within_one_histogram_bin(tmp_path, client):
    single = json.loads(_table_bytes(tmp_path, "single.json", config=_config("percentile")))
    dask = json.loads(_table_bytes(tmp_path, "dask.json", config=_config("percentile"),
                                   executor=client.get_executor()))
    assert dask["num_samples"] == single["num_samples"] == 10
    for name, entry in single["tensors"].items():
        other = dask["tensors"][name]
        assert (other["min"], other["max"]) == (entry["min"], entry["max"]), name
        bin_width = max(abs(entry["min"]), abs(entry["max"])) / 2048
        np.testing.assert_allclose(other["range"], entry["range"], rtol=0, atol=bin_width, err_msg=name)


def _figures(report) -> dict:
    """The report's JSON without what is timed."""
    data = json.loads(report.to_json())
    data.pop("latency")
    data["sensitivity"].pop("seconds")
    return data


@pytest.mark.slow
def test_evaluate_figures_and_sensitivity_ranking_are_identical(tmp_path, client):
    images, labels = kit_path("data", "imagenet_dev", "images"), kit_path("data", "imagenet_dev", "labels.tsv")
    table = tmp_path / "table.json"
    qtool.calibrate(EFFNET, CALIB_SAMPLES, EFFNET_CONFIG, progress=False).save(table)
    int8 = tmp_path / "int8.onnx"
    config = {"evaluation": {"num_samples": 24, "runs": 2, "warmup": 1, "sensitivity": True, "layer_samples": 4}}
    qtool.quantize(EFFNET, table=table, config=config).save(int8)
    single = qtool.evaluate(EFFNET, int8, images, config, labels=str(labels), table=table, progress=False)
    dask = qtool.evaluate(EFFNET, int8, images, config, labels=str(labels), table=table, progress=False,
                          executor=client.get_executor())
    assert _figures(dask) == _figures(single)
    assert dask.task_figures["labelled"] == 24 and dask.latency["measured_on"].startswith("one worker")
    assert [layer["node"] for layer in dask.sensitivity["layers"]] == \
        [layer["node"] for layer in single.sensitivity["layers"]]


def test_a_killed_worker_changes_nothing(tmp_path, client):
    single = _table_bytes(tmp_path, "single.json", config=_config("minmax"))
    pids = list(client.run(os.getpid).values())
    result: dict = {}

    def run():
        result["table"] = _table_bytes(tmp_path, "dask.json", config=_config("minmax"),
                                       executor=client.get_executor())

    thread = threading.Thread(target=run)
    thread.start()
    deadline = time.monotonic() + 60
    while not any(client.processing().values()) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert any(client.processing().values()), "no task started"
    os.kill(pids[0], signal.SIGKILL)
    thread.join(timeout=300)
    assert result["table"] == single
    client.wait_for_workers(2, timeout=60)


def test_a_bad_sample_fails_the_command_naming_the_file(tmp_path):
    data = tmp_path / "data"
    data.mkdir()
    rng = np.random.default_rng(0)
    for i in range(6):
        np.save(data / f"s{i}.npy", rng.normal(size=(3, 224, 224)).astype(np.float32))
    (data / "s3.npy").write_bytes(b"not an array")
    out = tmp_path / "table.json"
    result = CliRunner().invoke(main, ["calibrate", str(EFFNET), "--data", str(data), "--batch-size", "2",
                                       "--dask", "local:2", "-o", str(out)])
    assert result.exit_code == 2, result.output
    assert "s3.npy" in result.output and "cannot read tensor file" in result.output
    assert result.output.count("\n") == 1 and not out.exists(), result.output


def test_without_dask_the_option_says_how_to_install_it(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "distributed", None)  # `import distributed` raises ImportError
    result = CliRunner().invoke(main, ["calibrate", str(EFFNET), "--data", str(CALIB_SAMPLES), "--dask", "local:2",
                                       "-o", str(tmp_path / "t.json")])
    assert result.exit_code == 2
    assert result.output == f"error: {INSTALL_HINT}\n"


def test_dask_option_values():
    assert parse_dask("local:3") == (None, 3)
    assert parse_dask("tcp://10.0.0.1:8786") == ("tcp://10.0.0.1:8786", 0)
    assert parse_dask("local")[0] is None
    for bad in ("local:0", "local:x", " "):
        with pytest.raises(QtoolError, match="--dask"):
            parse_dask(bad)
