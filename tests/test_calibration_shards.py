"""Sharded, merged and multi-process calibration equal a single run; method rules; in-graph statistics."""

from __future__ import annotations

import json

import numpy as np
import onnx
import pytest
from click.testing import CliRunner

from qtool.cli import main
from qtool.config import CalibrationConfig, load_config
from qtool.prepare.graph_prep import prepare
from qtool.calibration.method_rules import methods_for
from qtool.calibration.observer import observe
from qtool.data.dataset import Batch
from qtool.calibration.statistics import TensorStats
from tests.conftest import CALIB_SAMPLES, EFFNET, EFFNET_CONFIG
from tests.graphs import conv_model, write_samples

BASE = ["--config", str(EFFNET_CONFIG), "--batch-size", "2"]


def _run(*args) -> None:
    result = CliRunner().invoke(main, ["calibrate", str(EFFNET), *map(str, args)])
    assert result.exit_code == 0, result.output


@pytest.fixture(scope="module")
def shard_files(tmp_path_factory):
    out = tmp_path_factory.mktemp("shards")
    files = []
    for k in range(3):  # 10 samples in batches of 2: 5 batches over 3 shards (1, 2, 2 batches)
        files.append(out / f"s{k}.npz")
        _run("--data", CALIB_SAMPLES, *BASE, "--shard", f"{k}/3", "-o", files[-1])
    return files


@pytest.mark.parametrize("method", ["minmax", "entropy", "percentile", "mse", "aciq"])
def test_merged_shards_equal_a_single_run(tmp_path, shard_files, method):
    _run("--data", CALIB_SAMPLES, *BASE, "--method", method, "-o", tmp_path / "single.json")
    _run(*BASE, "--method", method, "--merge", *shard_files, "-o", tmp_path / "merged.json")
    single = json.loads((tmp_path / "single.json").read_text())
    assert single["num_samples"] == 10 and len(single["tensors"]) > 10
    assert len(single["channel_means"]) > 10  # the config's bias correction (weights) reads them
    # the histogram merges by adding counts, the channel means' integer sums add exactly, and every
    # range method reads only the merged summary
    assert (tmp_path / "merged.json").read_bytes() == (tmp_path / "single.json").read_bytes()


def test_shard_statistics_of_one_shard_differ_from_the_whole(tmp_path, shard_files):
    _run(*BASE, "--merge", shard_files[0], "-o", tmp_path / "one.json")
    _run("--data", CALIB_SAMPLES, *BASE, "-o", tmp_path / "single.json")
    one, single = (json.loads((tmp_path / f).read_text()) for f in ("one.json", "single.json"))
    assert one["num_samples"] == 2
    assert one["tensors"] != single["tensors"]


def test_merge_refuses_a_repeated_shard_and_a_foreign_file(tmp_path, shard_files):
    result = CliRunner().invoke(main, ["calibrate", str(EFFNET), *BASE, "--merge", str(shard_files[0]),
                                       str(shard_files[0]), "-o", str(tmp_path / "t.json")])
    assert result.exit_code == 2 and "same shard" in result.output
    bogus = tmp_path / "bogus.npz"
    bogus.write_bytes(b"not a zip")
    result = CliRunner().invoke(main, ["calibrate", str(EFFNET), *BASE, "--merge", str(bogus),
                                       "-o", str(tmp_path / "t.json")])
    assert result.exit_code == 2 and "bogus.npz" in result.output and not (tmp_path / "t.json").exists()
    result = CliRunner().invoke(main, ["calibrate", str(EFFNET), *BASE, "--data", str(CALIB_SAMPLES),
                                       "--shard", "3/3", "-o", str(tmp_path / "s.npz")])
    assert result.exit_code == 2 and "0 <= K < N" in result.output


@pytest.mark.slow
def test_workers_equal_a_single_run(tmp_path):
    _run("--data", CALIB_SAMPLES, *BASE, "--method", "entropy", "-o", tmp_path / "single.json")
    _run("--data", CALIB_SAMPLES, *BASE, "--method", "entropy", "--workers", "2", "-o", tmp_path / "w2.json")
    assert (tmp_path / "w2.json").read_bytes() == (tmp_path / "single.json").read_bytes()


