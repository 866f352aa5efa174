"""ONNX shape and type inference, in one place, so every caller gets the path that works over 2 GiB.

onnx's inference takes the model as one protobuf, which cannot hold more than 2 GiB, and
serialising and parsing the weights is most of its cost besides. It reads tensor values
only for small integer shape constants, so it runs here on a copy whose large
initializers have no payload (`_shapes_only`): the same types and shapes, for any size.
Inference is advisory for every caller: a model that fails it keeps the shapes it
declares (unknown shapes take each caller's generic path).
"""

from __future__ import annotations

import math
from typing import Collection, Mapping, Optional, Sequence

import onnx

from qtool.graph import modelio
from qtool.graph.index import tensor_bytes

_SHAPE_ONLY_BYTES = 1 << 16  # initializers above this lose their payload in the shape-inference copy


def _shapes_only(model: onnx.ModelProto) -> onnx.ModelProto:
    """The model with the payload of its large initializers dropped (dims and type kept).

    Shape inference reads tensor values only for small integer shape constants, so this
    copy infers the same types and shapes and fits in one protobuf when the model does not.
    """
    light = onnx.ModelProto(ir_version=model.ir_version)
    light.opset_import.extend(model.opset_import)
    light.functions.extend(model.functions)
    graph = light.graph
    for name in ("node", "input", "output", "value_info"):
        getattr(graph, name).extend(getattr(model.graph, name))
    for tensor in model.graph.initializer:
        if tensor_bytes(tensor) > _SHAPE_ONLY_BYTES:
            tensor = onnx.TensorProto(name=tensor.name, dims=tensor.dims, data_type=tensor.data_type)
        graph.initializer.append(tensor)
    return light


def _has_subgraphs(model: onnx.ModelProto) -> bool:
    return any(attr.type in (onnx.AttributeProto.GRAPH, onnx.AttributeProto.GRAPHS)
               for node in model.graph.node for attr in node.attribute)


def _pin_inputs(model: onnx.ModelProto, input_shapes: Mapping[str, Sequence[int]]) -> None:
    for value in model.graph.input:
        if value.name in input_shapes:
            for dim, size in zip(value.type.tensor_type.shape.dim, input_shapes[value.name]):
                dim.Clear()
                dim.dim_value = int(size)


def inferred(model: onnx.ModelProto, data_prop: bool = True,
             input_shapes: Optional[Mapping[str, Sequence[int]]] = None) -> onnx.ModelProto:
    """The model without weight payloads after shape inference, to read types and shapes from
    (`model` itself is not changed). `input_shapes` pins the graph inputs' dims first (a real
    batch's, so dynamic sizes resolve); `data_prop` also propagates shape values (Shape ->
    Gather -> Concat -> Reshape). When inference fails, the copy declares what `model` does."""
    light = _shapes_only(model)
    if input_shapes:
        _pin_inputs(light, input_shapes)
    try:
        found = onnx.shape_inference.infer_shapes(light, data_prop=data_prop)
    except Exception:  # inference is advisory: unknown shapes take the callers' generic paths
        found = light
    if _untyped_contrib_outputs(found):
        found = _contrib_inferred(light) or found
    return found


def _untyped_contrib_outputs(model: onnx.ModelProto) -> bool:
    """Whether a com.microsoft node's output has no inferred type: onnx's inference does not know
    onnxruntime's contrib ops (a fused Attention, SkipLayerNormalization, QAttention) and stops
    at them."""
    typed = elem_types(model)
    return any(name and name not in typed for node in model.graph.node if node.domain == "com.microsoft"
               for name in node.output)


def _contrib_inferred(light: onnx.ModelProto) -> Optional[onnx.ModelProto]:
    """Inference by onnxruntime's symbolic shape inference, which knows its contrib ops, taught
    QAttention (the fused attention of qtool's dynamic int8 model: Attention's shape, float out);
    None when it fails."""
    try:
        from onnxruntime.tools.symbolic_shape_infer import SymbolicShapeInference

        class Inference(SymbolicShapeInference):
            def __init__(self, *args):
                super().__init__(*args)
                self.dispatcher_.setdefault("QAttention", self._q_attention)

            def _q_attention(self, node):
                self._infer_Attention(node)
                self.known_vi_[node.output[0]].type.tensor_type.elem_type = onnx.TensorProto.FLOAT

        inference = Inference(2**31 - 1, True, False, 0)
        inference._preprocess(light)
        while inference.run_:
            inference._infer_impl()
        inference._update_output_from_vi()
        return inference.out_mp_
    except Exception:  # advisory, as above
        return None


