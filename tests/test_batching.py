"""Models that do not take the batches their declared dynamic first axis promises, outputs of any
rank, and runs onnxruntime refuses: the plain command goes through, or exits 2 in one line."""

from __future__ import annotations

import warnings

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import yaml
from click.testing import CliRunner
from onnx import TensorProto, helper, numpy_helper

import qtool
from qtool.cli import main
from qtool.data.batching import batch_refusal
from qtool.data.dataset import open_data
from qtool.config import PreprocessConfig
from qtool.evaluation.metrics import ClassificationAccumulator, FidelityAccumulator, rows
from qtool.graph.modelio import input_specs


def _model(nodes, inits, output_shape, input_shape=("N", 2, 6), input_type=TensorProto.FLOAT, name="x"):
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info(name, input_type, list(input_shape))],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, output_shape)], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return model


def _weight(rng, shape=(6, 6)):
    return numpy_helper.from_array(rng.normal(0, 1, shape).astype(np.float32), "w")


def baked_reshape(rng) -> onnx.ModelProto:
    """x [N, 2, 6] -> MatMul -> Reshape to the constant [1, 2, 3, 2] (batch 1 baked in, as a traced
    attention view) -> Relu."""
    shape = numpy_helper.from_array(np.array([1, 2, 3, 2], np.int64), "s")
    nodes = [helper.make_node("MatMul", ["x", "w"], ["m"], name="mm"),
             helper.make_node("Reshape", ["m", "s"], ["r"], name="node_view"),
             helper.make_node("Relu", ["r"], ["y"], name="relu")]
    return _model(nodes, [_weight(rng), shape], ["N", 2, 3, 2])


def scalar_output(rng) -> onnx.ModelProto:
    """x [N, 2, 6] -> MatMul -> Relu -> ReduceMean over everything: a 0-d score."""
    nodes = [helper.make_node("MatMul", ["x", "w"], ["m"], name="mm"),
             helper.make_node("Relu", ["m"], ["r"], name="relu"),
             helper.make_node("ReduceMean", ["r"], ["y"], name="mean", keepdims=0)]
    return _model(nodes, [_weight(rng)], [])


def _samples(rng, count=6, shape=(1, 2, 6)):
    return [{"x": rng.normal(0, 1, shape).astype(np.float32)} for _ in range(count)]


def _folder(tmp_path, samples):
    folder = tmp_path / "data"
    folder.mkdir()
    for i, sample in enumerate(samples):
        np.savez(folder / f"{i}.npz", **sample)
    return folder


def test_a_graph_with_batch_one_baked_in_is_calibrated_one_sample_at_a_time(tmp_path):
    rng = np.random.default_rng(0)
    onnx.save(baked_reshape(rng), str(tmp_path / "m.onnx"))
    samples = _samples(rng)
    result = qtool.quantize(tmp_path / "m.onnx", data=samples, progress=False)
    sized = [d for d in result.decisions if d.option == "calibration.batch_size"]
    assert [d.value for d in sized] == [1]
    assert result.settled.calibration.batch_size == 1 and result.settled.evaluation.batch_size == 1
    assert result.table.settings["batch_size"] == 1
    notes = [n for n in result.notes if n.startswith("calibration.batch_size = 1")]
    assert len(notes) == 1 and "refuses a batch of 6 samples" in notes[0] and "node_view" in notes[0]
    session = ort.InferenceSession(result.model.SerializeToString(), providers=["CPUExecutionProvider"])
    assert session.run(None, samples[0])[0].shape == (1, 2, 3, 2)
    # the settled config replays the same model, measuring nothing and probing nothing
    result.save_config(tmp_path / "settled.yaml")
    assert yaml.safe_load((tmp_path / "settled.yaml").read_text())["calibration"]["batch_size"] == 1
    again = qtool.quantize(tmp_path / "m.onnx", data=samples, config=tmp_path / "settled.yaml", progress=False)
    assert again.model.SerializeToString() == result.model.SerializeToString()
    assert not any(d.option == "calibration.batch_size" for d in again.decisions)


