"""Which range method each tensor gets: the default, or a per-op-type / per-name choice.

`method_by_op_type: {Softmax: minmax}` applies to the tensors that feed a node of that
type (its inputs: what the Q/DQ pair in front of the node quantizes); `method_by_tensor:
{"*attn*": percentile}` matches tensor names by glob. A name match wins over an op-type
match, which wins over the default; among rules of one kind the first listed wins.
"""

from __future__ import annotations

import fnmatch

import onnx

from qtool.config import CalibrationConfig
from qtool.calibration.ranges import HISTOGRAM_METHODS, check_method, resolve_method


def methods_for(model: onnx.ModelProto, tensors: list[str], calib: CalibrationConfig) -> dict[str, str]:
    for _, method in (*calib.method_by_op_type, *calib.method_by_tensor):
        check_method(method)
    default = resolve_method(calib.method)
    consumed_by: dict[str, set[str]] = {}
    for node in model.graph.node:
        for name in node.input:
            consumed_by.setdefault(name, set()).add(node.op_type)
    chosen = {}
    for name in tensors:
        method = default
        for op_type, m in calib.method_by_op_type:
            if op_type in consumed_by.get(name, ()):
                method = m
                break
        for pattern, m in calib.method_by_tensor:
            if fnmatch.fnmatchcase(name, pattern):
                method = m
                break
        chosen[name] = method
    return chosen


def needs_histogram(methods: dict[str, str]) -> set[str]:
    return {name for name, method in methods.items() if method in HISTOGRAM_METHODS}
