"""The int8 model as written for onnxruntime CPU: without value_info, SkipLayerNormalization split.

- Without value_info (the shapes and types the front end inferred); onnxruntime infers its own
  when it loads a model. Declared shapes let it fuse a residual Add and the LayerNormalization
  after it into SkipLayerNormalization, whose CPU kernel is several times slower than the two ops.
- For the same reason, the com.microsoft SkipLayerNormalization nodes of a graph that
  onnxruntime's transformer optimizer fused become Add (input + skip, + bias) and
  LayerNormalization, with the same values within float rounding. Measurements: docs/targets.md.
"""

from __future__ import annotations

import onnx

from qtool.graph.index import attribute, node_label, replace_nodes

SKIP_NOTE = ("{} SkipLayerNormalization node(s) written as Add and LayerNormalization, which onnxruntime's CPU "
             "kernels run 4-7x faster (the same values within float rounding)")


def written_form(qmodel: onnx.ModelProto) -> int:
    """In place: value_info dropped and SkipLayerNormalization nodes split; the number split."""
    del qmodel.graph.value_info[:]
    return _split_skip_layer_norms(qmodel.graph)


def _split_skip_layer_norms(graph: onnx.GraphProto) -> int:
    nodes, split = [], 0
    for node in graph.node:
        if node.op_type != "SkipLayerNormalization" or node.domain != "com.microsoft" or any(node.output[1:3]):
            nodes.append(node)  # mean and inverse deviation outputs (training) have no LayerNormalization twin
            continue
        data, skip, gamma = node.input[:3]
        beta, bias = (list(node.input[3:5]) + ["", ""])[:2]
        out, label = node.output[0], node_label(node)
        total = node.output[3] if len(node.output) > 3 and node.output[3] else out + "_skip_sum"
        summed = total if not bias else out + "_skip"
        nodes.append(onnx.helper.make_node("Add", [data, skip], [summed], name=label + "_skip"))
        if bias:
            nodes.append(onnx.helper.make_node("Add", [summed, bias], [total], name=label + "_bias"))
        nodes.append(onnx.helper.make_node("LayerNormalization", [total, gamma] + ([beta] if beta else []), [out],
                                           name=label, axis=-1, epsilon=attribute(node, "epsilon", 1e-12)))
        split += 1
    if split:
        replace_nodes(graph, nodes)
    return split
