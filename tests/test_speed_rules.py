"""qtool.plan.speed: float_for_speed's decisions on small real graphs, from their shapes alone."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import helper

from qtool import api
from qtool.config import AdvancedConfig, QuantizeConfig
from qtool.plan.planner import build_plan
from qtool.graph.runtime import tensor_dims
from qtool.plan.speed import COSTS, Costs, cost_terms, float_for_speed
from tests.graphs import init, model, tensor, write_samples

FLOAT_FORM = QuantizeConfig(advanced=AdvancedConfig(hard_activations="float"))  # the hard-swish's float form (DQ, op, Q)


def _conv(rng, name, x, y, c_in, c_out, k=1, group=1, stride=1):
    w = rng.normal(0, 0.2, (c_out, c_in // group, k, k)).astype(np.float32)
    b = rng.normal(0, 0.1, c_out).astype(np.float32)
    node = helper.make_node("Conv", [x, f"{name}_w", f"{name}_b"], [y], name=name, group=group,
                            kernel_shape=[k, k], pads=[k // 2] * 4, strides=[stride, stride])
    return node, [init(f"{name}_w", w), init(f"{name}_b", b)]


def mobile_block(rng, size=112, channels=16):
    """x -> 1x1 expand -> HardSwish -> 3x3 depthwise -> HardSwish -> 1x1 project -> y: a MobileNetV3 /
    PP-LCNet block at the first stages' resolution, few channels."""
    nodes, inits = [], []
    for node, tensors in (_conv(rng, "expand", "x", "e", channels, 2 * channels),
                          _conv(rng, "depthwise", "h1", "d", 2 * channels, 2 * channels, k=3, group=2 * channels),
                          _conv(rng, "project", "h2", "p", 2 * channels, channels)):
        nodes.append(node)
        inits += tensors
    nodes.insert(1, helper.make_node("HardSwish", ["e"], ["h1"], name="hardswish_1"))
    nodes.insert(3, helper.make_node("HardSwish", ["d"], ["h2"], name="hardswish_2"))
    nodes.append(helper.make_node("Softsign", ["p"], ["y"], name="out"))  # a float reader: y is not int8
    return model(nodes, [tensor("x", [1, channels, size, size])], [tensor("y", None)], inits)


def large_conv(rng, size=14, channels=256):
    """x -> 3x3 Conv (256 -> 256) -> Relu -> y: 2304 MACs per output value."""
    conv, inits = _conv(rng, "conv", "x", "c", channels, channels, k=3)
    nodes = [conv, helper.make_node("Relu", ["c"], ["r"], name="relu"),
             helper.make_node("Softsign", ["r"], ["y"], name="out")]
    return model(nodes, [tensor("x", [1, channels, size, size])], [tensor("y", None)], inits)


def sandwich(rng, size=28, channels=128):
    """Two large 3x3 Convs with a depthwise Conv between them: its int8 kernel gains nothing, but
    floating it alone would put a DequantizeLinear and a QuantizeLinear around it."""
    nodes, inits = [], []
    for node, tensors in (_conv(rng, "conv_a", "x", "a", channels, channels, k=3),
                          _conv(rng, "middle", "a", "m", channels, channels, k=3, group=channels),
                          _conv(rng, "conv_b", "m", "b", channels, channels, k=3)):
        nodes.append(node)
        inits += tensors
    nodes.append(helper.make_node("Softsign", ["b"], ["y"], name="out"))
    return model(nodes, [tensor("x", [1, channels, size, size])], [tensor("y", None)], inits)


def pointwise_chain(rng, size=56, channels=96):
    """x -> (1x1 Conv -> HardSwish) x 2 -> 3x3 Conv -> y: 96 MACs per value in the 1x1 Convs."""
    nodes, inits, last = [], [], "x"
    for i in range(2):
        conv, tensors = _conv(rng, f"pointwise_{i}", last, f"c{i}", channels, channels)
        nodes += [conv, helper.make_node("HardSwish", [f"c{i}"], [f"h{i}"], name=f"hardswish_{i}")]
        inits += tensors
        last = f"h{i}"
    conv, tensors = _conv(rng, "conv", last, "c", channels, channels, k=3)
    nodes += [conv, helper.make_node("Softsign", ["c"], ["y"], name="out")]
    return model(nodes, [tensor("x", [1, channels, size, size])], [tensor("y", None)], inits + tensors)


