"""Early saturation (qtool.calibration.saturation): min-max tables stay byte-identical, and the rule stops
observing a bounded tensor only once its extremes have reached both of its bounds."""

from __future__ import annotations

import dataclasses

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

import qtool.calibration.collect as collect_module
import qtool.calibration.observer as observer_module
from qtool.calibration.calibrate import calibrate
from qtool.config import load_config
from qtool.data.dataset import Batch
from qtool.calibration.observer import observe, with_channel_means
from qtool.calibration.saturation import bounds
from qtool.graph.shapes import inferred_shapes
from tests.conftest import CALIB_SAMPLES, EFFNET, EFFNET_CONFIG, kit_path


def _two_clips(spatial=(8, 8)):
    """x -> Clip(0, 6) -> a (ReLU6: both bounds reachable); x -> Clip(-1, 100) -> b -> Sigmoid -> y;
    x declared [N, 4, *spatial]."""
    inits = [numpy_helper.from_array(np.array(v, np.float32), n)
             for n, v in (("z", 0.0), ("six", 6.0), ("m1", -1.0), ("hundred", 100.0))]
    nodes = [helper.make_node("Clip", ["x", "z", "six"], ["a"], name="relu6"),
             helper.make_node("Clip", ["x", "m1", "hundred"], ["b"], name="wide"),
             helper.make_node("Add", ["a", "b"], ["s"], name="add"),
             helper.make_node("Sigmoid", ["s"], ["y"], name="out")]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 4, *spatial])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])


def test_saturation_stops_a_bounded_tensor_and_keeps_observing_the_others(monkeypatch):
    model = _two_clips()
    assert bounds(model) == {"a": (0.0, 6.0), "b": (-1.0, 100.0)}
    rng = np.random.default_rng(0)
    feeds = [rng.uniform(0, 3, (2, 4, 8, 8)),   # a not saturated yet (max < 6)
             rng.uniform(-5, 10, (2, 4, 8, 8)),  # a reaches 0 and 6: saturated; b reaches -1 but not 100
             rng.uniform(-5, 50, (2, 4, 8, 8)),  # b's max moves to ~50: it must still be observed
             rng.uniform(-5, 80, (2, 4, 8, 8))]
    feeds = [f.astype(np.float32) for f in feeds]
    built = []
    real = observer_module._observing_session
    monkeypatch.setattr(observer_module, "_observing_session",
                        lambda model, names, *rest: built.append(list(names)) or real(model, names, *rest))
    batches = [Batch([str(i)], {"x": f}) for i, f in enumerate(feeds)]
    got = observe(model, ["a", "b", "s"], batches, saturate={"a", "b", "s"})
    assert built == [["a", "b", "s"], ["b", "s"]]  # one rebuild, after the second batch, without a
    full = observe(model, ["a", "b", "s"], batches)  # nothing saturates: every batch observed
    per_batch = feeds[0].size
    for name in ("a", "b", "s"):
        assert (got[name].min, got[name].max) == (full[name].min, full[name].max), name
    assert (got["a"].min, got["a"].max) == (0.0, 6.0)
    assert got["b"].max == float(np.max(feeds[3])) and got["b"].min == -1.0
    assert got["a"].count == 2 * per_batch  # the values seen until it saturated
    assert got["b"].count == full["b"].count == 4 * per_batch
    assert full["a"].count == 4 * per_batch


def test_not_saturated_without_permission_or_before_both_bounds(monkeypatch):
    model = _two_clips()
    built = []
    real = observer_module._observing_session
    monkeypatch.setattr(observer_module, "_observing_session",
                        lambda model, names, *rest: built.append(list(names)) or real(model, names, *rest))
    low = np.full((1, 4, 8, 8), 3.0, np.float32)  # a's max stays below 6: never saturated
    high = np.full((1, 4, 8, 8), 9.0, np.float32)
    observe(model, ["a", "b"], [Batch(["0"], {"x": low})] * 3, saturate={"a", "b"})
    observe(model, ["a", "b"], [Batch(["0"], {"x": high})] * 3, saturate=())  # e.g. averaged min-max, shards
    assert built == [["a", "b"]] * 2
    # a histogram tensor saturates only when its dims but the batch are static (its count comes from its sample)
    dynamic = _two_clips()
    dynamic.graph.input[0].type.tensor_type.shape.dim[2].dim_param = "H"
    observe(dynamic, ["a", "b"], [Batch(["0"], {"x": high})] * 3, saturate={"a"}, histogram_for={"a"})
    assert built == [["a", "b"]] * 3


