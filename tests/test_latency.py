"""The opt-in latency tuning (qtool.choices.latency) on a real small graph, with the measurement
replaced by a latency table (no timing is asserted): the op type the table makes slower in int8
stays float with its Q/DQ gone, the decision lands in the settled config's float_nodes and
replays without timing, and the last weighted layers stay int8, with a note when the int8 model
is still not 5% faster than fp32. The plain command times nothing."""

from __future__ import annotations

import numpy as np
import onnx
import pytest

import qtool.choices as choices
from qtool.calibration.calibrate import calibrate
from qtool.choices import latency
from qtool.config import AdvancedConfig, CalibrationConfig, Config, PreprocessConfig, QuantizeConfig
from qtool.quantization.quantize import quantize_model
from qtool.graph.modelio import InputSpec, input_specs

from tests import graphs

# The test graphs' final op stays float (Softsign has no int8 rule; a Sigmoid is excluded), so the
# pool's output is quantized for the pool alone.
# the timing search alone (the speed rule, off here, reads the graph before it)
ON = QuantizeConfig(exclude_op_types=("Sigmoid",), advanced=AdvancedConfig(latency_aware="on", **graphs.RULE_OFF))


def _cost(model: "onnx.ModelProto | str", table: dict[str, tuple[float, float]]) -> float:
    """Milliseconds of a model (the fp32 one comes as its path) by the table: op -> (int8, float)
    cost; a node is int8 when its weight comes from a DequantizeLinear or a QuantizeLinear reads its
    output. Q/DQ nodes cost a little each."""
    model = onnx.load(model) if isinstance(model, str) else model
    dq = {n.output[0] for n in model.graph.node if n.op_type == "DequantizeLinear"}
    quantized = {n.input[0] for n in model.graph.node if n.op_type == "QuantizeLinear"}
    total = 0.0
    for node in model.graph.node:
        if node.op_type in table:
            int8 = node.output[0] in quantized or (len(node.input) > 1 and node.input[1] in dq)
            total += table[node.op_type][0 if int8 else 1]
        elif node.op_type in ("QuantizeLinear", "DequantizeLinear"):
            total += 0.01
    return total


class Tuned:
    """The model built from the settled config, and the latency tuning's decision."""

    def __init__(self, graph, decision, settled):
        self.plan, self.model, self.decision, self.settled = graph.plan, graph.model, decision, settled
        self.notes = list(decision.details) if decision is not None else []


def tune(path, table, options: QuantizeConfig, measure, monkeypatch) -> Tuned:
    """settle (the latency tuning timed by `measure`), then the back end on the settled config."""
    monkeypatch.setattr(latency, "timer", lambda feeds, specs: measure)
    settled, decisions = choices.settle(path, onnx.load(path), table, None, Config(quantization=options))
    decision = next((d for d in decisions if d.option == "quantization.advanced.float_nodes"), None)
    assert settled.quantization.advanced.latency_aware == "off"  # nothing left to measure
    return Tuned(quantize_model(path, table, settled.quantization), decision, settled)


@pytest.fixture
def setup(tmp_path, monkeypatch):
    path = tmp_path / "m.onnx"
    onnx.save(graphs.conv_model(np.random.default_rng(0), activation="Relu", pool="GlobalAveragePool"), path)
    data = graphs.write_samples(tmp_path / "data", np.random.default_rng(1), (8, 12, 12), count=8)
    table = calibrate(path, data, PreprocessConfig(), CalibrationConfig(batch_size=4), ON, progress=False)
    calls: list[int] = []

    def run(costs: dict[str, tuple[float, float]], options: QuantizeConfig = ON):
        def measure(models):
            calls.append(len(models))
            assert models.get("fp32", str(path)) == str(path)  # the model as given, not the prepared graph
            return {name: [_cost(m, costs)] for name, m in models.items()}
        if options.advanced.latency_aware == "off":
            return Tuned(quantize_model(path, table, options), None, None)
        return tune(path, table, options, measure, monkeypatch)
    return run, calls, (path, table)


