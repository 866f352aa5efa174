"""The written model runs (qtool.quantization.run_check): quantize runs the int8 model once in
onnxruntime, keeps float a node whose int8 form onnxruntime cannot run, and never writes a
model that still does not run.

The real case: a cubic Resize that scales down between int8 Convs. fp32 runs; in the int8
model onnxruntime moves the Convs to NHWC, pushes their Transposes through the Resize and
then rejects NHWC cubic down-scaling when it loads the model. (A 3-D cubic Resize, the
other shape onnxruntime's message names, fails in fp32 already: calibration reports it.)
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from click.testing import CliRunner
from onnx import TensorProto, helper, numpy_helper

from qtool.cli import main
from qtool.graph.modelio import input_specs
from qtool.quantization import run_check
from tests import graphs

SHAPE = (1, 4, 8, 8)


def _cubic_branch(i: int, rng: np.random.Generator, inits: list) -> tuple[list, str]:
    """Conv -> cubic Resize to half size -> Conv -> Conv: onnxruntime makes the Convs NHWC."""
    nodes = []
    x = "x"
    for j, op in enumerate(["Conv", "Resize", "Conv", "Conv"]):
        out = f"b{i}_{j}"
        if op == "Conv":
            inits.append(numpy_helper.from_array(rng.normal(0, 0.3, (4, 4, 3, 3)).astype(np.float32), f"w{i}_{j}"))
            nodes.append(helper.make_node("Conv", [x, f"w{i}_{j}"], [out], pads=[1, 1, 1, 1], name=f"conv{i}_{j}"))
        else:
            nodes.append(helper.make_node("Resize", [x, "", "half"], [out], mode="cubic", name=f"resize{i}"))
        x = out
    return nodes, x


def _cubic_model(path, branches: int = 1) -> None:
    rng = np.random.default_rng(0)
    inits = [numpy_helper.from_array(np.array([1, 1, 0.5, 0.5], np.float32), "half")]
    nodes, ends = [], []
    for i in range(branches):
        branch, end = _cubic_branch(i, rng, inits)
        nodes += branch
        ends.append(end)
    out = ends[0]
    for i, end in enumerate(ends[1:]):
        nodes.append(helper.make_node("Add", [out, end], [f"sum{i}"], name=f"add{i}"))
        out = f"sum{i}"
    graph = helper.make_graph(nodes, "cubic", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 4, 8, 8])],
                              [helper.make_tensor_value_info(out, TensorProto.FLOAT, ["N", 4, 4, 4])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.save(model, str(path))
    ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])  # fp32 loads and runs


def _data(tmp_path):
    folder = tmp_path / "data"
    folder.mkdir()
    rng = np.random.default_rng(1)
    for i in range(4):
        np.save(folder / f"{i}.npy", rng.normal(0, 1, SHAPE).astype(np.float32))
    return folder


def _runs(path) -> np.ndarray:
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    return session.run(None, {"x": np.ones(SHAPE, np.float32)})[0]


def test_a_cubic_resize_onnxruntime_cannot_run_in_int8_stays_float_with_a_note(tmp_path):
    _cubic_model(tmp_path / "m.onnx")
    result = CliRunner().invoke(main, ["quantize", str(tmp_path / "m.onnx"), "--data", str(_data(tmp_path)),
                                       "--config", str(graphs.mechanics_yaml(tmp_path)), "-o", str(tmp_path / "q.onnx")])
    assert result.exit_code == 0, result.output + result.stderr
    notes = [line for line in result.stderr.splitlines() if line.startswith("note:") and "kept in float" in line]
    assert len(notes) == 1, result.stderr
    assert "'resize0' (Resize)" in notes[0] and "'Cubic' mode" in notes[0]
    assert _runs(tmp_path / "q.onnx").shape == (1, 4, 4, 4)
    assert any(n.op_type == "QuantizeLinear" for n in onnx.load(str(tmp_path / "q.onnx")).graph.node)


def test_the_check_runs_on_made_up_inputs_without_data(tmp_path):
    _cubic_model(tmp_path / "m.onnx")
    runner = CliRunner()
    calibrated = runner.invoke(main, ["calibrate", str(tmp_path / "m.onnx"), "--data", str(_data(tmp_path)),
                                      "-o", str(tmp_path / "t.json")])
    assert calibrated.exit_code == 0, calibrated.stderr
    result = runner.invoke(main, ["quantize", str(tmp_path / "m.onnx"), "--table", str(tmp_path / "t.json"),
                                  "--config", str(graphs.mechanics_yaml(tmp_path)), "-o", str(tmp_path / "q.onnx")])
    assert result.exit_code == 0, result.stderr
    assert "kept in float" in result.stderr and "'resize0' (Resize)" in result.stderr
    assert _runs(tmp_path / "q.onnx").shape == (1, 4, 4, 4)


def test_a_model_that_still_does_not_run_is_an_internal_error_and_is_not_written(tmp_path):
    # four independent failing branches need four nodes in float: one more than the check keeps
    # (the speed rule off: it would keep these small layers float for speed, and the model would run)
    _cubic_model(tmp_path / "m.onnx", branches=4)
    (tmp_path / "config").mkdir()
    result = CliRunner().invoke(main, ["quantize", str(tmp_path / "m.onnx"), "--data", str(_data(tmp_path)),
                                       "--config", str(graphs.mechanics_yaml(tmp_path / "config")),
                                       "-o", str(tmp_path / "q.onnx")])
    assert result.exit_code == 3, result.output + result.stderr
    assert "internal error" in result.stderr and "'Cubic' mode" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config", "data", "m.onnx"]


def _identity_model() -> onnx.ModelProto:
    graph = helper.make_graph([helper.make_node("Identity", ["x"], ["y"])], "g",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return model


def test_wrong_shapes_and_new_non_finite_outputs_fail_the_check():
    model = _identity_model()
    feeds = {"x": np.array([1.0, np.inf], np.float32)}
    finite = run_check.Reference(feeds, ("y",), (np.zeros(2, np.float32),))
    assert "NaN/Inf" in run_check.check(model, finite).reason
    with_inf = run_check.Reference(feeds, ("y",), (np.array([0, np.inf], np.float32),))
    assert run_check.check(model, with_inf) is None  # fp32 is not finite there either
    other_shape = run_check.Reference(feeds, ("y",), (np.zeros(3, np.float32),))
    assert "shape [2], fp32's is [3]" in run_check.check(model, other_shape).reason


def test_locate_halves_down_to_the_one_node_that_passes_in_float():
    candidates = [(f"n{i}", "Conv") for i in range(13)]
    tried = []

    def passes(labels):
        tried.append(labels)
        return "n9" in labels

    assert run_check.locate(run_check.RunFailure("no kernel"), candidates, passes) == "n9"
    assert len(tried) <= 2 * 4 + 1
    assert run_check.locate(run_check.RunFailure("no kernel"), candidates, lambda labels: False) is None


def test_made_up_inputs_grow_until_the_fp32_model_runs(tmp_path, monkeypatch):
    """quantize with a table and no data makes its run-check inputs up from the input specs; a
    CNN whose height and width are open cannot run on 1x1 (a 3x3 conv without padding), so a
    larger size is tried, and the latency-aware step times the model on those inputs (it
    crashed onnxruntime on the 1x1 ones)."""
    from onnx import helper

    from qtool.calibration.calibrate import calibrate
    from qtool.config import AdvancedConfig, CalibrationConfig, PreprocessConfig, QuantizeConfig
    from qtool.quantization import run_check
    from qtool.quantization.quantize import quantize_model
    from tests import graphs

    rng = np.random.default_rng(0)
    nodes = [helper.make_node("Conv", ["x", "w"], ["c"], name="conv"),
             helper.make_node("Relu", ["c"], ["r"], name="relu"),
             helper.make_node("Conv", ["r", "w2"], ["y"], name="conv2")]
    built = graphs.model(nodes, [graphs.tensor("x", ["N", 3, "H", "W"])], [graphs.tensor("y", None)],
                         [graphs.init("w", rng.normal(0, 0.3, (8, 3, 3, 3)).astype(np.float32)),
                          graphs.init("w2", rng.normal(0, 0.3, (4, 8, 3, 3)).astype(np.float32))])
    path = tmp_path / "m.onnx"
    onnx.save(built, path)
    data = graphs.write_samples(tmp_path / "data", rng, (3, 16, 16), count=4)
    options = QuantizeConfig(advanced=AdvancedConfig(latency_aware="on", **graphs.RULE_OFF))  # the tuning's inputs
    table = calibrate(path, data, PreprocessConfig(), CalibrationConfig(), options, progress=False)
    sizes = []
    made_up = run_check.made_up_feeds
    monkeypatch.setattr(run_check, "made_up_feeds", lambda specs, size=1: sizes.append(size) or made_up(specs, size))
    import qtool.choices as choices
    from qtool.config import Config

    settled, _ = choices.settle(path, onnx.load(path), table, None, Config(quantization=options))
    assert sizes == [1, 64]  # 1x1 fails the 3x3 convs, 64x64 runs: the tuning timed those
    result = quantize_model(path, table, settled.quantization)
    assert not any("does not run" in note for note in result.notes)
    assert any(n.op_type == "QuantizeLinear" for n in result.model.graph.node)


def test_candidates_are_checked_on_the_first_calibration_sample_whose_fp32_outputs_are_computed_once(tmp_path, monkeypatch):
    """A plain job's candidate builds (here the range choice's, the cubic Resize kept float) and its
    final build run the check on the first calibration sample, not on made-up inputs: the
    candidates are checked as the model written is, and fp32 runs that sample once."""
    from qtool import api

    _cubic_model(tmp_path / "m.onnx")
    sources = []
    reference = run_check.reference
    monkeypatch.setattr(run_check, "reference",
                        lambda fp32, feeds, source: sources.append(source) or reference(fp32, feeds, source))
    result = api.quantize(tmp_path / "m.onnx", data=_data(tmp_path), config=graphs.mechanics_yaml(tmp_path),
                          progress=False)
    ranges = [d for d in result.decisions if d.option == "calibration.method"]
    assert ranges and ranges[0].measured  # a candidate built, checked and scored, then the model
    assert sources == ["the first calibration sample"]
    assert any("kept in float" in note for note in result.notes)


def test_a_candidate_is_scored_on_its_run_checks_session_with_the_same_figures(tmp_path, monkeypatch):
    """A plain job's range choice scores each candidate on the session its run check made (no
    session of its own), and the figures are those a fresh session gives."""
    from qtool import api
    from qtool.choices.measure import Scoring
    from qtool.config import load_config
    from qtool.calibration.calibrate import calibrate
    from qtool.graph import runtime

    _cubic_model(tmp_path / "m.onnx")
    data = _data(tmp_path)
    labels = []
    made = runtime._session
    monkeypatch.setattr(runtime, "_session",
                        lambda source, options, label: labels.append(label) or made(source, options, label))
    result = api.quantize(tmp_path / "m.onnx", data=data, config=graphs.mechanics_yaml(tmp_path), progress=False)
    ranges = [d for d in result.decisions if d.option == "calibration.method"]
    assert ranges and ranges[0].measured  # a candidate built, checked and scored
    assert "candidate" not in labels

    cfg = load_config(graphs.mechanics_yaml(tmp_path))
    table = calibrate(tmp_path / "m.onnx", data, cfg.preprocess, cfg.calibration, cfg.quantization, progress=False)
    scoring = Scoring(tmp_path / "m.onnx", data, cfg)
    built = scoring.build(table, cfg.quantization).model
    labels.clear()
    kept = scoring(built)
    assert "candidate" not in labels
    fresh = onnx.ModelProto()
    fresh.CopyFrom(built)
    assert scoring._ready()(fresh)[0] == kept
    assert "candidate" in labels  # another proto: its own session


@pytest.mark.parametrize("parallel", [False, True])
def test_a_candidate_runs_its_check_and_scoring_on_the_scorings_threads(tmp_path, monkeypatch, parallel):
    """Runs of PARALLEL_MACS or more are scored on SCORING_THREADS intra-op threads, the candidate's
    run check included, so that its session is the one it is scored on; smaller runs on one."""
    from qtool.calibration.calibrate import calibrate
    from qtool.choices import measure
    from qtool.config import load_config
    from qtool.graph import runtime

    _cubic_model(tmp_path / "m.onnx")
    data = _data(tmp_path)
    if parallel:
        monkeypatch.setattr(measure, "PARALLEL_MACS", 0)
    labels = []
    made = runtime._session
    monkeypatch.setattr(runtime, "_session",
                        lambda source, options, label: labels.append(label) or made(source, options, label))
    cfg = load_config(graphs.mechanics_yaml(tmp_path))
    table = calibrate(tmp_path / "m.onnx", data, cfg.preprocess, cfg.calibration, cfg.quantization, progress=False)
    scoring = measure.Scoring(tmp_path / "m.onnx", data, cfg)
    built = scoring.build(table, cfg.quantization).model
    threads = measure.SCORING_THREADS if parallel else 1
    assert scoring._ready().threads == threads
    assert scoring._kept.session.get_session_options().intra_op_num_threads == threads
    labels.clear()
    assert scoring(built)["cosine"] > 0.9 and "candidate" not in labels


def test_the_scored_samples_fp32_runs_go_beside_the_first_build(tmp_path, monkeypatch):
    """A plain job's range choice starts fp32 on the run check's sample (with the tensor dims the
    speed rule reads on it) and on the scored samples in the background thread, and builds its
    first candidate meanwhile; the figures are those fp32 computed on the main thread gives."""
    import threading

    from qtool import api
    from qtool.choices import measure
    from qtool.config import load_config
    from qtool.graph import runtime
    from qtool.quantization import quantize as back_end

    _cubic_model(tmp_path / "m.onnx")
    data = _data(tmp_path)
    made_on, dims_on = [], []
    made = runtime._session
    monkeypatch.setattr(runtime, "_session", lambda source, options, label: made_on.append(
        (label, threading.current_thread().name)) or made(source, options, label))
    dims = back_end.tensor_dims
    monkeypatch.setattr(back_end, "tensor_dims", lambda model, feeds: dims_on.append(
        threading.current_thread().name) or dims(model, feeds))
    result = api.quantize(tmp_path / "m.onnx", data=data, config=graphs.mechanics_yaml(tmp_path), progress=False)
    [ranges] = [d for d in result.decisions if d.option == "calibration.method"]
    assert ranges.measured
    fp32 = [thread for label, thread in made_on if label == str(tmp_path / "m.onnx")]
    assert any(thread.startswith("qtool-fp32") for thread in fp32)  # the batch probe runs on the main thread
    assert [thread for label, thread in made_on if label == "fp32 model"] == ["qtool-fp32_0"]  # the run check's
    assert dims_on == []  # the speed rule is off in this config: nothing reads the dims
    plain = api.quantize(tmp_path / "m.onnx", data=data, progress=False)
    assert any(d.option == "quantization.advanced.float_nodes" and "speed rule" in d.rule for d in plain.decisions)
    assert dims_on == ["qtool-fp32_0"]
    assert all(thread == "MainThread" for label, thread in made_on if label == "int8 model")

    cfg = load_config(graphs.mechanics_yaml(tmp_path))
    samples, threads = measure.scored_samples(tmp_path / "m.onnx", input_specs(onnx.load(tmp_path / "m.onnx")),
                                              data, cfg)
    here = measure.evaluator(tmp_path / "m.onnx", samples, threads, cfg)  # on this thread
    beside = measure.Scoring(tmp_path / "m.onnx", data, cfg)._ready()
    assert len(beside.reference) == len(here.reference) == len(samples) > 0
    for theirs, ours in zip(beside.reference, here.reference):
        for a, b in zip(theirs, ours):
            np.testing.assert_array_equal(a, b)


def test_a_candidate_is_the_written_build_without_the_checks_of_what_qtool_writes(tmp_path, monkeypatch):
    """A measured candidate skips onnx's checker and the target's constraints (the build that is
    written runs them) and is the same model."""
    from qtool.calibration.calibrate import calibrate
    from qtool.config import load_config
    from qtool.quantization import quantize as back_end

    _cubic_model(tmp_path / "m.onnx")
    data = _data(tmp_path)
    cfg = load_config(graphs.mechanics_yaml(tmp_path))
    table = calibrate(tmp_path / "m.onnx", data, cfg.preprocess, cfg.calibration, cfg.quantization, progress=False)
    checked = []
    for name in ("check_model", "target_problems"):
        real = getattr(back_end, name)
        monkeypatch.setattr(back_end, name, lambda *a, real=real, name=name, **k: checked.append(name) or real(*a, **k))
    candidate = back_end.quantize_model(tmp_path / "m.onnx", table, cfg.quantization, candidate=True)
    assert checked == []
    written = back_end.quantize_model(tmp_path / "m.onnx", table, cfg.quantization)
    assert set(checked) == {"target_problems", "check_model"}  # each build of it (the run check may build twice)
    assert candidate.model.SerializeToString() == written.model.SerializeToString()


def test_keeping_holds_the_last_passing_models_session_only():
    model = _identity_model()
    feeds = {"x": np.array([1.0, np.inf], np.float32)}
    passes = run_check.Reference(feeds, ("y",), (np.array([0, np.inf], np.float32),))
    fails = run_check.Reference(feeds, ("y",), (np.zeros(3, np.float32),))
    assert run_check.check(model, passes) is None  # outside keeping(): nothing kept anywhere
    with run_check.keeping() as kept:
        assert run_check.check(model, passes) is None
        assert kept.model is model and kept.session is not None
        assert run_check.check(model, fails) is not None
        assert kept.model is None and kept.session is None
        assert run_check.check(model, passes) is None
    other = onnx.ModelProto()
    other.CopyFrom(model)
    assert kept.take(other) is None and kept.model is None  # another proto, even of the same bytes
    assert run_check._KEEPING.get() is None


def test_every_build_of_a_file_checks_on_one_sample_and_fp32_runs_it_once(tmp_path, monkeypatch):
    """Two builds of one job's model file from different prepared graphs (one with a Conv kept
    float, as the speed rule keeps some) check their int8 models on the first calibration sample
    alone, though calibration batches 8, and fp32 runs that sample once for both: every graph
    prepared from a file computes its function, so the same output shapes and finite values."""
    from qtool import api
    from qtool.config import load_config
    from qtool.graph.modelio import input_specs
    from qtool.quantization.quantize import SharedGraphs, quantize_model

    rng = np.random.default_rng(3)
    built = graphs.model([helper.make_node("Conv", ["x", "wa"], ["a"], name="conv_a", pads=[1, 1, 1, 1]),
                          helper.make_node("Relu", ["a"], ["r"], name="relu"),
                          helper.make_node("Conv", ["r", "wb"], ["y"], name="conv_b", pads=[1, 1, 1, 1])],
                         [graphs.tensor("x", ["N", 3, 8, 8])], [graphs.tensor("y", ["N", 4, 8, 8])],
                         [graphs.init("wa", rng.normal(0, 0.3, (4, 3, 3, 3)).astype(np.float32)),
                          graphs.init("wb", rng.normal(0, 0.3, (4, 4, 3, 3)).astype(np.float32))])
    options = graphs.mechanics()
    path, table = graphs.calibrated(tmp_path, rng, built, options, count=16)
    cfg = load_config(None)
    calib = api._calibration_batches(tmp_path / "data", input_specs(onnx.load(path)), cfg)
    assert len(next(iter(calib(16)))) == cfg.calibration.batch_size > 1
    references, checked = [], []
    reference, check = run_check.reference, run_check.check
    monkeypatch.setattr(run_check, "reference", lambda fp32, feeds, source: references.append(feeds["x"].shape)
                        or reference(fp32, feeds, source))
    monkeypatch.setattr(run_check, "check", lambda model, ref: checked.append(ref.feeds["x"].shape)
                        or check(model, ref))
    shared = SharedGraphs()
    whole = quantize_model(path, table, options, data=calib, shared=shared)
    advanced = replace(options.advanced, float_nodes=("conv_b",))
    part = quantize_model(path, table, replace(options, advanced=advanced), data=calib, shared=shared)
    assert "conv_b" in whole.plan.quantized_nodes and "conv_b" not in part.plan.quantized_nodes  # two graphs
    assert references == [(1, 3, 8, 8)]
    assert checked == [(1, 3, 8, 8)] * 2


def test_the_speed_rule_reads_its_shapes_on_the_run_checks_input(tmp_path, monkeypatch):
    """The plain command (speed rule on) reads the first calibration sample once: the speed rule's
    shapes come from the run check's input, on which fp32 runs once for the whole job."""
    from qtool import api
    from qtool.quantization import quantize as back_end

    _cubic_model(tmp_path / "m.onnx")
    references, shaped = [], []
    reference, dims = run_check.reference, back_end.tensor_dims
    monkeypatch.setattr(run_check, "reference",
                        lambda fp32, feeds, source: references.append(feeds) or reference(fp32, feeds, source))
    monkeypatch.setattr(back_end, "tensor_dims", lambda model, feeds: shaped.append(feeds) or dims(model, feeds))
    result = api.quantize(tmp_path / "m.onnx", data=_data(tmp_path), progress=False)
    assert any(d.option == "quantization.advanced.float_nodes" and "speed rule" in d.rule for d in result.decisions)
    assert len(references) == 1 and len(shaped) == 1 and shaped[0] is references[0]


