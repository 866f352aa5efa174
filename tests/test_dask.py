"""On a real Dask LocalCluster (2 worker processes, no mocks): the same tables and reports as one process."""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time

import numpy as np
import onnx
import pytest
from click.testing import CliRunner

import qtool
from qtool.calibration.calibrate import calibrate as calibrate_table
from qtool.cli import main
from qtool.config import CalibrationConfig, QuantizeConfig
from qtool.data.dataset import Batch
from qtool.errors import QtoolError, ThresholdError
from qtool.evaluation.mixed_precision import Target, search
from qtool.graph.executor import INSTALL_HINT, as_engine, parse_dask
from tests import graphs
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
    for part in ("sensitivity", "per_layer"):
        if data.get(part) is not None:
            data[part].pop("seconds")
    return data


@pytest.mark.slow
def test_evaluate_figures_and_sensitivity_ranking_are_identical(tmp_path, client):
    images, labels = kit_path("data", "imagenet_dev", "images"), kit_path("data", "imagenet_dev", "labels.tsv")
    table = tmp_path / "table.json"
    qtool.calibrate(EFFNET, CALIB_SAMPLES, EFFNET_CONFIG, progress=False).save(table)
    int8 = tmp_path / "int8.onnx"
    config = {"evaluation": {"num_samples": 24, "runs": 2, "warmup": 1, "sensitivity": True, "layer_samples": 4,
                                  "per_layer": True}}
    qtool.quantize(EFFNET, table=table, config=config).save(int8)
    single = qtool.evaluate(EFFNET, int8, images, config, labels=str(labels), table=table, progress=False)
    dask = qtool.evaluate(EFFNET, int8, images, config, labels=str(labels), table=table, progress=False,
                          executor=client.get_executor())
    assert _figures(dask) == _figures(single)
    assert dask.task_figures["labelled"] == 24 and dask.latency["measured_on"].startswith("one worker")
    assert [layer["node"] for layer in dask.sensitivity["layers"]] == \
        [layer["node"] for layer in single.sensitivity["layers"]]


def test_per_layer_errors_on_workers_equal_one_process(tmp_path, client):
    from tests.test_accuracy_methods import _crushed_model

    rng = np.random.default_rng(0)
    path, int8 = tmp_path / "m.onnx", tmp_path / "m.int8.onnx"
    onnx.save(_crushed_model(rng), path)
    data = graphs.write_samples(tmp_path / "data", rng, (3, 8, 8), count=12)
    config = {"calibration": {"batch_size": 2}, "evaluation": {"batch_size": 2, "per_layer": True,
                                                               "layer_samples": 7, "runs": 1, "warmup": 0},
              "quantization": {"advanced": dict(graphs.RULE_OFF)}}  # toy layers: float for speed otherwise
    qtool.quantize(path, data=data, config=config).save(int8)
    single = qtool.evaluate(path, int8, data, config, progress=False)
    dask = qtool.evaluate(path, int8, data, config, progress=False, executor=client.get_executor())
    assert dask.per_layer["samples"] == 7 and len(dask.per_layer["tensors"]) >= 3
    assert _figures(dask) == _figures(single)


def test_search_data_dask_calibrates_and_searches_on_workers_writing_the_same_model(tmp_path):
    from tests.test_accuracy_methods import _crushed_model

    rng = np.random.default_rng(0)
    path = tmp_path / "m.onnx"
    onnx.save(_crushed_model(rng), path)
    data = graphs.write_samples(tmp_path / "data", rng, (3, 8, 8), count=8)
    evals = graphs.write_samples(tmp_path / "eval", np.random.default_rng(2), (3, 8, 8), count=8)
    config = tmp_path / "c.yaml"
    config.write_text("quantization:\n  per_channel: false\n  advanced:\n    speed_rule: 'off'\n")  # toy layers
    args = ["search", str(path), "--data", str(data), "--config", str(config), "--batch-size", "2", "--eval-data",
            str(evals), "--target-sqnr", "20", "--max-float-layers", "2"]
    outputs = []
    for extra in ([], ["--dask", "local:2"]):
        out = tmp_path / f"q{len(outputs)}.onnx"
        result = CliRunner().invoke(main, [*args, *extra, "-o", str(out)])
        assert result.exit_code == 0 and "target met with 1 layer(s) in float: conv_b" in result.output, \
            result.output
        outputs.append(out.read_bytes())
    assert outputs[0] == outputs[1]


