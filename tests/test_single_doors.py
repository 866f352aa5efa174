"""Done in one module each, so every caller gets the same behaviour: ONNX shape inference in
qtool/graph/shapes.py (the weight-free path that works over 2 GiB), onnxruntime sessions in
qtool/graph/runtime.py (the same options everywhere, the >2 GiB file fallback)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "qtool"


@pytest.mark.parametrize("call, home", [("shape_inference.", "graph/shapes.py"),
                                        ("Session(", "graph/runtime.py"),  # InferenceSession or its subclass
                                        ("SessionOptions(", "graph/runtime.py")])
def test_only_one_module_makes_the_call(call, home):
    callers = sorted(path.relative_to(PACKAGE).as_posix() for path in PACKAGE.rglob("*.py")
                     if call in path.read_text())
    assert callers == [home]


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity") or (os.cpu_count() or 1) < 2,
                    reason="needs CPU affinity and two cores")
def test_sessions_stay_on_the_cores_the_process_may_use():
    """onnxruntime's default thread count ignores the affinity mask (taskset): the session
    builder passes the allowed cores' count instead, and keeps the default when all are allowed."""
    code = ("import os; from qtool.graph.runtime import session_options; "
            "print(session_options().intra_op_num_threads, session_options(3).intra_op_num_threads, end=' '); "
            "os.sched_setaffinity(0, {sorted(os.sched_getaffinity(0))[0]}); "
            "print(session_options().intra_op_num_threads, session_options(3).intra_op_num_threads)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    everywhere = "0" if len(os.sched_getaffinity(0)) >= os.cpu_count() else str(len(os.sched_getaffinity(0)))
    assert out == [everywhere, "3", "1", "3"]


def test_the_jobs_batch_passes_run_without_spinning_or_memory_pattern(tmp_path, monkeypatch):
    """The calibration's observing pass and the candidates' scoring are a job's bulk passes over
    batches: onnxruntime's memory pattern (a block planned for every tensor of a batch's shapes,
    kept for the next run) set the job's peak RSS there, and spinning threads only burn CPU. A real
    plain quantize job: every session it makes is recorded, and those passes' options are read."""
    import onnxruntime as ort

    from qtool import api
    from qtool.graph import runtime
    from tests.graphs import conv_model, write_samples

    made = []
    real = runtime._session

    def recording(source, options: ort.SessionOptions, label: str):
        try:
            spinning = options.get_session_config_entry("session.intra_op.allow_spinning")
        except RuntimeError:  # not set: onnxruntime's default, spinning
            spinning = "1"
        made.append((label, options.enable_mem_pattern, spinning))
        return real(source, options, label)

    monkeypatch.setattr(runtime, "_session", recording)
    rng = np.random.default_rng(0)
    path = tmp_path / "m.onnx"
    onnx.save(conv_model(rng, activation="Relu"), path)
    data = write_samples(tmp_path / "calib", rng, (8, 12, 12))
    api.quantize(path, data=data, progress=False)
    # the observing pass; the candidates' fp32 reference; each candidate, scored on its run check's session
    bulk = ("the fp32 model with calibration observers", str(path), "int8 model")
    start = [m[0] for m in made].index(bulk[0])  # before it: the one-batch check of the batch size
    passes = [m for m in made[start:] if m[0] in bulk]
    assert {m[0] for m in passes} == set(bulk), made
    assert all(m[1:] == (False, "0") for m in passes), passes