def test_candidates_measured_side_by_side_give_the_figures_measured_in_turn(tmp_path, monkeypatch):
    """Where a scored run takes one thread, Scoring.measured builds and scores the first candidate on
    the caller's thread and the others on the background thread at the same time; each candidate's
    figures are those build() then scoring() give it on its own."""
    import threading

    from qtool.calibration.calibrate import calibrate_methods
    from qtool.choices import measure
    from qtool.config import load_config
    from qtool.graph import runtime

    rng = np.random.default_rng(3)
    onnx.save(graphs.conv_model(rng, activation="Relu"), tmp_path / "m.onnx")
    data = graphs.write_samples(tmp_path / "data", rng, (8, 12, 12), scale=2.0)
    cfg = load_config(graphs.mechanics_yaml(tmp_path))
    tables = calibrate_methods(tmp_path / "m.onnx", data, cfg.preprocess, cfg.calibration, cfg.quantization,
                               ["minmax", "mse", "percentile"], progress=False)
    threads = []
    made = runtime._session
    monkeypatch.setattr(runtime, "_session", lambda source, options, label: (
        label == "int8 model" and threads.append(threading.current_thread().name)) or made(source, options, label))
    beside = measure.Scoring(tmp_path / "m.onnx", data, cfg).measured([(t, cfg.quantization) for t in tables])
    assert "MainThread" in threads and any(name.startswith("qtool-fp32") for name in threads)
    in_turn = measure.Scoring(tmp_path / "m.onnx", data, cfg)
    alone = [in_turn(in_turn.build(t, cfg.quantization).model) for t in tables]
    assert beside == alone
    assert len({f["cosine"] for f in alone}) > 1  # the tables differ: the figures say which is which