def test_samples_of_varying_lengths_are_probed_with_the_first_stacked_with_itself(tmp_path):
    """A sequence model with batch 1 baked in after its first axis (a traced attention view,
    [S, 1, 3, 2]): its first 32 samples all differ in length, so the first batches hold one sample
    each, and only later samples of one length batch together."""
    rng = np.random.default_rng(5)
    concat_axis = numpy_helper.from_array(np.array([1, 3, 2], np.int64), "tail")
    nodes = [helper.make_node("Transpose", ["x"], ["t"], perm=[1, 0, 2]),
             helper.make_node("MatMul", ["t", "w"], ["m"], name="mm"),
             helper.make_node("Shape", ["x"], ["shape"], start=1, end=2),
             helper.make_node("Concat", ["shape", "tail"], ["s"], axis=0),
             helper.make_node("Reshape", ["m", "s"], ["r"], name="node_view"),
             helper.make_node("Relu", ["r"], ["y"], name="relu")]
    model = _model(nodes, [_weight(rng), concat_axis], ["S", 1, 3, 2], input_shape=("N", "S", 6))
    onnx.save(model, str(tmp_path / "m.onnx"))
    lengths = list(range(3, 35)) + [5] * 8
    folder = _folder(tmp_path, [{"x": rng.normal(0, 1, (1, n, 6)).astype(np.float32)} for n in lengths])
    result = qtool.quantize(tmp_path / "m.onnx", data=folder, progress=False)
    assert [d.value for d in result.decisions if d.option == "calibration.batch_size"] == [1]
    assert result.table.num_samples == len(lengths)


def test_a_generator_is_probed_without_losing_its_first_samples(tmp_path):
    rng = np.random.default_rng(1)
    onnx.save(baked_reshape(rng), str(tmp_path / "m.onnx"))
    samples = _samples(rng, 10)
    table = qtool.calibrate(tmp_path / "m.onnx", iter(samples), progress=False)
    assert table.num_samples == 10 and table.settings["batch_size"] == 1
    assert any("refuses a batch of 8 samples" in note for note in table.notes)


def test_the_probe_reads_no_further_than_its_first_batch(tmp_path):
    """The batch is probed on the first batch of several samples; the files after it are not read
    (here the ninth is unreadable, which the job reports where it reads it)."""
    rng = np.random.default_rng(6)
    onnx.save(baked_reshape(rng), str(tmp_path / "m.onnx"))
    folder = _folder(tmp_path, _samples(rng, 8))
    (folder / "8.npz").write_bytes(b"not an npz file")
    source = open_data(folder, input_specs(baked_reshape(rng)), PreprocessConfig())
    assert "refuses a batch of 8 samples" in batch_refusal(str(tmp_path / "m.onnx"), source, 8)


def test_a_model_that_takes_the_batch_keeps_it(tmp_path):
    rng = np.random.default_rng(2)
    model = scalar_output(rng)
    model.graph.node[2].attribute[0].i = 1  # keepdims: [1, 1, 1] per sample...
    model.graph.node[2].attribute.append(helper.make_attribute("axes", [1, 2]))  # ...reduced per sample: [N, 1, 1]
    model.graph.output[0].CopyFrom(helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 1, 1]))
    onnx.save(model, str(tmp_path / "m.onnx"))
    source = open_data(_samples(rng), input_specs(model), PreprocessConfig())
    assert batch_refusal(str(tmp_path / "m.onnx"), source, 8) is None
    result = qtool.quantize(tmp_path / "m.onnx", data=_samples(rng), progress=False)
    assert result.settled.calibration.batch_size == 8