def test_in_graph_statistics_equal_numpy_on_every_batch_shape():
    model = prepare(conv_model(np.random.default_rng(0), activation="Relu", size=32), False, "m", True).model
    names = [n.output[0] for n in model.graph.node]
    relu = next(n.output[0] for n in model.graph.node if n.op_type == "Relu")
    rng = np.random.default_rng(1)
    feeds = [rng.normal(size=(b, 8, 32, 32)).astype(np.float32) for b in (1, 3, 2, 5)]
    got = observe(model, names, [Batch([str(i)], {"x": f}) for i, f in enumerate(feeds)], histogram_for=names,
                  sample_limit=256)
    import onnxruntime as ort
    from qtool.graph.edit import with_outputs
    session = ort.InferenceSession(with_outputs(model, names).SerializeToString(), providers=["CPUExecutionProvider"])
    for name in names:
        want = TensorStats.with_histogram()
        want.sample_limit = 256
        for f in feeds:
            array = session.run([name], {"x": f})[0]
            if name == relu:  # non-negative 4-D: sampled from every 4th row and column, min not observed
                want.add_extremes(0.0, float(array.max()), array.size)
                flat = np.ascontiguousarray(array[:, :, ::4, ::4]).reshape(-1)
                s = flat.size // 256
                want.add_sample(flat[::s - s % 2 + 1])
            else:
                want.update(array)
        want.flush()
        assert (got[name].min, got[name].max, got[name].count) == (want.min, want.max, want.count), name
        np.testing.assert_array_equal(got[name].hist, want.hist, err_msg=name)  # the same strided sample
        assert 64 * len(feeds) <= got[name].sampled < got[name].count / 8  # bounded, not everything


def test_observed_histograms_hold_their_filled_keys_only():
    """A calibration pass keeps each tensor's histogram as its filled keys and their counts, not the
    65,536 dense counters (512 KB a tensor: with hundreds of tensors, most of the pass's peak)."""
    model = prepare(conv_model(np.random.default_rng(0), activation="Relu", size=32), False, "m", True).model
    names = [n.output[0] for n in model.graph.node]
    rng = np.random.default_rng(1)
    batches = [Batch([str(i)], {"x": rng.normal(size=(2, 8, 32, 32)).astype(np.float32)}) for i in range(3)]
    got = observe(model, names, batches, histogram_for=names)
    for name in names:
        stats, dense = got[name], got[name].hist
        held = [v for v in vars(stats).values() if isinstance(v, np.ndarray)]
        assert 0 < stats.hist_keys.size == np.count_nonzero(dense) < dense.size // 16, name
        assert sum(a.nbytes for a in held) == stats.hist_keys.size * 10, name  # uint16 keys + int64 counts
        assert np.array_equal(dense[stats.hist_keys], stats.hist_counts) and stats.sampled == dense.sum()


def test_method_by_op_type_and_tensor_pattern(tmp_path):
    config = tmp_path / "c.yaml"
    config.write_text("calibration:\n  method: entropy\n  method_by_op_type: {Relu: minmax}\n"
                      "  method_by_tensor: {'c*': percentile}\n")
    calib = load_config(config).calibration
    assert calib.method_by_op_type == (("Relu", "minmax"),)
    model = prepare(conv_model(np.random.default_rng(0), activation="Relu"), False, "m", True).model
    relu_input = next(n.input[0] for n in model.graph.node if n.op_type == "Relu")
    chosen = methods_for(model, ["x", relu_input, "other"], calib)
    assert chosen["x"] == "entropy"
    assert chosen[relu_input] == ("percentile" if relu_input.startswith("c") else "minmax")
    chosen = methods_for(model, [relu_input], CalibrationConfig(method="mse", method_by_op_type=(("Relu", "aciq"),)))
    assert chosen[relu_input] == "aciq"


