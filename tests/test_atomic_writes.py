"""Outputs are atomic: an interrupted or failing run leaves no partial or temporary file.

The kill tests freeze a real `qtool quantize` (SIGSTOP) at a moment when its temporary
output file exists, i.e. in the middle of writing the model, send SIGINT or SIGTERM and
let it continue: the run must end with the signal's exit code and leave nothing behind.
"""

from __future__ import annotations

import fcntl
import os
import pty
import re
import select
import signal
import struct
import subprocess
import sys
import termios
import time
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from qtool import atomic

from qtool import interrupt

from qtool.graph import modelio
from tests.conftest import ROOT

EXIT = {signal.SIGINT: (interrupt.EXIT_SIGINT, "interrupted"), signal.SIGTERM: (interrupt.EXIT_SIGTERM, "terminated")}


def _big_matmul(folder: Path, n: int = 2048, external: bool = False) -> tuple[Path, Path]:
    """A model with a 16 MB weight (writing its 4 MB int8 copy takes tens of ms) and one sample."""
    folder.mkdir()
    weight = numpy_helper.from_array(np.random.default_rng(0).normal(size=(n, n)).astype(np.float32), "W")
    graph = helper.make_graph([helper.make_node("MatMul", ["x", "W"], ["y"]), helper.make_node("Relu", ["y"], ["z"])],
                              "big", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", n])],
                              [helper.make_tensor_value_info("z", TensorProto.FLOAT, ["N", n])], [weight])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    path = folder / "big.onnx"
    onnx.save_model(model, str(path), save_as_external_data=external, location="big.weights")
    data = folder / "data"
    data.mkdir()
    np.save(data / "x.npy", np.random.default_rng(1).normal(size=(1, n)).astype(np.float32))
    return path, data


def _popen(*args) -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.Popen([sys.executable, "-m", "qtool", *map(str, args)], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def _temporaries(folder: Path, name: str) -> list[str]:
    return [e.name for e in os.scandir(folder) if e.name.startswith(f".{name}.")]


def _signal_mid_write(model: Path, data: Path, out_dir: Path, sig: int) -> tuple[bool, subprocess.CompletedProcess]:
    """Run quantize; when its temporary output appears, freeze it, check it is still mid-write, signal it."""
    proc = _popen("quantize", model, "--data", data, "-o", out_dir / "out.onnx")
    caught = False
    deadline = time.monotonic() + 300
    while proc.poll() is None and time.monotonic() < deadline:
        if _temporaries(out_dir, "out.onnx"):
            proc.send_signal(signal.SIGSTOP)
            caught = bool(_temporaries(out_dir, "out.onnx"))  # frozen: the write is in progress
            if caught:
                proc.send_signal(sig)
            proc.send_signal(signal.SIGCONT)
            break
        time.sleep(0.0005)
    stdout, stderr = proc.communicate(timeout=300)
    return caught, subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr)


@pytest.mark.parametrize("external", [False, True], ids=["one_file", "external_data"])
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_signal_during_model_write_leaves_nothing(tmp_path, sig, external):
    model, data = _big_matmul(tmp_path / "in", external=external)
    for attempt in range(5):  # the write window is ~30 ms: retry if the poll missed it
        out_dir = tmp_path / f"out{attempt}"
        out_dir.mkdir()
        caught, proc = _signal_mid_write(model, data, out_dir, sig)
        if caught:
            break
    assert caught, "never saw the temporary output file"
    assert "Traceback" not in proc.stderr
    left = sorted(os.listdir(out_dir))
    # The signal is handled before the rename, so nothing is left; were it handled just after
    # the rename, the output would be complete. Either way: no temporary, no partial file.
    assert left == [] or left[0] == "out.onnx" and len(left) == 1 + external, left
    code, word = EXIT[sig]
    if left:  # the output was in place whole before the signal was acted on: the command is done
        modelio.load_model(out_dir / "out.onnx")
        code, word = 0, f"interrupted after the output was written whole: {out_dir / 'out.onnx'}"
    assert proc.returncode == code, proc.stderr
    assert proc.stderr.rstrip().splitlines()[-1].split("\r")[-1] == word


def _slow_model(folder: Path) -> Path:
    """Five 64-channel 3x3 convolutions at 32x32."""
    rng = np.random.default_rng(0)
    nodes, weights, previous, channels = [], [], "x", 3
    for i in range(5):
        weights.append(numpy_helper.from_array(rng.normal(0, 0.1, (64, channels, 3, 3)).astype(np.float32), f"W{i}"))
        nodes += [helper.make_node("Conv", [previous, f"W{i}"], [f"c{i}"], pads=[1, 1, 1, 1]),
                  helper.make_node("Relu", [f"c{i}"], [f"r{i}"])]
        previous, channels = f"r{i}", 64
    graph = helper.make_graph(nodes, "slow", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 3, 32, 32])],
                              [helper.make_tensor_value_info(previous, TensorProto.FLOAT, ["N", 64, 32, 32])], weights)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.save(model, str(folder / "m.onnx"))
    return folder / "m.onnx"


