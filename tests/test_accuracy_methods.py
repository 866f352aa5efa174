"""Beyond min-max: cross-layer equalization, bias correction, adaptive rounding, mixed precision."""

from __future__ import annotations

import random
import time
import warnings
from dataclasses import replace

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import helper, numpy_helper

from qtool.quantization import rounding as adaround

from qtool.table import qparams as qp
from qtool.quantization.bias_correction import _SampleMeans
from qtool.calibration.calibrate import calibrate
from qtool.config import CalibrationConfig, PreprocessConfig, QuantizeConfig, load_config
from qtool.data.dataset import Batch, batches, open_data
from qtool.prepare.equalize import equalize, find_pairs
from qtool.errors import ThresholdError
from qtool.prepare.graph_prep import prepare
from qtool.evaluation.mixed_precision import Target, search
from qtool.graph.modelio import input_specs, load_model
from qtool.graph.edit import with_outputs
from qtool.plan.planner import build_plan
from qtool.quantization.quantize import quantize_model
from qtool.quantization.rewrite import SCALE_SUFFIX, WEIGHT_SUFFIX

from tests import graphs
from tests.conftest import CALIB_SAMPLES, EFFNET, EFFNET_CONFIG, kit_path


def _run(model, feeds, names=None):
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return session.run(names, feeds)


def _chain_model(rng) -> onnx.ModelProto:
    """x -> clip6 -> conv1 -> relu -> dw -> clip6 -> conv3 -> conv4 -> y, with outlier channels."""
    w1 = rng.normal(0, 0.3, (8, 3, 3, 3)).astype(np.float32)
    w1[2] *= 25.0  # an outlier output channel: equalization must shrink it
    dw = rng.normal(0, 0.3, (8, 1, 3, 3)).astype(np.float32)
    dw[5] *= 0.01  # a quiet channel: never reaches 6 whatever its [0, 6] input, so ReLU6 lets it move
    dw[1] *= 20.0  # a loud one that saturates: must stay as it is
    w3 = rng.normal(0, 0.3, (6, 8, 1, 1)).astype(np.float32)
    w4 = rng.normal(0, 0.3, (4, 6, 1, 1)).astype(np.float32)
    w4[:, 3] *= 30.0
    inits = [graphs.init("w1", w1), graphs.init("b1", rng.normal(0, 0.1, 8).astype(np.float32)),
             graphs.init("dw", dw), graphs.init("bdw", np.full(8, 0.05, np.float32)),
             graphs.init("w3", w3), graphs.init("b3", rng.normal(0, 0.1, 6).astype(np.float32)),
             graphs.init("w4", w4), graphs.init("zero", np.float32(0)), graphs.init("six", np.float32(6))]
    nodes = [helper.make_node("Clip", ["x", "zero", "six"], ["x6"], name="clip0"),
             helper.make_node("Conv", ["x6", "w1", "b1"], ["c1"], name="conv1", pads=[1, 1, 1, 1]),
             helper.make_node("Relu", ["c1"], ["r1"], name="relu1"),
             helper.make_node("Conv", ["r1", "dw", "bdw"], ["c2"], name="dw", pads=[1, 1, 1, 1], group=8),
             helper.make_node("Clip", ["c2", "zero", "six"], ["r2"], name="relu6"),
             helper.make_node("Conv", ["r2", "w3", "b3"], ["c3"], name="conv3"),
             helper.make_node("Conv", ["c3", "w4"], ["y"], name="conv4")]
    return graphs.model(nodes, [graphs.tensor("x", ["N", 3, 10, 10])], [graphs.tensor("y", None)], inits)


def _weights(model):
    return {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}


def test_equalization_keeps_the_fp32_outputs_and_balances_ranges():
    rng = np.random.default_rng(0)
    model = _chain_model(rng)
    before = _weights(model)
    pairs = find_pairs(model)
    assert [(p.first.name, p.act.name if p.act else None, p.second.name) for p in pairs] == \
        [("conv1", "relu1", "dw"), ("dw", "relu6", "conv3"), ("conv3", None, "conv4")]
    eq = onnx.ModelProto()
    eq.CopyFrom(model)
    report = equalize(eq)
    after = _weights(eq)
    x = {"x": rng.uniform(-1, 8, (4, 3, 10, 10)).astype(np.float32)}  # inputs both inside and beyond the clip
    ref, got = _run(model, x)[0], _run(eq, x)[0]
    np.testing.assert_allclose(got, ref, rtol=1e-4, atol=1e-4 * np.abs(ref).max())

    def spread(w):  # largest over median per-output-channel range
        r = np.abs(w.reshape(w.shape[0], -1)).max(axis=1)
        return r.max() / np.median(r)

    assert spread(after["w1"]) < spread(before["w1"]) / 3  # the Relu pair: the outlier channel is balanced
    assert report.pinned >= 1 and report.pairs == 3
    # the linear pair conv3 -> conv4 balances its input channel 3 outlier
    assert spread(np.moveaxis(after["w4"], 1, 0)) < spread(np.moveaxis(before["w4"], 1, 0)) / 3