def test_in_memory_sequences_are_sent_as_slices_and_generators_refused(tmp_path, client):
    """A list of feed dicts: each shard gets its slice (keys and errors keep the caller's positions):
    the table and the report are those of one process; a generator cannot be cut: one line says so."""
    from qtool.graph.modelio import input_specs, load_model

    (spec,) = input_specs(load_model(EFFNET))
    rng = np.random.default_rng(0)
    samples = [{spec.name: rng.normal(0, 1, (3, 224, 224)).astype(np.float32)} for _ in range(9)]
    config = {"calibration": {"batch_size": 2}, "evaluation": {"batch_size": 2, "runs": 1, "warmup": 0,
                                                               "per_layer": True, "layer_samples": 3}}
    executor = client.get_executor()
    single = qtool.calibrate(EFFNET, samples, config, progress=False)
    assert qtool.calibrate(EFFNET, samples, config, progress=False, executor=executor).to_json_text() == \
        single.to_json_text()
    int8 = tmp_path / "int8.onnx"
    qtool.quantize(EFFNET, table=single, config=config).save(int8)
    report = qtool.evaluate(EFFNET, int8, samples, config, progress=False)
    assert _figures(qtool.evaluate(EFFNET, int8, samples, config, progress=False, executor=executor)) == \
        _figures(report)
    bad = samples[:7] + [{spec.name: np.zeros((3, 5, 5), np.float32)}] + samples[8:]
    with pytest.raises(QtoolError, match="in-memory sample 7"):
        qtool.calibrate(EFFNET, bad, config, progress=False, executor=executor)
    with pytest.raises(QtoolError, match="needs the data as a folder or a sequence") as error:
        qtool.calibrate(EFFNET, (s for s in samples), config, progress=False, executor=executor)
    assert "\n" not in str(error.value)


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


def test_local_cluster_workers_keep_the_adaptive_malloc():
    """Dask's default MALLOC_TRIM_THRESHOLD_ for workers turns off glibc's adaptive mmap threshold,
    which made every batch-sized array an mmap/munmap (40% more time per sample): qtool's local
    cluster starts its workers without it, and keeps Dask's one-thread settings for BLAS/OpenMP."""
    from qtool.graph.executor import open_engine

    with open_engine("local:1") as engine:
        env = engine.client.run(lambda: (os.environ.get("MALLOC_TRIM_THRESHOLD_"), os.environ.get("OMP_NUM_THREADS")))
    assert list(env.values()) == [(None, "1")]


def test_the_local_cluster_listens_on_loopback_only():
    """`--dask local` sends models and samples between processes: every socket its scheduler,
    nannies and workers listen on (their HTTP servers too, the dashboard's place) is bound to
    127.0.0.1, not to every interface as Dask's default dashboard is."""
    import psutil

    from qtool.graph.executor import open_engine

    def port(address: str) -> int:
        return int(address.rsplit(":", 1)[1])

    with open_engine("local:1") as engine:
        info = engine.client.scheduler_info()
        worker_pids = list(engine.client.run(os.getpid).values())
        here = {port(info["address"]), *info.get("services", {}).values()}
        here |= {port(w["nanny"]) for w in info["workers"].values() if w.get("nanny")}
        listening = [c for c in psutil.Process().net_connections("inet")
                     if c.status == psutil.CONN_LISTEN and c.laddr.port in here]
        for pid in worker_pids:
            listening += [c for c in psutil.Process(pid).net_connections("inet") if c.status == psutil.CONN_LISTEN]
    assert worker_pids and len(listening) >= len(here) + 1
    assert all(c.laddr.ip == "127.0.0.1" for c in listening), [c.laddr for c in listening]