def test_a_background_call_the_background_thread_waits_for_runs_at_once():
    """A call the background thread waits for before its turn (made there, or queued behind the
    waiting call) runs there and then: on the one thread, its turn would never come."""
    import threading

    from qtool.graph.runtime import in_background

    def outer():
        return in_background(lambda: threading.current_thread().name).result(timeout=20)

    assert in_background(outer).result(timeout=30).startswith("qtool-fp32")
    failing = in_background(lambda: in_background(lambda: 1 / 0).result())
    with pytest.raises(ZeroDivisionError):
        failing.result(timeout=30)
    # ... and so does a call queued behind the one that waits for it
    go, later = threading.Event(), []

    def waiting():
        go.wait(20)
        return later[0].result(timeout=20)

    first = in_background(waiting)
    later.append(in_background(lambda: threading.current_thread().name))
    go.set()
    assert first.result(timeout=30).startswith("qtool-fp32")
    assert later[0].result(timeout=30).startswith("qtool-fp32")


def test_two_threads_asking_for_one_prepared_graph_prepare_it_once(tmp_path, monkeypatch):
    """Candidates built side by side share the job's prepared graph: the first thread to ask makes
    it, the other waits for it."""
    import threading
    import time

    from qtool.calibration.calibrate import calibrate
    from qtool.config import load_config
    from qtool.quantization import quantize as back_end

    _cubic_model(tmp_path / "m.onnx")
    data = _data(tmp_path)
    cfg = load_config(graphs.mechanics_yaml(tmp_path))
    table = calibrate(tmp_path / "m.onnx", data, cfg.preprocess, cfg.calibration, cfg.quantization, progress=False)
    prepared = []
    real = back_end._prepared_graph

    def slow(*args):
        prepared.append(threading.current_thread().name)
        time.sleep(0.3)  # long enough for the other thread to ask meanwhile
        return real(*args)

    monkeypatch.setattr(back_end, "_prepared_graph", slow)
    shared = back_end.SharedGraphs()
    got = []
    askers = [threading.Thread(target=lambda: got.append(shared.graph(tmp_path / "m.onnx", table, cfg.quantization)))
              for _ in range(2)]
    for asker in askers:
        asker.start()
    for asker in askers:
        asker.join()
    assert len(prepared) == 1 and len(got) == 2 and got[0] is got[1]