def test_relu6_pins_the_channels_that_can_saturate():
    """dw -> ReLU6 -> conv3 alone: a channel that can reach 6 keeps s = 1, a provably quiet one moves."""
    rng = np.random.default_rng(1)
    full = _chain_model(rng)
    keep = {"clip0", "dw", "relu6", "conv3"}
    nodes = [n for n in full.graph.node if n.name in keep]
    nodes[0].input[0] = "x"
    nodes[1].input[0] = "x6"  # the dw reads the clipped input directly
    inits = [t for t in full.graph.initializer if t.name in {"dw", "bdw", "w3", "b3", "zero", "six"}]
    model = graphs.model(nodes, [graphs.tensor("x", ["N", 8, 6, 6])], [graphs.tensor("c3", ["N", 6, 6, 6])], inits)
    model_before = onnx.ModelProto()
    model_before.CopyFrom(model)
    before = _weights(model)
    report = equalize(model)
    after = _weights(model)
    ratio = after["dw"].reshape(8, -1)[:, 0] / before["dw"].reshape(8, -1)[:, 0]
    assert ratio[1] == 1.0  # dw[1] * 20 saturates the clip: pinned
    assert abs(ratio[5] - 1.0) > 0.1  # dw[5] * 0.01 never reaches 6 for inputs in [0, 6]
    assert report.pairs == 1 and 1 <= report.pinned < 8
    x = {"x": rng.uniform(-2, 9, (4, 8, 6, 6)).astype(np.float32)}
    ref, got = _run(model_before, x)[0], _run(model, x)[0]
    np.testing.assert_allclose(got, ref, rtol=1e-4, atol=1e-5 * np.abs(ref).max())


def test_equalization_is_exact_on_efficientnet_lite0():
    model = prepare(load_model(EFFNET)).model
    eq = onnx.ModelProto()
    eq.CopyFrom(model)
    report = equalize(eq)
    assert report.pairs >= 30 and report.channels > 1000
    changed = sum(not np.array_equal(a, _weights(model)[name]) for name, a in _weights(eq).items())
    assert changed > 50
    cfg = load_config(EFFNET_CONFIG)
    batch = next(batches(open_data(CALIB_SAMPLES, input_specs(model), cfg.preprocess), 8, 8))
    ref, got = _run(model, batch.feeds)[0], _run(eq, batch.feeds)[0]
    assert np.abs(got - ref).max() < 1e-4 * np.abs(ref).max()
    assert (ref.argmax(1) == got.argmax(1)).all()


@pytest.fixture(scope="module")
def effnet_setup():
    cfg = load_config(EFFNET_CONFIG)
    model = prepare(load_model(EFFNET)).model
    data = list(batches(open_data(CALIB_SAMPLES, input_specs(model), cfg.preprocess), 5, None))
    table = calibrate(EFFNET, CALIB_SAMPLES, cfg.preprocess, CalibrationConfig(), cfg.quantization, progress=False)
    return cfg, model, data, table


def _channel_shift(fp32, qmodel, data, tensor):
    """Mean over channels of |E[y] - E[y_q]| for one Conv output."""
    means = []
    for m in (fp32, qmodel):
        acc = _SampleMeans()
        for batch in data:
            acc.update(_run(with_outputs(m, [tensor]), batch.feeds, [tensor])[0], 1)
        means.append(acc.values.mean(axis=0))
    return float(np.mean(np.abs(means[0] - means[1])))


@pytest.mark.slow
def test_bias_correction_removes_the_mean_shift_and_keeps_the_bias_scale(effnet_setup):
    cfg, model, data, table = effnet_setup
    plain = quantize_model(EFFNET, table, cfg.quantization).model
    options = QuantizeConfig(bias_correction="fast")
    corrected = quantize_model(EFFNET, table, options, data=lambda n: iter(data)).model
    plain_inits, corrected_inits = _weights(plain), _weights(corrected)
    plan = build_plan(model, options)
    moved = 0
    for bias, bplan in plan.biases.items():
        # the scale stays exactly s_in x s_w: only the int32 values move
        np.testing.assert_array_equal(corrected_inits[bias + SCALE_SUFFIX], plain_inits[bias + SCALE_SUFFIX])
        assert corrected_inits[bias + WEIGHT_SUFFIX].dtype == np.int32
        moved += not np.array_equal(corrected_inits[bias + WEIGHT_SUFFIX], plain_inits[bias + WEIGHT_SUFFIX])
    assert moved >= 40
    # a deep layer (the head conv), measured on the same data: the shift is much smaller
    head = next(n for n in model.graph.node if n.input[1] == "_conv_head.weight").output[0]
    before, after = _channel_shift(model, plain, data, head), _channel_shift(model, corrected, data, head)
    assert after < 0.5 * before
    # and the model's outputs move closer to fp32
    ref = [_run(model, b.feeds)[0] for b in data]
    err = [sum(float(np.mean((_run(q, b.feeds)[0] - r) ** 2)) for b, r in zip(data, ref)) for q in (plain, corrected)]
    assert err[1] < err[0]


