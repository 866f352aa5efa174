"""The ONNX ops that only move or retype values, computed in numpy on constant inputs.

Preparing a graph folds such ops on constants (torch's LSTM export slices and concatenates its
weights); onnx's reference evaluator computes any op, but its import and one evaluator per node cost
more than the preparing of a small model. `compute` covers the movement ops at every opset by their
spec and returns None for anything else (an attribute or type it does not know): the caller then
asks the reference evaluator.
"""

from __future__ import annotations

from typing import Callable, Optional, Sequence

import numpy as np
import onnx

from qtool.graph.index import attribute

Values = Sequence[Optional[np.ndarray]]  # a node's inputs, None where the input is left out ("")


def _ints(value: Optional[np.ndarray]) -> Optional[list[int]]:
    return None if value is None else [int(v) for v in np.asarray(value).reshape(-1)]


def _input_or_attribute(node: onnx.NodeProto, inputs: Values, index: int, name: str, opset: int,
                        since: int) -> Optional[list[int]]:
    """An operand that moved from an attribute to an input at opset `since`."""
    if opset >= since:
        return _ints(inputs[index]) if len(inputs) > index else None
    value = attribute(node, name)
    return None if value is None else [int(v) for v in value]


def _slice(node, inputs: Values, opset: int) -> np.ndarray:
    data = inputs[0]
    starts = _input_or_attribute(node, inputs, 1, "starts", opset, 10)
    ends = _input_or_attribute(node, inputs, 2, "ends", opset, 10)
    axes = _input_or_attribute(node, inputs, 3, "axes", opset, 10)
    steps = _ints(inputs[4]) if opset >= 10 and len(inputs) > 4 else None
    axes = list(range(len(starts))) if axes is None else axes
    steps = [1] * len(starts) if steps is None else steps
    for start, end, axis, step in zip(starts, ends, axes, steps):
        dim = data.shape[axis]
        start, end = start + dim if start < 0 else start, end + dim if end < 0 else end
        if step > 0:
            start, end = min(max(start, 0), dim), min(max(end, 0), dim)
        else:
            start, end = min(max(start, 0), dim - 1), min(max(end, -1), dim - 1)
        data = np.take(data, np.arange(start, end, step, dtype=np.int64), axis=axis)
    return data


def _reshape(node, inputs: Values, opset: int) -> np.ndarray:
    data, shape = inputs[0], (_ints(inputs[1]) if opset >= 5 else list(attribute(node, "shape")))
    if not attribute(node, "allowzero", 0):
        shape = [data.shape[i] if d == 0 else d for i, d in enumerate(shape)]
    return data.reshape(shape)


def _squeeze(node, inputs: Values, opset: int) -> np.ndarray:
    axes = _input_or_attribute(node, inputs, 1, "axes", opset, 13)
    return np.squeeze(inputs[0]) if axes is None else np.squeeze(inputs[0], axis=tuple(axes))


def _unsqueeze(node, inputs: Values, opset: int) -> np.ndarray:
    return np.expand_dims(inputs[0], tuple(_input_or_attribute(node, inputs, 1, "axes", opset, 13)))


# numpy's own types (onnx maps bfloat16, float8 and int4 to ml_dtypes' types, whose casts round otherwise)
PLAIN = frozenset(np.dtype(t) for t in (np.bool_, np.int8, np.int16, np.int32, np.int64, np.uint8, np.uint16,
                                        np.uint32, np.uint64, np.float16, np.float32, np.float64))


def _cast(node, inputs: Values, opset: int) -> Optional[np.ndarray]:
    to = onnx.helper.tensor_dtype_to_np_dtype(attribute(node, "to"))
    return inputs[0].astype(to) if to in PLAIN else None


def _transpose(node, inputs: Values, opset: int) -> np.ndarray:
    perm = attribute(node, "perm")
    return np.transpose(inputs[0], None if perm is None else list(perm))


def _concat(node, inputs: Values, opset: int) -> Optional[np.ndarray]:
    axis = attribute(node, "axis")
    return None if axis is None else np.concatenate(list(inputs), axis=axis)


# the ops that only move or retype values (what preparing folds on constants), each computed here
COMPUTE: dict[str, Callable[[onnx.NodeProto, Values, int], Optional[np.ndarray]]] = {
    "Identity": lambda node, inputs, opset: inputs[0],
    "Cast": _cast,
    "Concat": _concat,
    "Gather": lambda node, inputs, opset: np.take(inputs[0], inputs[1], axis=attribute(node, "axis", 0)),
    "Reshape": _reshape,
    "Slice": _slice,
    "Squeeze": _squeeze,
    "Transpose": _transpose,
    "Unsqueeze": _unsqueeze,
}
MOVEMENT_OPS = tuple(COMPUTE)


def compute(node: onnx.NodeProto, inputs: Values, opset: int) -> Optional[np.ndarray]:
    """The one output of movement op `node` on `inputs` at ai.onnx `opset`; None where it is not one
    this module computes."""
    if node.domain not in ("", "ai.onnx") or node.op_type not in COMPUTE or len(node.output) != 1 \
            or any(v is not None and v.dtype not in PLAIN for v in inputs):
        return None
    try:
        return COMPUTE[node.op_type](node, inputs, opset)
    except (TypeError, ValueError, IndexError):
        return None  # outside what the spec allows here: the reference evaluator says what it does