def test_a_scalar_output_goes_through_quantize_and_evaluate(tmp_path):
    """A 0-d output (a quality score): at batch 1 one value per sample; the choices score it and
    evaluate reports it."""
    rng = np.random.default_rng(3)
    onnx.save(scalar_output(rng), str(tmp_path / "m.onnx"))
    folder = _folder(tmp_path, _samples(rng))
    runner = CliRunner()
    result = runner.invoke(main, ["quantize", str(tmp_path / "m.onnx"), "--data", str(folder),
                                  "-o", str(tmp_path / "q.onnx")])
    assert result.exit_code == 0, result.output + result.stderr
    assert "output 'y' does not hold the batch" in result.stderr
    result = runner.invoke(main, ["evaluate", str(tmp_path / "m.onnx"), str(tmp_path / "q.onnx"),
                                  "--data", str(folder), "--json", str(tmp_path / "r.json")])
    assert result.exit_code == 0, result.output + result.stderr
    assert "evaluating one sample at a time" in result.stderr
    report = qtool.evaluate(tmp_path / "m.onnx", tmp_path / "q.onnx", str(folder), progress=False)
    assert report.data["samples"] == 6 and report.outputs["y"]["sqnr_db"] > 20


def test_a_baked_batch_goes_through_evaluate(tmp_path):
    rng = np.random.default_rng(4)
    onnx.save(baked_reshape(rng), str(tmp_path / "m.onnx"))
    folder = _folder(tmp_path, _samples(rng))
    runner = CliRunner()
    assert runner.invoke(main, ["quantize", str(tmp_path / "m.onnx"), "--data", str(folder),
                                "-o", str(tmp_path / "q.onnx")]).exit_code == 0
    result = runner.invoke(main, ["evaluate", str(tmp_path / "m.onnx"), str(tmp_path / "q.onnx"),
                                  "--data", str(folder)])
    assert result.exit_code == 0, result.output + result.stderr
    assert result.stderr.count("evaluating one sample at a time") == 1
    for k in range(2):  # evaluate --shard: every shard checks the same first batch
        result = runner.invoke(main, ["evaluate", str(tmp_path / "m.onnx"), str(tmp_path / "q.onnx"), "--data",
                                      str(folder), "--shard", f"{k}/2", "-o", str(tmp_path / f"e{k}.json")])
        assert result.exit_code == 0, result.output + result.stderr
    result = runner.invoke(main, ["evaluate", str(tmp_path / "m.onnx"), str(tmp_path / "q.onnx"), "--merge",
                                  str(tmp_path / "e0.json"), str(tmp_path / "e1.json")])
    assert result.exit_code == 0, result.output + result.stderr


def test_metrics_take_outputs_of_any_rank():
    # 0-d: one row (one value per sample at batch 1; one per batch for several samples)
    assert rows(np.float32(2.0)).shape == (1, 1) and rows(np.float32(2.0), 4).shape == (1, 1)
    assert rows(np.ones(5), 1).shape == (1, 5)  # no batch axis: one row for the batch
    assert rows(np.ones((4, 3)), 4).shape == (4, 3)
    assert rows([np.ones(2), np.ones(3)], 1).shape == (1, 5)  # a sequence output
    fidelity = FidelityAccumulator()
    assert len(fidelity.update(np.float32(1.0), np.float32(1.1), samples=4)) == 1
    assert len(fidelity.update([np.float32(2.0)], [np.float32(2.0)], samples=1)) == 1
    assert fidelity.result()["sqnr_db"] > 10
    classes = ClassificationAccumulator()
    classes.update(np.array(3.0), np.array(2.0), [None])
    classes.update(np.array(3.0), np.array(2.0), [1, 2])  # a 0-d output of a batch of 2: one row, no labels
    assert classes.result()["samples"] == 2


def test_the_choices_score_a_scalar_output_at_any_batch(tmp_path):
    """The measured choices' Evaluator (qtool.evaluation.mixed_precision) on a 0-d output, fed
    batches of 2 directly: one value per batch, no IndexError."""
    from qtool.data.dataset import batches
    from qtool.evaluation.mixed_precision import Evaluator

    rng = np.random.default_rng(5)
    onnx.save(scalar_output(rng), str(tmp_path / "m.onnx"))
    source = open_data(_samples(rng, 4), input_specs(onnx.load(str(tmp_path / "m.onnx"))), PreprocessConfig())
    evaluate = Evaluator(tmp_path / "m.onnx", list(batches(source, 2)), None, 1)
    figures, _ = evaluate(onnx.load(str(tmp_path / "m.onnx")))
    assert figures["cosine"] == pytest.approx(1.0) and figures["sqnr_db"] == float("inf")


