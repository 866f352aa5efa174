"""Done in one module each, so every caller gets the same behaviour: ONNX shape inference in
qtool/graph/shapes.py (the weight-free path that works over 2 GiB), onnxruntime sessions in
qtool/graph/runtime.py (the same options everywhere, the >2 GiB file fallback)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

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
