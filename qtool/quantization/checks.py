"""Checks of the quantizer's input and output: constants it can quantize, scales it may write,
and the written QDQ model against its target's constraints. (The ONNX checker itself is
qtool.graph.modelio.check_model.)"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import numpy_helper

from qtool.errors import QtoolError
from qtool.graph.index import GraphIndex, matches, scoped_initializers
from qtool.plan.planner import QuantPlan
from qtool.prepare.graph_prep import BIASED, per_channel_possible
from qtool.quantization.rewrite import SCALE_SUFFIX
from qtool.targets import target_of, weight_qmax


def check_finite_constants(model: onnx.ModelProto, plan: QuantPlan, path: object = None) -> None:
    """NaN/Inf in a weight, bias or embedding table has no int8 representation: the model itself is broken."""
    initializers = scoped_initializers(model.graph)
    for name in [*plan.weights, *plan.biases, *plan.embeddings, *(w for d in plan.dynamic.values() for w in d.weights)]:
        values = numpy_helper.to_array(initializers[name])
        bad = int(values.size - np.count_nonzero(np.isfinite(values)))
        if bad:
            raise QtoolError(f"constant '{name}' contains {bad} NaN/Inf value(s); fix the model before quantizing",
                             path)


def check_no_bad_scales(model: onnx.ModelProto) -> None:
    """No NaN, Inf or zero scale may reach a written model."""
    for init in model.graph.initializer:
        if init.name.endswith(SCALE_SUFFIX):
            values = numpy_helper.to_array(init)
            if not np.all(np.isfinite(values)) or np.any(values <= 0):
                raise AssertionError(f"internal error: bad scale in {init.name}")


def check_bias_scales(model: onnx.ModelProto) -> None:
    """Each int32 bias's scale is its own layer's input scale times its weight scales: an integer
    kernel adds the int32 values to its accumulator as they are, so a bias written at another
    layer's scale (one bias initializer read by two layers) computes other answers than the QDQ
    graph says, silently."""
    index = GraphIndex(model)

    def dequantized(name: str):
        node = index.producer.get(name)
        return node if node is not None and node.op_type == "DequantizeLinear" else None

    def scale_of(name: str):
        node = dequantized(name)
        if node is None or node.input[1] not in index.initializers:
            return None
        return numpy_helper.to_array(index.initializers[node.input[1]]).astype(np.float64).ravel()

    for node in model.graph.node:
        if node.op_type not in BIASED or len(node.input) < 3:
            continue
        bias = dequantized(node.input[2])
        codes = index.initializers.get(bias.input[0]) if bias is not None else None
        if codes is None or codes.data_type != onnx.TensorProto.INT32 or not np.any(numpy_helper.to_array(codes)):
            continue  # an all-zero bias is zero at any scale (a shared one stays shared)
        s_in, s_w, s_b = scale_of(node.input[0]), scale_of(node.input[1]), scale_of(node.input[2])
        if s_in is None or s_w is None or s_b is None or s_b.size % s_w.size:
            continue
        want = s_in[0] * np.tile(s_w, s_b.size // s_w.size)
        if not np.allclose(s_b, want, rtol=1e-5, atol=0.0):
            raise AssertionError(f"internal error: the int32 bias of {node.name or node.output[0]} is not at its "
                                 "input scale times its weight scales")


def target_problems(model: onnx.ModelProto, options, plan=None) -> list[str]:
    """Constraint violations of the written QDQ model: the target's hard requirements (an option
    overriding the preset can break them) and the options it was written with."""
    inits = {t.name: t for t in model.graph.initializer}
    problems: list[str] = []
    target = target_of(options)
    expected = np.int8 if target.int8_activations_only or options.activation_dtype == "int8" else np.uint8
    symmetric = target.symmetric_only or options.symmetric_activations
    qmax = weight_qmax(options.reduce_range)
    # below opset 13 weights are per tensor whatever the options (a kept or unconvertible opset, noted)
    per_channel = options.per_channel and per_channel_possible(model)
    params: dict[str, tuple[float, int]] = {}  # quantized tensor -> (scale, zero point)
    # A weight is a dequantized constant read as a Conv/ConvTranspose/Gemm/MatMul's second input;
    # other dequantized int8/uint8 constants (Add/Mul operands) are quantized like activations.
    weight_inputs = {n.input[1] for n in model.graph.node
                     if n.op_type in ("Conv", "ConvTranspose", "Gemm", "MatMul") and len(n.input) > 1}
    for node in model.graph.node:
        if node.op_type not in ("QuantizeLinear", "DequantizeLinear") or len(node.input) < 3:
            continue
        scale, zero = (numpy_helper.to_array(inits[n]) if n in inits else None for n in node.input[1:3])
        if scale is None or zero is None:
            continue
        if not np.all(np.isfinite(scale)) or np.any(scale <= 0):
            problems.append(f"{node.name}: scale not finite and positive")
        constant = node.op_type == "DequantizeLinear" and node.input[0] in inits
        is_weight = constant and node.output[0] in weight_inputs
        if (node.op_type == "QuantizeLinear" and zero.itemsize == 2
                and matches(node.input[0], options.int16_activations)):
            continue  # put in 16 bits on request (qtool.table.qparams.sixteen_bit): no 8-bit constraint applies
        if node.op_type == "QuantizeLinear" or (constant and not is_weight and zero.dtype != np.int32):
            # an activation, or a constant operand quantized like one
            if target.unsigned_nonnegative and symmetric and zero.dtype == np.uint8 and int(zero) == 0:
                pass  # a symmetric range with no negative value, written uint8 (Target.unsigned_nonnegative)
            elif target.signed_as_uint8 and symmetric and zero.dtype == np.uint8 and int(zero) == 128:
                pass  # the symmetric int8 grid written uint8 (Target.signed_as_uint8)
            elif zero.dtype != expected:
                problems.append(f"{node.input[0]}: activation type {zero.dtype}, target wants {expected.__name__}")
            elif symmetric and int(zero) != (0 if expected == np.int8 else 128):
                problems.append(f"{node.input[0]}: zero point {int(zero)} on a symmetric target")
            if node.op_type == "QuantizeLinear":
                params[node.input[0]] = (float(scale), int(zero))
        elif is_weight and zero.dtype == np.int8:
            q = numpy_helper.to_array(inits[node.input[0]])
            if np.any(zero != 0) or q.min(initial=0) < -qmax or q.max(initial=0) > qmax:
                problems.append(f"{node.input[0]}: weight outside [-{qmax}, {qmax}] or zero point not 0")
            if per_channel and q.ndim >= 2 and scale.ndim == 0:
                problems.append(f"{node.input[0]}: per-tensor weight on a per-channel target")
    if plan is not None:
        for group in plan.tie_groups:
            # a fixed-range member (Softmax) keeps its spec parameters when the others do not fit in
            # them (table.resolve.resolve_qparams); the others must still agree among themselves
            found = {params[n] for n in group if n in params and n not in plan.fixed}
            if len(found) > 1:
                problems.append(f"shared-scale group {group[:3]}...: parameters differ")
        if target.spec_fixed_outputs:
            for name, rule in plan.fixed.items():
                if name in params:
                    want = rule.fixed(options.activation_dtype)
                    got = params[name]
                    if not (np.float32(got[0]) == np.float32(want[0]) and got[1] == want[1]):
                        problems.append(f"{name}: {rule.op_type} output {got}, {target.runtime} spec wants {want}")
    return problems