def _token_model(vocabulary: int = 4) -> onnx.ModelProto:
    """ids [N, 3] int64 -> Gather of a [vocabulary, 6] table -> MatMul: onnxruntime refuses ids out
    of range (InvalidArgument), at any batch."""
    rng = np.random.default_rng(6)
    table = numpy_helper.from_array(rng.normal(0, 1, (vocabulary, 6)).astype(np.float32), "table")
    nodes = [helper.make_node("Gather", ["table", "ids"], ["e"], name="embed"),
             helper.make_node("MatMul", ["e", "w"], ["y"], name="mm")]
    return _model(nodes, [table, _weight(rng)], ["N", 3, 6], ("N", 3), TensorProto.INT64, "ids")


@pytest.mark.parametrize("batch_size", ["1", "8"])
def test_a_run_onnxruntime_refuses_is_exit_2_naming_the_model(tmp_path, batch_size):
    onnx.save(_token_model(), str(tmp_path / "m.onnx"))
    folder = _folder(tmp_path, [{"ids": np.array([[0, 1, 9]], np.int64)} for _ in range(3)])
    result = CliRunner().invoke(main, ["quantize", str(tmp_path / "m.onnx"), "--data", str(folder),
                                       "--batch-size", batch_size, "-o", str(tmp_path / "q.onnx")])
    assert result.exit_code == 2, result.output + result.stderr
    line, = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert f"{tmp_path / 'm.onnx'}: onnxruntime refused to run" in line and "out of" in line
    assert "internal error" not in result.stderr and "Traceback" not in result.stderr
    assert not (tmp_path / "q.onnx").exists()


def test_the_search_evaluates_one_sample_at_a_time_on_a_model_that_refuses_its_batch(tmp_path):
    """Calibrated one sample at a time by request: the search's evaluation data (batch 8) is
    checked on its own and settles evaluation.batch_size."""
    rng = np.random.default_rng(7)
    onnx.save(baked_reshape(rng), str(tmp_path / "m.onnx"))
    samples = _samples(rng)
    result = qtool.search(tmp_path / "m.onnx", qtool.MixedPrecisionSearch(data=samples, cosine=0.5), data=samples,
                          config={"calibration": {"batch_size": 1}}, progress=False)
    sized = [d for d in result.decisions if d.option.endswith("batch_size")]
    assert [(d.option, d.value) for d in sized] == [("evaluation.batch_size", 1)]
    assert "on the evaluation data" in sized[0].note()
    assert result.settled.evaluation.batch_size == 1 and result.search is not None


def test_the_latency_tuning_keeps_a_fixed_first_dimension(tmp_path):
    """x [4, 6] fixed (a batched MatMul's operand, not a batch): the opt-in latency tuning times
    it as it is, never cut to [1, 6] (onnxruntime: Got invalid dimensions for input)."""
    rng = np.random.default_rng(8)
    nodes = [helper.make_node("MatMul", ["x", "w"], ["m"], name="mm"),
             helper.make_node("Relu", ["m"], ["y"], name="relu")]
    onnx.save(_model(nodes, [_weight(rng)], [4, 6], (4, 6)), str(tmp_path / "m.onnx"))
    samples = [{"x": rng.normal(0, 1, (4, 6)).astype(np.float32)} for _ in range(4)]
    result = qtool.quantize(tmp_path / "m.onnx", data=samples, config={"quantization": {"advanced": {"latency_aware": "on"}}},
                            progress=False)
    assert any(d.rule.startswith("latency tuning") for d in result.decisions)


