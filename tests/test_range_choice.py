"""Calibration method auto: the range method whose int8 model measures closest to fp32 on the
calibration samples, min-max unless another clearly wins."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import helper

import qtool
from qtool.calibration.calibrate import calibrate_methods
from qtool.config import load_config

from tests import graphs


def _conv(path, rng) -> None:
    """x -> Conv -> Relu -> Conv -> y: the input's range decides the first Conv's precision."""
    w1 = rng.normal(0, 0.3, (6, 3, 3, 3)).astype(np.float32)
    w2 = rng.normal(0, 0.3, (4, 6, 1, 1)).astype(np.float32)
    nodes = [helper.make_node("Conv", ["x", "w1"], ["a"], name="conv1", pads=[1, 1, 1, 1]),
             helper.make_node("Relu", ["a"], ["r"], name="relu"),
             helper.make_node("Conv", ["r", "w2"], ["y"], name="conv2")]
    onnx.save(graphs.model(nodes, [graphs.tensor("x", ["N", 3, 32, 32])], [graphs.tensor("y", None)],
                           [graphs.init("w1", w1), graphs.init("w2", w2)]), path)


def _samples(rng, spike: float) -> list[dict]:
    # 32 x 32: enough values that the percentile method's 0.01% tail holds the spike
    samples = [{"x": rng.normal(0, 1, (1, 3, 32, 32)).astype(np.float32)} for _ in range(24)]
    samples[3]["x"][0, 1, 4, 4] = spike
    return samples


def test_a_spike_makes_auto_leave_min_max(tmp_path):
    """One value 500x the data in one calibration sample: min-max ranges stretch to it and the
    int8 model loses the rest; auto measures that and takes a clipping method, with a note."""
    rng = np.random.default_rng(0)
    path = tmp_path / "m.onnx"
    _conv(path, rng)
    data = _samples(rng, 500.0)
    table = qtool.calibrate(path, data, progress=False)
    assert table.method in ("mse", "percentile")
    # the same table as asking for that method, and what quantize --data writes from it
    cfg = load_config(None)
    alone = calibrate_methods(path, data, cfg.preprocess, cfg.calibration, cfg.quantization, [table.method],
                              progress=False)[0]
    assert alone.to_json_text() == table.to_json_text()
    result = qtool.quantize(path, data=data)
    assert result.table.to_json_text() == table.to_json_text()
    [chosen] = [d for d in result.decisions if d.option == "calibration.method"]
    assert chosen.value == table.method and [c for c, _ in chosen.measured][0] == "minmax"
    assert dict(chosen.measured)[table.method]["cosine_db"] > dict(chosen.measured)["minmax"]["cosine_db"] + 0.5
    assert result.notes[0] == chosen.note() and chosen.note() in table.notes


def test_auto_keeps_min_max_where_it_is_good_or_cannot_measure(tmp_path):
    rng = np.random.default_rng(1)
    path = tmp_path / "m.onnx"
    _conv(path, rng)
    data = _samples(rng, 2.0)  # no spike: min-max is within the cosine at which it is kept
    minmax = qtool.calibrate(path, data, config={"calibration": {"method": "minmax"}}, progress=False)
    table = qtool.calibrate(path, data, progress=False)
    assert table.method == "minmax" and not table.notes and table.to_json_text() == minmax.to_json_text()
    # a generator can be read once: nothing measures, auto is min-max
    spiked = _samples(np.random.default_rng(2), 500.0)
    once = qtool.calibrate(path, (s for s in spiked), progress=False)
    pinned = qtool.calibrate(path, spiked, config={"calibration": {"method": "minmax"}}, progress=False)
    assert once.method == "minmax" and once.to_json_text() == pinned.to_json_text()


def test_the_choice_is_by_cosine_distance_in_db():
    """The mean of -10 log10(1 - cosine) up to 50 dB: one sample a rounding moved a lot does not
    carry it, nor do samples as good as fp32 whose dB only single rounding flips move."""
    from qtool.evaluation.mixed_precision import cosine_db

    assert cosine_db(np.array([0.99, 0.999])) == pytest.approx(25.0)
    assert cosine_db(np.array([1.0])) == pytest.approx(50.0)  # identical outputs
    assert cosine_db(np.array([0.99, 1 - 1e-6])) == cosine_db(np.array([0.99, 1 - 1e-7])) == pytest.approx(35.0)
    steady = np.full(16, 0.985)  # mean 0.985, 18.2 dB
    one_bad = np.r_[np.full(15, 0.9995), 0.74]  # closer on 15 of 16 samples: mean 0.983, 31.3 dB
    assert one_bad.mean() < steady.mean() and cosine_db(one_bad) > cosine_db(steady) + 10


def test_the_candidates_are_measured_on_samples_spread_over_the_data(tmp_path):
    """A folder sorted by where its samples came from (the kit recognizer's lines: the first 16 of
    48 are one image's) is measured on all of it: every third sample, not the first 16."""
    from qtool.config import Config
    from qtool.data.dataset import open_data, spread_samples
    from qtool.choices.measure import SAMPLES, scored_samples
    from qtool.graph.modelio import input_specs

    rng = np.random.default_rng(3)
    path = tmp_path / "m.onnx"
    _conv(path, rng)
    data = graphs.write_samples(tmp_path / "data", rng, (3, 32, 32), count=48)
    specs = input_specs(onnx.load(path))
    samples = scored_samples(path, specs, data, Config())[0]
    assert sum(len(b) for b in samples) == SAMPLES == 16
    assert [key for batch in samples for key in batch.keys] == [f"s{i:03d}.npy" for i in range(0, 48, 3)]
    # a calibration limit spreads over the samples calibration reads; a list is spread alike; a
    # generator (its length unknown until read) keeps its first samples
    limited = scored_samples(path, specs, data, load_config({"calibration": {"num_samples": 32}}))[0]
    assert [key for batch in limited for key in batch.keys] == [f"s{i:03d}.npy" for i in range(0, 32, 2)]
    listed = [{"x": np.full((1, 3, 32, 32), i, np.float32)} for i in range(48)]
    picked = spread_samples(open_data(listed, specs, Config().preprocess), None, 16)
    assert [float(item["x"].flat[0]) for item in picked.data] == [float(i) for i in range(0, 48, 3)]
    generator = open_data((s for s in listed), specs, Config().preprocess)
    assert spread_samples(generator, None, 16) is generator


@pytest.mark.parametrize("macs", [0, 10**18], ids=["two-thread runs", "one-thread runs"])
def test_candidates_measured_together_score_as_each_alone(tmp_path, monkeypatch, macs):
    """Candidates measured in one call overlap (the next built while one is scored, or two scored at
    once): each still gets the figures of its own model, those it gets measured alone."""
    from qtool.calibration.calibrate import calibrate_methods
    from qtool.choices import measure
    from qtool.graph import runtime

    monkeypatch.setattr(measure, "PARALLEL_MACS", macs)
    rng = np.random.default_rng(4)
    path = tmp_path / "m.onnx"
    _conv(path, rng)
    data = _samples(rng, 500.0)
    cfg = load_config(None)
    tables = calibrate_methods(path, data, cfg.preprocess, cfg.calibration, cfg.quantization,
                               ["minmax", "mse", "percentile"], progress=False)
    background = []
    original = runtime.in_background
    monkeypatch.setattr(measure, "in_background",
                        lambda function, *args: background.append(function.__name__) or original(function, *args))
    together = measure.Scoring(path, data, cfg).measured([(t, cfg.quantization) for t in tables])
    assert background.count("_build" if macs == 0 else "_measure") == 2  # the later candidates overlapped
    alone = [measure.Scoring(path, data, cfg).measured([(t, cfg.quantization)])[0] for t in tables]
    assert together == alone
    assert len({f["cosine_db"] for f in alone}) == 3  # three different models