def test_slow_int8_op_type_stays_float_and_loses_its_qdq(setup):
    run, calls, (path, table) = setup
    costs = {"Conv": (1.0, 3.0), "GlobalAveragePool": (5.0, 1.0)}
    result = run(costs)
    assert "conv" in result.plan.quantized_nodes and "pool" not in result.plan.quantized_nodes
    assert "pool" not in result.plan.activations  # the pool's own output Q/DQ is gone
    readers = {i for n in result.model.graph.node if n.op_type == "QuantizeLinear" for i in n.input}
    assert "pool" not in readers
    assert any(n.op_type == "QuantizeLinear" for n in result.model.graph.node)  # the Conv stays int8
    assert any("1 GlobalAveragePool node kept float (latency-aware)" in note for note in result.notes)
    assert result.decision.value == ("pool",) and result.settled.quantization.advanced.float_nodes == ("pool",)

    # The settled config replays the choice: the same bytes, nothing measured
    measured = len(calls)
    again = quantize_model(path, table, result.settled.quantization)
    assert len(calls) == measured
    assert again.model.SerializeToString() == result.model.SerializeToString()
    # and the plain options time nothing and keep the pool int8
    plain = quantize_model(path, table, QuantizeConfig(exclude_op_types=("Sigmoid",)))
    assert "pool" in plain.plan.quantized_nodes and len(calls) == measured


def test_the_last_weighted_layers_stay_int8_and_a_slower_model_says_so(setup):
    run, calls, _ = setup
    result = run({"Conv": (3.0, 1.0), "GlobalAveragePool": (1.0, 1.0)})
    assert "conv" in result.plan.quantized_nodes  # the only weighted type is never sent back to float
    assert any(n.op_type == "DequantizeLinear" for n in result.model.graph.node)
    assert not any("kept float (latency-aware)" in note for note in result.notes)
    assert any(note.startswith("onnxruntime runs this int8 model no more than 5% faster than fp32")
               for note in result.notes)


@pytest.mark.parametrize("conv_int8, note", [(0.9, True), (0.7, False)])
def test_an_int8_model_level_with_fp32_counts_as_slower(setup, conv_int8, note):
    """fp32 costs 2.0 by the table; int8 (its Q/DQ included) a little over 1.9 with the Conv at 0.9,
    within 5% of fp32: the fallback goes on as for a slower model (here nothing is left to send back,
    so the note says so); at 0.7 (a little over 1.7) the int8 model is ahead and nothing is said."""
    run, calls, _ = setup
    result = run({"Conv": (conv_int8, 1.0), "GlobalAveragePool": (1.0, 1.0)})
    assert "conv" in result.plan.quantized_nodes
    assert any(n.startswith("onnxruntime runs this int8 model no more than 5% faster than fp32")
               for n in result.notes) == note


def test_int8_faster_everywhere_changes_nothing(setup):
    run, calls, _ = setup
    result = run({"Conv": (1.0, 3.0), "GlobalAveragePool": (1.0, 1.0)})
    plain = run({}, QuantizeConfig(exclude_op_types=("Sigmoid",)))
    assert result.plan.quantized_nodes == plain.plan.quantized_nodes
    assert {"conv", "pool"} <= set(result.plan.quantized_nodes)
    assert result.model.SerializeToString() == plain.model.SerializeToString()
    assert not any("latency-aware" in note for note in result.notes)


def test_the_tuning_is_opt_in_and_the_default_settles_without_it():
    assert QuantizeConfig().advanced.latency_aware == "off"
    assert QuantizeConfig(target="tensorrt", advanced=AdvancedConfig(latency_aware="on")).advanced.latency_aware == "on"
    with pytest.raises(ValueError):
        AdvancedConfig(latency_aware="auto")