def infer_shapes(model: onnx.ModelProto, data_prop: bool = True) -> onnx.ModelProto:
    """`model` with inferred shapes, annotated in place from the copy without weight payloads
    (`inferred`). Without If/Loop/Scan bodies (whose own value_info inference fills) the
    result is the full model's: its value_info and the merged types of its inputs and
    outputs are copied back. A model with bodies is inferred whole (a new model returned)
    when it fits in one protobuf; over 2 GiB only its value_info is copied back."""
    light = not _has_subgraphs(model)
    data = None if light else modelio.serialized(model)
    if data is not None:
        try:
            return onnx.shape_inference.infer_shapes(data, data_prop=data_prop)
        except Exception:  # inference is advisory: a model that fails it still quantizes
            return model
    found = inferred(model, data_prop)
    del model.graph.value_info[:]
    model.graph.value_info.extend(found.graph.value_info)
    if light:
        for field in ("input", "output"):
            del getattr(model.graph, field)[:]
            getattr(model.graph, field).extend(getattr(found.graph, field))
    return model


def with_shapes(model: onnx.ModelProto, data_prop: bool = True) -> onnx.ModelProto:
    """A copy of `model`, weights included, with inferred shapes (`model` is not changed)."""
    copy = onnx.ModelProto()
    copy.CopyFrom(model)
    return infer_shapes(copy, data_prop)


def elem_types(model: onnx.ModelProto) -> dict[str, int]:
    """Element types the model declares for its tensors (graph inputs last: they win)."""
    graph = model.graph
    return {v.name: v.type.tensor_type.elem_type for v in [*graph.value_info, *graph.output, *graph.input]
            if v.type.HasField("tensor_type") and v.type.tensor_type.elem_type}


def declared_shapes(model: onnx.ModelProto) -> dict[str, list]:
    """Dims the model declares for its tensors (int, or None when symbolic/unknown)."""
    graph = model.graph
    return {v.name: [d.dim_value if d.HasField("dim_value") else None for d in v.type.tensor_type.shape.dim]
            for v in [*graph.value_info, *graph.output, *graph.input] if v.type.tensor_type.HasField("shape")}


def inferred_shapes(model: onnx.ModelProto, needed: Optional[Collection[str]] = None) -> dict[str, list]:
    """Tensor dims (int, or None when symbolic/unknown) from shape inference.

    A model that already declares a shape for every `needed` tensor (qtool.prepare.graph_prep.prepare
    ends with shape inference, whose results it keeps) is not inferred again: inference
    keeps the shapes a model declares, so it would find the same ones."""
    declared = declared_shapes(model)
    if needed is not None and all(name in declared for name in needed):
        return declared
    return declared_shapes(inferred(model, data_prop=False))


_ITEM_BYTES = {onnx.TensorProto.FLOAT: 4, onnx.TensorProto.FLOAT16: 2, onnx.TensorProto.DOUBLE: 8}


def samples_within(model: onnx.ModelProto, requested: int, budget: int) -> int:
    """How many of `requested` samples one run of `model` takes so that the float tensors the graph
    computes, by the shapes it declares past the first axis (dynamic ones not counted), hold at most
    `budget` bytes; at least 1. Decided from the graph alone: the same on every machine."""
    types = elem_types(model)
    per_sample = 0
    for name, dims in declared_shapes(model).items():
        if types.get(name) in _ITEM_BYTES and dims and all(d is not None for d in dims[1:]):
            per_sample += math.prod(dims[1:]) * _ITEM_BYTES[types[name]]
    return max(1, min(requested, budget // per_sample)) if per_sample else requested
