"""qtool evaluate --runtime openvino: both models compiled with OpenVINO, fidelity and latency
measured there, the report naming the runtime, its version, the fp32 baseline's precision (and the
f32 one where the default is not f32) and how many heavy ops run in int8; without openvino
installed, one line saying how to install it (exit 2)."""

from __future__ import annotations

import sys

import numpy as np
import onnx
import pytest
from click.testing import CliRunner

import qtool
from qtool.cli import main
from tests import graphs
from tests.conftest import openvino_weights

# nothing measured: no OpenVINO needed to quantize; toy layers, which the speed rule would keep float
CONFIG = {"calibration": {"method": "minmax"},
          "quantization": {"target": "openvino", "bias_correction": "off", **openvino_weights(),
                           "advanced": {"head_tails": "off", "speed_rule": "off"}}}


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    folder = tmp_path_factory.mktemp("ov")
    fp32 = folder / "m.onnx"
    onnx.save(graphs.fused_block_model(np.random.default_rng(0)), fp32)
    data = graphs.write_samples(folder / "data", np.random.default_rng(1), (3, 12, 12), count=8)
    int8 = folder / "int8.onnx"
    onnx.save(qtool.quantize(str(fp32), data=str(data), config=CONFIG, progress=False).model, int8)
    return fp32, int8, data


def test_without_openvino_the_runtime_says_how_to_install_it(models, monkeypatch):
    monkeypatch.setitem(sys.modules, "openvino", None)  # import openvino raises ImportError
    fp32, int8, data = models
    result = CliRunner().invoke(main, ["evaluate", str(fp32), str(int8), "--data", str(data), "--runtime", "openvino"])
    assert result.exit_code == 2, result.output
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert len(lines) == 1 and 'pip install "qtool[openvino]"' in lines[0]


def test_the_default_runtime_is_onnxruntime(models):
    fp32, int8, data = models
    report = qtool.evaluate(fp32, int8, data, {"evaluation": {"batch_size": 1, "runs": 3}}, progress=False)
    assert report.runtime["name"] == "onnxruntime" and report.to_dict()["runtime"] == report.runtime
    assert "fp32_precision" not in report.latency
    # whether int8 products were asked to be exact (x86 without VNNI) is data in the report
    from qtool.graph.runtime import exact_int8_products
    assert report.runtime["exact_int8_products"] is exact_int8_products()


def test_evaluate_on_openvino(models):
    pytest.importorskip("openvino", reason="openvino is not installed (pip install \"qtool[openvino]\")")
    from qtool.evaluation.openvino_runtime import default_precision

    fp32, int8, data = models
    report = qtool.evaluate(fp32, int8, data, {"evaluation": {"batch_size": 1, "runs": 3, "runtime": "openvino"}},
                            progress=False)
    import openvino

    assert report.runtime == {"name": "openvino", "version": openvino.get_version().split("-")[0],
                              "int8_codes_lost_at_concat": []}  # no Concat in this model
    latency = report.latency
    assert latency["runtime"] == "openvino" and latency["fp32_precision"] == default_precision()
    assert ("fp32_f32_ms" in latency) == (default_precision() != "f32")
    # four Convs (one depthwise), the Gemm and the MatMul: all six run in int8
    assert latency["int8_layers"]["heavy_ops"] == 6 and latency["int8_layers"]["int8_heavy_ops"] == 6
    assert all(out["cosine"] > 0.999 for out in report.outputs.values())
    # the CLI's text names the runtime and the baseline's precision
    result = CliRunner().invoke(main, ["evaluate", str(fp32), str(int8), "--data", str(data), "--runtime", "openvino",
                                       "--runs", "2", "--batch-size", "1"])
    assert result.exit_code == 0, result.output
    assert f"on openvino {report.runtime['version']}" in result.output
    assert f"default precision {default_precision()}" in result.output and "heavy ops in int8" in result.output


def test_fp32_on_openvino_runs_all_in_float(models):
    pytest.importorskip("openvino", reason="openvino is not installed (pip install \"qtool[openvino]\")")
    from qtool.evaluation.openvino_runtime import CompiledModel

    fp32, _, data = models
    layers = CompiledModel(fp32, 1, "f32").layers()
    assert layers["heavy_ops"] == 6 and layers["int8_heavy_ops"] == 0 and layers["unfused_fake_quantize"] == 0