def test_batch_one_is_measured_beside_the_batch():
    x = np.zeros((4, 3), np.float32)
    specs = [InputSpec("x", np.dtype(np.float32), (None, 3)), InputSpec("m", np.dtype(np.int64), (None, 2)),
             InputSpec("sr", np.dtype(np.int64), ())]
    sets = latency.feed_sets({"x": x, "m": np.ones((4, 2), np.int64)}, specs)
    assert [s["x"].shape for s in sets] == [(1, 3), (4, 3)]
    assert len(latency.feed_sets({"x": x, "sr": np.array(16000)}, specs)) == 1  # a scalar input: not batched


def test_an_input_whose_first_dimension_is_fixed_is_never_cut_to_one_sample():
    """A first dimension the model fixes above 1 is its own (a batched MatMul weight, a sequence):
    cut to [1, ...] onnxruntime refuses it (Got invalid dimensions for input)."""
    fixed = [InputSpec("x", np.dtype(np.float32), (4, 3)), InputSpec("m", np.dtype(np.int64), (4, 2))]
    sets = latency.feed_sets({"x": np.zeros((4, 3), np.float32), "m": np.ones((4, 2), np.int64)}, fixed)
    assert [s["x"].shape for s in sets] == [(4, 3)]


@pytest.mark.parametrize("seconds, expected", [(0.1, (1, latency.MIN_RUNS)), (0.4, (1, latency.MIN_RUNS)),
                                                (0.5, (0, latency.FEW_RUNS)), (3.0, (0, latency.FEW_RUNS))])
def test_models_that_run_for_seconds_are_timed_with_few_runs(monkeypatch, seconds, expected):
    """timer: after a probe run, a pair of models whose one run each takes SLOW_S or more together
    is timed FEW_RUNS runs with no second warm-up; a faster pair MIN_RUNS or more after a warm-up;
    at batch 1 and at the batch alike. time_sessions is replaced by a clock that says each run
    takes `seconds`."""
    calls: list[tuple[int, int]] = []

    def clock(sessions, feeds, warmup, runs):
        calls.append((warmup, runs))
        return {name: [seconds] * runs for name in sessions}

    monkeypatch.setattr(latency, "time_sessions", clock)
    model = graphs.conv_model(np.random.default_rng(0))
    x = np.zeros((4, 8, 12, 12), np.float32)
    medians = latency.timer({"x": x}, input_specs(model))({"int8": model, "float": model})
    assert medians == {"int8": [seconds, seconds], "float": [seconds, seconds]}
    assert calls == [(1, 1), expected] * 2


def _classifier(tmp_path, rng, body: list, inits: list, size: int):
    """`body` (x [N, 8, size, size] -> ... -> "feat", 16 channels) -> GlobalAveragePool -> Flatten ->
    Gemm (its weight drawn from `rng` after the body's) -> Softsign, saved and calibrated on 8
    random samples: (path, table)."""
    from onnx import helper

    nodes = [*body, helper.make_node("GlobalAveragePool", ["feat"], ["pool"], name="pool"),
             helper.make_node("Flatten", ["pool"], ["flat"], name="flatten"),
             helper.make_node("Gemm", ["flat", "wg"], ["fc"], name="fc", transB=1),
             helper.make_node("Softsign", ["fc"], ["y"], name="out")]
    inits = [*inits, graphs.init("wg", rng.normal(0, 0.3, (4, 16)).astype(np.float32))]
    path = tmp_path / "m.onnx"
    onnx.save(graphs.model(nodes, [graphs.tensor("x", ["N", 8, size, size])], [graphs.tensor("y", ["N", 4])], inits),
              path)
    data = graphs.write_samples(tmp_path / "data", np.random.default_rng(1), (8, size, size), count=8)
    return path, calibrate(path, data, PreprocessConfig(), CalibrationConfig(batch_size=4), ON, progress=False)


