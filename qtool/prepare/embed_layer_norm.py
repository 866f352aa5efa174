"""onnxruntime's fused com.microsoft EmbedLayerNormalization written out as standard ops.

    EmbedLayerNormalization(ids, segments, word, position, segment, gamma, beta, mask)
    ==>  Gather(word, ids) + Gather(position, 0..S-1 or position_ids) [+ Gather(segment, segments)]
         -> LayerNormalization(gamma, beta) (below opset 17 the chain exporters write for it)
         mask_index = ReduceSum(Cast(mask, int32), axis 1)

The fused op reads its tables as float, and the word table is about half a BERT's file. Written
out, each table is read by a Gather only, so the embedding rule stores it int8 per row
(qtool.plan.planner: embeddings). Left alone: a node whose mask_index is read but has no mask input.
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import helper, numpy_helper

from qtool.graph.index import GraphIndex, attribute, default_opset, node_label, replace_nodes

REDUCE_AXES_INPUT_OPSET = 13  # ReduceSum takes its axes as an input from here on
LAYER_NORM_OPSET = 17  # LayerNormalization exists from here on; below, the chain exporters write


def _layer_norm_chain(p: str, x: str, gamma: str, beta: str, out: str, epsilon: float):
    """LayerNormalization over the last axis as ReduceMean -> Sub -> Pow 2 -> ReduceMean -> Add eps
    -> Sqrt -> Div -> Mul gamma [-> Add beta] (opsets 13-16: ReduceMean's axes an attribute); the
    block rules keep the chain float as they keep the op. (nodes, constants)."""
    values = [numpy_helper.from_array(np.array(2.0, np.float32), p + "_two"),
              numpy_helper.from_array(np.array(epsilon, np.float32), p + "_epsilon")]
    scaled = out if not beta else p + "_scaled"
    nodes = [helper.make_node("ReduceMean", [x], [p + "_mean"], name=p + "_mean", axes=[-1], keepdims=1),
             helper.make_node("Sub", [x, p + "_mean"], [p + "_centred"], name=p + "_centred"),
             helper.make_node("Pow", [p + "_centred", p + "_two"], [p + "_squares"], name=p + "_squares"),
             helper.make_node("ReduceMean", [p + "_squares"], [p + "_variance"], name=p + "_variance", axes=[-1],
                              keepdims=1),
             helper.make_node("Add", [p + "_variance", p + "_epsilon"], [p + "_stabilised"], name=p + "_stabilised"),
             helper.make_node("Sqrt", [p + "_stabilised"], [p + "_deviation"], name=p + "_deviation"),
             helper.make_node("Div", [p + "_centred", p + "_deviation"], [p + "_normed"], name=p + "_normed"),
             helper.make_node("Mul", [p + "_normed", gamma], [scaled], name=p)]
    if beta:
        nodes.append(helper.make_node("Add", [scaled, beta], [out], name=p + "_beta"))
    return nodes, values


def write_out_embed_layer_norms(model: onnx.ModelProto) -> int:
    """Rewrite each com.microsoft EmbedLayerNormalization of the main graph in place; how many."""
    graph = model.graph
    index = GraphIndex(model)
    opset = default_opset(model)
    nodes, constants, written = [], [], 0
    for node in graph.node:
        if node.op_type != "EmbedLayerNormalization" or node.domain != "com.microsoft":
            nodes.append(node)
            continue
        inputs = list(node.input) + [""] * (9 - len(node.input))
        outputs = list(node.output) + [""] * (3 - len(node.output))
        if not inputs[7] and outputs[1] and (index.consumers.get(outputs[1]) or outputs[1] in index.outputs):
            nodes.append(node)  # without a mask there is nothing to count for a mask_index that is read
            continue
        ids, segments, word, position, segment, gamma, beta, mask, positions = inputs
        p = node_label(node)
        summed = outputs[2] or p + "_sum"
        nodes.append(helper.make_node("Gather", [word, ids], [p + "_words"], name=p + "_words", axis=0))
        if not positions:  # positions 0..S-1, S the ids' second dimension
            constants += [numpy_helper.from_array(np.array(v, np.int64), p + name)
                          for name, v in (("_zero", 0), ("_one", 1))]
            nodes += [helper.make_node("Shape", [ids], [p + "_shape"], name=p + "_shape"),
                      helper.make_node("Gather", [p + "_shape", p + "_one"], [p + "_length"], name=p + "_length",
                                       axis=0),
                      helper.make_node("Range", [p + "_zero", p + "_length", p + "_one"], [p + "_positions"],
                                       name=p + "_positions")]
            positions = p + "_positions"
        nodes.append(helper.make_node("Gather", [position, positions], [p + "_places"], name=p + "_places", axis=0))
        terms = [p + "_words", p + "_places"]
        if segments and segment:
            nodes.append(helper.make_node("Gather", [segment, segments], [p + "_segments"], name=p + "_segments",
                                          axis=0))
            terms.append(p + "_segments")
        nodes.append(helper.make_node("Add", terms[:2], [summed if len(terms) == 2 else p + "_partial"],
                                      name=p + "_add"))
        if len(terms) == 3:
            nodes.append(helper.make_node("Add", [p + "_partial", terms[2]], [summed], name=p + "_add_segments"))
        epsilon = attribute(node, "epsilon", 1e-12)
        if opset >= LAYER_NORM_OPSET:
            nodes.append(helper.make_node("LayerNormalization", [summed, gamma] + ([beta] if beta else []),
                                          [outputs[0]], name=p, axis=-1, epsilon=epsilon))
        else:
            layer_norm, values = _layer_norm_chain(p, summed, gamma, beta, outputs[0], epsilon)
            nodes += layer_norm
            constants += values
        if outputs[1] and mask:  # without a mask, a mask_index nobody reads is not written
            counted = p + "_mask_int32"
            nodes.append(helper.make_node("Cast", [mask], [counted], name=counted, to=onnx.TensorProto.INT32))
            if opset >= REDUCE_AXES_INPUT_OPSET:
                constants.append(numpy_helper.from_array(np.array([1], np.int64), p + "_axis"))
                nodes.append(helper.make_node("ReduceSum", [counted, p + "_axis"], [outputs[1]],
                                              name=p + "_mask_index", keepdims=0))
            else:
                nodes.append(helper.make_node("ReduceSum", [counted], [outputs[1]], name=p + "_mask_index",
                                              axes=[1], keepdims=0))
        written += 1
    if written:
        replace_nodes(graph, nodes, constants)
    return written
