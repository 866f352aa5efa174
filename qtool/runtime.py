"""onnxruntime sessions, created the same way everywhere so fp32 and int8 compare fairly."""

from __future__ import annotations

import onnx
import onnxruntime as ort

from qtool import modelio
from qtool.errors import QtoolError


def session_options(threads: int = 0) -> ort.SessionOptions:
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    options.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    options.intra_op_num_threads = threads  # 0: onnxruntime's default (one per core)
    options.inter_op_num_threads = 1
    options.log_severity_level = 3
    return options


def create_session(model: onnx.ModelProto | str, threads: int = 0, label: str = "model") -> ort.InferenceSession:
    source = model if isinstance(model, str) else modelio.serialized(model)
    if source is None:
        # Over 2 GiB a model cannot be serialised to bytes: hand onnxruntime a file with external
        # data. onnxruntime has read the initializers once the session exists.
        with modelio.on_disk(model) as path:
            return create_session(str(path), threads, label)
    try:
        return ort.InferenceSession(source, session_options(threads), providers=["CPUExecutionProvider"])
    except Exception as exc:  # onnxruntime raises its own Fail/InvalidGraph types
        raise QtoolError(f"onnxruntime cannot load it: {str(exc).strip().splitlines()[0]}", label) from None
