"""A gated residual written with one reader of its input: x + x * g  ==>  x * (1 + g).

Residual squeeze-and-excitation blocks (x plus x scaled by its channel gate g, as in PP-OCR's
detector neck) read x twice in float. Where x is a quantized layer output, OpenVINO's CPU plugin
then dequantizes it in an elementwise pass of its own, since it fuses a dequantization into one
float reader only; read by the one Mul, it is fused there (one pass over x instead of three:
dequantize, Mul, Add). The product computes the same sum in real arithmetic; 1 + g has the
gate's shape, a channel vector in such a block. Only where the Mul's output is read by the Add
alone and no tensor of the three is known to be other than float32.
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import helper, numpy_helper

from qtool.graph.index import GraphIndex, replace_nodes


def gated_residuals(model: onnx.ModelProto) -> int:
    """Rewrite each Add(x, Mul(x, g)) of the main graph in place; how many."""
    graph = model.graph
    index = GraphIndex(model)
    rewritten: dict[int, tuple[onnx.NodeProto, onnx.NodeProto]] = {}  # the Add's id -> (1 + g, x * (1 + g))
    dropped: set[int] = set()  # the Muls' ids
    for add in graph.node:
        if add.op_type != "Add" or add.domain not in ("", "ai.onnx") or len(add.input) != 2:
            continue
        for x, product in (add.input, add.input[::-1]):
            mul = index.producer.get(product)
            if mul is None or mul.op_type != "Mul" or mul.domain not in ("", "ai.onnx") or id(mul) in dropped \
                    or index.only_consumer(product) is not add or list(mul.input).count(x) != 1:
                continue
            gate = mul.input[1] if mul.input[0] == x else mul.input[0]
            if not all(index.is_float(name) for name in (x, gate, add.output[0])):
                continue
            name = f"{add.name or add.output[0]}_gate_plus_one"
            plus = helper.make_node("Add", [gate, "qtool_one"], [name], name=name)
            times = helper.make_node("Mul", [x, name], list(add.output), name=add.name)
            rewritten[id(add)] = (plus, times)
            dropped.add(id(mul))
            break
    if not rewritten:
        return 0
    nodes = []
    for node in graph.node:
        if id(node) in dropped:
            continue
        nodes.extend(rewritten.get(id(node), (node,)))
    one = [] if "qtool_one" in index.initializers else [numpy_helper.from_array(np.array(1.0, np.float32), "qtool_one")]
    replace_nodes(graph, nodes, one)
    return len(rewritten)
