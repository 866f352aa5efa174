"""Fixed-point requantization: every real multiplier as an int32 and a shift.

Integer kernels accumulate int8 x int8 products in int32 and must scale the sum by a
real factor M (for a convolution M = s_in * s_w / s_out). Hardware and integer
runtimes hold M as M0 * 2^-31 * 2^-n with M0 in [2^30, 2^31) (TFLite's
QuantizeMultiplier, TPU-MLIR's multiplier/rshift: 0.1234 = 2119995857 / 2^34), and
apply it as ruy's reference does: add 2^(s-1), shift right arithmetically by s = 31 + n
(round half up). `export_params` writes these integers for every quantized layer of a
QDQ model; qtool/integer/verify_int.py executes them and compares with onnxruntime.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, Optional

import numpy as np
from qtool import atomic
from qtool.graph.shapes import with_shapes
from qtool.integer.qdq_graph import WEIGHTED, QLayer, find_layers
from qtool.table.qparams import INT_RANGES

Q31 = 1 << 31
MAX_RIGHT_SHIFT = 31  # TFLite: a multiplier below 2^-32 is zero
ADD_LEFT_SHIFT = 20  # TFLite's int8 Add: inputs are scaled up by 2^20 before their multipliers
INT16_MAX = 2**15 - 1
INT8_MULTIPLIER_MAX = 127


def quantize_multiplier(real: float) -> tuple[int, int]:
    """M -> (M0, n) with M = M0 * 2^-31 * 2^-n, M0 in [2^30, 2^31); n < 0 means a left shift."""
    if real < 0:
        raise ValueError(f"multiplier {real} is negative")
    if real == 0:
        return 0, 0
    mantissa, exponent = math.frexp(real)  # real = mantissa * 2^exponent, mantissa in [0.5, 1)
    m0 = math.floor(mantissa * Q31 + 0.5)  # round half away from zero, as TFLite's TfLiteRound
    if m0 == Q31:
        m0, exponent = m0 // 2, exponent + 1
    if -exponent > MAX_RIGHT_SHIFT:
        return 0, 0
    return m0, -exponent


def quantize_multipliers(reals: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    pairs = [quantize_multiplier(float(r)) for r in np.atleast_1d(reals)]
    return np.array([p[0] for p in pairs], np.int64), np.array([p[1] for p in pairs], np.int64)


def multiply_by_quantized_multiplier(x, m0, n) -> np.ndarray:
    """ruy's reference: (x * M0 + 2^(s-1)) >> s with s = 31 + n, in int64 (x int32, M0 < 2^31)."""
    x = np.asarray(x, np.int64)
    m0 = np.asarray(m0, np.int64)
    total = np.asarray(31 + np.asarray(n, np.int64), np.int64)
    if np.any(total < 1) or np.any(total > 62):
        raise ValueError("shift out of range: 31 + n must be in [1, 62]")
    return (x * m0 + (np.int64(1) << (total - 1))) >> total


def rounding_shift_right(x, shift: int) -> np.ndarray:
    x = np.asarray(x, np.int64)
    return x if shift == 0 else (x + (np.int64(1) << (shift - 1))) >> shift


# ---- per-op parameters -------------------------------------------------------------

def _multiplier_json(real: float) -> dict[str, Any]:
    m0, n = quantize_multiplier(real)
    return {"real": real, "multiplier": m0, "shift": n}


def _tensor_json(t) -> dict[str, Any]:
    return {"tensor": t.name, "scale": t.scale, "zero_point": t.zero_point, "dtype": t.dtype}


def output_clamp(layer: QLayer) -> tuple[int, int]:
    """Integer bounds of the output: the type's range, narrowed by a fused Relu/Clip."""
    out = layer.output
    qmin, qmax = INT_RANGES[out.dtype]
    if layer.activation is not None:
        lo, hi = layer.activation
        if lo is not None and math.isfinite(lo):
            qmin = max(qmin, out.zero_point + int(np.rint(np.float32(lo) / np.float32(out.scale))))
        if hi is not None and math.isfinite(hi):
            qmax = min(qmax, out.zero_point + int(np.rint(np.float32(hi) / np.float32(out.scale))))
    return qmin, qmax


def channel_multipliers(layer: QLayer) -> np.ndarray:
    """M[c] = s_in * s_w[c] / s_out in float64 (the exact real factor of each output channel)."""
    s_in = float(layer.inputs[0].scale)
    s_w = np.atleast_1d(layer.weight.scale.astype(np.float64))
    return s_in * s_w / float(layer.output.scale)


def folded_bias(layer: QLayer) -> np.ndarray:
    """int32 bias with the input zero point folded in: b - z_in * sum_k(w[c, k] - z_w[c])."""
    w = layer.weight.channels_first().astype(np.int64)
    w = w - layer.weight.zero_point_per_channel().reshape(-1, *([1] * (w.ndim - 1)))
    sums = w.reshape(w.shape[0], -1).sum(axis=1)
    bias = layer.bias.values.astype(np.int64) if layer.bias is not None else np.zeros(w.shape[0], np.int64)
    return bias - layer.inputs[0].zero_point * sums