@pytest.mark.slow
def test_adaptive_rounding_lowers_a_real_layers_output_error(effnet_setup):
    cfg, model, data, table = effnet_setup
    plan = build_plan(model, cfg.quantization)
    wanted = {"_blocks.15._project_conv.weight", "_blocks.6._depthwise_conv.weight", "_conv_stem.weight", "_fc.weight"}
    plan.weights = {k: v for k, v in plan.weights.items() if k in wanted}
    layers = adaround.collect_inputs(model, plan, data)
    assert set(layers) == wanted
    weights = _weights(model)
    for name, layer in layers.items():
        w = weights[name]
        axis = plan.weights[name].axis
        scales = qp.weight_scales(w, axis)
        nearest = qp.quantize_weight(w, scales, axis)
        adaptive = adaround.round_layer(w, scales, layer)
        assert adaptive.dtype == np.int8 and adaptive.shape == w.shape
        assert np.abs(adaptive.astype(int) - nearest.astype(int)).max() <= 1  # only the rounding direction moves
        assert adaround.output_error(w, adaptive, scales, layer) < 0.7 * adaround.output_error(w, nearest, scales,
                                                                                                 layer)
        # 7-bit weights (--reduce-range): the adaptive values stay inside [-63, 63] too
        scales7 = qp.weight_scales(w, axis, 63)
        assert np.abs(adaround.round_layer(w, scales7, layer, qmax=63).astype(int)).max() <= 63


@pytest.mark.slow
def test_adaptive_rounding_runs_its_fp32_pass_in_parts_within_its_budget(effnet_setup, monkeypatch):
    """The pass fetches every layer's input, so a calibration batch of 224 px photos runs in parts
    whose float tensors hold at most FETCHED_BYTES (the job's peak memory), which share the batch's
    patches: the stem conv still gets about PATCHES_PER_BATCH of them per batch."""
    from qtool.graph.shapes import samples_within

    cfg, model, data, _ = effnet_setup
    plan = build_plan(model, cfg.quantization)
    plan.weights = {k: v for k, v in plan.weights.items() if k == "_conv_stem.weight"}
    sizes = []
    made = adaround.create_session

    def recording(*args, **kwargs):
        session = made(*args, **kwargs)
        run = session.run
        session.run = lambda names, feeds: sizes.append(len(next(iter(feeds.values())))) or run(names, feeds)
        return session

    monkeypatch.setattr(adaround, "create_session", recording)
    layers = adaround.collect_inputs(model, plan, data)
    part = samples_within(model, 5, adaround.FETCHED_BYTES)
    assert len(data[0]) == 5 and part < 5  # EfficientNet's batches of 5 do not fit the budget
    assert max(sizes) == part and sum(sizes) == sum(len(b) for b in data)
    count = layers["_conv_stem.weight"].count
    assert 0.99 * adaround.PATCHES_PER_BATCH * len(data) <= count <= adaround.PATCHES_PER_BATCH * len(data)


def test_a_batch_is_cut_into_runs_only_along_one_row_a_sample():
    """Runs of a batch take its samples' rows; a batch whose feeds do not hold one row a sample
    (a sample file with several rows, a scalar feed) runs whole."""
    batch = Batch(["a", "b", "c"], {"x": np.arange(6.0).reshape(3, 2), "m": np.ones(3, bool)})
    runs = batch.parts(2)
    assert [r.keys for r in runs] == [["a", "b"], ["c"]]
    assert np.array_equal(np.concatenate([r.feeds["x"] for r in runs]), batch.feeds["x"])
    assert Batch(["a", "b"], {"x": np.zeros((8, 2))}).parts(1)[0].feeds["x"].shape == (8, 2)
    assert len(Batch(["a", "b"], {"x": np.zeros((2, 2)), "sr": np.array(16000)}).parts(1)) == 1


def _sequential_reference(z: np.ndarray, second: np.ndarray) -> np.ndarray:
    """Each row rounded column by column in order, each column to floor or floor + 1, the columns
    not yet rounded then moved to the least output error given those rounded (a linear solve per
    step, on the damped C): what the Cholesky form computes, written out the slow way."""
    k = z.shape[1]
    h = second + adaround.DAMPING * np.mean(np.diag(second)) * np.eye(k)
    q = np.empty_like(z)
    for r in range(z.shape[0]):
        target = z[r].copy()
        for j in range(k):
            low = np.floor(z[r, j])
            q[r, j] = np.clip(np.rint(target[j]), low, low + 1)
            done, rest = slice(0, j + 1), slice(j + 1, k)
            if j + 1 < k:  # e_rest = -H_rr^-1 H_rd e_done minimises (e_done, e_rest) H (e_done, e_rest)^T
                target[rest] = z[r, rest] - np.linalg.solve(h[rest, rest], h[rest, done] @ (q[r, done] - z[r, done]))
    return q


