"""Front end: bring an fp32 graph into the canonical form the planner expects.

The same preparation runs before calibration and before quantization, so tensor
names in the calibration table always match the graph being quantized. Every step
is deterministic and keeps the model's outputs unchanged.
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import numpy_helper, version_converter

from qtool.errors import QtoolError

MIN_QDQ_OPSET = 10  # QuantizeLinear/DequantizeLinear exist
MIN_PER_CHANNEL_OPSET = 13  # DequantizeLinear gets its `axis` attribute


def default_opset(model: onnx.ModelProto) -> int:
    for entry in model.opset_import:
        if entry.domain in ("", "ai.onnx"):
            return entry.version
    return 0


def check_opset(model: onnx.ModelProto, upgrade: bool, path: object = None) -> onnx.ModelProto:
    """Per-channel int8 weights need opset 13; upgrade with onnx's converter when asked."""
    opset = default_opset(model)
    if opset >= MIN_PER_CHANNEL_OPSET:
        return model
    if not upgrade:
        need = "QDQ" if opset < MIN_QDQ_OPSET else "per-channel weights"
        raise QtoolError(f"opset {opset} is too old for {need} (needs >= {MIN_PER_CHANNEL_OPSET}); "
                         f"re-run with --upgrade-opset to convert it with onnx's version converter", path)
    try:
        return version_converter.convert_version(model, MIN_PER_CHANNEL_OPSET)
    except Exception as exc:  # the converter raises bare RuntimeErrors with C++ messages
        raise QtoolError(f"onnx version converter could not upgrade opset {opset} to "
                         f"{MIN_PER_CHANNEL_OPSET}: {str(exc).splitlines()[0]}", path) from None


def constants_to_initializers(model: onnx.ModelProto) -> None:
    """Constant nodes holding tensors become initializers (Paddle exports keep weights there)."""
    keep = []
    for node in model.graph.node:
        if node.op_type == "Constant" and node.domain in ("", "ai.onnx") and len(node.attribute) == 1:
            attr = node.attribute[0]
            value = None
            if attr.name == "value":
                value = numpy_helper.to_array(attr.t)
            elif attr.name in ("value_float", "value_int", "value_floats", "value_ints"):
                value = onnx.helper.get_attribute_value(attr)
                value = np.asarray(value, dtype=np.float32 if "float" in attr.name else np.int64)
            if value is not None:
                model.graph.initializer.append(numpy_helper.from_array(value, node.output[0]))
                continue
        keep.append(node)
    del model.graph.node[:]
    model.graph.node.extend(keep)


def remove_identities(model: onnx.ModelProto) -> None:
    """Drop Identity and inference-mode Dropout nodes, wiring their consumers to the input."""
    graph_outputs = {o.name for o in model.graph.output}
    rename: dict[str, str] = {}
    keep = []
    for node in model.graph.node:
        passthrough = node.op_type == "Identity" or (
            node.op_type == "Dropout" and (len(node.output) == 1 or not node.output[1]))
        if passthrough and node.domain in ("", "ai.onnx") and node.output[0] not in graph_outputs:
            source = node.input[0]
            rename[node.output[0]] = rename.get(source, source)
            continue
        keep.append(node)
    for node in keep:
        for i, name in enumerate(node.input):
            if name in rename:
                node.input[i] = rename[name]
    del model.graph.node[:]
    model.graph.node.extend(keep)


def infer_shapes(model: onnx.ModelProto) -> onnx.ModelProto:
    try:
        return onnx.shape_inference.infer_shapes(model, data_prop=True)
    except Exception:  # inference is advisory: a model that fails it still quantizes
        return model


def prepare(model: onnx.ModelProto, upgrade_opset: bool = False, path: object = None) -> onnx.ModelProto:
    """Return a prepared copy; the input model is not modified."""
    prepared = onnx.ModelProto()
    prepared.CopyFrom(model)
    prepared = check_opset(prepared, upgrade_opset, path)
    constants_to_initializers(prepared)
    remove_identities(prepared)
    return infer_shapes(prepared)
