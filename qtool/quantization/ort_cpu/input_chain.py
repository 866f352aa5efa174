"""A quantized graph input as the QDQ rewrite leaves it: input -> QuantizeLinear ->
DequantizeLinear -> the Convs that read it (input -> NHWC-to-NCHW Transpose -> QuantizeLinear ->
... for a channels-last export: a TensorFlow or Keras model); and how to slip a node in between
the Q and the DQ, where it works on the integer codes (4x fewer bytes than on floats).

The stem rewrites (qtool.quantization.ort_cpu.stem_s2d, qtool.quantization.ort_cpu.channel_pad)
both start here.
"""

from __future__ import annotations

from dataclasses import dataclass

import onnx
from onnx import helper

from qtool.graph.index import GraphIndex, attribute, replace_nodes


def fast_outputs(channels: int) -> bool:
    """Whether onnxruntime's fast int8 Conv (MLAS ConvSym) takes this many output channels: at least
    16, a multiple of 4 (single Convs: 20, 28, 36 as fast as 32; 18 and 12 not; benchmarks/README.md,
    "Small CNNs"). The stem rewrites align a stem's input channels only where it does."""
    return channels >= 16 and channels % 4 == 0


@dataclass
class InputChain:
    source: str  # the graph input
    name: str  # the tensor quantized: the graph input, or its NCHW Transpose's output
    dims: tuple  # its dims in NCHW order (None where not static)
    q: onnx.NodeProto
    dq: onnx.NodeProto
    readers: list[onnx.NodeProto]  # every node reading the DequantizeLinear output


_TO_NCHW = [0, 3, 1, 2]


def quantized_inputs(model: onnx.ModelProto, index: GraphIndex) -> list[InputChain]:
    """Graph inputs read only by one QuantizeLinear whose only reader is one DequantizeLinear, or
    only by an NHWC-to-NCHW Transpose that one such QuantizeLinear alone reads (onnxruntime then
    quantizes the input itself and cancels the Transpose with its channels-last int8 layout)."""
    chains = []
    for graph_input in model.graph.input:
        name = graph_input.name
        dims = index.shapes.get(name, ())
        readers = index.consumers.get(name, [])
        if (len(readers) == 1 and readers[0].op_type == "Transpose" and len(dims) == 4
                and list(attribute(readers[0], "perm", [])) == _TO_NCHW):
            name, dims = readers[0].output[0], tuple(dims[axis] for axis in _TO_NCHW)
            readers = index.consumers.get(name, [])
        if len(readers) != 1 or readers[0].op_type != "QuantizeLinear":
            continue
        q = readers[0]
        dqs = index.consumers.get(q.output[0], [])
        if len(dqs) != 1 or dqs[0].op_type != "DequantizeLinear":
            continue
        chains.append(InputChain(graph_input.name, name, dims, q, dqs[0], index.consumers.get(dqs[0].output[0], [])))
    return chains


def insert_on_codes(model: onnx.ModelProto, chain: InputChain, op_type: str, extra_inputs: list[str],
                    suffix: str, **attrs) -> None:
    """Put `op_type` between the chain's QuantizeLinear and DequantizeLinear.

    The DequantizeLinear output gets a new name (the input name + suffix), so no tool takes
    the rearranged tensor for the fp32 input it no longer equals; every reader follows it."""
    new_name = chain.name + suffix
    out = chain.q.output[0].replace(chain.name, new_name, 1)
    node = helper.make_node(op_type, [chain.q.output[0], *extra_inputs], [out], name=new_name, **attrs)
    old_dq_out = chain.dq.output[0]
    chain.dq.input[0] = out
    chain.dq.output[0] = old_dq_out.replace(chain.name, new_name, 1)
    for reader in chain.readers:
        for i, name in enumerate(reader.input):
            if name == old_dq_out:
                reader.input[i] = chain.dq.output[0]
    nodes = list(model.graph.node)
    nodes.insert(nodes.index(chain.q) + 1, node)
    replace_nodes(model.graph, nodes)