def test_a_layer_whose_inputs_are_not_finite_rounds_to_nearest():
    """An input of inf makes C not finite; such a layer is left out of the adaptive rounding (it
    rounds to nearest) instead of poisoning its weights with NaN. The largest finite float32 input
    squares fine in the float64 products: that layer is kept."""
    rng = np.random.default_rng(3)
    model = graphs.gemm_model(rng)
    plan = build_plan(model, QuantizeConfig())
    x = rng.normal(size=(8, 32)).astype(np.float32)
    fine = adaround.collect_inputs(model, plan, [Batch(["a"], {"x": x})])
    assert set(fine) == {"w"} and np.all(np.isfinite(fine["w"].second))
    large = x.copy()
    large[0, 0] = 3e38  # finite in float32, its square too in float64
    kept = adaround.collect_inputs(model, plan, [Batch(["a"], {"x": x}), Batch(["b"], {"x": large})])
    assert set(kept) == {"w"} and np.all(np.isfinite(kept["w"].second))
    huge = x.copy()
    huge[0, 0] = np.inf
    with warnings.catch_warnings():  # nothing warns either (the products run on worker threads)
        warnings.simplefilter("error")
        assert adaround.collect_inputs(model, plan, [Batch(["a"], {"x": x}), Batch(["b"], {"x": huge})]) == {}
    w = numpy_helper.to_array(model.graph.initializer[0])
    scales = qp.weight_scales(w, 0)
    rounding = adaround.adaptive_rounding(model, plan, None, [Batch(["b"], {"x": huge})], QuantizeConfig())
    assert rounding({"w": (w, scales)}) == {}  # the rewrite then rounds "w" to nearest


@pytest.mark.parametrize("block", [1, 3, 64])
def test_sequential_rounding_is_the_least_squares_compensation_column_by_column(monkeypatch, block):
    """_round_dense (the Cholesky form, its columns in lazy blocks) gives what rounding each column
    in turn and re-solving the later columns for the least output error gives; blocks of any size
    give the same values."""
    rng = np.random.default_rng(3)
    x = rng.normal(size=(40, 9)) @ rng.normal(size=(9, 9))  # correlated inputs
    second = x.T @ x / len(x)
    z = rng.uniform(-20, 20, size=(7, 9))
    monkeypatch.setattr(adaround, "COLUMN_BLOCK", block)
    low = np.floor(z)
    got = adaround._round_dense(z, low, adaround._compensation(second))
    np.testing.assert_array_equal(got, _sequential_reference(z, second))
    assert np.count_nonzero(got != np.rint(z)) > 0  # the compensation moved some roundings
    # a depthwise layer: each row with its own C, the same steps batched
    seconds = np.stack([second, second[::-1, ::-1]])
    per_row = np.repeat(adaround._compensation(seconds), [3, 4], axis=0)
    got = adaround._round_depthwise(z, low, per_row)
    np.testing.assert_array_equal(got[:3], _sequential_reference(z[:3], seconds[0]))
    np.testing.assert_array_equal(got[3:], _sequential_reference(z[3:], seconds[1]))


@pytest.mark.slow
def test_adaptive_rounding_splits_its_work_without_changing_a_bit(effnet_setup, monkeypatch):
    """The two ways adaptive rounding bounds its cost give what it gave without them: a depthwise
    conv's patches gathered a few channels at a time (the same second moments as from all its
    patches at once) and the layers rounded on several threads (the same int8 weights as on one)."""
    cfg, model, data, table = effnet_setup
    plan = build_plan(model, cfg.quantization)
    depthwise = "_blocks.6._depthwise_conv.weight"
    node = next(n for n in model.graph.node if n.op_type == "Conv" and n.input[1] == depthwise)
    x = _run(with_outputs(model, [node.input[0]]), data[0].feeds, [node.input[0]])[0]
    kernel = tuple(_weights(model)[depthwise].shape[2:])
    pick = adaround._pick(node, x.shape, kernel, np.random.default_rng(0))
    whole = adaround._patches(x, node, kernel, pick)
    flat = np.ascontiguousarray(whole.reshape(whole.shape[0], whole.shape[1], -1).transpose(1, 2, 0), np.float64)
    monkeypatch.setattr(adaround, "PATCH_BYTES", flat[:7].nbytes)  # 7 channels at a time
    second, count = adaround._depthwise_second(x, node, kernel, pick)
    np.testing.assert_array_equal(second, flat @ flat.transpose(0, 2, 1))
    assert count == whole.shape[0]
    names = [depthwise, "_blocks.15._project_conv.weight", "_blocks.14._expand_conv.weight", "_fc.weight"]
    plan.weights = {k: v for k, v in plan.weights.items() if k in names}
    weights = {name: (w, qp.weight_scales(w, plan.weights[name].axis)) for name, w in _weights(model).items()
               if name in names}
    rounded, finish, delays = {}, adaround.round_layer, random.Random(0)

    def late(*args, **kwargs):  # the layers finish in another order than they started
        time.sleep(delays.uniform(0, 0.05))
        return finish(*args, **kwargs)

    for cores in (1, 4):
        adaround._MEMO.clear()
        monkeypatch.setattr(adaround, "usable_cores", lambda: cores)
        monkeypatch.setattr(adaround, "round_layer", late if cores > 1 else finish)
        rounded[cores] = adaround.adaptive_rounding(model, plan, None, data, cfg.quantization)(weights)
    assert rounded[1].keys() == set(names)
    for name in names:
        np.testing.assert_array_equal(rounded[4][name], rounded[1][name])
    adaround._MEMO.clear()


