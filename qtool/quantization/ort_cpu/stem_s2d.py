"""Space-to-depth stem: a 3x3 stride-2 convolution on a quantized RGB input becomes a 2x2
stride-1 convolution on the input's 2x2 blocks (12 channels), for onnxruntime's int8 kernels.

onnxruntime's int8 Conv (MLAS ConvSym) walks an indirection buffer, one pointer per output pixel
and kernel tap, and with few input channels that per-tap cost is the whole stem; 4 taps of 12
channels cost less than 9 of 3. A SpaceToDepth (blocksize 2, DCR order) goes between the input's
QuantizeLinear and DequantizeLinear (same scale and zero point) and the int8 weight is rearranged
(`_blocked_weight`): the same products, so bit-identical outputs. Applied only where the quantized
input feeds nothing but such convolutions, with static even height and width, and where the
installed onnxruntime runs SpaceToDepth on 8-bit integers. The rewritten tensor is named with
suffix `_s2d`; `undo` maps it back. Figures: benchmarks/README.md, "int8 conv kernel paths".
"""

from __future__ import annotations

from functools import lru_cache

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from qtool.graph.runtime import create_session
from qtool.quantization.ort_cpu.input_chain import fast_outputs, insert_on_codes, quantized_inputs
from qtool.graph.index import GraphIndex, attribute, set_attribute

BLOCK = 2
S2D_SUFFIX = "_s2d"


def space_to_depth_stems(model: onnx.ModelProto) -> list[str]:
    """Rewrite in place; returns the names of the graph inputs rewritten."""
    index = GraphIndex(model)
    done = []
    for chain in quantized_inputs(model, index):
        height, width = chain.dims[2:] if len(chain.dims) == 4 else (None, None)
        if height is None or width is None or height % BLOCK or width % BLOCK:
            continue
        convs = chain.readers
        plans = [_plan(conv, chain.dq.output[0], index.producer, index.initializers, height, width) for conv in convs]
        if not convs or any(p is None for p in plans) or not _runtime_supports(_zero_type(chain.q, index.initializers)):
            continue
        for conv, (init_name, weight, pads) in zip(convs, plans):
            blocked = _blocked_weight(weight, pads[0], pads[1])
            index.initializers[init_name].CopyFrom(numpy_helper.from_array(blocked, init_name))
            set_attribute(conv, "kernel_shape", [BLOCK, BLOCK])
            set_attribute(conv, "strides", [1, 1])
            set_attribute(conv, "pads", _blocked_pads(pads, height, width))
        insert_on_codes(model, chain, "SpaceToDepth", [], S2D_SUFFIX, blocksize=BLOCK)
        done.append(chain.source)
    return done


def undo(array: np.ndarray) -> np.ndarray:
    """DepthToSpace (DCR) of an NCHW array: the rewritten input back in the input's shape."""
    n, c, h, w = array.shape
    c0 = c // (BLOCK * BLOCK)
    blocks = array.reshape(n, BLOCK, BLOCK, c0, h, w).transpose(0, 3, 4, 1, 5, 2)
    return blocks.reshape(n, c0, h * BLOCK, w * BLOCK)


def _plan(conv, data_name, producer, inits, height, width):
    """(int8 weight initializer, weight, pads) of a 3x3 stride-2 QDQ Conv reading `data_name`, else None."""
    if conv.op_type != "Conv" or conv.input[0] != data_name or attribute(conv, "group", 1) != 1:
        return None
    if list(attribute(conv, "strides", [1, 1])) != [2, 2] or list(attribute(conv, "dilations", [1, 1])) != [1, 1]:
        return None
    if attribute(conv, "auto_pad", b"NOTSET") not in (b"NOTSET", "NOTSET"):
        return None
    dq = producer.get(conv.input[1]) if len(conv.input) > 1 else None
    if dq is None or dq.op_type != "DequantizeLinear" or dq.input[0] not in inits:
        return None
    weight = numpy_helper.to_array(inits[dq.input[0]])
    if weight.dtype != np.int8 or weight.shape[2:] != (3, 3):
        return None
    if not fast_outputs(weight.shape[0]):
        return None
    pads = list(attribute(conv, "pads", [0, 0, 0, 0]))
    if any(p not in (0, 1) for p in pads[:2]):
        return None
    new_pads = _blocked_pads(pads, height, width)
    if any(p < 0 for p in new_pads):
        return None
    return dq.input[0], weight, pads


def _blocked_weight(weight: np.ndarray, pad_top: int, pad_left: int) -> np.ndarray:
    """The 3x3 weight over 2x2 blocks (channel = (dy * 2 + dx) * C + c, DCR): tap k reads block
    (k - pad_begin) // 2, phase (k - pad_begin) % 2; a tap no original tap maps to is 0. Padding
    stays the zero point (real 0) at the same positions."""
    out, channels = weight.shape[:2]
    blocked = np.zeros((out, BLOCK, BLOCK, channels, BLOCK, BLOCK), weight.dtype)  # o, dy, dx, c, by, bx
    for ky in range(3):
        for kx in range(3):
            by, bx = (ky - pad_top) // BLOCK + pad_top, (kx - pad_left) // BLOCK + pad_left
            blocked[:, (ky - pad_top) % BLOCK, (kx - pad_left) % BLOCK, :, by, bx] = weight[:, :, ky, kx]
    return blocked.reshape(out, BLOCK * BLOCK * channels, BLOCK, BLOCK)


def _blocked_pads(pads: list[int], height: int, width: int) -> list[int]:
    """Pads of the 2x2 stride-1 conv over blocks giving the original output size."""
    result = []
    for axis, size in enumerate((height, width)):
        begin, end = pads[axis], pads[axis + 2]
        out = (size + begin + end - 3) // 2 + 1
        result.append((begin, out - (size // BLOCK - 1) - begin))
    return [result[0][0], result[1][0], result[0][1], result[1][1]]


def _zero_type(q, inits) -> int:
    zero = inits.get(q.input[2]) if len(q.input) > 2 else None
    return zero.data_type if zero is not None else TensorProto.UINT8


@lru_cache(maxsize=None)
def _runtime_supports(elem_type: int) -> bool:
    """Whether the installed onnxruntime has a CPU SpaceToDepth kernel for this integer type."""
    node = helper.make_node("SpaceToDepth", ["x"], ["y"], blocksize=BLOCK)
    graph = helper.make_graph([node], "s2d", [helper.make_tensor_value_info("x", elem_type, [1, 1, 2, 2])],
                              [helper.make_tensor_value_info("y", elem_type, [1, 4, 1, 1])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    try:
        create_session(model, label="SpaceToDepth probe", log_level=4)
        return True
    except Exception:  # no kernel for the type: keep the channel padding instead
        return False
