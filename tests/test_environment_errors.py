"""The machine's failures are the user's one-line errors (exit 2, a QtoolError from the API), not
qtool bugs: a read-only or full output, too little memory; and an interrupt that arrives once the
output is in place whole loses nothing (exit 0). The bad-input corpus (tests/bad_inputs/) runs the
same failures through the CLI; these tests hold the API's side and what the corpus cannot set up."""

from __future__ import annotations

import contextlib
import errno
import json
import os
import signal
import subprocess
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

import qtool
from qtool import atomic
from qtool.cli import main
from qtool.errors import NotEnoughMemory, OutputError, QtoolError
from qtool.graph import modelio

CORPUS = Path(__file__).resolve().parent / "bad_inputs"
TINY = CORPUS / "models" / "tiny.onnx"
OK_DATA = CORPUS / "data" / "ok"


@contextlib.contextmanager
def _tmpfs(folder: Path, options: str):
    """A tmpfs mounted on `folder` for the block (root only: skips where mounting is not permitted)."""
    folder.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(folder)], capture_output=True,
                             text=True)
    if mounted.returncode != 0:
        folder.rmdir()
        pytest.skip(f"cannot mount a tmpfs here (needs root): {mounted.stderr.strip()}")
    try:
        yield folder
    finally:
        subprocess.run(["umount", str(folder)], check=True)
        folder.rmdir()


def _tiny_table(tmp_path: Path) -> Path:
    path = tmp_path / "tiny.json"
    qtool.calibrate(TINY, OK_DATA, {"calibration": {"method": "minmax"}}, progress=False).save(path)
    return path


def test_a_read_only_output_directory_is_refused_before_the_work(tmp_path):
    with _tmpfs(tmp_path / "ro", "ro,size=16k") as folder:
        with pytest.raises(OutputError) as info:
            atomic.check_output_path(folder / "out.onnx", TINY)
        assert str(info.value) == f"{folder / 'out.onnx'}: output directory {folder} is on a read-only file system"
        # the API's writers say the same kind of thing when no check came first
        result = qtool.quantize(TINY, table=_tiny_table(tmp_path))
        with pytest.raises(OutputError) as info:
            result.save(folder / "out.onnx")
        assert str(info.value).startswith(f"{folder / 'out.onnx'}: cannot write it: Read-only file system")
        assert isinstance(info.value, qtool.QtoolError) and isinstance(info.value, qtool.OutputError)
        assert isinstance(info.value, OSError)


def test_a_directory_without_write_permission_is_named(tmp_path, monkeypatch):
    """What a user who is not root meets on a chmod 555 directory (root could write there)."""
    monkeypatch.setattr(atomic.os, "access", lambda path, mode: False)
    with pytest.raises(OutputError, match="output directory .* is not writable$"):
        atomic.check_output_path(tmp_path / "out.json")


def test_a_full_disk_names_the_output_and_leaves_nothing(tmp_path):
    """A real ENOSPC: a 64 KiB tmpfs filled to the last block, then quantize -o into it."""
    with _tmpfs(tmp_path / "full", "size=64k") as folder:
        with contextlib.suppress(OSError), open(folder / "filler", "wb") as filler:
            while True:
                filler.write(b"\0" * 4096)
                filler.flush()
        result = CliRunner().invoke(main, ["quantize", str(TINY), "--data", str(OK_DATA), "-o",
                                           str(folder / "out.onnx")])
        assert result.exit_code == 2, result.output
        # notes may come before it; the error is one line, the last
        lines = result.stderr.splitlines()
        assert lines[-1] == f"error: {folder / 'out.onnx'}: cannot write it: No space left on device"
        assert [line for line in lines if not line.startswith("note: ")] == lines[-1:]
        assert os.listdir(folder) == ["filler"]


def test_a_full_disk_while_writing_external_data_is_an_output_error(tmp_path, monkeypatch):
    result = qtool.quantize(TINY, table=_tiny_table(tmp_path))

    def disk_full(fd):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(modelio.os, "fsync", disk_full)
    out = tmp_path / "out" / "m.onnx"
    out.parent.mkdir()
    with pytest.raises(OutputError) as info:
        modelio.save_model(result.model, out, external=True)
    assert str(info.value) == f"{out}: cannot write it: No space left on device"
    assert os.listdir(out.parent) == []


def test_too_little_memory_is_not_enough_memory_naming_the_model(tmp_path):
    """The run check's made-up input for a model of input [1, 3, 2^23, 2^23] needs 1.5 PiB."""
    with pytest.raises(qtool.NotEnoughMemory) as info:
        qtool.quantize(CORPUS / "models" / "huge_input.onnx", table=CORPUS / "tables" / "huge_input.json")
    assert str(info.value).startswith(f"{CORPUS / 'models' / 'huge_input.onnx'}: not enough memory to quantize it "
                                      "(Unable to allocate")


def test_onnxruntime_failing_to_allocate_while_calibrating_is_not_enough_memory():
    with pytest.raises(NotEnoughMemory) as info:
        qtool.calibrate(CORPUS / "models" / "expand_bomb.onnx", OK_DATA, progress=False)
    assert str(info.value) == (f"{CORPUS / 'models' / 'expand_bomb.onnx'}: not enough memory to calibrate it "
                               "(onnxruntime could not allocate 256.0 TiB)")