@pytest.mark.slow
def test_input_moments_on_threads_are_the_bytes_of_one_thread(effnet_setup, monkeypatch):
    """collect_inputs draws every layer's patch positions in the layers' order before the layers'
    sums run on worker threads, and adds the sums in that order: the second moments are the bytes
    one thread computes, in whatever order the threads finish (here each layer's sums start after
    a random delay)."""
    cfg, model, data, table = effnet_setup
    plan = build_plan(model, cfg.quantization)
    moments, delays = adaround._moments, random.Random(0)

    def late(*args):
        time.sleep(delays.uniform(0, 0.004))
        return moments(*args)

    runs = {}
    for cores in (4, 1):
        monkeypatch.setattr(adaround, "usable_cores", lambda: cores)
        monkeypatch.setattr(adaround, "_moments", late if cores > 1 else moments)
        runs[cores] = adaround.collect_inputs(model, plan, data)
    threaded, single = runs[4], runs[1]
    assert threaded.keys() == single.keys() and len(single) == 50
    assert {layer.kind for layer in single.values()} == {"dense", "depthwise"}
    for name, layer in single.items():
        assert threaded[name].count == layer.count
        np.testing.assert_array_equal(threaded[name].second, layer.second)


@pytest.mark.parametrize("pads,strides,dilations", [([2, 1, 0, 1], [1, 1], [1, 1]), ([1, 0, 2, 2], [2, 2], [1, 1]),
                                                     ([2, 2, 2, 2], [1, 2], [2, 1])])
def test_conv_patches_and_depthwise_moments_are_the_windows_the_conv_reads(pads, strides, dilations):
    """Each patch is the kh x kw window (pads, strides, dilations as the Conv's) the conv reads
    at one output position, and a depthwise conv's second moments are those windows' products."""
    rng = np.random.default_rng(0)
    x = rng.normal(0, 1, (2, 5, 9, 11)).astype(np.float32)
    node = helper.make_node("Conv", ["x", "w"], ["y"], group=5, pads=pads, strides=strides, dilations=dilations)
    kernel = (3, 2)
    xp = np.pad(x, ((0, 0), (0, 0), (pads[0], pads[2]), (pads[1], pads[3])))
    oh = (xp.shape[2] - dilations[0] * (kernel[0] - 1) - 1) // strides[0] + 1
    ow = (xp.shape[3] - dilations[1] * (kernel[1] - 1) - 1) // strides[1] + 1
    windows = {xp[b, :, y * strides[0]:y * strides[0] + dilations[0] * (kernel[0] - 1) + 1:dilations[0],
                  z * strides[1]:z * strides[1] + dilations[1] * (kernel[1] - 1) + 1:dilations[1]].tobytes()
               for b in range(2) for y in range(oh) for z in range(ow)}
    pick = adaround._pick(node, x.shape, kernel, np.random.default_rng(1))
    patches = adaround._patches(x, node, kernel, pick)
    assert patches.shape[1:] == (5, 3, 2) and all(p.tobytes() in windows for p in patches)
    second, count = adaround._depthwise_second(x, node, kernel, pick)
    flat = patches.reshape(count, 5, -1).transpose(1, 0, 2).astype(np.float64)
    np.testing.assert_allclose(second, flat.transpose(0, 2, 1) @ flat, rtol=1e-5, atol=1e-5)


def _crushed_model(rng) -> onnx.ModelProto:
    """x -> conv_a -> relu -> conv_b -> gap -> flatten -> y [N, 6]; conv_b's per-tensor weights are crushed."""
    return graphs.crushed_conv_pair(rng, [helper.make_node("GlobalAveragePool", ["b"], ["g"], name="gap"),
                                          helper.make_node("Flatten", ["g"], ["y"], name="flatten")])


