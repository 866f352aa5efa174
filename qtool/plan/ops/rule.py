"""The types the op families write their rules in: `OpRule` (what quantizing one ONNX op type
means) and `BlockRule` (a chain of nodes kept float as a whole). The package, qtool.plan.ops,
lists the families' rules."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterable, Optional

import onnx

# (scale, zero point) of a fixed-range output, by activation dtype.
FixedParams = Callable[[str], tuple[float, int]]


@dataclass(frozen=True)
class OpRule:
    """What quantizing one op type means.

    The output's quantization parameters are "own" (its own calibrated range: Conv, Add, Relu),
    "tie" (its input's scale and zero point, because the op only moves or selects values: MaxPool,
    Reshape, Concat; a requantization there costs time and accuracy for nothing) or "fixed" (set by
    the op's math, Softmax/Sigmoid [0, 1) and Tanh [-1, 1), as the LiteRT int8 spec prescribes).

    A weight-only rule (`kernel`) makes the op a runtime kernel that takes int8 weights and
    quantizes its activations itself (onnxruntime's DynamicQuantizeLSTM): no Q/DQ and no
    calibration, only its weights are planned. On a target whose runtime lacks the kernel
    (Target.kernels) the node stays float with a note saying so (GRU's kernel is on no target: its
    rule only records why it is never int8).
    """
    op_type: str
    # Input indices quantized per tensor as activations. None: every input.
    activations: Optional[tuple[int, ...]] = (0,)
    # Index of the weight input (quantized per output channel when it is a constant).
    weight: Optional[int] = None
    # Output-channel axis of the weight, from the node's attributes and the weight's rank (None: per tensor).
    weight_axis: Optional[Callable[[onnx.NodeProto, int], Optional[int]]] = None
    # Index of the bias input, quantized to int32 with scale s_input * s_weight.
    bias: Optional[int] = None
    output: str = "own"  # "own" | "tie" | "fixed"
    fixed: Optional[FixedParams] = None
    # A compute op whose output may flow straight into a following activation (Conv -> Relu):
    # runtimes fuse the pair, so no Q/DQ belongs between them.
    absorbs_activation: bool = False
    # A weighted op whose integer kernel can also write float (onnxruntime's QGemm and
    # MatMulIntegerToFloat, TensorRT's layers): an output it delivers to the graph's outputs needs
    # no Q/DQ. Conv's kernel writes int8 only, so its output keeps them.
    float_output: bool = False
    # An activation that a preceding compute op can absorb (Relu, Clip).
    fusable_activation: bool = False
    # Extra condition on the node (e.g. Clip with constant bounds only).
    applies: Optional[Callable[[onnx.NodeProto, "object"], bool]] = None
    # Constant float operands among `activations` are stored quantized per tensor like an
    # activation (Add's bias vector, HardSwish's "+ 3"): onnxruntime fuses DQ -> Add -> Q into
    # QLinearAdd only when every input comes from a DequantizeLinear.
    quantize_constants: bool = False
    # Weight-only op: the runtime kernel it becomes (its domain's op type), and the indices of the
    # constant weights stored int8 for it. `activations` is () for such a rule. On a target whose
    # runtime lacks the kernel (not in Target.kernels), or where `applies` rejects the node, it
    # stays float and the user is told why: `unsupported` says what the kernel cannot take.
    kernel: Optional[str] = None
    kernel_weights: tuple[int, ...] = ()
    unsupported: str = ""


@dataclass(frozen=True)
class BlockRule:
    """A chain of nodes computing one higher-level op, kept float whatever its nodes' own rules say."""
    name: str
    # Every occurrence in the graph: the nodes kept float.
    match: Callable[["object"], Iterable[list[onnx.NodeProto]]]
    # Tensors no quantized op may give a range to (a mask's -1e4), whoever reads them.
    never_quantized: Optional[Callable[["object"], set[str]]] = None