def test_the_written_builds_kernels_are_counted_beside_its_run_check(tmp_path, monkeypatch):
    """The kernels onnxruntime makes of the written model are counted in the background while its
    run check runs, and reach the result, its JSON and the command's summary line as the written
    file's counts; a target that does not run onnxruntime's kernels counts none."""
    import dataclasses
    import json
    import threading

    from qtool import api
    from qtool.calibration.calibrate import calibrate
    from qtool.config import load_config
    from qtool.graph import runtime
    from qtool.graph.kernels import count_kernels, kernel_summary

    rng = np.random.default_rng(4)
    onnx.save(graphs.conv_model(rng, activation="Relu"), tmp_path / "m.onnx")
    data = graphs.write_samples(tmp_path / "data", rng, (8, 12, 12))
    made = runtime._session
    counted_on = []
    monkeypatch.setattr(runtime, "_session", lambda source, options, label: (
        options.optimized_model_filepath and counted_on.append(threading.current_thread().name))
        or made(source, options, label))
    result = api.quantize(tmp_path / "m.onnx", data=data, config=graphs.mechanics_yaml(tmp_path), progress=False)
    assert counted_on and all(name.startswith("qtool-fp32") for name in counted_on)
    result.save(tmp_path / "q.onnx")
    assert result.kernels == count_kernels(tmp_path / "q.onnx")
    assert result.kernels.integer_convs == result.kernels.quantized_convs == 1
    assert result.to_dict()["kernels"] == dataclasses.asdict(result.kernels)

    out = CliRunner().invoke(main, ["quantize", str(tmp_path / "m.onnx"), "--data", str(data), "--config",
                                    str(graphs.mechanics_yaml(tmp_path)), "-o", str(tmp_path / "c.onnx"),
                                    "--json", str(tmp_path / "c.json")])
    assert out.exit_code == 0, out.stderr
    assert kernel_summary(result.kernels) in out.stdout.splitlines()
    assert json.loads((tmp_path / "c.json").read_text())["kernels"]["integer_convs"] == 1

    cfg = load_config(graphs.mechanics_yaml(tmp_path))
    table = calibrate(tmp_path / "m.onnx", data, cfg.preprocess, cfg.calibration, cfg.quantization, progress=False)
    openvino = api.quantize(tmp_path / "m.onnx", table=table, config={"quantization": {"target": "openvino"}})
    assert openvino.settled.quantization.target == "openvino"
    assert openvino.kernels is None and openvino.to_dict()["kernels"] is None