@pytest.fixture(scope="module")
def crushed(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("mixed")
    rng = np.random.default_rng(0)
    options = QuantizeConfig(per_channel=False)
    path, table = graphs.calibrated(tmp, rng, _crushed_model(rng), options)
    x = np.random.default_rng(1).normal(0, 1, (32, 3, 8, 8)).astype(np.float32)
    evals = [Batch([f"s{i}" for i in range(j, j + 8)], {"x": x[j:j + 8]}) for j in range(0, 32, 8)]
    return path, table, options, evals


def test_mixed_precision_keeps_the_crushed_layer_float(crushed):
    path, table, options, evals = crushed
    all_int8 = search(path, table, options, Target(sqnr=-100.0), evals, None, 3)
    assert all_int8.chosen.float_layers == [] and all_int8.chosen.int8_mac_fraction == 1.0
    base = all_int8.chosen.figures["sqnr_db"]
    found = search(path, table, options, Target(sqnr=base + 5.0), evals, None, 3)
    assert found.chosen.float_layers == ["conv_b"]
    assert found.chosen.figures["sqnr_db"] >= base + 5.0  # verified on the evaluation data
    assert 0.0 < found.chosen.int8_mac_fraction < 1.0
    assert [t["float_layers"] for t in found.tried] == [0, 1]


def test_mixed_precision_fails_clearly_beyond_the_budget(crushed):
    path, table, options, evals = crushed
    with pytest.raises(ThresholdError, match="not met with up to 0 layer"):
        search(path, table, options, Target(sqnr=200.0), evals, None, 0)
    with pytest.raises(ThresholdError, match="not met with up to 1 layer"):
        search(path, table, options, Target(sqnr=200.0), evals, None, 1)
    # both layers float: no Q/DQ left at all, the fp32 model itself
    assert len(search(path, table, options, Target(sqnr=200.0), evals, None, 2).chosen.float_layers) == 2


def test_search_cli_target_exit_codes(crushed, tmp_path, qtool_cli):
    path, table, options, evals = crushed
    data = graphs.write_samples(tmp_path / "eval", np.random.default_rng(2), (3, 8, 8), count=8)
    table_path = tmp_path / "t.json"
    table.save(table_path)
    cfg = tmp_path / "c.yaml"
    cfg.write_text("quantization:\n  per_channel: false\n  advanced:\n    speed_rule: 'off'\n")  # toy layers
    ok = qtool_cli("search", path, "--table", table_path, "--config", cfg, "--eval-data", data,
                   "--target-agreement", "100", "-o", tmp_path / "q.onnx")
    assert ok.returncode == 0, ok.stderr
    assert "target met with" in ok.stdout and "% of MACs in int8" in ok.stdout and (tmp_path / "q.onnx").exists()
    bad = qtool_cli("search", path, "--table", table_path, "--config", cfg, "--eval-data", data,
                    "--target-sqnr", "300", "--max-float-layers", "1", "-o", tmp_path / "r.onnx")
    assert bad.returncode == 1 and "not met with up to 1 layer" in bad.stderr
    assert not (tmp_path / "r.onnx").exists()
    missing = qtool_cli("search", path, "--table", table_path, "--target-sqnr", "3", "-o", tmp_path / "s.onnx")
    assert missing.returncode == 2 and "--eval-data" in missing.stderr
    no_target = qtool_cli("search", path, "--table", table_path, "--eval-data", data, "-o", tmp_path / "s.onnx")
    assert no_target.returncode == 2 and "give a target" in no_target.stderr
    moved = qtool_cli("quantize", path, "--table", table_path, "--eval-data", data, "--target-sqnr", "3",
                      "-o", tmp_path / "s.onnx")
    assert moved.returncode == 2 and "No such option" in moved.stderr


def test_bias_correction_without_data_is_a_user_error(crushed, tmp_path, qtool_cli):
    path, table, options, evals = crushed
    table_path = tmp_path / "t.json"
    table.save(table_path)
    result = qtool_cli("quantize", path, "--table", table_path, "--bias-correction", "fast", "-o", tmp_path / "q.onnx")
    assert result.returncode == 2 and "need calibration data" in result.stderr


def test_equalize_flag_calibrates_the_equalized_graph(tmp_path, qtool_cli):
    rng = np.random.default_rng(3)
    path = tmp_path / "m.onnx"
    onnx.save(_chain_model(rng), path)
    data = graphs.write_samples(tmp_path / "data", rng, (3, 10, 10), count=8, scale=3.0)
    out = tmp_path / "q.onnx"
    result = qtool_cli("quantize", path, "--data", data, "--equalize", "--bias-correction", "fast", "-o", out)
    assert result.returncode == 0, result.stderr
    q = _weights(onnx.load(out))
    w1 = numpy_helper.to_array(onnx.load(path).graph.initializer[0])
    # the int8 weights are those of the equalized conv1: its outlier channel no longer saturates the others
    scales = q["w1" + SCALE_SUFFIX]
    assert scales.max() / np.median(scales) < 0.5 * np.abs(w1.reshape(8, -1)).max(1).max() / np.median(
        np.abs(w1.reshape(8, -1)).max(1))


def test_bias_correction_gives_a_conv_without_bias_one(tmp_path):
    """An unfolded-BN style Conv without bias gets an int32 bias (scale s_in x s_w) that removes its mean shift."""
    rng = np.random.default_rng(5)
    w = rng.normal(0, 0.3, (8, 4, 3, 3)).astype(np.float32)
    w[0, 0, 0, 0] = 30.0  # per-tensor weights: everything else is rounded coarsely
    nodes = [helper.make_node("Conv", ["x", "w"], ["y"], name="conv", pads=[1, 1, 1, 1])]
    path = tmp_path / "m.onnx"
    onnx.save(graphs.model(nodes, [graphs.tensor("x", ["N", 4, 8, 8])], [graphs.tensor("y", None)],
                           [graphs.init("w", w)]), path)
    data = graphs.write_samples(tmp_path / "d", rng, (4, 8, 8), count=16)
    x = np.concatenate([np.load(p) for p in sorted(data.iterdir())]) + 2.0  # inputs with a non-zero mean
    for i, p in enumerate(sorted(data.iterdir())):
        np.save(p, x[i:i + 1])
    options = QuantizeConfig(per_channel=False, bias_correction="fast")
    table = calibrate(path, data, PreprocessConfig(), CalibrationConfig(), options, progress=False)
    feeds = [Batch(["a"], {"x": x})]
    plain = quantize_model(path, table, replace_bc(options, "off")).model
    fixed = quantize_model(path, table, options, data=lambda n: iter(feeds)).model
    conv = next(n for n in fixed.graph.node if n.op_type == "Conv")
    assert len(conv.input) == 3 and conv.input[2]
    inits = _weights(fixed)
    bias_name = conv.input[2].replace("_DequantizeLinear_Output", "")
    assert inits[bias_name + WEIGHT_SUFFIX].dtype == np.int32
    s_in = next(v for k, v in inits.items() if k.startswith("x") and k.endswith(SCALE_SUFFIX))
    np.testing.assert_array_equal(inits[bias_name + SCALE_SUFFIX], np.float32(s_in) * inits["w" + SCALE_SUFFIX])
    ref = _run(onnx.load(path), {"x": x})[0].mean(axis=(0, 2, 3))
    shift = [np.abs(_run(q, {"x": x})[0].mean(axis=(0, 2, 3)) - ref).mean() for q in (plain, fixed)]
    assert shift[1] < 0.2 * shift[0]


def replace_bc(options, value):
    from dataclasses import replace
    return replace(options, bias_correction=value)


def test_a_float_layer_after_an_int8_one_stays_float_in_onnxruntime(crushed):
    """onnxruntime's WeightBiasQuantization quantizes the float weights of a Conv fed by a
    DequantizeLinear to per-tensor int8; the rewrite's guard keeps an excluded layer really float."""
    path, table, options, evals = crushed
    qmodel = quantize_model(path, table, QuantizeConfig(per_channel=True, exclude_nodes=("conv_b",))).model
    assert any(n.op_type == "Max" and n.output[0] == "conv_b_float_guard" for n in qmodel.graph.node)
    feeds = evals[0].feeds
    ref = _run(onnx.load(path), feeds)[0]
    plain = ort.SessionOptions()
    plain.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    unoptimized = ort.InferenceSession(qmodel.SerializeToString(), plain, providers=["CPUExecutionProvider"])
    got, expected = _run(qmodel, feeds)[0], unoptimized.run(None, feeds)[0]
    # conv_b's single outlier weight would crush the others to zero in per-tensor int8
    np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-4 * np.abs(ref).max())


