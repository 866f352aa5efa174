"""onnxruntime's com.microsoft FusedConv and FusedGemm written back as the op and its activation.

    FusedConv(x, w, b[, z], activation=A)  ==>  Conv(x, w, b) [-> Add(z)] -> A
    FusedGemm(a, b, c, activation=A)       ==>  Gemm(a, b, c) -> A

A model saved from an onnxruntime session (`SessionOptions.optimized_model_filepath`, extended
level) carries these CPU-only ops in place of a Conv or Gemm and the activation after it. Neither
is a standard op, so neither would be quantized, and no other runtime runs them. Written back, the
Conv or Gemm is quantized like any other and onnxruntime fuses the activation into the integer
kernel's output range again. Left alone: an activation without a standard twin taking the same
parameters.
"""

from __future__ import annotations

from typing import Optional

import numpy as np
import onnx
from onnx import helper, numpy_helper

from qtool.graph.index import attribute, node_label, replace_nodes

CLIP_INPUTS_OPSET = 11  # Clip takes min and max as inputs from here on
# activation (the standard op of the same name) -> its parameters, in the order FusedConv's activation_params lists them
ACTIVATIONS = {
    "Relu": (),
    "Sigmoid": (),
    "Tanh": (),
    "LeakyRelu": ("alpha",),
    "HardSigmoid": ("alpha", "beta"),
    "Clip": ("min", "max"),
}
OWN_ATTRIBUTES = {"activation", "activation_params", "activation_alpha", "activation_beta", "activation_gamma"}


def write_out_fused_activations(model: onnx.ModelProto, opset: int) -> int:
    """Rewrite each com.microsoft FusedConv and FusedGemm of the main graph in place; how many."""
    graph = model.graph
    nodes, constants, written = [], [], 0
    for node in graph.node:
        written_out = _written_out(node, opset, constants) if node.domain == "com.microsoft" else None
        if written_out is None:
            nodes.append(node)
            continue
        nodes.extend(written_out)
        written += 1
    if written:
        replace_nodes(graph, nodes, constants)
    return written


def _written_out(node: onnx.NodeProto, opset: int, constants: list) -> Optional[list[onnx.NodeProto]]:
    if node.op_type not in ("FusedConv", "FusedGemm"):
        return None
    kind = attribute(node, "activation", b"")
    kind = kind.decode() if isinstance(kind, bytes) else kind
    if kind not in ACTIVATIONS or (node.op_type == "FusedGemm" and kind == "Clip"):
        return None
    names = ACTIVATIONS[kind]
    if node.op_type == "FusedConv":
        values = list(attribute(node, "activation_params", []))
    else:
        values = [attribute(node, "activation_alpha", None), attribute(node, "activation_beta", None)]
    values = [v for v in values[:len(names)] if v is not None]
    if len(values) != len(names) and (kind == "Clip" or values):
        return None  # parameters the standard op would not read the same way
    label, out = node_label(node), node.output[0]
    base = node.op_type[len("Fused"):]
    own = [a for a in node.attribute if a.name not in OWN_ATTRIBUTES]
    inputs = list(node.input)
    summed = base == "Conv" and len(inputs) > 3 and inputs[3]
    result = [helper.make_node(base, inputs[:3], [out + "_" + base.lower()], name=label)]
    result[0].attribute.extend(own)
    if summed:  # FusedConv's fourth input is added before the activation
        result.append(helper.make_node("Add", [result[0].output[0], inputs[3]], [out + "_sum"], name=label + "_sum"))
    before = result[-1].output[0]
    if kind == "Clip" and opset >= CLIP_INPUTS_OPSET:
        bounds = [numpy_helper.from_array(np.array(v, np.float32), f"{out}_clip_{n}") for n, v in zip(names, values)]
        constants.extend(bounds)
        result.append(helper.make_node(kind, [before] + [b.name for b in bounds], [out], name=label + "_act"))
    else:
        result.append(helper.make_node(kind, [before], [out], name=label + "_act", **dict(zip(names, values))))
    return result