def test_statistics_travel_to_and_from_workers_whole_and_small():
    """A shard's statistics are pickled with their histogram's filled keys only: the same counts back."""
    import pickle

    stats = TensorStats.with_histogram()
    values = np.random.default_rng(0).normal(size=50_000).astype(np.float32)
    stats.update(values)
    copy = pickle.loads(pickle.dumps(stats))
    assert (copy.min, copy.max, copy.count, copy.batches) == (stats.min, stats.max, stats.count, stats.batches)
    assert copy.hist.dtype == np.int64 and np.array_equal(copy.hist, stats.hist) and copy.sampled == stats.sampled
    assert len(pickle.dumps(stats)) < stats.hist.nbytes // 8
    assert pickle.loads(pickle.dumps(TensorStats())).hist is None


# ---- a partial last batch, without the kit and without Dask --------------------------------------
# 9 samples in batches of 2 make 5 batches, the last of one sample; the last sample is the loudest,
# so a shard that dropped it would change the ranges as well as the sample count.
PARTIAL = 9


def _partial_batch_data(tmp_path):
    """A small Conv model and PARTIAL samples whose last one holds the largest values: (model, folder)."""
    rng = np.random.default_rng(3)
    model = tmp_path / "m.onnx"
    onnx.save(conv_model(rng, c_in=3, c_out=4, activation="Relu", size=6), model)
    data = write_samples(tmp_path / "data", rng, (3, 6, 6), count=PARTIAL)
    last = sorted(data.iterdir())[-1]
    np.save(last, np.load(last) * 10)
    return model, data


def _single_table(tmp_path, model, data) -> dict:
    result = CliRunner().invoke(main, ["calibrate", str(model), "--data", str(data), "--batch-size", "2",
                                       "--method", "minmax", "-o", str(tmp_path / "single.json")])
    assert result.exit_code == 0, result.output
    single = json.loads((tmp_path / "single.json").read_text())
    assert single["num_samples"] == len(list(data.iterdir())) == PARTIAL
    return single


def test_shards_with_a_partial_last_batch_merge_to_the_single_run(tmp_path):
    """--shard K/3 then --merge, in this process: the last shard ends with the partial batch."""
    model, data = _partial_batch_data(tmp_path)
    single = _single_table(tmp_path, model, data)
    files = []
    for k in range(3):  # 5 batches over 3 shards: 1, 2 and 2 batches, the last of them 1 sample
        files.append(tmp_path / f"s{k}.npz")
        result = CliRunner().invoke(main, ["calibrate", str(model), "--data", str(data), "--batch-size", "2",
                                           "--shard", f"{k}/3", "-o", str(files[-1])])
        assert result.exit_code == 0, result.output
    result = CliRunner().invoke(main, ["calibrate", str(model), "--batch-size", "2", "--method", "minmax",
                                       "--merge", *map(str, files), "-o", str(tmp_path / "merged.json")])
    assert result.exit_code == 0, result.output
    merged = json.loads((tmp_path / "merged.json").read_text())
    assert merged["num_samples"] == PARTIAL
    assert merged["tensors"] == single["tensors"]
    assert (tmp_path / "merged.json").read_bytes() == (tmp_path / "single.json").read_bytes()


def test_workers_with_a_partial_last_batch_equal_the_single_run(tmp_path):
    """The data cut into runs of whole batches for workers (split_shard): local processes
    (--workers 2) over a folder, and a thread pool (executor=) over the same samples in memory."""
    import concurrent.futures

    from qtool import api

    model, data = _partial_batch_data(tmp_path)
    single = _single_table(tmp_path, model, data)
    result = CliRunner().invoke(main, ["calibrate", str(model), "--data", str(data), "--batch-size", "2",
                                       "--method", "minmax", "--workers", "2", "-o", str(tmp_path / "w2.json")])
    assert result.exit_code == 0, result.output
    workers = json.loads((tmp_path / "w2.json").read_text())
    assert workers["num_samples"] == PARTIAL and workers["tensors"] == single["tensors"]
    assert (tmp_path / "w2.json").read_bytes() == (tmp_path / "single.json").read_bytes()
    samples = [{"x": np.load(f)} for f in sorted(data.iterdir())]
    config = {"calibration": {"batch_size": 2, "method": "minmax"}}
    alone = api.calibrate(model, samples, config, progress=False)
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        pooled = api.calibrate(model, samples, config, progress=False, executor=pool)
    assert alone.num_samples == pooled.num_samples == PARTIAL
    assert pooled.to_json_text() == alone.to_json_text()