def test_with_counters_a_run_reports_its_layers_time_and_the_same_outputs(models):
    """benchmarks/openvino.py's kernel time: a model compiled with the per-layer counters gives each
    run's sum of its layers' times (positive, below the run's wall time) and the outputs it gives
    without them."""
    pytest.importorskip("openvino", reason="openvino is not installed (pip install \"qtool[openvino]\")")
    import time

    from qtool.evaluation.openvino_runtime import CompiledModel

    fp32, _, data = models
    x = np.random.default_rng(2).normal(0, 1, (1, 3, 12, 12)).astype(np.float32)
    feeds = {onnx.load(fp32).graph.input[0].name: x}
    plain, counted = CompiledModel(fp32, 1, "f32"), CompiledModel(fp32, 1, "f32", counters=True)
    start = time.perf_counter()
    got = counted.run(None, feeds)
    wall = time.perf_counter() - start
    assert 0 < counted.layer_seconds() < wall
    np.testing.assert_array_equal(got[0], plain.run(None, feeds)[0])


def _quantize_cli(models, tmp_path):
    fp32, _, data = models
    return CliRunner().invoke(main, ["quantize", str(fp32), "--data", str(data), "--target", "openvino",
                                     "-o", str(tmp_path / "q.onnx")])


def test_without_openvino_the_targets_measured_choices_say_how_to_install_it(models, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "openvino", None)
    result = _quantize_cli(models, tmp_path)  # calibration.method auto: measured candidates
    assert result.exit_code == 2, result.output
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert len(lines) == 1 and 'pip install "qtool[openvino]"' in lines[0] and "measured choices" in lines[0]


def test_the_targets_measured_choices_score_on_openvino(models, tmp_path, monkeypatch):
    pytest.importorskip("openvino", reason="openvino is not installed (pip install \"qtool[openvino]\")")
    from qtool.evaluation import openvino_runtime

    compiled = []
    real = openvino_runtime.CompiledModel.__init__

    def counting(self, model, threads=1, precision=None, label=None):
        compiled.append(precision)
        real(self, model, threads, precision, label)

    monkeypatch.setattr(openvino_runtime.CompiledModel, "__init__", counting)
    result = _quantize_cli(models, tmp_path)
    assert result.exit_code == 0, result.output
    # the fp32 reference and at least one candidate, compiled at f32
    assert len(compiled) >= 2 and set(compiled) == {"f32"}


def test_a_model_openvino_cannot_compile_is_one_line(tmp_path):
    pytest.importorskip("openvino", reason="openvino is not installed (pip install \"qtool[openvino]\")")
    from onnx import helper

    from qtool.errors import QtoolError
    from qtool.evaluation.openvino_runtime import CompiledModel

    path = tmp_path / "unknown.onnx"
    node = helper.make_node("NoSuchOp", ["x"], ["y"], domain="example.unknown")
    graph = helper.make_graph([node], "g", [graphs.tensor("x", ["N", 4])], [graphs.tensor("y", None)])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17),
                                                    helper.make_opsetid("example.unknown", 1)])
    onnx.save(model, path)
    with pytest.raises(QtoolError) as raised:
        CompiledModel(path)
    message = str(raised.value)
    assert "OpenVINO cannot compile it" in message and "\n" not in message and "NoSuchOp" in message
    assert "Exception from src" not in message


def _requantized_concat(tmp_path, quantized: bool):
    """x -> three Sigmoids -> Concat -> [Q/DQ uint8 with zero point 127 -> Q/DQ zero point 0] -> Conv:
    OpenVINO 2026.4.1's CPU plugin dies compiling the quantized form (as it did on a face detector's
    onnxruntime-target model); the float form is the fp32 model."""
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(0)
    parts = [helper.make_node("Sigmoid", ["x"], [f"a{k}"]) for k in range(3)]
    nodes = [*parts, helper.make_node("Concat", [f"a{k}" for k in range(3)], ["cat"], axis=1)]
    inits = [numpy_helper.from_array(rng.standard_normal((8, 48, 1, 1)).astype(np.float32) * 0.1, "w")]
    source = "cat"
    if quantized:
        inits += [numpy_helper.from_array(np.array(0.0588, np.float32), "s1"),
                  helper.make_tensor("z1", TensorProto.UINT8, [], [127]),
                  numpy_helper.from_array(np.array(0.0221, np.float32), "s2"),
                  helper.make_tensor("z2", TensorProto.UINT8, [], [0])]
        nodes += [helper.make_node("QuantizeLinear", ["cat", "s1", "z1"], ["q1"]),
                  helper.make_node("DequantizeLinear", ["q1", "s1", "z1"], ["d1"]),
                  helper.make_node("QuantizeLinear", ["d1", "s2", "z2"], ["q2"]),
                  helper.make_node("DequantizeLinear", ["q2", "s2", "z2"], ["d2"])]
        source = "d2"
    nodes.append(helper.make_node("Conv", [source, "w"], ["y"]))
    path = tmp_path / ("int8.onnx" if quantized else "fp32.onnx")
    onnx.save(graphs.model(nodes, [graphs.tensor("x", [1, 16, 8, 8])], [graphs.tensor("y", [1, 8, 8, 8])], inits), path)
    return path