def test_sigterm_during_calibration(tmp_path):
    """SIGTERM in the middle of the sample loop: exit 143 before the data is through, no table,
    nothing left behind.

    stderr is a pseudo-terminal, so qtool draws its progress bar (at every sample: tqdm's
    TQDM_MININTERVAL=0); once the bar shows a sample done, calibration is under way and the
    test sends SIGTERM. The bar never reaching 1000/1000 shows the loop stopped there, not at
    its end (no clock is read: a busy machine slows both sides alike).
    """
    folder = tmp_path / "in"
    folder.mkdir()
    model = _slow_model(folder)
    data = folder / "data"
    data.mkdir()
    sample = np.random.default_rng(1).normal(size=(1, 3, 32, 32)).astype(np.float32)
    for i in range(1000):
        np.save(data / f"{i:04d}.npy", sample)
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    controller, terminal = pty.openpty()
    fcntl.ioctl(terminal, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 100, 0, 0))  # tqdm draws nothing at width 0
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""),
               TQDM_MININTERVAL="0")
    proc = subprocess.Popen([sys.executable, "-m", "qtool", "calibrate", str(model), "--data", str(data),
                             "--batch-size", "1", "-o", str(out_dir / "t.json")], env=env, stdout=subprocess.PIPE,
                            stderr=terminal)
    os.close(terminal)
    seen = b""
    deadline = time.monotonic() + 120
    while not re.search(rb"calibrating: +\d+%\|[^|]*\| *[1-9]\d*/1000", seen) and time.monotonic() < deadline:
        if select.select([controller], [], [], 0.1)[0]:
            try:
                seen += os.read(controller, 4096)
            except OSError:  # EIO: qtool exited already
                break
    assert proc.poll() is None, f"calibration ended before it could be interrupted: {seen[-500:]!r}"
    proc.send_signal(signal.SIGTERM)
    while True:  # read on while it ends: a full terminal buffer would block its writes
        if select.select([controller], [], [], 0.2)[0]:
            try:
                chunk = os.read(controller, 4096)
            except OSError:  # EIO: the terminal side is closed
                break
            if not chunk:
                break
            seen += chunk
        elif proc.poll() is not None:
            break
    proc.wait(timeout=600)  # a hang guard, not a speed bound
    os.close(controller)
    text = seen.decode(errors="replace")
    assert proc.returncode == interrupt.EXIT_SIGTERM, text
    assert "1000/1000" not in text, "the sample loop ran to its end before the signal was acted on"
    assert text.rstrip().splitlines()[-1].split("\r")[-1] == "terminated"
    assert "Traceback" not in text
    assert os.listdir(out_dir) == []


def test_exception_mid_write_keeps_the_old_file(tmp_path, monkeypatch):
    target = tmp_path / "table.json"
    target.write_text("old")

    def failing_fsync(fd):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(atomic.os, "fsync", failing_fsync)
    with pytest.raises(OSError):
        atomic.write_text(target, "new" * 1000)
    assert target.read_text() == "old"
    assert os.listdir(tmp_path) == ["table.json"]


def test_exception_mid_external_write_leaves_nothing(tmp_path, monkeypatch):
    model, _ = _big_matmul(tmp_path / "in", n=64)
    loaded = modelio.load_model(model)
    out_dir = tmp_path / "out"
    out_dir.mkdir()

    def failing_fsync(fd):
        raise OSError(5, "Input/output error")

    monkeypatch.setattr(modelio.os, "fsync", failing_fsync)
    with pytest.raises(OSError):
        modelio.save_model(loaded, out_dir / "m.onnx", external=True)
    assert os.listdir(out_dir) == []


def test_deferred_signal_arrives_after_the_critical_section():
    before = signal.getsignal(signal.SIGTERM)
    order = []
    with pytest.raises(interrupt.Terminated):
        with interrupt.signals_raise():
            with interrupt.deferred():
                os.kill(os.getpid(), signal.SIGTERM)
                time.sleep(0.05)  # the handler has run by now, and held the signal
                order.append("critical section finished")
            order.append("not reached")
    assert order == ["critical section finished"]
    assert signal.getsignal(signal.SIGTERM) is before  # restored after the command


def test_outputs_get_the_usual_permissions(tmp_path):
    """Temporary files are private (0600); the renamed output must be readable like any new file."""
    umask = os.umask(0o022)
    os.umask(umask)
    atomic.write_text(tmp_path / "report.json", "{}")
    assert (tmp_path / "report.json").stat().st_mode & 0o777 == 0o666 & ~umask