def add_int16_params(layer: QLayer) -> dict[str, Any]:
    """TPU-MLIR's symmetric Add: y = ((qa-za)*Ma + (qb-zb)*Mb)_int16 >> n + zy, Ma, Mb int8.

    The largest right shift n is taken for which both multipliers round to at most 127
    and the int16 intermediate cannot overflow for any input code.
    """
    a, b, out = layer.inputs[0], layer.inputs[1], layer.output
    ratios = [a.scale / out.scale, b.scale / out.scale]
    spans = [max(t.zero_point - INT_RANGES[t.dtype][0], INT_RANGES[t.dtype][1] - t.zero_point) for t in (a, b)]
    best = None
    for n in range(0, 32):
        ms = [int(math.floor(r * (1 << n) + 0.5)) for r in ratios]
        if max(ms) > INT8_MULTIPLIER_MAX or sum(m * s for m, s in zip(ms, spans)) > INT16_MAX:
            break
        best = (ms, n)
    if best is None:
        return {"representable": False, "reason": "a scale ratio exceeds 127"}
    ms, n = best
    return {"representable": True, "multipliers": ms, "shift": n,
            "relative_error": [abs(m / (1 << n) - r) / r for m, r in zip(ms, ratios)]}


def add_int32_params(layer: QLayer) -> dict[str, Any]:
    """TFLite's int8 Add: inputs scaled by 2^20 and by s_i / (2 max s), output by 2 max s / (2^20 s_out)."""
    a, b, out = layer.inputs[0], layer.inputs[1], layer.output
    twice_max = 2.0 * max(a.scale, b.scale)
    return {"left_shift": ADD_LEFT_SHIFT,
            "inputs": [_multiplier_json(a.scale / twice_max), _multiplier_json(b.scale / twice_max)],
            "output": _multiplier_json(twice_max / ((1 << ADD_LEFT_SHIFT) * out.scale))}


def _layer_params(layer: QLayer) -> Optional[dict[str, Any]]:
    if layer.output is None:
        return None
    item: dict[str, Any] = {"name": layer.name, "op_type": layer.op_type,
                            "inputs": [_tensor_json(t) for t in layer.inputs], "output": _tensor_json(layer.output),
                            "clamp": list(output_clamp(layer))}
    if layer.op_type in WEIGHTED:
        reals = channel_multipliers(layer)
        m0, n = quantize_multipliers(reals)
        item["weight"] = {"tensor": layer.weight.name, "axis": layer.weight.axis,
                          "zero_point": layer.weight.zero_point_per_channel().tolist()}
        item["bias"] = layer.bias.values.astype(np.int64).tolist() if layer.bias is not None else None
        item["bias_with_input_zero_point"] = folded_bias(layer).tolist()
        item["per_channel"] = {"real": reals.tolist(), "multiplier": m0.tolist(), "shift": n.tolist()}
    elif layer.op_type == "Add":
        item["int16"] = add_int16_params(layer)
        item["int32"] = add_int32_params(layer)
    elif layer.op_type in ("AveragePool", "GlobalAveragePool"):
        ratio = layer.inputs[0].scale / layer.output.scale
        item["scale_ratio"] = _multiplier_json(ratio)
        area = layer.window_area()
        item["window_area"] = area
        item["per_window"] = _multiplier_json(ratio / area) if area else None
    elif layer.op_type in ("LeakyRelu", "PRelu"):
        ratio = layer.inputs[0].scale / layer.output.scale
        item["positive"] = _multiplier_json(ratio)
        slopes = np.atleast_1d(layer.slopes())
        item["slope"] = slopes.tolist()
        item["negative"] = [_signed_multiplier_json(ratio * float(a)) for a in slopes]
    return item


def _signed_multiplier_json(real: float) -> dict[str, Any]:
    m0, n = quantize_multiplier(abs(real))
    return {"real": real, "multiplier": -m0 if real < 0 else m0, "shift": n}


def export_params(model) -> dict[str, Any]:
    layers, skipped = find_layers(with_shapes(model, data_prop=False))  # shapes give pooling windows
    exported, float_out = [], []
    for layer in layers:
        item = _layer_params(layer)
        if item is None:
            float_out.append(f"{layer.name} ({layer.op_type})")
        else:
            exported.append(item)
    return {"format": "qtool-fixed-point", "version": 1,
            "convention": "real = scale * (q - zero_point); a multiplier M is stored as (multiplier M0, shift n) "
                          "with M = M0 * 2^-31 * 2^-n, M0 in [2^30, 2^31); apply as (x * M0 + 2^(30+n)) >> (31+n)",
            "layers": exported, "float_output": float_out, "not_quantized": skipped}


def write_params(params: dict[str, Any], path: str | Path) -> None:
    atomic.write_text(path, json.dumps(params, indent=1) + "\n")


def describe(path: str | Path, params: dict[str, Any]) -> str:
    return (f"exported {len(params['layers'])} layers ({len(params['float_output'])} with float outputs, "
            f"{len(params['not_quantized'])} ops not in QDQ form) -> {path}")
