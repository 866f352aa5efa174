"""User errors: exit code 2 and one line on stderr naming the file, no traceback; a model qtool derives
that onnxruntime cannot load, from one it loads, is exit 3."""

from __future__ import annotations

from tests.conftest import CALIB_SAMPLES, EFFNET, run_qtool


def _one_line_error(result, *fragments):
    assert result.returncode == 2, result.stderr
    lines = [l for l in result.stderr.splitlines() if l.startswith("error:")]
    assert len(lines) == 1, result.stderr
    assert "Traceback" not in result.stderr
    for fragment in fragments:
        assert fragment in lines[0], lines[0]


def test_missing_model(tmp_path):
    _one_line_error(run_qtool("calibrate", tmp_path / "nope.onnx", "--data", CALIB_SAMPLES, "-o", tmp_path / "t.json"),
                    "nope.onnx", "not found")


def test_not_an_onnx_file(tmp_path):
    bogus = tmp_path / "bogus.onnx"
    bogus.write_bytes(b"\x00\x01 definitely not protobuf \xff" * 10)
    _one_line_error(run_qtool("quantize", bogus, "--data", CALIB_SAMPLES, "-o", tmp_path / "q.onnx"), "bogus.onnx")
    assert not (tmp_path / "q.onnx").exists()


def test_output_in_missing_directory(tmp_path):
    _one_line_error(run_qtool("calibrate", EFFNET, "--data", CALIB_SAMPLES, "-o", tmp_path / "no" / "t.json"),
                    "does not exist")


def test_output_equal_to_input(tmp_path):
    _one_line_error(run_qtool("quantize", EFFNET, "--data", CALIB_SAMPLES, "-o", EFFNET), "same as an input")


def test_table_for_another_model_lacks_tensors(tmp_path):
    from tests import graphs
    import numpy as np
    import onnx

    other = tmp_path / "other.onnx"
    onnx.save(graphs.gemm_model(np.random.default_rng(0)), other)
    data = graphs.write_samples(tmp_path / "d", np.random.default_rng(0), (32,), count=4)
    table = tmp_path / "t.json"
    assert run_qtool("calibrate", other, "--data", data, "-o", table).returncode == 0
    result = run_qtool("quantize", EFFNET, "--table", table, "-o", tmp_path / "q.onnx")
    _one_line_error(result, "t.json", "no entry for", "--allow-missing")
    assert "different model" in result.stderr  # the sha256 mismatch is a warning first


def test_usage_error_exits_2(tmp_path):
    result = run_qtool("quantize", EFFNET, "-o", tmp_path / "q.onnx")
    assert result.returncode == 2 and "exactly one of --table" in result.stderr


def test_a_model_quantized_already_is_refused(tmp_path):
    """An int8 model given back to quantize or calibrate: one line naming its quantized ops, exit 2,
    nothing written (quantizing it again would stack a second set of ranges on int8 codes)."""
    from tests import graphs
    import numpy as np
    import onnx

    model = tmp_path / "m.onnx"
    onnx.save(graphs.conv_model(np.random.default_rng(0), activation="Relu"), model)
    data = graphs.write_samples(tmp_path / "data", np.random.default_rng(1), (8, 12, 12), count=4)
    assert run_qtool("quantize", model, "--data", data, "-o", tmp_path / "q.onnx").returncode == 0
    _one_line_error(run_qtool("quantize", tmp_path / "q.onnx", "--data", data, "-o", tmp_path / "qq.onnx"),
                    "q.onnx", "quantized already", "QuantizeLinear", "give it the fp32 model")
    _one_line_error(run_qtool("calibrate", tmp_path / "q.onnx", "--data", data, "-o", tmp_path / "t.json"),
                    "quantized already")
    assert not (tmp_path / "qq.onnx").exists() and not (tmp_path / "t.json").exists()


def _conv_then(tmp_path, last_node=None, domain=None):
    """tests.graphs' Conv model (its last node replaced by `last_node`), 4 samples beside it."""
    import numpy as np
    import onnx
    from onnx import helper

    from tests import graphs

    rng = np.random.default_rng(0)
    model = graphs.conv_model(rng)
    if last_node is not None:
        model.graph.node[-1].CopyFrom(last_node)
        model.opset_import.append(helper.make_opsetid(domain, 1))
    onnx.save(model, tmp_path / "m.onnx")
    return tmp_path / "m.onnx", graphs.write_samples(tmp_path / "data", rng, (8, 12, 12), count=4)


def test_a_model_onnxruntime_cannot_load_is_exit_2_naming_it(tmp_path):
    from click.testing import CliRunner
    from onnx import helper

    from qtool.cli import main

    path, data = _conv_then(tmp_path, helper.make_node("Foo", ["conv"], ["y"], name="out", domain="com.example"),
                            "com.example")
    result = CliRunner().invoke(main, ["quantize", str(path), "--data", str(data), "-o", str(tmp_path / "q.onnx")])
    assert result.exit_code == 2, result.output + result.stderr
    assert result.stderr.startswith(f"error: {path}: onnxruntime cannot load it:"), result.stderr


def test_a_model_qtool_derives_that_onnxruntime_cannot_load_is_exit_3(tmp_path, monkeypatch):
    """The model loads; the graph qtool makes from it to observe calibration tensors does not (a
    Cast of a tensor with no name, as a rewrite of an absent optional input once wrote): qtool's
    bug, exit 3, not the user's model (exit 2)."""
    from click.testing import CliRunner
    from onnx import helper

    import qtool.calibration.observer as observer
    from qtool.cli import main

    made = observer.with_reductions

    def broken(model, *args, **kwargs):
        reduced, outputs = made(model, *args, **kwargs)
        reduced.graph.node.append(helper.make_node("Cast", [""], ["nothing"], name="cast_nothing", to=6))
        return reduced, outputs

    monkeypatch.setattr(observer, "with_reductions", broken)
    path, data = _conv_then(tmp_path)
    result = CliRunner().invoke(main, ["quantize", str(path), "--data", str(data), "-o", str(tmp_path / "q.onnx")])
    assert result.exit_code == 3, result.output + result.stderr
    assert "internal error" in result.stderr and f"onnxruntime loads {path} itself" in result.stderr, result.stderr
    assert not (tmp_path / "q.onnx").exists()


def test_the_command_ends_with_its_whole_output_and_its_exit_code(tmp_path):
    """`python -m qtool` ends the process as soon as the command is done, without Python's teardown
    (qtool.cli.entry): its output reaches the pipe to the last line, its file is written, and the
    exit code is the command's."""
    import numpy as np
    import onnx

    from tests import graphs

    rng = np.random.default_rng(0)
    onnx.save(graphs.conv_model(rng, activation="Relu"), tmp_path / "m.onnx")
    data = graphs.write_samples(tmp_path / "calib", rng, (8, 12, 12), count=8)
    done = run_qtool("quantize", tmp_path / "m.onnx", "--data", data, "-o", tmp_path / "q.onnx")
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines()[0].startswith("quantized ")
    assert done.stdout.splitlines()[-1].startswith("onnxruntime kernels: 1 integer Conv")
    onnx.checker.check_model(onnx.load(tmp_path / "q.onnx"))
    _one_line_error(run_qtool("quantize", tmp_path / "nope.onnx", "--data", data, "-o", tmp_path / "x.onnx"),
                    "nope.onnx")
    version = run_qtool("--version")
    assert version.returncode == 0 and version.stdout.startswith("qtool, version")
    assert run_qtool("quantize").returncode == 2  # a usage error: click's own exit code