def test_a_model_whose_compile_kills_openvino_is_one_line_not_a_crash(tmp_path):
    """OpenVINO's CPU plugin can end the process that compiles a model with a signal; evaluate
    compiles each model in a child process first and says so in one line (exit 2) instead of dying."""
    pytest.importorskip("openvino", reason="openvino is not installed (pip install \"qtool[openvino]\")")
    import subprocess

    fp32, int8 = _requantized_concat(tmp_path, False), _requantized_concat(tmp_path, True)
    data = graphs.write_samples(tmp_path / "data", np.random.default_rng(1), (16, 8, 8), count=2)
    probe = subprocess.run([sys.executable, "-c", "import sys, openvino as ov; ov.Core().compile_model(sys.argv[1], 'CPU')",
                            str(int8)], capture_output=True)
    run = subprocess.run([sys.executable, "-m", "qtool", "evaluate", str(fp32), str(int8), "--data", str(data),
                          "--runtime", "openvino", "--runs", "2"], capture_output=True, text=True)
    assert run.returncode >= 0, "qtool died by a signal"
    if probe.returncode < 0:  # this OpenVINO still crashes on it
        lines = [line for line in run.stderr.splitlines() if line.strip()]
        assert run.returncode == 2 and len(lines) == 1, run.stderr
        assert str(int8) in lines[0] and "crashes compiling it" in lines[0]
    else:
        assert run.returncode == 0, run.stderr


def test_latency_tuning_which_times_onnxruntime_is_refused_for_the_openvino_target(models, tmp_path):
    fp32, _, data = models
    config = tmp_path / "latency.yaml"
    config.write_text("quantization:\n  target: openvino\n  advanced:\n    latency_aware: \"on\"\n")
    result = CliRunner().invoke(main, ["quantize", str(fp32), "--data", str(data), "--config", str(config),
                                       "-o", str(tmp_path / "q.onnx")])
    assert result.exit_code == 2, result.output
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert len(lines) == 1 and "latency_aware" in lines[0] and "openvino" in lines[0]


def test_asymmetric_int8_activations_are_refused_for_openvino_and_the_uint8_config_compiles(models, tmp_path):
    """OpenVINO compiles no int8 Conv input with a zero point: asymmetric activations on the
    openvino target are uint8 (configs/openvino_asymmetric.yaml), and asking for int8 ones is one
    line, exit 2, nothing written."""
    from pathlib import Path

    fp32, _, data = models
    config = tmp_path / "asym_int8.yaml"
    config.write_text("quantization:\n  target: openvino\n  symmetric_activations: false\n")
    out = tmp_path / "q.onnx"
    result = CliRunner().invoke(main, ["quantize", str(fp32), "--data", str(data), "--config", str(config),
                                       "-o", str(out)])
    assert result.exit_code == 2, result.output
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert len(lines) == 1 and str(config) in lines[0] and "uint8" in lines[0] and not out.exists()
    pytest.importorskip("openvino", reason="openvino is not installed (pip install \"qtool[openvino]\")")
    from qtool.evaluation.openvino_runtime import CompiledModel

    shipped = Path(__file__).resolve().parents[1] / "configs" / "openvino_asymmetric.yaml"
    result = CliRunner().invoke(main, ["quantize", str(fp32), "--data", str(data), "--config", str(shipped),
                                       "-o", str(out)])
    assert result.exit_code == 0, result.output
    written = onnx.load(str(out))
    zero_points = {t.name: onnx.numpy_helper.to_array(t) for t in written.graph.initializer}
    activation_zps = [zero_points[n.input[2]] for n in written.graph.node
                      if n.op_type == "QuantizeLinear" and len(n.input) > 2]
    assert activation_zps and all(z.dtype == np.uint8 for z in activation_zps)
    x = np.random.default_rng(2).normal(0, 1, (1, 3, 12, 12)).astype(np.float32)
    assert np.all(np.isfinite(CompiledModel(out).run(None, {written.graph.input[0].name: x})[0]))