def test_a_weighted_type_goes_float_with_the_elementwise_types_when_only_together_faster(tmp_path, monkeypatch):
    """Conv -> Relu -> pool -> Gemm where the Q/DQ pairs (the cost here) go only when the Conv, the
    Relu and the pool are all float: no single type measures faster, the group does; the Gemm, the
    last weighted type, stays int8."""
    from onnx import helper

    rng = np.random.default_rng(0)
    built = graphs.conv_model(rng, activation="Relu", pool="GlobalAveragePool")
    last = built.graph.node.pop()  # pool -> Flatten -> Gemm -> the final float op
    built.graph.node.extend([helper.make_node("Flatten", ["pool"], ["flat"], name="flatten"),
                             helper.make_node("Gemm", ["flat", "wg"], ["fc"], name="fc", transB=1)])
    built.graph.initializer.append(graphs.init("wg", rng.normal(0, 0.3, (4, 16)).astype(np.float32)))
    last.input[0] = "fc"
    built.graph.node.append(last)
    del built.graph.output[:], built.graph.value_info[:]
    built.graph.output.append(graphs.tensor("y", ["N", 4]))
    path = tmp_path / "m.onnx"
    onnx.save(built, path)
    data = graphs.write_samples(tmp_path / "data", np.random.default_rng(1), (8, 12, 12), count=8)
    table = calibrate(path, data, PreprocessConfig(), CalibrationConfig(batch_size=4), ON, progress=False)

    def measure(models):
        def cost(model):
            model = onnx.load(model) if isinstance(model, str) else model
            producers = {o: n.op_type for n in model.graph.node for o in n.output}
            quantized = {producers.get(n.input[0]) for n in model.graph.node if n.op_type == "QuantizeLinear"}
            return 10.0 if quantized & {"Conv", "Relu", "GlobalAveragePool"} else 1.0
        return {name: [cost(m)] for name, m in models.items()}
    result = tune(path, table, ON, measure, monkeypatch)
    assert "fc" in result.plan.quantized_nodes
    assert not {"conv", "relu", "pool"} & set(result.plan.quantized_nodes)
    assert any("of types Relu, GlobalAveragePool, Conv kept float" in note or
               "of types GlobalAveragePool, Relu, Conv kept float" in note for note in result.notes)
    assert not any(note.startswith("onnxruntime runs this int8 model slower") for note in result.notes)


def test_the_elementwise_types_go_float_together_after_a_weighted_type_went_alone(tmp_path, monkeypatch):
    """Conv -> Relu -> Add -> Mul -> pool -> Flatten -> Gemm where the Conv is faster float on its own, and the
    Q/DQ pairs (the cost here) go only when the Add and the Mul are both float. Greedily the Conv goes
    float, then no single type is faster and the Gemm, the last weighted type, must stay int8: the
    elementwise types together are the way left, instead of a model slower than fp32."""
    from onnx import helper

    rng = np.random.default_rng(0)
    # (the Relu keeps the Add and Mul apart from the Conv: an affine right after a Conv is folded into it)
    body = [helper.make_node("Conv", ["x", "w"], ["c"], name="conv", pads=[1, 1, 1, 1]),
            helper.make_node("Relu", ["c"], ["r"], name="relu"),
            helper.make_node("Add", ["r", "shift"], ["a"], name="add"),
            helper.make_node("Mul", ["a", "gain"], ["feat"], name="mul")]
    inits = [graphs.init("w", rng.normal(0, 0.3, (16, 8, 3, 3)).astype(np.float32)),
             graphs.init("shift", rng.normal(0, 0.3, (1, 16, 1, 1)).astype(np.float32)),
             graphs.init("gain", rng.uniform(0.5, 1.5, (1, 16, 1, 1)).astype(np.float32))]
    path, table = _classifier(tmp_path, rng, body, inits, 12)

    def measure(models):
        def cost(model):
            model = onnx.load(model) if isinstance(model, str) else model
            producers = {o: n.op_type for n in model.graph.node for o in n.output}
            dequantized = {n.output[0] for n in model.graph.node if n.op_type == "DequantizeLinear"}
            quantized = {producers.get(n.input[0]) for n in model.graph.node if n.op_type == "QuantizeLinear"}
            conv_int8 = any(n.op_type == "Conv" and n.input[1] in dequantized for n in model.graph.node)
            return 1.0 + (10.0 if quantized & {"Add", "Mul"} else 0.0) + (2.0 if conv_int8 else 0.0)
        return {name: [cost(m)] for name, m in models.items()}
    result = tune(path, table, ON, measure, monkeypatch)
    assert "fc" in result.plan.quantized_nodes
    assert not {"conv", "relu", "add", "mul"} & set(result.plan.quantized_nodes), result.plan.quantized_nodes
    assert any(note.startswith("1 Conv node kept float") for note in result.notes), result.notes
    assert any(note.startswith("4 nodes of types Relu, Add, Mul, GlobalAveragePool kept float")
               for note in result.notes), result.notes
    assert not any(note.startswith("onnxruntime runs this int8 model slower") for note in result.notes)