# Saves `argv[1]` to `argv[2]` with external data and dies (os._exit, as from SIGKILL: no cleanup
# runs) at the argv[3]-th call that renames or removes a file.
_KILLED_SAVE = """
import os, sys
import onnx
from qtool.graph import modelio
calls = [0]
def dying(real):
    def call(*args, **kwargs):
        calls[0] += 1
        if calls[0] == int(sys.argv[3]):
            os._exit(9)
        return real(*args, **kwargs)
    return call
for name in ("replace", "rename", "unlink", "remove", "rmdir"):
    setattr(os, name, dying(getattr(os, name)))
modelio.save_model(onnx.load(sys.argv[1]), sys.argv[2], external=True)
"""


def _matmul(seed: int) -> onnx.ModelProto:
    """x @ W + b with 16 kB of weights: the same graph with other weights for each seed."""
    rng = np.random.default_rng(seed)
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "W"], ["m"]), helper.make_node("Add", ["m", "b"], ["y"])], "mm",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 64])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 64])],
        [numpy_helper.from_array(rng.normal(size=(64, 64)).astype(np.float32), "W"),
         numpy_helper.from_array(rng.normal(size=(256,)).astype(np.float32)[:64], "b")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return model


def _output(model: onnx.ModelProto | Path, x: np.ndarray) -> np.ndarray:
    source = model.SerializeToString() if isinstance(model, onnx.ModelProto) else str(model)
    return ort.InferenceSession(source, providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]


def test_a_kill_at_any_rename_or_removal_never_pairs_a_model_with_other_weights(tmp_path):
    """Kill a save of model B over model A at its 1st, 2nd, ... rename/removal until it completes.

    After each kill onnxruntime must load the pair at `out.onnx` and give A's outputs or B's (a
    fixed data file name would pair A's graph with B's weights); the next save must then remove
    the killed run's temporaries and data files (a legacy temporary directory too), and leave a
    live writer's locked temporary alone.
    """
    old, new = _matmul(0), _matmul(1)
    new_path = tmp_path / "new.onnx"
    onnx.save(new, str(new_path))
    x = np.random.default_rng(2).normal(size=(3, 64)).astype(np.float32)
    expected = {"old": _output(old, x), "new": _output(new, x)}
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    seen = []
    for kill_at in range(1, 30):
        out_dir = tmp_path / f"kill{kill_at}"
        out_dir.mkdir()
        out = out_dir / "out.onnx"
        modelio.save_model(old, out, external=True)
        (out_dir / ".out.onnx.abcd_123").mkdir()  # an older version's temporary directory
        (out_dir / ".out.onnx.abcd_123" / "out.onnx.data").write_bytes(b"stale")
        (out_dir / ".out.onnx.stale123.tmp").write_bytes(b"stale")
        live = out_dir / ".out.onnx.live1234.tmp"
        with open(live, "wb") as held:
            fcntl.flock(held.fileno(), fcntl.LOCK_EX)  # a concurrent writer's, still writing
            proc = subprocess.run([sys.executable, "-c", _KILLED_SAVE, str(new_path), str(out), str(kill_at)],
                                  env=env, capture_output=True, text=True, timeout=300)
            assert proc.returncode in (0, 9), proc.stderr
            got = _output(out, x)
            [state] = [name for name, y in expected.items() if np.array_equal(got, y)]
            modelio.load_model(out)  # the loader's external data checks accept the names
            seen.append(state)
            if proc.returncode == 0:
                assert state == "new" and kill_at > 3
                break
            modelio.save_model(new, out, external=True)
            left = sorted(os.listdir(out_dir))
            data = modelio.data_file_name(out, modelio.sha256_file(out_dir / left[-1]))
            assert left == [".out.onnx.live1234.tmp", "out.onnx", data], (kill_at, left)
            assert np.array_equal(_output(out, x), expected["new"])
    assert seen[-1] == "new" and "old" in seen, seen


def test_saving_over_an_external_model_removes_only_its_own_old_data(tmp_path):
    """The `<name>.data` that an older version wrote goes once the new model is in place; data
    files of other names, which other models may read, stay."""
    for location in ("out.onnx.data", "weights.bin"):
        folder = tmp_path / location
        folder.mkdir()
        onnx.save_model(_matmul(0), str(folder / "out.onnx"), save_as_external_data=True, location=location,
                        size_threshold=0)
        modelio.save_model(_matmul(1), folder / "out.onnx")  # one file now
        assert sorted(os.listdir(folder)) == ["out.onnx"] + (["weights.bin"] if location == "weights.bin" else [])


def test_the_data_file_gets_the_models_permissions(tmp_path):
    umask = os.umask(0o022)
    os.umask(umask)
    modelio.save_model(_matmul(0), tmp_path / "m.onnx", external=True)
    modes = {p.name: p.stat().st_mode & 0o777 for p in tmp_path.iterdir()}
    assert len(modes) == 2 and set(modes.values()) == {0o666 & ~umask}, modes
