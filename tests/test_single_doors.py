"""Done in one module each, so every caller gets the same behaviour: ONNX shape inference in
qtool/graph/shapes.py (the weight-free path that works over 2 GiB), onnxruntime sessions in
qtool/graph/runtime.py (the same options everywhere, the >2 GiB file fallback)."""

from __future__ import annotations

from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "qtool"


@pytest.mark.parametrize("call, home", [("shape_inference.", "graph/shapes.py"),
                                        ("InferenceSession(", "graph/runtime.py"),
                                        ("SessionOptions(", "graph/runtime.py")])
def test_only_one_module_makes_the_call(call, home):
    callers = sorted(path.relative_to(PACKAGE).as_posix() for path in PACKAGE.rglob("*.py")
                     if call in path.read_text())
    assert callers == [home]
