"""HardSigmoid and HardSwish between uint8 tensors as onnxruntime integer kernels (ort-cpu).

onnxruntime has no int8 kernel for either and runs each in float between a DQ and a Q (four float
passes, which can cost more than the int8 convolutions around them save). Both are an affine map
clipped to [0, 1], and a QuantizeLinear whose range is exactly [0, 1 / alpha] clips by saturating:

    HardSigmoid:  DQ(x) -> Add(DQ(beta / alpha)) -> Q(scale s_out / alpha) -> DQ(s_out)
    HardSwish:    DQ(x) -> Add(DQ(3)) -> Q(1 / (255 alpha)) -> DQ(1 / 255) -> Mul(DQ(x), .) -> Q(s_out)

run as QLinearAdd (and QLinearMul), one integer pass each. The written-out x * clip(x + 3, 0, 6) / 6
gets its division folded into the clip's DequantizeLinear (`folded_products`); a block kept float
runs as HardSigmoid and Mul (`float_hard_sigmoids`). Figures: docs/targets.md, "Fusion-aware placement".
"""

from __future__ import annotations

from typing import Optional

import numpy as np
import onnx
from onnx import helper, numpy_helper

from qtool.graph.edit import drop_unread
from qtool.graph.index import GraphIndex, attribute, node_label, replace_nodes

OFFSET, GATE = "_int8_offset", "_int8_gate"  # suffixes of the rewritten nodes and tensors
NOTE = ("{} HardSigmoid/HardSwish node(s) between int8 tensors written as an Add whose QuantizeLinear clips "
        "and a Mul, which onnxruntime runs as integer kernels (QLinearAdd, QLinearMul) instead of in float")
FLOAT_NOTE = ("{} hard-swish/hard-sigmoid block(s) written out in Add, Clip and Div and computed in float run "
              "as HardSigmoid (and its Mul): two float ops instead of four")
FOLD_NOTE = ("{} product(s) by a constant after a product of two int8 tensors (hard-swish written out as "
             "x * clip(x + 3, 0, 6) / 6) folded into the second operand's DequantizeLinear scale: one "
             "requantization and one QLinearMul fewer each")
HARD = {"HardSigmoid": (0.2, 0.5), "HardSwish": (1.0 / 6.0, 0.5)}  # default (alpha, beta)
STEPS = 255  # uint8 codes above the zero point
GATE_SUFFIX = "_hardsigmoid"  # a float block's HardSigmoid output