def test_dask_option_values():
    assert parse_dask("local:3") == (None, 3)
    assert parse_dask("tcp://10.0.0.1:8786") == ("tcp://10.0.0.1:8786", 0)
    assert parse_dask("local")[0] is None
    for bad in ("local:0", "local:x", " "):
        with pytest.raises(QtoolError, match="--dask"):
            parse_dask(bad)


def _crushed_search(tmp_path, **kwargs):
    """The mixed-precision search on a small model whose second conv is crushed by per-tensor weights."""
    from tests.test_accuracy_methods import _crushed_model

    rng = np.random.default_rng(0)
    options = QuantizeConfig(per_channel=False)
    path, table = graphs.calibrated(tmp_path, rng, _crushed_model(rng), options)
    x = np.random.default_rng(1).normal(0, 1, (32, 3, 8, 8)).astype(np.float32)
    evals = [Batch([f"s{i}" for i in range(j, j + 8)], {"x": x[j:j + 8]}) for j in range(0, 32, 8)]
    base = search(path, table, options, Target(sqnr=-100.0), evals, None, 3).chosen.figures["sqnr_db"]
    return search(path, table, options, Target(sqnr=base + 5.0), evals, None, 3, **kwargs)


def _same_search(found, single) -> None:
    assert found.chosen.float_layers == single.chosen.float_layers == ["conv_b"]
    assert found.ranking == single.ranking and found.tried == single.tried
    assert found.chosen.result.model.SerializeToString() == single.chosen.result.model.SerializeToString()


def test_the_search_scores_its_candidates_on_workers_and_chooses_the_same_model(tmp_path, client):
    single = _crushed_search(tmp_path)
    _same_search(_crushed_search(tmp_path, engine=as_engine(client.get_executor())), single)


def test_the_search_on_a_process_pool_reads_the_shared_models_from_a_file(tmp_path):
    import concurrent.futures
    import multiprocessing

    single = _crushed_search(tmp_path)
    with concurrent.futures.ProcessPoolExecutor(2, mp_context=multiprocessing.get_context("spawn")) as pool:
        _same_search(_crushed_search(tmp_path, engine=as_engine(pool)), single)


@pytest.mark.slow
def test_the_search_ranks_the_kit_model_as_one_process_does(client):
    """EfficientNet-Lite0: the first step ranks all its layers (SQNR scores: single-threaded on the workers,
    on both cores here): the same ranking and the same chosen model."""
    from dataclasses import replace

    from qtool.config import load_config
    from qtool.data.dataset import batches, open_data
    from qtool.graph.modelio import input_specs, load_model

    cfg = load_config(EFFNET_CONFIG)
    options = replace(cfg.quantization, bias_correction="off", weight_rounding="nearest")
    table = calibrate_table(EFFNET, CALIB_SAMPLES, cfg.preprocess, CalibrationConfig(), options, progress=False)
    dev = kit_path("data", "imagenet_dev", "images")
    evals = list(batches(open_data(dev, input_specs(load_model(EFFNET)), cfg.preprocess), 8, 48))
    goal = Target(sqnr=200.0)  # never met: one step ranks every layer by its SQNR
    runs = []
    for engine in (None, as_engine(client.get_executor())):
        with pytest.raises(ThresholdError):
            search(EFFNET, table, options, goal, evals, None, 1, engine=engine, focus_samples=16,
                   log=lambda line: runs.append(line))
    assert any(line.startswith("  1 layer(s) float: ") for line in runs), runs  # a step ranked the layers
    assert len(runs) % 2 == 0 and runs[:len(runs) // 2] == runs[len(runs) // 2:]