def test_onnxruntime_failing_to_allocate_while_loading_is_not_enough_memory(tmp_path, monkeypatch):
    """Not 'onnxruntime cannot load it', which would blame the model."""
    from onnxruntime.capi.onnxruntime_pybind11_state import RuntimeException

    import qtool.graph.runtime as runtime

    table = _tiny_table(tmp_path)

    def session(*args, **kwargs):
        raise RuntimeException("[ONNXRuntimeError] : 6 : RUNTIME_EXCEPTION : Exception during initialization: "
                           "Failed to allocate memory for requested buffer of size 3221225472")

    monkeypatch.setattr(runtime, "Session", session)
    with pytest.raises(NotEnoughMemory) as info:
        qtool.quantize(TINY, table=table)
    assert str(info.value) == f"{TINY}: not enough memory to quantize it (onnxruntime could not allocate 3.0 GiB)"


def test_a_memory_error_in_a_command_outside_the_api_is_exit_2(monkeypatch):
    import qtool.integer.verify_int as verify_int

    def verify(*args, **kwargs):
        raise MemoryError("Unable to allocate 9.00 TiB for an array")

    monkeypatch.setattr(verify_int, "verify", verify)
    result = CliRunner().invoke(main, ["verify-int", str(TINY), "--data", str(OK_DATA)])
    assert result.exit_code == 2
    assert result.stderr == (f"error: {TINY}: not enough memory to run verify-int on it (Unable to allocate 9.00 TiB "
                             "for an array)\n")


def test_unusable_table_values_are_refused_when_read(tmp_path):
    document = json.loads(_tiny_table(tmp_path).read_text())
    for change, message in [({"range": [0.0, float("inf")]}, "tensor 'x' has a NaN/Inf value in its range"),
                            ({"zero_point": -1}, "tensor 'x' has zero point -1, outside uint8's [0, 255]"),
                            ({"dtype": "int4"}, "tensor 'x' has unknown integer type 'int4'"),
                            ({"scale": 1e-6}, "tensor 'x' has scale 1e-06 and zero point"),
                            ({"scale": 100.0}, "tensor 'x' has scale 100 and zero point")]:
        bad = json.loads(json.dumps(document))
        bad["tensors"]["x"].update(change)
        path = tmp_path / "bad.json"
        path.write_text(json.dumps(bad))
        with pytest.raises(QtoolError) as info:
            qtool.quantize(TINY, table=path)
        assert str(info.value).startswith(f"{path}: unusable calibration table: {message}"), info.value


def test_a_qtool_table_read_on_its_own_is_checked_too(tmp_path):
    """load_table (evaluate's --table for the sensitivity ranking) reads without the format registry."""
    from qtool.table.table import load_table

    path = CORPUS / "tables" / "zero_point_300.json"
    with pytest.raises(QtoolError, match="tensor 'x' has zero point 300, outside uint8's"):
        load_table(path)


def test_calibration_data_with_no_finite_value_of_a_tensor_is_refused():
    data = [{"x": np.full((1, 3, 8, 8), np.inf, np.float32)}, {"x": np.full((1, 3, 8, 8), np.nan, np.float32)}]
    with pytest.warns(UserWarning), pytest.raises(QtoolError) as info:
        qtool.calibrate(TINY, data, {"calibration": {"method": "minmax"}}, progress=False)
    assert str(info.value) == ("no finite value of tensor 'x' in the calibration data (every value NaN/Inf): "
                               "check the data and its preprocessing")


def test_a_shard_without_finite_values_is_refused_when_merged(tmp_path):
    """A shard's statistics may lack finite values of a tensor (another shard may have them); the
    merge of all of them may not."""
    stats = tmp_path / "s0.npz"
    shard = CliRunner().invoke(main, ["calibrate", str(TINY), "--data", str(CORPUS / "data" / "all_nan"), "--shard",
                                      "0/1", "-o", str(stats)])
    assert shard.exit_code == 0, shard.output
    merged = CliRunner().invoke(main, ["calibrate", str(TINY), "--merge", str(stats), "-o", str(tmp_path / "t.json")])
    assert merged.exit_code == 2
    assert merged.stderr.splitlines()[-1] == (f"error: {stats}: no finite value of tensor 'x' in the calibration data "
                                              "(every value NaN/Inf): check the data and its preprocessing")
    assert sorted(os.listdir(tmp_path)) == ["s0.npz"]


@pytest.mark.parametrize("sig, code", [(signal.SIGINT, 130), (signal.SIGTERM, 143)], ids=["SIGINT", "SIGTERM"])
@pytest.mark.parametrize("when", ["after the rename", "while writing"])
def test_an_interrupt_after_the_output_is_in_place_exits_0(tmp_path, monkeypatch, sig, code, when):
    """The signal arrives right after the table's rename (exit 0: the table is whole), or while
    it is written (130/143: nothing is left)."""
    replace, fsync = os.replace, os.fsync

    def replace_then_signal(source, target):
        replace(source, target)
        os.kill(os.getpid(), sig)

    def signal_in_fsync(fd):
        os.kill(os.getpid(), sig)
        fsync(fd)

    if when == "after the rename":
        monkeypatch.setattr(os, "replace", replace_then_signal)
    else:
        monkeypatch.setattr(os, "fsync", signal_in_fsync)
    out = tmp_path / "t.json"
    result = CliRunner().invoke(main, ["calibrate", str(TINY), "--data", str(OK_DATA), "--method", "minmax",
                                       "-o", str(out)])
    monkeypatch.undo()
    if when == "after the rename":
        assert result.exit_code == 0, result.output
        assert result.stderr.splitlines()[-1] == f"interrupted after the output was written whole: {out}"
        assert json.loads(out.read_text())["tensors"]
    else:
        assert result.exit_code == code, result.output
        assert os.listdir(tmp_path) == []
