"""A float16 model computed in float32 inside, float16 at its inputs and outputs.

Models exported in half precision (optimum's `--fp16`, onnxconverter's float16 conversion) hold
their weights, constants and activations as float16. qtool quantizes float32 graphs: the front end
widens every float16 weight and constant (exactly: float32 holds every float16 value), turns each
Cast, ConstantOfShape and random op that makes float16 into one that makes float32, and casts the
float16 graph inputs to float32 where they enter and the outputs back to float16 where they leave.
The int8 model then has the fp16 model's interface, and its float parts run in float32.
"""

from __future__ import annotations

import onnx
from onnx import TensorProto, helper, numpy_helper

from qtool.graph.index import bodies, rename_reads, replace_nodes, scoped_nodes

HALF = TensorProto.FLOAT16
DTYPE_ATTRIBUTES = ("to", "dtype")  # Cast; EyeLike and the Random ops


def widen_float16(model: onnx.ModelProto) -> int:
    """In place; how many float16 tensors, attributes and graph inputs/outputs were widened (0: a
    model without float16, left as it is)."""
    widened = _widen_graph(model.graph)
    graph = model.graph
    constants = {t.name for t in graph.initializer}
    for info in graph.input:  # an initializer listed among the inputs (IR < 4) is a constant, widened
        if info.name in constants and info.type.tensor_type.elem_type == HALF:
            info.type.tensor_type.elem_type = TensorProto.FLOAT
    inputs = [i for i in graph.input if i.type.tensor_type.elem_type == HALF]
    outputs = [o for o in graph.output if o.type.tensor_type.elem_type == HALF]
    if not (widened or inputs or outputs):
        return 0
    renamed = {i.name: i.name + "_float32" for i in inputs}
    ends = {o.name: o.name + "_float32" for o in outputs}
    for node in graph.node:
        for k, name in enumerate(node.output):
            if name in ends:
                node.output[k] = ends[name]
    rename_reads(scoped_nodes(graph), {**renamed, **ends})  # a graph output also read inside: the widened one
    head = [helper.make_node("Cast", [i.name], [renamed[i.name]], name=i.name + "_to_float32", to=TensorProto.FLOAT)
            for i in inputs]
    tail = [helper.make_node("Cast", [ends[o.name]], [o.name], name=o.name + "_to_float16", to=HALF)
            for o in outputs]
    replace_nodes(graph, head + list(graph.node) + tail)
    return widened + len(inputs) + len(outputs)


def _widen_graph(graph: onnx.GraphProto) -> int:
    widened = 0
    for k, tensor in enumerate(graph.initializer):
        if tensor.data_type == HALF:
            graph.initializer[k].CopyFrom(_widened(tensor))
            widened += 1
    for info in graph.value_info:
        if info.type.tensor_type.elem_type == HALF:
            info.type.tensor_type.elem_type = TensorProto.FLOAT
    for node in graph.node:
        for attr in node.attribute:
            if attr.type == onnx.AttributeProto.TENSOR and attr.t.data_type == HALF:
                attr.t.CopyFrom(_widened(attr.t))  # Constant, ConstantOfShape
                widened += 1
            elif attr.type == onnx.AttributeProto.INT and attr.name in DTYPE_ATTRIBUTES and attr.i == HALF:
                attr.i = TensorProto.FLOAT
                widened += 1
        for _, body in bodies(node):
            widened += _widen_graph(body)
            for info in list(body.input) + list(body.output):
                if info.type.tensor_type.elem_type == HALF:
                    info.type.tensor_type.elem_type = TensorProto.FLOAT
                    widened += 1
    return widened


def _widened(tensor: onnx.TensorProto) -> onnx.TensorProto:
    return numpy_helper.from_array(numpy_helper.to_array(tensor).astype("float32"), tensor.name)
