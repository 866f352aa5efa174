"""Pad a graph input's channels to a multiple of 4 for onnxruntime's fast int8 convolution.

onnxruntime's x86 QLinearConv uses its fast kernel (MLAS ConvSym: int8 weights with zero point 0,
indirect convolution) only when a non-grouped convolution's input channels are a multiple of 4
(and its output channels at least 16, a multiple of 4: input_chain.fast_outputs). An RGB stem
misses it and falls back to im2col + GEMM. So the quantized graph input gets a fourth channel
filled with its zero point (a Pad between its QuantizeLinear and DequantizeLinear) and the stem's
int8 weight a zero input channel: bit-identical outputs. Applied only where the quantized input
feeds nothing but such convolutions; the padded tensor has a new name, so no tool mistakes it for
the fp32 input. Figures: docs/targets.md, "Fusion-aware placement".
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import numpy_helper

from qtool.quantization.ort_cpu.input_chain import fast_outputs, insert_on_codes, quantized_inputs

from qtool.graph.index import GraphIndex, attribute

ALIGN = 4
PAD_SUFFIX = "_chpad"


def pad_input_channels(model: onnx.ModelProto) -> list[str]:
    """Rewrite in place; returns the names of the graph inputs padded."""
    index = GraphIndex(model)
    padded = []
    for chain in quantized_inputs(model, index):
        convs = chain.readers
        weights = [_conv_weight(conv, chain.dq.output[0], index.producer, index.initializers) for conv in convs]
        if not convs or any(w is None for w in weights):
            continue
        channels = weights[0][1].shape[1]
        if channels % ALIGN == 0 or any(w[1].shape[1] != channels for w in weights):
            continue
        if not all(fast_outputs(w[1].shape[0]) for w in weights):  # otherwise padding buys nothing
            continue
        extra = ALIGN - channels % ALIGN
        for init_name, weight in {w[0]: w[1] for w in weights}.items():
            pad_shape = (weight.shape[0], extra, *weight.shape[2:])
            grown = np.concatenate([weight, np.zeros(pad_shape, weight.dtype)], axis=1)
            index.initializers[init_name].CopyFrom(numpy_helper.from_array(grown, init_name))
        pads_name = chain.name + PAD_SUFFIX + "_pads"
        rank = len(weights[0][1].shape)
        pads = np.zeros(2 * rank, np.int64)
        pads[rank + 1] = extra  # end of axis 1
        model.graph.initializer.append(numpy_helper.from_array(pads, pads_name))
        # Pad the quantized tensor with its zero point (real 0): a quarter of the bytes a float Pad
        # would move (measured 1.0 ms in float against 0.2 ms in uint8 at batch 8).
        insert_on_codes(model, chain, "Pad", [pads_name, chain.q.input[2]], PAD_SUFFIX, mode="constant")
        padded.append(chain.source)
    return padded


def _conv_weight(conv, data_name, producer, inits):
    """(int8 weight initializer name, array) of a non-grouped QDQ Conv reading `data_name`, else None."""
    if conv.op_type != "Conv" or conv.input[0] != data_name or attribute(conv, "group", 1) != 1:
        return None
    dq = producer.get(conv.input[1]) if len(conv.input) > 1 else None
    if dq is None or dq.op_type != "DequantizeLinear" or dq.input[0] not in inits:
        return None
    weight = numpy_helper.to_array(inits[dq.input[0]])
    if weight.dtype != np.int8 or weight.ndim < 3:
        return None
    return dq.input[0], weight