def test_histogram_tensors_keep_their_samples_and_counts_when_saturated(monkeypatch):
    """A saturated tensor with a histogram loses its min/max reductions but keeps its sample:
    its statistics (extremes, count, histogram) equal the unsaturated path's exactly, for the
    pooled grid sample of a non-negative 4-D tensor (a) and the flat sample of a signed one (b)."""
    model = _two_clips()
    rng = np.random.default_rng(1)
    feeds = [rng.uniform(0, 3, (2, 4, 8, 8)),    # a not saturated yet
             rng.uniform(-5, 10, (2, 4, 8, 8)),  # a saturated; b reaches -1 only
             rng.uniform(-5, 50, (1, 4, 8, 8)),  # another batch size: the count must follow it
             rng.uniform(-5, 200, (2, 4, 8, 8)),  # b reaches 100: saturated
             rng.uniform(-5, 50, (3, 4, 8, 8)),
             rng.uniform(-5, 8, (2, 4, 8, 8))]
    batches = [Batch([str(i)], {"x": f.astype(np.float32)}) for i, f in enumerate(feeds)]
    built = []
    real = observer_module._observing_session
    monkeypatch.setattr(observer_module, "_observing_session",
                        lambda model, names, *rest: built.append((list(names), list(rest[4] if len(rest) > 4 else [])))
                        or real(model, names, *rest))
    names = ["a", "b", "s"]
    got = observe(model, names, batches, histogram_for=set(names), saturate=set(names), sample_limit=64)
    assert built == [(names, []), (["b", "s"], ["a"]), (["s"], ["a", "b"])]
    full = observe(model, names, batches, histogram_for=set(names), sample_limit=64)
    for name in names:
        g, f = got[name], full[name]
        assert (g.min, g.max, g.count, g.batches, g.nonfinite, g.sampled) == \
            (f.min, f.max, f.count, f.batches, f.nonfinite, f.sampled), name
        assert np.array_equal(g.hist, f.hist), name
    assert (got["a"].min, got["a"].max, got["b"].min, got["b"].max) == (0.0, 6.0, -1.0, 100.0)
    assert got["a"].count == sum(f.size for f in feeds)


def test_a_kept_observer_builds_each_session_once_and_each_pass_starts_afresh(monkeypatch):
    """An Observer kept for several passes (a worker's shards): every pass has the statistics of a
    pass of its own, whatever saturated before (here the second pass never reaches a's bounds),
    and a session it needs again is not rebuilt."""
    model = _two_clips()
    rng = np.random.default_rng(2)
    saturating = [Batch([str(i)], {"x": rng.uniform(-5, 10, (2, 4, 8, 8)).astype(np.float32)}) for i in range(3)]
    below = [Batch([str(i)], {"x": rng.uniform(1, 3, (2, 4, 8, 8)).astype(np.float32)}) for i in range(3)]
    built = []
    real = observer_module._observing_session
    monkeypatch.setattr(observer_module, "_observing_session",
                        lambda model, names, *rest: built.append(list(names)) or real(model, names, *rest))
    names = ["a", "b", "s"]
    kept = observer_module.Observer(model, names, histogram_for={"a"}, saturate=set(names))
    passes = [kept.run(saturating), kept.run(below), kept.run(saturating)]
    assert built == [names, ["b", "s"]]  # the full session and the one without the saturated a, once each
    for got, data in zip(passes, (saturating, below, saturating)):
        alone = observe(model, names, data, histogram_for={"a"}, saturate=set(names))
        for name in names:
            g, f = got[name], alone[name]
            assert (g.min, g.max, g.count, g.batches) == (f.min, f.max, f.count, f.batches), name
            assert np.array_equal(g.hist, f.hist) if name == "a" else g.hist is None
    assert (passes[1]["a"].min, passes[1]["a"].max) == (0.0, float(max(b.feeds["x"].max() for b in below)))


def _table_bytes(monkeypatch, saturating: bool, *args) -> tuple[str, dict]:
    seen = {}
    real = collect_module.Observer

    def spy(*a, **kw):
        if not saturating:
            kw["saturate"] = ()
        observer = real(*a, **kw)
        run = observer.run
        observer.run = lambda *ra, **rk: seen.update(run(*ra, **rk)) or seen
        return observer

    monkeypatch.setattr(collect_module, "Observer", spy)
    table = calibrate(*args, progress=False)
    monkeypatch.undo()
    return table.to_json_text(), seen


def _assert_same_tables(monkeypatch, model, data, cfg):
    old, old_stats = _table_bytes(monkeypatch, False, model, data, cfg.preprocess, cfg.calibration, cfg.quantization)
    new, new_stats = _table_bytes(monkeypatch, True, model, data, cfg.preprocess, cfg.calibration, cfg.quantization)
    assert new == old
    # the saturated path really was taken: some tensors stopped being counted early
    assert any(new_stats[t].count < old_stats[t].count for t in old_stats)