def test_the_layers_of_the_largest_activations_go_float_when_no_op_type_helps(tmp_path, monkeypatch):
    """conv_big (stride 1, 16 x 24 x 24 values out) -> Relu -> conv_small (stride 2, 16 x 12 x 12)
    -> pool -> Flatten -> Gemm, where int8 costs per value for the big stage (its Q/DQ and
    elementwise passes) and pays on the small one: no op type going float is 5% faster (Conv float
    takes the small conv with it; the Relu alone gains nothing), so the model is slower than fp32
    until the nodes of the largest outputs go float, by size."""
    from onnx import helper

    rng = np.random.default_rng(0)
    body = [helper.make_node("Conv", ["x", "w1"], ["c1"], name="conv_big", pads=[1, 1, 1, 1]),
            helper.make_node("Relu", ["c1"], ["r1"], name="relu_big"),
            helper.make_node("Conv", ["r1", "w2"], ["c2"], name="conv_small", pads=[1, 1, 1, 1], strides=[2, 2]),
            helper.make_node("Relu", ["c2"], ["feat"], name="relu_small")]
    inits = [graphs.init("w1", rng.normal(0, 0.3, (16, 8, 3, 3)).astype(np.float32)),
             graphs.init("w2", rng.normal(0, 0.3, (16, 16, 3, 3)).astype(np.float32))]
    path, table = _classifier(tmp_path, rng, body, inits, 24)
    # (int8, float) cost: all int8 7.0, fp32 6.8, Convs float 6.8 (not 5% faster), the big stage float 4.0
    costs = {"conv_big": (5.0, 2.0), "conv_small": (1.0, 3.8), "fc": (1.0, 1.0)}
    sizes_seen, measured = [], []

    def measure(models):
        def cost(model):
            model = onnx.load(model) if isinstance(model, str) else model
            dequantized = {n.output[0] for n in model.graph.node if n.op_type == "DequantizeLinear"}
            return sum(costs[n.name][0 if n.input[1] in dequantized else 1]
                       for n in model.graph.node if n.name in costs)
        measured.append(len(models))
        return {name: [cost(m)] for name, m in models.items()}
    real_choose = latency.choose

    def choose(fp32, quantized, build, measure, sizes):
        sizes_seen.append(sizes())
        return real_choose(fp32, quantized, build, measure, sizes)
    monkeypatch.setattr(latency, "choose", choose)
    result = tune(path, table, ON, measure, monkeypatch)
    # on the run check's batch (made up from the input specs here: one sample)
    assert sizes_seen[0]["conv_big"] == sizes_seen[0]["relu_big"] == 16 * 24 * 24
    assert sizes_seen[0]["conv_small"] == 16 * 12 * 12
    assert not {"conv_big", "relu_big"} & set(result.plan.quantized_nodes)
    assert {"conv_small", "fc"} <= set(result.plan.quantized_nodes)
    assert any(note.startswith("2 nodes whose outputs hold at least 9216 values kept float (latency-aware, by size)")
               for note in result.notes), result.notes
    assert not any(note.startswith("onnxruntime runs this int8 model slower") for note in result.notes)
    # decided once: the settled config gives the same model without measuring
    before = len(measured)
    again = quantize_model(path, table, result.settled.quantization)
    assert again.model.SerializeToString() == result.model.SerializeToString() and len(measured) == before