def test_an_input_no_node_reads_and_an_output_behind_an_identity_on_openvino(tmp_path):
    """OpenVINO drops a graph input no node reads when it reads a model from bytes (the candidates),
    and names an output behind an Identity by the node's tensor as well as the graph's: the
    measured choices fed the dropped input, and evaluate asked for the output by a name the
    port was not listed under (both were exit 3). Both go through, fidelity measured."""
    pytest.importorskip("openvino", reason="openvino is not installed (pip install \"qtool[openvino]\")")
    rng = np.random.default_rng(0)
    nodes = [onnx.helper.make_node("MatMul", ["x", "w"], ["m"], name="mm"),
             onnx.helper.make_node("Add", ["m", "b"], ["a"], name="add"),
             onnx.helper.make_node("Identity", ["a"], ["fetch_0"], name="out")]
    inits = [graphs.init("w", rng.normal(0, 0.3, (16, 8)).astype(np.float32)),
             graphs.init("b", rng.normal(0, 0.3, (8,)).astype(np.float32))]
    fp32 = tmp_path / "m.onnx"
    onnx.save(graphs.model(nodes, [graphs.tensor("x", ["N", 16]), graphs.tensor("unused", ["N", 1])],
                           [graphs.tensor("fetch_0", ["N", 8])], inits), fp32)
    data = tmp_path / "data"
    data.mkdir()
    for i in range(8):
        np.savez(data / f"s{i}.npz", x=rng.normal(0, 1, (1, 16)).astype(np.float32),
                 unused=np.zeros((1, 1), np.float32))
    int8 = tmp_path / "int8.onnx"
    result = CliRunner().invoke(main, ["quantize", str(fp32), "--data", str(data), "--target", "openvino",
                                       "-o", str(int8)])
    assert result.exit_code == 0, result.output
    report = qtool.evaluate(fp32, int8, data, {"evaluation": {"batch_size": 1, "runs": 2, "runtime": "openvino"}},
                            progress=False)
    assert list(report.outputs) == ["fetch_0"] and report.outputs["fetch_0"]["cosine"] > 0.99


def _concat_models(folder):
    """A Concat of x and -x read by a 1x1 Conv: the fp32 model (its weights already on the int8
    grid) and two QDQ forms of it that compute the same values, the activations' codes int8 with
    zero point 0 and uint8 with zero point 128 (scale 0.03)."""
    from onnx import TensorProto, helper

    rng = np.random.default_rng(3)
    w = rng.normal(0, 0.3, (4, 8, 1, 1)).astype(np.float32)
    w_scale = (np.abs(w).reshape(4, -1).max(1) / 127).astype(np.float32)
    w_codes = np.round(w / w_scale[:, None, None, None]).astype(np.int8)
    io = ([graphs.tensor("x", [1, 4, 6, 6])], [graphs.tensor("y", [1, 4, 6, 6])])
    head = [helper.make_node("Neg", ["x"], ["n"])]
    fp32 = graphs.model(head + [helper.make_node("Concat", ["x", "n"], ["c"], axis=1),
                                helper.make_node("Conv", ["c", "w"], ["y"])],
                        *io, [graphs.init("w", w_codes.astype(np.float32) * w_scale[:, None, None, None])])
    paths = {"fp32": folder / "concat.onnx"}
    onnx.save(fp32, paths["fp32"])
    for codes, (dtype, zero) in {"int8": (TensorProto.INT8, 0), "uint8": (TensorProto.UINT8, 128)}.items():
        nodes = list(head)
        for t in ("x", "n"):
            nodes += [helper.make_node("QuantizeLinear", [t, "s", "z"], [f"{t}_q"]),
                      helper.make_node("DequantizeLinear", [f"{t}_q", "s", "z"], [f"{t}_d"])]
        nodes += [helper.make_node("DequantizeLinear", ["wq", "ws"], ["w"], axis=0),
                  helper.make_node("Concat", ["x_d", "n_d"], ["c"], axis=1),
                  helper.make_node("Conv", ["c", "w"], ["y"])]
        inits = [graphs.init("s", np.float32(0.03)), helper.make_tensor("z", dtype, [], [zero]),
                 graphs.init("wq", w_codes), graphs.init("ws", w_scale)]
        paths[codes] = folder / f"concat_{codes}.onnx"
        onnx.save(graphs.model(nodes, *io, inits), paths[codes])
    return paths, graphs.write_samples(folder / "data", rng, (4, 6, 6), count=4)