def _uint8_zero(index: GraphIndex, node: onnx.NodeProto, value: int | None = None) -> bool:
    """`node` (a QuantizeLinear or DequantizeLinear) has a uint8 scalar zero point (equal to `value`)."""
    zero = index.const(node.input[2]) if len(node.input) > 2 else None
    return (zero is not None and zero.dtype == np.uint8 and zero.size == 1
            and (value is None or int(zero.reshape(-1)[0]) == value))


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
            out_scale = index.scalar(quant.input[1])
            if (out_scale is None or not _uint8_zero(index, quant, 0) or node.output[0] in index.outputs
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
        replace_nodes(graph, nodes, inits)
    return done


def folded_products(model: onnx.ModelProto) -> int:
    """Fold a constant factor into a product, in place: Mul(DQ(a), DQ(b)) -> Q -> DQ -> Mul(., DQ(r))
    becomes Mul(DQ(a), DQ'(b)) with b's codes dequantized at scale s_b * r, writing the second
    Mul's output. Paddle's hard-swish x * clip(x + 3, 0, 6) / 6 is such a chain (the product
    rounded on a grid six times the output's, then divided): one requantization and one
    QLinearMul fewer. Applied to main-graph chains with uint8 codes, a positive scalar r and a
    product read by nothing else; the number folded."""
    graph = model.graph
    index = GraphIndex(model)
    inits: list[onnx.TensorProto] = []
    before: dict[int, onnx.NodeProto] = {}  # id of a product -> its operand's rescaled DequantizeLinear
    gone: set[int] = set()  # the constant factors' Mul nodes
    touched: set[int] = set()
    for scale_mul in graph.node:
        if scale_mul.op_type != "Mul" or scale_mul.domain not in ("", "ai.onnx") or len(scale_mul.input) != 2:
            continue
        sources = [index.producer.get(name) for name in scale_mul.input]
        if any(s is None or s.op_type != "DequantizeLinear" for s in sources):
            continue
        constant = [s for s in sources if s.input[0] in index.initializers]
        product_dq = [s for s in sources if s.input[0] not in index.initializers]
        if len(constant) != 1 or len(product_dq) != 1:
            continue
        r_codes, r_scale = index.const(constant[0].input[0]), index.scalar(constant[0].input[1])
        r_zero = index.const(constant[0].input[2]) if len(constant[0].input) > 2 else np.zeros(1)
        if r_codes is None or r_codes.size != 1 or r_scale is None or r_zero is None:
            continue
        factor = r_scale * (float(r_codes.reshape(-1)[0]) - float(r_zero.reshape(-1)[0]))
        quant = index.producer.get(product_dq[0].input[0])
        product = index.producer.get(quant.input[0]) if quant is not None and quant.op_type == "QuantizeLinear" else None
        if (factor <= 0 or product is None or product.op_type != "Mul" or product.domain not in ("", "ai.onnx")
                or index.only_consumer(product.output[0]) is not quant
                or index.only_consumer(quant.output[0]) is not product_dq[0]
                or index.only_consumer(product_dq[0].output[0]) is not scale_mul
                or product.output[0] in index.outputs or not _uint8_zero(index, quant)):
            continue
        if {id(scale_mul), id(product)} & touched:
            continue  # a chain of such products: one fold each time, on the graph as indexed
        operands = [index.producer.get(name) for name in product.input]
        if any(o is None or o.op_type != "DequantizeLinear" or not _uint8_zero(index, o)
               or index.scalar(o.input[1]) is None for o in operands):
            continue
        second = operands[1]
        label = node_label(product)
        scaled = helper.make_node("DequantizeLinear", [second.input[0], label + "_folded_scale", second.input[2]],
                                  [label + "_folded"], name=label + "_folded_DequantizeLinear")
        inits.append(numpy_helper.from_array(np.array(index.scalar(second.input[1]) * factor, np.float32),
                                             label + "_folded_scale"))
        product.input[1] = scaled.output[0]
        product.output[0] = scale_mul.output[0]
        before[id(product)] = scaled
        gone.add(id(scale_mul))  # the product's Q/DQ pair, and operand DQs nothing else reads, go unread
        touched |= {id(scale_mul), id(product)}
    if before:
        nodes = [n for node in graph.node if id(node) not in gone
                 for n in ([before[id(node)], node] if id(node) in before else [node])]
        replace_nodes(graph, nodes, inits)
        drop_unread(graph)
    return len(before)


def float_hard_sigmoids(model: onnx.ModelProto) -> int:
    """Rewrite in place every main-graph clip(x + c, 0, h) / h computed in float (constants stored
    as fp32 initializers: the blocks the latency-aware fallback or the plan kept float) as
    HardSigmoid(x), and every x * clip(x + c, 0, h) / h as x * HardSigmoid(x): two float ops
    instead of four, exact up to float32 rounding. The number of blocks rewritten."""
    graph = model.graph
    index = GraphIndex(model)
    replaced: dict[int, list[onnx.NodeProto]] = {}  # id of a block's last node -> its new nodes
    gone: set[int] = set()
    for clip in graph.node:
        if clip.op_type != "Clip" or clip.domain not in ("", "ai.onnx"):
            continue
        low, high = index.clip_bounds(clip) or (None, None)
        add = index.producer.get(clip.input[0])
        if low != 0.0 or high is None or high <= 0 or add is None or add.op_type != "Add" or len(add.input) != 2:
            continue
        if index.only_consumer(add.output[0]) is not clip or index.only_consumer(clip.output[0]) is None:
            continue
        offsets = [index.uniform(name) for name in add.input]
        if (offsets[0] is None) == (offsets[1] is None):
            continue  # one operand must be the constant c, the other the activation x
        x, offset = (add.input[1], offsets[0]) if offsets[0] is not None else (add.input[0], offsets[1])
        after = index.only_consumer(clip.output[0])
        gate = helper.make_node("HardSigmoid", [x], [clip.output[0] + GATE_SUFFIX], name=node_label(clip),
                                alpha=1.0 / high, beta=offset / high)
        if index.divides(after, clip.output[0], high):  # clip(x + c, 0, h) / h
            gate.output[0] = after.output[0]
            block, new = [add, clip, after], [gate]
        elif after.op_type == "Mul" and set(after.input) == {x, clip.output[0]}:  # x * clip(x + c, 0, h) / h
            last = index.only_consumer(after.output[0])
            if not index.divides(last, after.output[0], high):
                continue
            block = [add, clip, after, last]
            new = [gate, helper.make_node("Mul", [x, gate.output[0]], [last.output[0]], name=node_label(after))]
        else:
            continue
        if any(id(node) in gone for node in block):
            continue
        gone |= {id(node) for node in block}
        replaced[id(block[-1])] = new
    if not replaced:
        return 0
    nodes = [n for node in graph.node for n in replaced.get(id(node), [] if id(node) in gone else [node])]
    replace_nodes(graph, nodes)
    drop_unread(graph)  # the block's constants
    return len(replaced)