def test_calibration_shards_of_a_model_that_refuses_its_batch_merge(tmp_path):
    rng = np.random.default_rng(9)
    onnx.save(baked_reshape(rng), str(tmp_path / "m.onnx"))
    folder = _folder(tmp_path, _samples(rng))
    runner = CliRunner()
    for k in range(2):
        with warnings.catch_warnings():  # each shard is a process of its own: each warns
            warnings.simplefilter("always")
            result = runner.invoke(main, ["calibrate", str(tmp_path / "m.onnx"), "--data", str(folder),
                                          "--shard", f"{k}/2", "-o", str(tmp_path / f"s{k}.npz")])
        assert result.exit_code == 0, result.output + result.stderr
        assert "calibrating one sample at a time" in result.stderr, (k, result.stderr)
    result = runner.invoke(main, ["calibrate", str(tmp_path / "m.onnx"), "--merge", str(tmp_path / "s0.npz"),
                                  str(tmp_path / "s1.npz"), "-o", str(tmp_path / "t.json")])
    assert result.exit_code == 0, result.output + result.stderr
    result = runner.invoke(main, ["calibrate", str(tmp_path / "m.onnx"), "--data", str(folder),
                                  "-o", str(tmp_path / "single.json")])
    assert result.exit_code == 0 and "note: calibration.batch_size = 1" in result.stderr


def test_an_output_holds_the_batch_when_an_axis_grows_from_one_to_n():
    from qtool.data.batching import _stacked

    assert _stacked((1, 5, 3), (4, 7, 3), 4)  # a decoder's output as long as the batch's longest
    assert _stacked((2, 1, 8), (2, 4, 8), 4)  # a recurrent state [layers, batch, hidden]
    assert not _stacked((), (), 4)  # a 0-d score
    assert not _stacked((3,), (3,), 4)  # a sum over the batch
    assert not _stacked((1, 4), (4,), 4)  # the batch squeezed away


def baked_sequence_view(rng) -> onnx.ModelProto:
    """x [N, S, 6] -> MatMul -> Reshape to [1, S, 3, 2], the 1 a constant (batch 1 baked into a
    traced attention view whose length is read from the input) -> Relu. A batch of n samples comes
    out as one of length n * S."""
    shape = [numpy_helper.from_array(np.array(v, np.int64), n) for n, v in
             (("one", [1]), ("two", [2]), ("tail", [3, 2]))]
    nodes = [helper.make_node("Shape", ["x"], ["sx"]),
             helper.make_node("Slice", ["sx", "one", "two"], ["s"]),
             helper.make_node("Concat", ["one", "s", "tail"], ["view"], axis=0),
             helper.make_node("MatMul", ["x", "w"], ["m"], name="mm"),
             helper.make_node("Reshape", ["m", "view"], ["r"], name="node_view"),
             helper.make_node("Relu", ["r"], ["y"], name="relu")]
    return _model(nodes, [_weight(rng), *shape], [1, "S", 3, 2], input_shape=("N", "S", 6))


# sequence lengths with no two neighbours equal, but samples 4 and 6 equal: spread over 24 samples, the
# choices' 16 samples put them side by side
LENGTHS = [34, 52, 44, 37, 40, 47, 40, 26, 25, 42, 29, 55, 29, 61, 48, 31, 35, 38, 19, 29, 43, 32, 46, 61]


def test_samples_of_varying_shapes_probe_the_batch_with_the_first_sample_twice(tmp_path):
    rng = np.random.default_rng(7)
    model = baked_sequence_view(rng)
    onnx.save(model, str(tmp_path / "m.onnx"))
    samples = [{"x": rng.normal(0, 1, (1, n, 6)).astype(np.float32)} for n in LENGTHS]
    source = open_data(samples, input_specs(model), PreprocessConfig())
    # onnxruntime folds the view's length into a -1: a batch of 2 comes out as one sample of length 2S
    assert "for one sample, [1, 272, 3, 2] for 8" in batch_refusal(str(tmp_path / "m.onnx"), source, 8)
    result = qtool.quantize(tmp_path / "m.onnx", data=_folder(tmp_path, samples), progress=False)
    assert [d.value for d in result.decisions if d.option == "calibration.batch_size"] == [1]
    session = ort.InferenceSession(result.model.SerializeToString(), providers=["CPUExecutionProvider"])
    assert session.run(None, samples[1])[0].shape == (1, 52, 3, 2)