def test_int8_codes_a_concat_loses_are_named_where_openvino_converts_them(tmp_path):
    """On a CPU without AMX (oneDNN capped at AVX-512 VNNI in a child process) OpenVINO converts int8
    codes for its Convolutions and loses the scale of those that reach a Concat: the report names
    them, and the outputs show it; the same values written uint8 with zero point 128 are computed
    right and nothing is named. Uncapped, what is named follows what this CPU's plugin does."""
    pytest.importorskip("openvino", reason="openvino is not installed (pip install \"qtool[openvino]\")")
    import json
    import os
    import subprocess

    from qtool.evaluation.openvino_runtime import converts_int8_codes

    paths, data = _concat_models(tmp_path)
    reports = {}
    for codes in ("int8", "uint8"):
        out = tmp_path / f"{codes}.json"
        done = subprocess.run([sys.executable, "-m", "qtool", "evaluate", str(paths["fp32"]), str(paths[codes]),
                               "--data", str(data), "--runtime", "openvino", "--runs", "1", "--batch-size", "1",
                               "--json", str(out)],
                              env=dict(os.environ, ONEDNN_MAX_CPU_ISA="AVX512_CORE_VNNI"), capture_output=True,
                              text=True)
        assert done.returncode == 0, done.stderr
        reports[codes] = json.loads(out.read_text())
        if codes == "int8":
            assert "loses the scale of 2 that reach a Concat" in done.stdout
    assert reports["int8"]["runtime"]["int8_codes_lost_at_concat"] == ["x", "n"]
    assert reports["uint8"]["runtime"]["int8_codes_lost_at_concat"] == []
    assert reports["uint8"]["outputs"]["y"]["cosine"] > 0.999
    assert reports["int8"]["outputs"]["y"]["cosine"] < 0.99
    here = qtool.evaluate(str(paths["fp32"]), str(paths["int8"]), str(data),
                          {"evaluation": {"batch_size": 1, "runs": 1, "runtime": "openvino"}}, progress=False)
    assert here.runtime["int8_codes_lost_at_concat"] == (["x", "n"] if converts_int8_codes() else [])


def test_only_codes_that_reach_a_concat_read_by_a_convolution_are_named(tmp_path):
    """The graph half of codes_lost_at_concat: int8 codes through a Concat into a Conv are named
    where the plugin converts them (also through a MaxPool on the way, with a zero point from a
    Constant, or with a Q/DQ pair after the Concat); codes whose Concat feeds no Conv (an Identity,
    a Mul) and uint8 codes are not; where the plugin does not convert, nothing is. No OpenVINO
    needed: the plugin's side is given."""
    from onnx import helper

    from qtool.evaluation.openvino_runtime import codes_lost_at_concat

    paths, _ = _concat_models(tmp_path)
    int8 = onnx.load(paths["int8"])
    assert codes_lost_at_concat(int8, converts=True) == ["x", "n"]
    assert codes_lost_at_concat(int8, converts=False) == []
    assert codes_lost_at_concat(onnx.load(paths["uint8"]), converts=True) == []
    # a zero point given by a Constant node (as exporters that keep weights in Constants write it)
    model = onnx.load(paths["int8"])
    zero = next(t for t in model.graph.initializer if t.name == "z")
    model.graph.initializer.remove(zero)
    model.graph.node.insert(0, helper.make_node("Constant", [], ["z"], value=zero))
    assert codes_lost_at_concat(model, converts=True) == ["x", "n"]
    # codes that pass an op moving them (a MaxPool, whose rule ties its output) on their way to the Concat
    model = onnx.load(paths["int8"])
    concat = next(n for n in model.graph.node if n.op_type == "Concat")
    concat.input[0] = "x_p"
    model.graph.node.append(helper.make_node("MaxPool", ["x_d"], ["x_p"], kernel_shape=[1, 1]))
    assert codes_lost_at_concat(model, converts=True) == ["x", "n"]
    # a Q/DQ pair on the Concat's output, as some quantizers add: the codes reach the Conv all the same
    model = onnx.load(paths["int8"])
    conv = next(n for n in model.graph.node if n.op_type == "Conv")
    conv.input[0] = "c_d"
    model.graph.node.extend([helper.make_node("QuantizeLinear", ["c", "s", "z"], ["c_q"]),
                             helper.make_node("DequantizeLinear", ["c_q", "s", "z"], ["c_d"])])
    assert codes_lost_at_concat(model, converts=True) == ["x", "n"]
    for reader in ("Identity", "Mul"):  # the Concat read by something else than a Conv
        model = onnx.load(paths["int8"])
        conv = next(n for n in model.graph.node if n.op_type == "Conv")
        conv.CopyFrom(helper.make_node(reader, ["c", "c"] if reader == "Mul" else ["c"], ["y"]))
        assert codes_lost_at_concat(model, converts=True) == []