def test_minmax_tables_identical_on_the_shipped_model(monkeypatch):
    cfg = load_config(EFFNET_CONFIG)
    cfg = dataclasses.replace(cfg, calibration=dataclasses.replace(cfg.calibration, method="minmax", batch_size=2))
    _assert_same_tables(monkeypatch, EFFNET, CALIB_SAMPLES, cfg)


@pytest.mark.parametrize("method", ["percentile", "entropy"])  # one histogram serves every method
def test_histogram_tables_identical_on_the_shipped_model(monkeypatch, method):
    cfg = load_config(EFFNET_CONFIG)
    cfg = dataclasses.replace(cfg, calibration=dataclasses.replace(cfg.calibration, method=method, batch_size=2))
    known = []
    real = observer_module._observing_session

    def spy(model, names, *rest):
        known.extend(rest[4] if len(rest) > 4 else [])
        return real(model, names, *rest)

    monkeypatch.setattr(observer_module, "_observing_session", spy)
    old, old_stats = _table_bytes(monkeypatch, False, EFFNET, CALIB_SAMPLES, cfg.preprocess, cfg.calibration,
                                  cfg.quantization)
    assert not known
    monkeypatch.setattr(observer_module, "_observing_session", spy)
    new, new_stats = _table_bytes(monkeypatch, True, EFFNET, CALIB_SAMPLES, cfg.preprocess, cfg.calibration,
                                  cfg.quantization)
    assert new == old
    assert len(known) >= 20  # the ReLU6 outputs saturated: only sampled from then on
    for name in old_stats:
        assert new_stats[name].count == old_stats[name].count, name
        assert np.array_equal(new_stats[name].hist, old_stats[name].hist), name


@pytest.mark.slow
def test_minmax_tables_identical_on_a_kit_model(monkeypatch):
    model = kit_path("models", "efficientnet_lite0_dyn.onnx")
    data = kit_path("data", "calib", "images")
    cfg = load_config(EFFNET_CONFIG)
    cfg = dataclasses.replace(cfg, calibration=dataclasses.replace(cfg.calibration, method="minmax",
                                                                   num_samples=96))
    _assert_same_tables(monkeypatch, model, data, cfg)


@pytest.mark.parametrize("spatial", [(8, 8), ("H", "W")], ids=["static", "dynamic"])
def test_channel_means_are_kept_through_saturation_and_merge_to_the_same_sums_in_any_split(spatial):
    """The per-sample channel means bias correction reads: kept for a tensor after it saturates,
    equal to numpy's means of the batches (each sample weighing the same, whatever the batch size),
    with the mean spatial size, read from the graph where its dims are known (no Shape node: it
    would make onnxruntime reorder the tensor out of its blocked layout) and from a Shape output
    where they are not; a graph input's from the feeds; and two passes over halves of the data
    merge to exactly the sums of one pass (integer sums: no order dependence)."""
    model = _two_clips(spatial)
    observing = onnx.ModelProto()
    observing.CopyFrom(model)
    added = with_channel_means(observing, {"a": 4, "b": 4}, inferred_shapes(model))
    shapes_read = [n for n in observing.graph.node if n.op_type == "Shape"]
    if spatial == (8, 8):
        assert not shapes_read and (added["a"].shape, added["a"].static) == ("", (8, 8))
    else:
        assert len(shapes_read) == 2 and added["a"].static == ()
    rng = np.random.default_rng(4)
    shapes = [(2, 4, 8, 8), (1, 4, 8, 8), (3, 4, 8, 8), (2, 4, 8, 8)]
    feeds = [rng.uniform(-5, 10, s).astype(np.float32) for s in shapes]  # a saturates in the first batch
    batches = [Batch([str(i)], {"x": f}) for i, f in enumerate(feeds)]
    ranks = {"a": 4, "b": 4, "x": 4}
    whole = observe(model, ["a", "b", "x"], batches, saturate={"a", "b"}, means_for=ranks)
    samples = np.concatenate(feeds)
    for name, values in (("a", np.clip(samples, 0, 6)), ("b", np.clip(samples, -1, 100)), ("x", samples)):
        assert whole[name].channel_samples == 8, name
        np.testing.assert_allclose(whole[name].channel_mean, values.mean(axis=(2, 3)).mean(axis=0), atol=1e-6)
        assert tuple(whole[name].spatial_mean) == (8.0, 8.0)
    first = observe(model, ["a", "b", "x"], batches[:2], saturate={"a", "b"}, means_for=ranks)
    second = observe(model, ["a", "b", "x"], batches[2:], saturate={"a", "b"}, means_for=ranks)
    for name in ranks:
        merged = first[name].merge(second[name])
        assert np.array_equal(merged.channel_sums, whole[name].channel_sums), name
        assert np.array_equal(merged.spatial_sums, whole[name].spatial_sums) and merged.channel_samples == 8
    assert observe(model, ["a"], batches)["a"].channel_mean is None  # not asked for: not kept
