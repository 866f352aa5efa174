"""Float for speed on OpenVINO CPU: a network made mostly of small convolutions keeps its convolutions float.

OpenVINO folds each quantizer into the int8 layer that reads it, so an int8 convolution costs its kernel and
its input's quantization, where the float one runs in OpenVINO's default precision (bf16 on CPUs that have it).
Per layer, its int8 convolutions under MIN_CONV_MACS multiply-accumulates run no faster than bf16 (slower
below about 2^16), and under GAIN_CONV_MACS they gain a few percent at most (10% and more above); its int8
FullyConnected/MatMul gained at most sizes, so MatMul and Gemm keep their plan. Each float layer among int8
ones adds precision changes at its edges, so a few small convolutions float gain nothing whole-model: only in
a network whose convolutions are at least MIN_SHARE small do they go float, and then with every convolution
under GAIN_CONV_MACS, which left int8 among them would pay those edges for a few percent. If every weighted
layer would go float, the largest stays int8: an int8 model is what was asked for. From the graph and its
shapes alone, so the same graph gives the same nodes anywhere.
"""

from __future__ import annotations

from typing import Mapping, Sequence

import onnx

from qtool.graph.index import GraphIndex, node_label
from qtool.plan.speed import WEIGHTED, layer_macs

MIN_CONV_MACS = 1 << 18
GAIN_CONV_MACS = 1 << 22
MIN_SHARE = 0.5
CONVOLUTIONS = ("Conv", "ConvTranspose")


def small_convs_float(model: onnx.ModelProto, plan, shapes: Mapping[str, Sequence[int]], options=None
                      ) -> tuple[list[str], list[str]]:
    """(labels of quantized convolutions to keep float, one reason for them); the arguments as
    qtool.plan.speed.float_for_speed's. A node without its output's shape keeps its plan."""
    index = GraphIndex(model)
    quantized = set(plan.quantized_nodes)
    macs = {}
    for node in model.graph.node:
        label = node_label(node)
        if label in quantized and node.op_type in WEIGHTED and node.output and node.output[0] in shapes:
            weight = index.initializers.get(node.input[1]) if len(node.input) > 1 else None
            if weight is not None:
                macs[label] = (node.op_type, layer_macs(node, shapes, weight))
    convolutions = [label for label, (op, _) in macs.items() if op in CONVOLUTIONS]
    small = [label for label in convolutions if macs[label][1] < MIN_CONV_MACS]
    if not small or len(small) < MIN_SHARE * len(convolutions):
        return [], []
    floated = [label for label in convolutions if macs[label][1] < GAIN_CONV_MACS]
    if len(floated) == len(macs):
        floated.remove(max(floated, key=lambda label: macs[label][1]))
    if not floated:
        return [], []
    largest = max(macs[label][1] for label in small)
    larger = len([label for label in floated if label not in small])
    return floated, [f"{len(small)} of {len(convolutions)} convolutions have fewer than {MIN_CONV_MACS} MACs per "
                     f"sample (the largest {largest}): OpenVINO CPU runs them no faster in int8 than in its float "
                     "precision, and each int8 one quantizes its input"
                     + (f"; {larger} larger ones under {GAIN_CONV_MACS} go float with them, whose few percent in int8 "
                        "the precision changes at their edges would cost" if larger else "")]