def test_the_sessions_take_turns_each_after_every_other():
    """time_sessions: every session runs once per turn, in a fresh order each turn, so that each
    runs right after every other one, and the order is the same on every call."""
    from qtool.graph.runtime import time_sessions

    order: list[str] = []

    class Recorder:
        def __init__(self, name):
            self.name = name

        def run(self, outputs, feeds):
            order.append(self.name)

    times = time_sessions({name: Recorder(name) for name in "abc"}, {}, warmup=0, runs=30)
    assert {name: len(values) for name, values in times.items()} == {"a": 30, "b": 30, "c": 30}
    assert all(sorted(order[i:i + 3]) == ["a", "b", "c"] for i in range(0, 90, 3))
    within = [(turn[0], turn[1]) for turn in zip(order[0::3], order[1::3])] + \
             [(turn[0], turn[1]) for turn in zip(order[1::3], order[2::3])]
    # each session right after each other one within a turn (a turning cycle gives only a-b, b-c, c-a)
    assert all(within.count((x, y)) >= 3 for x in "abc" for y in "abc" if x != y)
    first = list(order)
    order.clear()
    time_sessions({name: Recorder(name) for name in "abc"}, {}, warmup=0, runs=30)
    assert order == first


FAST, LEVEL = 1 - 2 * latency.MARGIN, 1.0  # int8 time over fp32's: well ahead of the margin, or level


@pytest.mark.parametrize("at_batch_one, at_the_batch", [(FAST, FAST), (FAST, LEVEL), (LEVEL, FAST), (LEVEL, LEVEL)])
def test_the_int8_model_must_be_ahead_of_fp32_at_both_batch_sizes(at_batch_one, at_the_batch):
    """choose() with an injected measurement of two feed sets (batch 1, the calibration batch): the
    int8 model counts as ahead of fp32 only when it is more than MARGIN faster at both; ahead at one
    and level at the other, the fallback goes on and (the one weighted type staying int8) the note
    says it is no more than 5% faster. Nothing is timed."""
    fp32_times = [2.0e-3, 8.0e-3]
    int8_times = [at_batch_one * fp32_times[0], at_the_batch * fp32_times[1]]
    calls = []

    def measure(models):
        calls.append(dict(models))
        times = {"fp32": fp32_times, "int8": int8_times}
        return {name: list(times[name]) for name in models}

    choice = latency.choose(lambda: "fp32", {"conv": "Conv"}, lambda labels: "int8", measure)
    assert calls and all(c == {"int8": "int8", "fp32": "fp32"} for c in calls)  # only int8 against fp32
    ahead = at_batch_one == at_the_batch == FAST
    assert choice.labels == ()  # the last weighted layer stays int8 either way
    notes = [n for n in choice.notes if n.startswith("onnxruntime runs this int8 model no more than 5% faster")]
    assert bool(notes) == (not ahead), choice.notes
    assert len(calls) == (2 if ahead else 1)  # ahead must be shown twice; behind once is enough
    if notes:
        assert "(batch 1 / the calibration batch;" in notes[0]


def test_the_tuning_times_the_first_calibration_batch_and_its_first_sample(setup, monkeypatch):
    """With data, the timer gets the first calibration batch (4 samples here, where the run check
    runs one), which it times at batch 1 and as a whole."""
    from qtool import api

    _, _, (path, table) = setup
    seen = []

    def timer(feeds, specs):
        seen.append(feeds)
        return lambda models: {name: [1.0] for name in models}
    monkeypatch.setattr(latency, "timer", timer)
    cfg = Config(calibration=CalibrationConfig(batch_size=4), quantization=ON)
    specs = input_specs(onnx.load(path))
    choices.settle(path, onnx.load(path), table, None, cfg, api._calibration_batches(path.parent / "data", specs, cfg))
    assert [feeds["x"].shape for feeds in seen] == [(4, 8, 12, 12)]
    assert [s["x"].shape[0] for s in latency.feed_sets(seen[0], specs)] == [1, 4]
