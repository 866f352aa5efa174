"""Activation equalization of Conv -> activation -> depthwise Conv chains: exact in fp32, every
channel of the activations spans the same range, and the int8 model gets closer to fp32."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import helper, numpy_helper

from qtool import api
from qtool.calibration.grid import CHANNEL_BITS
from qtool.calibration.smoothing import measured_smoothing
from qtool.config import AdvancedConfig, CalibrationConfig, PreprocessConfig, QuantizeConfig
from qtool.graph.edit import with_outputs
from qtool.graph.runtime import create_session
from qtool.plan.planner import prepared_model
from qtool.prepare.equalize import activation_sites
from qtool.table.table import smoothed_options
from tests import graphs
from tests.graphs import RULE_OFF, init, model, tensor, write_samples

C = 8
GAINS = np.array([1.0, 0.01, 0.05, 1.0, 0.02, 0.5, 0.03, 0.2], np.float32)  # channel c of conv_a's output
# hard-swish four ways; then with a scalar affine after it (PP-LCNetV3), which gets factors of its
# own; then the homogeneous activations, which need no rewrite
FORMS = ["written_out", "gate_scaled", "hardswish_op", "hardsigmoid_mul", "written_out_affine", "gate_scaled_affine",
         "hardswish_op_affine", "relu", "linear"]


def _dw_input(form: str) -> str:
    return "a" if form == "linear" else "h"


def _measured(form: str) -> list[str]:
    """The tensors whose channel maxima the equalization measures."""
    return ["a", "h"] if form.endswith("_affine") else ["a"]


SWISH_FORMS = [form for form in FORMS if form not in ("relu", "linear")]


def _chain(rng, form: str) -> onnx.ModelProto:
    """x -> conv_a (a: channels whose ranges lie 100x apart) -> hard-swish in `form` (h) ->
    depthwise conv (it multiplies the small channels back up) -> conv_b -> GAP -> Flatten -> y."""
    swish = "hs" if form.endswith("_affine") else "h"
    if form.startswith("written_out"):
        act = [helper.make_node("Add", ["a", "three"], ["a3"], name="add3"),
               helper.make_node("Clip", ["a3", "zero", "six"], ["c"], name="clip"),
               helper.make_node("Mul", ["a", "c"], ["m"], name="mul"),
               helper.make_node("Div", ["m", "six"], [swish], name="div")]
    elif form.startswith("gate_scaled"):  # x * (Clip(x + 3, 0, 6) / 6), as timm's hard_sigmoid exports
        act = [helper.make_node("Add", ["a", "three"], ["a3"], name="add3"),
               helper.make_node("Clip", ["a3", "zero", "six"], ["c"], name="clip"),
               helper.make_node("Div", ["c", "six"], ["cs"], name="div"),
               helper.make_node("Mul", ["a", "cs"], [swish], name="mul")]
    elif form.startswith("hardswish_op"):
        act = [helper.make_node("HardSwish", ["a"], [swish])]
    elif form == "hardsigmoid_mul":
        act = [helper.make_node("HardSigmoid", ["a"], ["c"], alpha=1.0 / 6.0, beta=0.5),
               helper.make_node("Mul", ["a", "c"], ["h"])]
    elif form == "relu":
        act = [helper.make_node("Relu", ["a"], ["h"])]
    else:
        act = []
    if form.endswith("_affine"):  # y = scale * hardswish(x) + offset (PP-LCNetV3's learnable affine)
        act += [helper.make_node("Mul", [swish, "scale"], ["ha"], name="affine_mul"),
                helper.make_node("Add", ["ha", "offset"], ["h"], name="affine_add")]
    wa = rng.normal(0, 0.5, (C, 3, 3, 3)).astype(np.float32) * GAINS.reshape(-1, 1, 1, 1)
    ba = rng.normal(0, 0.5, C).astype(np.float32) * GAINS
    wd = rng.normal(0, 0.5, (C, 1, 3, 3)).astype(np.float32) / GAINS.reshape(-1, 1, 1, 1)
    nodes = [helper.make_node("Conv", ["x", "wa", "ba"], ["a"], name="conv_a", pads=[1, 1, 1, 1]), *act,
             helper.make_node("Conv", [_dw_input(form), "wd"], ["d"], name="dw", group=C, pads=[1, 1, 1, 1]),
             helper.make_node("Conv", ["d", "wb"], ["b"], name="conv_b"),
             helper.make_node("GlobalAveragePool", ["b"], ["g"]),
             helper.make_node("Flatten", ["g"], ["y"])]
    inits = [init("wa", wa), init("ba", ba), init("wd", wd),
             init("wb", rng.normal(0, 0.3, (4, C, 1, 1)).astype(np.float32)),
             init("three", np.array(3.0, np.float32)), init("zero", np.array(0.0, np.float32)),
             init("six", np.array(6.0, np.float32)), init("scale", np.array(0.7, np.float32)),
             init("offset", np.array(0.05, np.float32))]
    return model(nodes, [tensor("x", ["N", 3, 8, 8])], [tensor("y", ["N", 4])], inits)


def _saved(tmp_path, form):
    rng = np.random.default_rng(4)
    path = tmp_path / "m.onnx"
    onnx.save(_chain(rng, form), path)
    return path, write_samples(tmp_path / "data", rng, [3, 8, 8], count=8, scale=2.0)


def _equalized(path, data, options=QuantizeConfig()):
    model, plan = prepared_model(path, options)
    measured = measured_smoothing(path, model, plan, data, PreprocessConfig(), CalibrationConfig(), options)
    return measured, prepared_model(path, measured)[0]


@pytest.mark.parametrize("form", FORMS)
def test_the_rewrite_is_exact_in_fp32_and_evens_the_channel_ranges(tmp_path, form):
    path, data = _saved(tmp_path, form)
    assert [site.tensor for site in activation_sites(onnx.load(path))] == ["a"]
    options, equalized = _equalized(path, data)
    assert [name for name, _ in options.smooth_scales] == _measured(form)
    x = np.stack([np.load(f)[0] for f in sorted(data.iterdir())])
    ref = create_session(str(path)).run(None, {"x": x})[0]
    got = create_session(equalized).run(None, {"x": x})[0]
    np.testing.assert_allclose(got, ref, rtol=1e-4, atol=1e-5)
    # conv_a's output and the depthwise conv's input: every channel now spans the same range
    names = sorted({"a", _dw_input(form)})
    ranges = dict(zip(names, (np.abs(v).max(axis=(0, 2, 3)) for v in
                              create_session(with_outputs(equalized, names)).run(names, {"x": x}))))
    before = np.abs(create_session(with_outputs(onnx.load(path), ["a"])).run(["a"], {"x": x})[0]).max(axis=(0, 2, 3))
    assert before.max() / before.min() > 20
    # the measured tensors span one range in every channel, up to the grid the maxima are measured on
    # (a Relu's factors are measured on its output); a hard-swish's negative lobe keeps the small
    # channels apart a little after it
    even = ["a", "h"] if form.endswith("_affine") else [_dw_input(form)] if form in ("relu", "linear") else ["a"]
    for name in even:
        np.testing.assert_allclose(ranges[name], ranges[name].max(), rtol=2.0 ** -CHANNEL_BITS)
    assert ranges[_dw_input(form)].max() / ranges[_dw_input(form)].min() < 4


@pytest.mark.parametrize("form", FORMS)
def test_the_int8_model_gets_closer_to_fp32(tmp_path, form):
    path, data = _saved(tmp_path, form)
    # the equalization's effect on int8 layers: the speed rule off (it would keep this small graph float)
    config = {"calibration": {"method": "minmax"}, "quantization": {"advanced": dict(graphs.RULE_OFF)}}
    off = api.quantize(path, data=data, config={**config, "quantization": {"advanced": {
                                                 "equalize_activations": False, **graphs.RULE_OFF}}})
    on = api.quantize(path, data=data, config=config)
    assert any("equalized across channels in 1" in note for note in on.notes)
    assert not any("equalized" in note for note in off.notes)
    x = np.stack([np.load(f)[0] for f in sorted(data.iterdir())])
    ref = create_session(str(path)).run(None, {"x": x})[0]

    def error(result) -> float:
        got = create_session(result.model).run(None, {"x": x})[0]
        return float(np.sqrt(((got - ref) ** 2).mean() / (ref ** 2).mean()))

    # measured (on / off): hard-swish 0.0046 / 0.030, with the affine 0.0067 / 0.090, linear
    # 0.017 / 0.14; Relu 0.0070 / 0.012, whose zeroed negative half leaves less to gain
    assert error(on) < (0.7 if form == "relu" else 0.5) * error(off)
    # the table carries the scales: quantizing from it rewrites the same graph
    table = api.calibrate(path, data, config)
    assert list(table.smoothing) == _measured(form)
    again = api.quantize(path, table=table, config=config)
    assert again.model.SerializeToString() == on.model.SerializeToString()


def test_a_depthwise_input_read_elsewhere_is_not_equalized(tmp_path):
    built = _chain(np.random.default_rng(5), "written_out")
    built.graph.node.append(helper.make_node("ReduceMean", ["h"], ["r"], keepdims=0))
    built.graph.output.append(tensor("r", None))
    assert activation_sites(built) == []


@pytest.mark.parametrize("form", SWISH_FORMS)
def test_a_chain_kept_wholly_float_is_left_unequalized(tmp_path, form):
    """The latency-aware choice may keep a chain float; there the rewrite only costs time, so the
    graph goes back to the chain as exported (same tensors, same ranges around it)."""
    from qtool.plan.planner import build_plan
    from qtool.prepare.equalize import equalized_chains
    from qtool.quantization.quantize import _unequalize_float_chains

    path, data = _saved(tmp_path, form)
    options, equalized = _equalized(path, data)
    scales = dict(options.smooth_scales)
    assert list(equalized_chains(equalized, scales)) == ["a"]
    chain = equalized_chains(equalized, ["a"])["a"]
    assert {"conv_a", "dw"} <= chain and "conv_b" not in chain
    # part of the chain int8: nothing changes
    plan = build_plan(equalized, options, keep_float=["conv_a"])
    same, _ = _unequalize_float_chains(path, equalized, plan, options, ["conv_a"])
    assert same is equalized
    # the whole chain float: the exported graph comes back, conv_b still int8
    plan = build_plan(equalized, options, keep_float=sorted(chain))
    model, replanned = _unequalize_float_chains(path, equalized, plan, options, sorted(chain))
    assert equalized_chains(model, scales) == {} and "conv_b" in replanned.quantized_nodes
    assert not {"conv_a", "dw"} & set(replanned.quantized_nodes)
    assert any("equalization of 1 chain(s) left out" in note for note in replanned.notes)
    plain, _ = prepared_model(path, QuantizeConfig(advanced=AdvancedConfig(equalize_activations=False)))
    assert [(n.op_type, list(n.input)) for n in model.graph.node] == \
        [(n.op_type, list(n.input)) for n in plain.graph.node]


def test_a_one_dimensional_chain_is_rewritten_exactly(tmp_path):
    """Conv1d chains (audio front ends) get a 1-D gate."""
    rng = np.random.default_rng(6)
    nodes = [helper.make_node("Conv", ["x", "wa", "ba"], ["a"], name="conv_a", pads=[1, 1]),
             helper.make_node("HardSwish", ["a"], ["h"]),
             helper.make_node("Conv", ["h", "wd"], ["d"], name="dw", group=C, pads=[1, 1]),
             helper.make_node("Conv", ["d", "wb"], ["b"], name="conv_b"),
             helper.make_node("GlobalAveragePool", ["b"], ["g"]),
             helper.make_node("Flatten", ["g"], ["y"])]
    inits = [init("wa", rng.normal(0, 0.5, (C, 3, 3)).astype(np.float32) * GAINS.reshape(-1, 1, 1)),
             init("ba", rng.normal(0, 0.5, C).astype(np.float32) * GAINS),
             init("wd", rng.normal(0, 0.5, (C, 1, 3)).astype(np.float32) / GAINS.reshape(-1, 1, 1)),
             init("wb", rng.normal(0, 0.3, (4, C, 1)).astype(np.float32))]
    path = tmp_path / "m.onnx"
    onnx.save(model(nodes, [tensor("x", ["N", 3, 16])], [tensor("y", ["N", 4])], inits), path)
    data = write_samples(tmp_path / "data", rng, [3, 16], count=8, scale=2.0)
    options, equalized = _equalized(path, data)
    assert [name for name, _ in options.smooth_scales] == ["a"]
    onnx.checker.check_model(equalized)
    x = np.stack([np.load(f)[0] for f in sorted(data.iterdir())])
    np.testing.assert_allclose(create_session(equalized).run(None, {"x": x})[0],
                               create_session(str(path)).run(None, {"x": x})[0], rtol=1e-4, atol=1e-5)
    result = api.quantize(path, data=data, config={"quantization": {}})
    assert any("equalized across channels in 1" in note for note in result.notes)
    create_session(result.model).run(None, {"x": x})


def test_an_excluded_chain_is_quantized_as_exported(tmp_path):
    path, data = _saved(tmp_path, "written_out")
    # the chain's nodes by name (the gate keeps the name of the "+ 3" Add it replaces)
    config = {"quantization": {"exclude_nodes": ["conv_a", "add3", "clip", "mul", "div", "dw"]}}
    result = api.quantize(path, data=data, config=config)
    assert any("equalization of 1 chain(s) left out" in note for note in result.notes)
    assert not any("_equalized_gate" in t.name for t in result.model.graph.initializer)
    assert sum(n.op_type == "Conv" for n in result.model.graph.node) == 3  # conv_a, dw, conv_b: no gate


@pytest.mark.parametrize("form", ["written_out", "written_out_affine", "gate_scaled", "linear"])
def test_per_layer_error_leaves_out_the_rescaled_tensors(tmp_path, form):
    """An equalized tensor keeps its name but holds x / s: paired with the fp32 x it would read as
    a huge error (cosine far below the int8 model's). The int8 model names them in its metadata;
    the per-layer error leaves them out and finds every other tensor close to fp32."""
    from qtool.data.dataset import batches, open_data
    from qtool.evaluation.layer_error import layer_errors
    from qtool.graph.edit import rescaled_tensors
    from qtool.graph.modelio import input_specs

    path, data = _saved(tmp_path, form)
    result = api.quantize(path, data=data, config={"calibration": {"method": "minmax"},
                                                   "quantization": {"advanced": dict(graphs.RULE_OFF)}})
    rescaled = rescaled_tensors(result.model)
    assert {"a", _dw_input(form)} <= rescaled and "d" not in rescaled
    assert not {"a3", "c", "cs"} & rescaled  # the gate's tensors keep their values
    fp32 = onnx.load(path)
    errors = layer_errors(fp32, result.model, batches(open_data(data, input_specs(fp32), PreprocessConfig()), 4))
    reported = {e.tensor for e in errors}
    assert not reported & rescaled and {"x", "d"} <= reported
    assert all(e.cosine > 0.99 for e in errors), [(e.tensor, e.cosine) for e in errors]


MULTIPLIER = 2  # depthwise channel multiplier: output channel o reads input channel o // MULTIPLIER


def _multiplier_chain(rng) -> onnx.ModelProto:
    """x -> conv_a (a: channels whose ranges lie 100x apart) -> Relu -> depthwise conv with channel
    multiplier 2 (group = C, 2C output channels, the two of input channel c next to each other) -> y."""
    wa = rng.normal(0, 0.5, (C, 3, 3, 3)).astype(np.float32) * GAINS.reshape(-1, 1, 1, 1)
    ba = rng.normal(0, 0.5, C).astype(np.float32) * GAINS
    # every output channel its own range, so a factor applied to the wrong one shows
    wd = rng.normal(0, 0.5, (MULTIPLIER * C, 1, 3, 3)).astype(np.float32) \
        * np.linspace(0.5, 3.0, MULTIPLIER * C, dtype=np.float32).reshape(-1, 1, 1, 1)
    bd = rng.normal(0, 0.1, MULTIPLIER * C).astype(np.float32)
    nodes = [helper.make_node("Conv", ["x", "wa", "ba"], ["a"], name="conv_a", pads=[1, 1, 1, 1]),
             helper.make_node("Relu", ["a"], ["h"], name="relu"),
             helper.make_node("Conv", ["h", "wd", "bd"], ["y"], name="dw", group=C, pads=[1, 1, 1, 1])]
    return model(nodes, [tensor("x", ["N", 3, 8, 8])], [tensor("y", ["N", MULTIPLIER * C, 8, 8])],
                 [init("wa", wa), init("ba", ba), init("wd", wd), init("bd", bd)])


@pytest.mark.parametrize("how", ["cross_layer", "activations"])
def test_a_depthwise_channel_multiplier_keeps_the_fp32_outputs(tmp_path, how):
    """Conv -> Relu -> depthwise Conv with channel multiplier 2: input channel c's factor goes to
    the depthwise Conv's output channels 2c and 2c + 1 (np.repeat, not np.tile), so the graph that
    calibration and quantization see computes what the exported one does. Both ways a user
    equalizes: cross-layer equalization (`equalize: true`) and activation equalization (the default)."""
    from qtool.config import load_config
    from qtool.table.table import smoothed_options

    rng = np.random.default_rng(7)
    path = tmp_path / "m.onnx"
    onnx.save(_multiplier_chain(rng), path)
    data = write_samples(tmp_path / "data", rng, [3, 8, 8], count=8, scale=2.0)
    quantization = {"equalize": how == "cross_layer",
                    "advanced": {"equalize_activations": how == "activations"}}
    config = {"calibration": {"method": "minmax"}, "quantization": quantization}
    table = api.calibrate(path, data, config, progress=False)
    # the fp32 graph quantize works on: prepared with the options and the table's equalization scales
    options = smoothed_options(load_config(config).quantization, table)
    assert (list(table.smoothing) == ["a"]) == (how == "activations")
    prepared, _ = prepared_model(path, options)
    weights = {t.name: numpy_helper.to_array(t) for t in prepared.graph.initializer}
    original = {t.name: numpy_helper.to_array(t) for t in onnx.load(path).graph.initializer}
    # equalization did rescale the pair, by factors that differ from channel to channel
    ratio = (weights["wa"].reshape(C, -1) / original["wa"].reshape(C, -1))[:, 0]
    assert ratio.max() / ratio.min() > 2
    x = np.stack([np.load(f)[0] for f in sorted(data.iterdir())])
    ref = create_session(str(path)).run(None, {"x": x})[0]
    got = create_session(prepared).run(None, {"x": x})[0]
    np.testing.assert_allclose(got, ref, rtol=1e-4, atol=1e-5 * np.abs(ref).max())


def test_a_chain_settled_float_by_its_equalized_labels_quantizes_as_exported(tmp_path):
    """The latency tuning and a settled config name the nodes of the equalized graph; undoing the
    chain's equalization brings back nodes they cannot name (the written-out hard-swish's Div):
    those go float with the chain (calibration, which saw the equalized graph, has no range for them)."""
    from qtool.graph.index import node_label

    path, data = _saved(tmp_path, "written_out_affine")
    table = api.calibrate(path, data, progress=False)
    equalized, plan = prepared_model(path, smoothed_options(QuantizeConfig(), table))
    chain = [node_label(n) for n in equalized.graph.node if node_label(n) != "conv_b"]
    original = {node_label(n) for n in onnx.load(path).graph.node}
    assert original - {node_label(n) for n in equalized.graph.node}  # nodes only the exported graph has
    result = api.quantize(path, table=table, config={"quantization": {"advanced": {"float_nodes": chain}}})
    assert any("equalization of 1 chain(s) left out" in note for note in result.notes)
    assert sum(n.op_type == "Conv" for n in result.model.graph.node) == 3  # conv_a, dw, conv_b: no gate
    x = np.stack([np.load(f)[0] for f in sorted(data.iterdir())])
    create_session(result.model).run(None, {"x": x})


def _readers(model: onnx.ModelProto, tensor: str) -> list[str]:
    return sorted(n.name for n in model.graph.node if tensor in n.input)


def _weight(model: onnx.ModelProto, conv: str) -> np.ndarray:
    name = next(n for n in model.graph.node if n.name == conv).input[1]
    return numpy_helper.to_array(next(i for i in model.graph.initializer if i.name == name))


@pytest.mark.parametrize("form", SWISH_FORMS)
def test_an_inputs_only_target_gets_the_rewrite_as_elementwise_ops(tmp_path, form):
    """OpenVINO quantizes only what its int8 layers read: the rewritten hard-swish's gate (and tail)
    are per-channel Mul/Add it fuses into conv_a, not depthwise Convs that would read the
    pre-activation through a quantizer of their own; the rewrite stays exact."""
    path, data = _saved(tmp_path, form)
    options, equalized = _equalized(path, data, QuantizeConfig(target="openvino"))
    assert [n.name for n in equalized.graph.node if n.op_type == "Conv"] == ["conv_a", "dw", "conv_b"]
    # conv_a and the activation compute as exported: no per-channel step after conv_a, which the
    # runtime would compute on each of its outputs; only the depthwise Conv's input is rescaled
    exported = onnx.load(path)
    assert _readers(equalized, "a") == _readers(exported, "a")
    np.testing.assert_array_equal(_weight(equalized, "conv_a"), _weight(exported, "conv_a"))
    x = np.stack([np.load(f)[0] for f in sorted(data.iterdir())])
    np.testing.assert_allclose(create_session(equalized).run(None, {"x": x})[0],
                               create_session(str(path)).run(None, {"x": x})[0], rtol=1e-4, atol=1e-5)
    result = api.quantize(path, data=data, config={"calibration": {"method": "minmax"},  # toy layers, nothing measured
                                                   "quantization": {"target": "openvino", "bias_correction": "off",
                                                                    "advanced": RULE_OFF}})
    assert any("equalized across channels in 1" in note for note in result.notes)
    written = result.model.graph.node
    assert sorted(n.name for n in written if n.op_type == "Conv") == ["conv_a", "conv_b", "dw"]
    # a quantizer on x, on the depthwise Conv's input and on conv_b's, none on the pre-activation
    assert len([n for n in written if n.op_type == "QuantizeLinear"]) == 3
    assert "a" not in {n.input[0] for n in written if n.op_type == "QuantizeLinear"}