def test_restore_float_puts_one_layer_back_in_float_and_leaves_the_rest_int8(crushed):
    """The mixed-precision search edits the finished int8 model: the restored layer computes with
    its fp32 weights on the same dequantized input (guarded against onnxruntime re-quantizing it),
    every other layer is untouched, and no dangling DequantizeLinear or int8 weight is left."""
    from qtool.plan.planner import prepared_model
    from qtool.quantization.float_fallback import restorable_layers, restore_float
    from qtool.graph.kernels import count_kernels

    path, table, options, evals = crushed
    qmodel = quantize_model(path, table, options).model
    prepared, _ = prepared_model(path, options)
    pool = restorable_layers(qmodel, prepared)
    assert sorted(pool) == ["conv_a", "conv_b"]
    restored = restore_float(qmodel, prepared, [pool["conv_b"]])
    onnx.checker.check_model(restored, full_check=True)
    conv_b = next(n for n in restored.graph.node if n.name == "conv_b")
    assert conv_b.input[0] == "conv_b_float_guard"
    inits = _weights(restored)
    np.testing.assert_array_equal(inits[conv_b.input[1]], _weights(onnx.load(path))["wb"])
    assert "wb" + WEIGHT_SUFFIX not in inits  # the int8 copy and its DequantizeLinear are gone
    produced = {o for n in restored.graph.node for o in n.output}
    read = {i for n in restored.graph.node for i in n.input} | {o.name for o in restored.graph.output}
    assert not [n.name for n in restored.graph.node if n.op_type == "DequantizeLinear" and n.output[0] not in read]
    assert all(i in produced or i in inits or i == "x" or i == "" for n in restored.graph.node for i in n.input)
    # conv_a is unchanged: the tensor conv_b reads is the int8 model's own, bit for bit
    feeds = evals[0].feeds
    names = ["r_DequantizeLinear_Output"]
    np.testing.assert_array_equal(_run(with_outputs(qmodel, names), feeds, names)[0],
                                  _run(with_outputs(restored, names), feeds, names)[0])
    # ... and conv_b really runs in float in onnxruntime (the optimized session computes what the
    # unoptimized one does, no per-tensor int8 weights behind our back), closer to fp32 than in int8
    ref = _run(onnx.load(path), feeds)[0]
    err = [np.abs(_run(m, feeds)[0] - ref).max() for m in (qmodel, restored)]
    assert err[1] < 0.8 * err[0]
    plain = ort.SessionOptions()
    plain.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    unoptimized = ort.InferenceSession(restored.SerializeToString(), plain, providers=["CPUExecutionProvider"])
    np.testing.assert_allclose(_run(restored, feeds)[0], unoptimized.run(None, feeds)[0], rtol=1e-4,
                               atol=1e-4 * np.abs(ref).max())
    q_path, r_path = path.parent / "int8.onnx", path.parent / "restored.onnx"
    onnx.save(qmodel, q_path)
    onnx.save(restored, r_path)
    assert count_kernels(q_path).float_convs == 0 and count_kernels(r_path).float_convs == 1