def squeeze_excite(rng, channels=64):
    """A squeeze-and-excitation gate's two 1x1 Convs on a 1x1 map: about 1000 MACs each."""
    first, a = _conv(rng, "squeeze", "x", "s", channels, channels // 4)
    second, b = _conv(rng, "excite", "r", "e", channels // 4, channels)
    nodes = [first, helper.make_node("Relu", ["s"], ["r"], name="relu"), second,
             helper.make_node("HardSigmoid", ["e"], ["g"], name="gate"),
             helper.make_node("Softsign", ["g"], ["y"], name="out")]
    return model(nodes, [tensor("x", [1, channels, 1, 1])], [tensor("y", None)], a + b)


def one_channel_filter(rng, width=16384, taps=256):
    """A Conv1D written as Conv2D over audio: one input channel, one output channel, a 1 x 256 kernel at
    stride 2 (a resampling filter). onnxruntime's QLinearConv runs one-in, one-out groups as a depthwise
    Conv: one pointer per output sample and tap."""
    w = rng.normal(0, 0.1, (1, 1, 1, taps)).astype(np.float32)
    nodes = [helper.make_node("Conv", ["x", "filter_w"], ["f"], name="filter", kernel_shape=[1, taps], strides=[1, 2]),
             helper.make_node("Softsign", ["f"], ["y"], name="out")]
    return model(nodes, [tensor("x", [1, 1, 1, width])], [tensor("y", None)], [init("filter_w", w)])


def keras_stem(rng, size=48):
    """A Keras-style stem: 3x3 Conv (3 -> 16) -> PRelu -> MaxPool -> two 3x3 Convs of 64 channels. onnxruntime
    has no integer PRelu (it runs float between a DQ and a Q), and runs a uint8 MaxPool fed by a float node in
    its slow NCHW form."""
    nodes, inits = [], []
    for node, tensors in (_conv(rng, "stem", "x", "s", 3, 16, k=3),
                          _conv(rng, "conv_a", "p", "a", 16, 64, k=3),
                          _conv(rng, "conv_b", "r", "b", 64, 64, k=3)):
        nodes.append(node)
        inits += tensors
    slope = init("slope", rng.uniform(0.1, 0.3, (16, 1, 1)).astype(np.float32))
    nodes[1:1] = [helper.make_node("PRelu", ["s", "slope"], ["q"], name="prelu"),
                  helper.make_node("MaxPool", ["q"], ["p"], name="pool", kernel_shape=[2, 2], strides=[2, 2])]
    nodes[4:4] = [helper.make_node("Relu", ["a"], ["r"], name="relu")]
    nodes.append(helper.make_node("Softsign", ["b"], ["y"], name="out"))
    return model(nodes, [tensor("x", [1, 3, size, size])], [tensor("y", None)], inits + [slope])


def pooled(rng, conv_after, size=16, channels=128):
    """x -> 1x1 Conv -> HardSwish -> MaxPool 2x2 -> a 1x1 Conv (conv_after), or a classifier's head
    (GlobalAveragePool -> Flatten -> Gemm)."""
    conv, inits = _conv(rng, "conv", "x", "c", channels, channels)
    nodes = [conv, helper.make_node("HardSwish", ["c"], ["h"], name="hardswish"),
             helper.make_node("MaxPool", ["h"], ["p"], name="pool", kernel_shape=[2, 2], strides=[2, 2])]
    if conv_after:
        after, more = _conv(rng, "after", "p", "a", channels, channels)
        nodes += [after, helper.make_node("Softsign", ["a"], ["y"], name="out")]
    else:
        more = [init("fc_w", rng.normal(0, 0.1, (10, channels)).astype(np.float32))]
        nodes += [helper.make_node("GlobalAveragePool", ["p"], ["g"], name="gap"),
                  helper.make_node("Flatten", ["g"], ["f"], name="flatten"),
                  helper.make_node("Gemm", ["f", "fc_w"], ["y"], name="fc", transB=1)]
    return model(nodes, [tensor("x", [1, channels, size, size])], [tensor("y", None)], inits + more)


def decide(built, options=FLOAT_FORM, costs: Costs = COSTS) -> tuple[list[str], list[str]]:
    shapes = tensor_dims(built, {i.name: np.zeros([d.dim_value for d in i.type.tensor_type.shape.dim],
                                                    np.float32) for i in built.graph.input})
    return float_for_speed(built, build_plan(built, options), shapes, options, costs)


def outcomes(costs: Costs = COSTS) -> dict[str, bool]:
    """Each decision the tests below expect, true or false with `costs`."""
    chain, reasons = decide(mobile_block(np.random.default_rng(0)), costs=costs)
    kept = {"expand", "project"} - set(chain)
    big, _ = decide(large_conv(np.random.default_rng(1)), costs=costs)
    middle, _ = decide(sandwich(np.random.default_rng(2)), costs=costs)
    wide, _ = decide(mobile_block(np.random.default_rng(3), size=7, channels=256), costs=costs)
    gate, _ = decide(squeeze_excite(np.random.default_rng(5)), costs=costs)
    resampler, _ = decide(one_channel_filter(np.random.default_rng(6)), costs=costs)
    stem, _ = decide(keras_stem(np.random.default_rng(7)), costs=costs)
    integer = QuantizeConfig(advanced=AdvancedConfig(hard_activations="integer"))
    head, _ = decide(pooled(np.random.default_rng(8), conv_after=False), integer, costs=costs)
    pool_conv, _ = decide(pooled(np.random.default_rng(8), conv_after=True), integer, costs=costs)
    pointwise = pointwise_chain(np.random.default_rng(4))
    float_form, _ = decide(pointwise, costs=costs)
    integer_form, _ = decide(pointwise, integer, costs=costs)
    return {
        # a depthwise Conv and the float-form HardSwish around it cost per value and gain nothing per MAC
        "the high-resolution chain goes float": {"depthwise", "hardswish_2", "hardswish_1"} <= set(chain),
        # every dense layer float would leave no int8 layer: the one that costs least in int8 stays
        "one of its dense layers stays int8": len(kept) == 1,
        # one reason for the float group, by cause, then one naming the dense layer kept int8
        "a reason for the float group, by cause": len(reasons) == 2 and "depthwise Convs" in reasons[0],
        "the layer kept int8 is named": len(kept) == 1 and reasons[-1].startswith(f"'{min(kept)}' stays int8"),
        "a large Conv stays int8": big == [],
        # the cut weighs the Q/DQ a float island would need: the depthwise Conv stays with its neighbours
        "a depthwise Conv between large Convs stays int8": middle == [],
        # per value the block pays the same; per MAC its 1x1 Convs gain with 16x the channels
        "the block's 1x1 Convs stay int8 at 7x7 with 256 channels": not {"expand", "project"} & set(wide),
        # 96 MACs per value: less than the float-form hard-swish's four passes cost, more than two
        "1x1 Convs with a float-form HardSwish go float": float_form == ["pointwise_0", "hardswish_0", "pointwise_1",
                                                                          "hardswish_1"],
        "with the integer form they stay int8": integer_form == [],
        # an integer kernel's fixed cost is more than 1000 MACs save; one Conv stays (an int8 model)
        "a squeeze-excite gate's small Convs go float": len({"squeeze", "excite"} & set(gate)) == 1,
        # one input and one output channel: a depthwise kernel's cost per sample and tap, no dense gain
        "a one-channel filter with a long kernel goes float": resampler == ["filter"],
        # a float PRelu would leave the MaxPool before an int8 conv_a on uint8 in NCHW, fed by a float node
        "a MaxPool goes float with the nodes on either side or not at all": stem == [] or {
            "prelu", "pool", "conv_a"} <= set(stem),
        # no integer Conv after it: a uint8 MaxPool would run in NCHW; float, it needs its producer float too
        "a MaxPool before a classifier's head goes float with its producer": {"pool", "hardswish"} <= set(head),
        "a MaxPool between integer Convs stays int8": "pool" not in pool_conv,
    }


def test_decisions():
    failed = [what for what, held in outcomes().items() if not held]
    assert not failed, failed


@pytest.mark.parametrize("planted", [
    {"passes": 0.0, "tap": 0.0, "depthwise_mac": 0.0, "depthwise_float_mac": 0.0},  # int8 pays nothing per value
    {"mac": 0.1},  # a dense MAC saves 10x what it does
    {"integer_kernel": 1e6},  # an integer kernel's fixed cost 300x too high: int8 layers never pay off
    {"boundary": 0.0},  # Q/DQ free: islands of float in int8 cost nothing
    {"nchw_pool": 0.0},  # a uint8 MaxPool as fast in NCHW as in NHWC
])
def test_a_cost_planted_wrong_changes_a_decision(planted):
    """test_decisions fails when a cost is planted wrong."""
    assert not all(outcomes(replace(COSTS, **planted)).values())


def test_integer_form_costs_fewer_passes_than_float_form():
    """The hard-swish's integer form (QLinearAdd + QLinearMul) adds two passes, its float form four."""
    built = mobile_block(np.random.default_rng(4))
    shapes = tensor_dims(built, {"x": np.zeros((1, 16, 112, 112), np.float32)})
    integer = cost_terms(built, build_plan(built, QuantizeConfig(advanced=AdvancedConfig(hard_activations="integer"))), shapes,
                         QuantizeConfig(advanced=AdvancedConfig(hard_activations="integer")))
    floated = cost_terms(built, build_plan(built, FLOAT_FORM), shapes, FLOAT_FORM)
    values = 32 * 112 * 112
    for label in ("hardswish_1", "hardswish_2"):  # float fuses each into the Conv before it
        assert floated.nodes[label]["passes"] == 4 * values
        assert integer.nodes[label]["passes"] == 2 * values


def test_nodes_without_shapes_keep_their_plan():
    built = mobile_block(np.random.default_rng(5))
    labels, _ = float_for_speed(built, build_plan(built, FLOAT_FORM), {}, FLOAT_FORM)
    assert labels == []


def test_prelu_costs_its_dequantize_and_quantize():
    """onnxruntime has no integer PRelu: int8, it runs float between a DequantizeLinear and a QuantizeLinear."""
    built = keras_stem(np.random.default_rng(8))
    shapes = tensor_dims(built, {"x": np.zeros((1, 3, 48, 48), np.float32)})
    terms = cost_terms(built, build_plan(built, FLOAT_FORM), shapes, FLOAT_FORM)
    assert terms.nodes["prelu"] == {"boundary": 2 * 16 * 48 * 48}
    assert ("conv_a", "pool") in terms.follows and ("pool", "prelu") in terms.follows


def batch_norm_over_unit_axis(rng, scalar_shape=(1,)):
    """A TensorFlow export's batch norm written as Mul and Add by one-value constants (rank 1, as tf2onnx
    writes them) over [1, 96, 128, 1], then two 3x3 Convs with 32 channels."""
    nodes = [helper.make_node("Mul", ["x", "gamma"], ["m"], name="bn_mul"),
             helper.make_node("Add", ["m", "beta"], ["a"], name="bn_add"),
             helper.make_node("Reshape", ["a", "to_nchw"], ["r"], name="to_nchw")]
    inits = [init("gamma", np.full(scalar_shape, 1.3, np.float32)), init("beta", np.full(scalar_shape, 0.2, np.float32)),
             init("to_nchw", np.array([1, 32, 3, 128], np.int64))]
    for node, tensors in (_conv(rng, "first", "r", "l", 32, 32, k=3), _conv(rng, "second", "l", "s", 32, 32, k=3)):
        nodes.append(node)
        inits += tensors
    nodes.append(helper.make_node("Softsign", ["s"], ["y"], name="out"))
    return model(nodes, [tensor("x", [1, 96, 128, 1])], [tensor("y", None)], inits)


def test_a_broadcast_stepping_value_by_value_is_costed():
    """A rank-1 one-value constant over a last axis of 1: onnxruntime's broadcast steps value by value
    (QLinearMul 23 ns a value, float 9); as [1, 1, 1, 1] it does not."""
    built = batch_norm_over_unit_axis(np.random.default_rng(9))
    shapes = tensor_dims(built, {"x": np.zeros((1, 96, 128, 1), np.float32)})
    terms = cost_terms(built, build_plan(built, FLOAT_FORM), shapes, FLOAT_FORM)
    assert terms.nodes["bn_mul"]["unit_span"] == 96 * 128 and terms.nodes["bn_add"]["unit_span"] == 96 * 128
    floated, reasons = decide(built)
    assert {"bn_mul", "bn_add"} <= set(floated) and not {"first", "second"} & set(floated)
    assert "broadcasts stepping value by value" in reasons[0]
    shaped = batch_norm_over_unit_axis(np.random.default_rng(9), scalar_shape=(1, 1, 1, 1))
    assert "unit_span" not in cost_terms(shaped, build_plan(shaped, FLOAT_FORM), shapes, FLOAT_FORM).nodes["bn_mul"]
    assert decide(shaped)[0] == []


@pytest.mark.parametrize("conv_after", [False, True])
def test_the_maxpools_costed_in_nchw_are_those_onnxruntime_leaves_in_nchw(tmp_path, conv_after):
    """The rule's layout for a uint8 MaxPool against onnxruntime's own graph optimizer (no timing): quantized
    with every node int8, the MaxPool runs as NhwcMaxPool exactly where the rule charges it nothing."""
    built = pooled(np.random.default_rng(9), conv_after)
    path = tmp_path / "m.onnx"
    onnx.save(built, path)
    data = write_samples(tmp_path / "data", np.random.default_rng(10), (128, 16, 16), count=4)
    result = api.quantize(path, data=data, config={"quantization": {"advanced": {"speed_rule": "off"}}}, progress=False)
    assert not result.settled.quantization.advanced.float_nodes
    options = ort.SessionOptions()
    options.optimized_model_filepath = str(tmp_path / "optimized.onnx")
    ort.InferenceSession(result.model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    pools = [(n.op_type, n.domain) for n in onnx.load(tmp_path / "optimized.onnx").graph.node
             if n.op_type.endswith("MaxPool")]
    shapes = tensor_dims(built, {"x": np.zeros((1, 128, 16, 16), np.float32)})
    charged = cost_terms(built, build_plan(built, FLOAT_FORM), shapes, FLOAT_FORM).nodes["pool"].get("nchw_pool", 0)
    assert pools == ([("NhwcMaxPool", "com.microsoft")] if conv_after else [("MaxPool", "")])  # uint8 in NCHW
    assert (charged > 0) == (not conv_after)
