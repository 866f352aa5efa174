"""Models derived from a model: extra outputs to read intermediate tensors, or a sub-model of some
of its nodes. Every stage that runs part of a graph (calibration, bias correction, adaptive
rounding, per-layer error, sensitivity, verify-int) builds it here."""

from __future__ import annotations

from typing import Iterable

import numpy as np
import onnx
from onnx import helper


def with_outputs(model: onnx.ModelProto, names: Iterable[str]) -> onnx.ModelProto:
    """A copy of `model` that also outputs the named intermediate tensors."""
    exposed = onnx.ModelProto()
    exposed.CopyFrom(model)
    present = {o.name for o in exposed.graph.output} | {i.name for i in exposed.graph.input}
    types = {v.name: v.type.tensor_type.elem_type for v in exposed.graph.value_info}
    for name in names:
        if name not in present:
            exposed.graph.output.append(
                onnx.helper.make_tensor_value_info(name, types.get(name, onnx.TensorProto.FLOAT), None))
    return exposed


def array_input(name: str, array: np.ndarray) -> onnx.ValueInfoProto:
    """A graph input of the array's element type and any shape (a boundary fed from a cache)."""
    return helper.make_tensor_value_info(name, helper.np_dtype_to_tensor_dtype(array.dtype), None)


def sub_model(model: onnx.ModelProto, nodes: list[onnx.NodeProto], inputs: list[onnx.ValueInfoProto],
              outputs: list[onnx.ValueInfoProto], name: str = "part") -> onnx.ModelProto:
    """A model of `nodes` alone: it reads `inputs` and the initializers of `model` its nodes read,
    and outputs `outputs`; opsets, IR version and local functions are those of `model`."""
    read = {x for n in nodes for x in n.input if x}
    graph = helper.make_graph(nodes, name, inputs, outputs, [t for t in model.graph.initializer if t.name in read])
    part = helper.make_model(graph, opset_imports=list(model.opset_import), functions=list(model.functions))
    part.ir_version = model.ir_version
    return part
