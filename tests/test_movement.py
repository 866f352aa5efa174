"""The movement ops qtool computes in numpy when it folds constants (qtool.graph.movement) give what
onnx's reference evaluator gives, at the opsets where their operands were attributes and inputs."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import helper, numpy_helper
from onnx.reference import ReferenceEvaluator

from qtool.graph.movement import compute

RNG = np.random.default_rng(0)
X = RNG.normal(0, 1, (2, 3, 4, 5)).astype(np.float32)
I64 = np.int64
BIG = np.iinfo(np.int64).max

# (op, opset, inputs (None: left out), attributes)
CASES = [
    ("Slice", 13, [X, np.array([1], I64), np.array([3], I64), np.array([2], I64)], {}),
    ("Slice", 13, [X, np.array([-1, 0], I64), np.array([-BIG, BIG], I64), np.array([3, 1], I64),
                   np.array([-1, 2], I64)], {}),
    ("Slice", 13, [X, np.array([10], I64), np.array([-10], I64), np.array([-1], I64), np.array([-2], I64)], {}),
    ("Slice", 13, [X, np.array([0, 1], I64), np.array([2, 3], I64)], {}),
    ("Slice", 13, [X, np.array([4], I64), np.array([1], I64), np.array([2], I64)], {}),  # empty
    ("Slice", 9, [X], {"starts": [1, -3], "ends": [BIG, -1], "axes": [1, 3]}),
    ("Concat", 13, [X, X[:, :1]], {"axis": 1}),
    ("Concat", 11, [X, X], {"axis": -1}),
    ("Unsqueeze", 13, [X, np.array([0, -1], I64)], {}),
    ("Unsqueeze", 11, [X], {"axes": [1, 5]}),
    ("Squeeze", 13, [X[:, :1, :, :1], np.array([1, -1], I64)], {}),
    ("Squeeze", 13, [X[:1, :1]], {}),
    ("Squeeze", 11, [X[:, :1]], {"axes": [1]}),
    ("Reshape", 13, [X, np.array([0, -1, 5], I64)], {}),
    ("Reshape", 14, [X, np.array([2, 0, -1], I64)], {}),
    ("Reshape", 14, [np.zeros((2, 0, 3), np.float32), np.array([0, 4], I64)], {"allowzero": 1}),
    ("Transpose", 13, [X], {"perm": [0, 2, 3, 1]}),
    ("Transpose", 13, [X], {}),
    ("Cast", 13, [X * 3], {"to": onnx.TensorProto.INT32}),
    ("Cast", 13, [np.array([0, 2, -1], I64)], {"to": onnx.TensorProto.FLOAT16}),
    ("Cast", 13, [np.array([0.0, 2.5, -1], np.float32)], {"to": onnx.TensorProto.BOOL}),
    ("Gather", 13, [X, np.array([[2, -1], [0, 1]], I64)], {"axis": 2}),
    ("Gather", 13, [X, np.array(1, I64)], {}),
    ("Identity", 13, [X], {}),
]


def _reference(op, opset, inputs, attrs):
    names = [f"i{k}" if v is not None else "" for k, v in enumerate(inputs)]
    node = helper.make_node(op, names, ["y"], **attrs)
    inits = [numpy_helper.from_array(v, n) for n, v in zip(names, inputs) if v is not None]
    model = helper.make_model(helper.make_graph([node], "g", [], [helper.make_empty_tensor_value_info("y")], inits),
                              opset_imports=[helper.make_opsetid("", opset)])
    return node, ReferenceEvaluator(model).run(None, {})[0]


@pytest.mark.parametrize("op, opset, inputs, attrs", CASES, ids=[f"{c[0]}-{c[1]}-{i}" for i, c in enumerate(CASES)])
def test_each_movement_op_computes_what_the_reference_evaluator_does(op, opset, inputs, attrs):
    node, want = _reference(op, opset, inputs, attrs)
    got = compute(node, inputs, opset)
    assert got is not None
    assert got.dtype == want.dtype and got.shape == want.shape
    assert np.array_equal(got, want)


def test_what_it_does_not_know_is_left_to_the_reference_evaluator():
    cast_bf16 = helper.make_node("Cast", ["x"], ["y"], to=onnx.TensorProto.BFLOAT16)
    assert compute(cast_bf16, [X], 13) is None
    assert compute(helper.make_node("Concat", ["a", "b"], ["y"]), [X, X], 13) is None  # no axis
    assert compute(helper.make_node("Gather", ["x", "i"], ["y"]), [X, np.array([5], I64)], 13) is None  # out of range
    assert compute(helper.make_node("Relu", ["x"], ["y"]), [X], 13) is None
    assert compute(helper.make_node("Identity", ["x"], ["y"], domain="com.microsoft"), [X], 13) is None
