"""Back end of the weight-only rules (qtool/plan/ops/recurrent.py): an LSTM becomes onnxruntime's
com.microsoft DynamicQuantizeLSTM, which takes int8 W and R and quantizes X and the hidden state
to uint8 itself at every step, so no Q/DQ pair and no calibrated range is involved.

W [dirs, 4*hidden, input] and R [dirs, 4*hidden, hidden] are stored transposed, as the kernel
wants them ([dirs, input, 4*hidden], [dirs, hidden, 4*hidden]), symmetric (zero point 0), with one
scale per gate column per direction, because the gates' rows differ in magnitude (figures:
docs/targets.md, "Recurrent layers"). Without per-channel weights there is one per direction.
"""

from __future__ import annotations

from typing import Callable

import numpy as np
import onnx
from onnx import helper

from qtool.graph.index import attribute, set_attribute
from qtool.table import qparams as qp

MS_DOMAIN = "com.microsoft"
# (name, int8 values, scales, zero points) -> the names of the three initializers stored
StoreQuantized = Callable[[str, np.ndarray, np.ndarray, np.ndarray], tuple[str, str, str]]


def kernel_weights(weight: np.ndarray, per_column: bool, qmax: int) -> tuple[np.ndarray, np.ndarray]:
    """int8 values in the kernel's transposed layout and their scales ([dirs, 4*hidden] or [dirs])."""
    dirs, columns, _ = weight.shape
    rows = weight.reshape(dirs * columns if per_column else dirs, -1)
    scales = qp.weight_scales(rows, 0, qmax)
    q = qp.quantize_weight(rows, scales, 0, qmax).reshape(weight.shape).transpose(0, 2, 1)
    return np.ascontiguousarray(q), scales.reshape(dirs, columns) if per_column else scales


def dynamic_lstm(node: onnx.NodeProto, weights: dict[str, np.ndarray], per_column: bool, qmax: int,
                 store: StoreQuantized) -> onnx.NodeProto:
    """The DynamicQuantizeLSTM computing what the LSTM `node` computes, with its W and R int8.
    Same name and outputs, so reports and per-layer matching find it under the LSTM's label."""
    quantized, params = [], []
    for name in node.input[1:3]:
        q, scales = kernel_weights(weights[name], per_column, qmax)
        q_name, scale_name, zero_name = store(name, q, scales, np.zeros(scales.shape, np.int8))
        quantized.append(q_name)
        params += [scale_name, zero_name]
    optional = list(node.input[3:8])  # B, sequence_lens, initial_h, initial_c, P
    optional += [""] * (5 - len(optional))
    made = helper.make_node("DynamicQuantizeLSTM", [node.input[0], *quantized, *optional, *params],
                            list(node.output), name=node.name, domain=MS_DOMAIN)
    made.attribute.extend(a for a in node.attribute if a.name != "layout")  # the kernel has none; it is 0 here
    if attribute(made, "hidden_size") is None:
        set_attribute(made, "hidden_size", int(weights[node.input[2]].shape[-1]))
    return made


KERNELS = {"DynamicQuantizeLSTM": dynamic_lstm}
KERNEL_SUFFIX = "_kernel"  # a weight also read by a QDQ layer keeps that layer's int8 copy apart


def stored_once(store: StoreQuantized) -> StoreQuantized:
    """`store` under the kernel's own names, once per weight: two LSTMs calling one module share
    W and R, and their int8 copies (same layout, same scales) are one set of initializers."""
    stored: dict[str, tuple[str, str, str]] = {}

    def once(name: str, q: np.ndarray, scales: np.ndarray, zero: np.ndarray) -> tuple[str, str, str]:
        if name not in stored:
            stored[name] = store(name + KERNEL_SUFFIX, q, scales, zero)
        return stored[name]
    return once


def use_kernel_domain(model: onnx.ModelProto) -> None:
    """Import the com.microsoft opset the rewritten nodes belong to."""
    if not any(entry.domain == MS_DOMAIN for entry in model.opset_import):
        model.opset_import.append(helper.make_opsetid(MS_DOMAIN, 1))