def test_margins_of_the_fp32_class():
    from qtool.evaluation.mixed_precision import _margins

    logits = np.array([[3.0, 1.0, 0.0], [1.0, 1.2, 0.0], [0.0, 0.0, 5.0], [2.0, 1.99, 0.0]])
    np.testing.assert_allclose(_margins(logits, logits.argmax(axis=1)), [2.0, 0.2, 5.0, 0.01])
    # measured against another class: negative when that row's top-1 changed
    np.testing.assert_allclose(_margins(logits, np.array([1, 1, 2, 1])), [-2.0, 0.2, 5.0, -0.01])


def test_mixed_precision_reaches_an_agreement_target_on_the_kit(tmp_path):
    """EfficientNet-Lite0 (ranges only, to stay fast) on 160 kit dev photos: ask for one more
    agreeing image than the all-int8 model gives; the greedy search keeps a few layers in float,
    verifies the target on all 160, and a MAC budget it cannot meet fails with exit-code semantics."""
    from dataclasses import replace

    dev = kit_path("data", "imagenet_dev", "images")
    cfg = load_config(EFFNET_CONFIG)
    options = replace(cfg.quantization, bias_correction="off", weight_rounding="nearest")
    table = calibrate(EFFNET, CALIB_SAMPLES, cfg.preprocess, CalibrationConfig(), options, progress=False)
    evals = list(batches(open_data(dev, input_specs(load_model(EFFNET)), cfg.preprocess), 8, 160))
    base = search(EFFNET, table, options, Target(agreement=0.0), evals, None, 0).chosen
    agreeing = round(base.figures["agreement"] * 160)
    assert agreeing < 160, "the all-int8 model already agrees everywhere: no test"
    goal = Target(agreement=100.0 * (agreeing + 1) / 160 - 1e-6)
    # the ranking scored on the 16 samples most at stake (64 by default: the same path here, 2x the time)
    found = search(EFFNET, table, options, goal, evals, None, 4, min_int8_macs=0.9, focus_samples=16)
    chosen = found.chosen
    assert 1 <= len(chosen.float_layers) <= 4 and goal.met(chosen.figures)
    assert chosen.int8_mac_fraction >= 0.9
    # the all-int8 model first, then prefixes of the ranking; the one kept is the fewest that met
    # (which prefixes, and in what order, follows this CPU's float kernels: near-ties flip)
    assert [t["float_layers"] for t in found.tried][:2] == [0, 1]
    assert len(chosen.float_layers) == min(t["float_layers"] for t in found.tried if t["met"])
    # the first step ranked every move once: the 50 layers (the SpaceToDepth stem comes back whole)
    # to float, and the classifier Gemm to dynamic int8
    assert len(set(found.ranking)) == len(found.ranking) == 51 and "node_linear (dynamic)" in found.ranking
    # the written model is the verified one: its layers are float in onnxruntime's optimized graph
    from qtool.graph.kernels import count_kernels
    out = tmp_path / "mixed.onnx"
    onnx.save(chosen.result.model, out)
    counts = count_kernels(out)
    assert counts.float_convs == sum(1 for n in chosen.float_layers if n != "node_linear")
    # the smallest layer (the classifier, 0.3% of the MACs) cannot go float within a 99.9% MAC budget
    with pytest.raises(ThresholdError, match="min-int8-macs 99.9"):
        search(EFFNET, table, options, goal, evals, None, 4, min_int8_macs=0.999)
