"""Integer-only reference check: run a QDQ model's layers in pure integer numpy and
compare each with what onnxruntime computed for it.

onnxruntime runs the QDQ model once per batch with every layer's integer input and output
exposed; each layer is recomputed from the integer inputs onnxruntime gave it (so differences
never accumulate) and compared code for code, in two forms: fixed (int32 accumulation and bias,
a 31-bit multiplier and shift per output channel, qtool/integer/fixed_point.py: what a
fixed-point accelerator does) and ort (the same accumulation requantized as onnxruntime's MLAS
kernels do), which should match exactly and shows that any difference of the fixed form is the
requantization, not the layer mapping. Add layers also run in TPU-MLIR's int16 form.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import numpy as np
import onnx
import onnxruntime as ort

from qtool.config import PreprocessConfig
from qtool.data.dataset import batches, open_data
from qtool.errors import QtoolError
from qtool.integer.fixed_point import add_int16_params, add_int32_params, channel_multipliers, output_clamp
from qtool.integer.int_kernels import (AccumulatorOverflow, add_float, add_int16, add_int32, avg_pool_float, conv_acc,
                               matmul_acc, max_pool, pool_sums, requantize_fixed, requantize_float)
from qtool.graph.modelio import input_specs, load_model
from qtool.graph.edit import with_outputs
from qtool.integer.qdq_graph import QLayer, find_layers
from qtool.graph.kernels import optimized_ops
from qtool.graph.runtime import create_session
from qtool.graph.shapes import with_shapes

CHECKED_OPS = ("Conv", "Gemm", "MatMul", "Add", "AveragePool", "GlobalAveragePool", "MaxPool")
MODES = ("fixed", "ort", "int16")
_ORT_KERNELS = ("QLinearConv", "QLinearAdd", "QGemm", "QLinearMatMul", "QLinearAveragePool",
                "QLinearGlobalAveragePool", "MaxPool", "MatMulIntegerToFloat", "ConvInteger")


@dataclass
class Agreement:
    outputs: int = 0
    exact: int = 0
    max_lsb: int = 0
    histogram: Counter = field(default_factory=Counter)  # |difference| -> count

    def add(self, ours: np.ndarray, theirs: np.ndarray) -> None:
        diff = np.abs(ours.astype(np.int64) - theirs.astype(np.int64))
        self.outputs += diff.size
        self.exact += int((diff == 0).sum())
        self.max_lsb = max(self.max_lsb, int(diff.max(initial=0)))
        values, counts = np.unique(diff, return_counts=True)
        self.histogram.update(dict(zip(values.tolist(), counts.tolist())))

    def merge(self, other: "Agreement") -> None:
        self.outputs += other.outputs
        self.exact += other.exact
        self.max_lsb = max(self.max_lsb, other.max_lsb)
        self.histogram.update(other.histogram)

    @property
    def fraction(self) -> Optional[float]:
        return self.exact / self.outputs if self.outputs else None

    def to_json(self) -> dict:
        return {"outputs": self.outputs, "exact": self.exact, "fraction_exact": self.fraction,
                "max_lsb": self.max_lsb, "lsb_histogram": {str(k): v for k, v in sorted(self.histogram.items())}}


@dataclass
class LayerResult:
    layer: QLayer
    modes: dict[str, Agreement] = field(default_factory=dict)


def _conv_acc(layer: QLayer, x: np.ndarray) -> np.ndarray:
    spatial = x.ndim - 2
    if layer.attr("auto_pad", b"NOTSET") not in (b"NOTSET", "NOTSET"):
        raise NotImplementedError("auto_pad")
    w = layer.weight
    acc = conv_acc(x, layer.inputs[0].zero_point, w.values, w.zero_point_per_channel(),
                   layer.attr("strides", [1] * spatial), layer.attr("pads", [0] * 2 * spatial),
                   layer.attr("dilations", [1] * spatial), int(layer.attr("group", 1)))
    if layer.bias is not None:
        acc = acc + layer.bias.values.astype(np.int64).reshape((1, -1) + (1,) * spatial)
    return acc


def _matmul_acc(layer: QLayer, a: np.ndarray) -> np.ndarray:
    w = layer.weight
    b = w.values.T if (layer.op_type == "Gemm" and layer.attr("transB", 0)) else w.values
    acc = matmul_acc(a, layer.inputs[0].zero_point, b, w.zero_point_per_channel())
    if layer.bias is not None:
        acc = acc + layer.bias.values.astype(np.int64)
    return acc


def _weighted(layer: QLayer, x: np.ndarray, mode: str) -> np.ndarray:
    acc = _conv_acc(layer, x) if layer.op_type == "Conv" else _matmul_acc(layer, x)
    axis = 1 if layer.op_type == "Conv" else acc.ndim - 1
    out = layer.output
    qmin, qmax = output_clamp(layer)
    if mode == "fixed":
        return requantize_fixed(acc, channel_multipliers(layer), out.zero_point, qmin, qmax, axis)
    s_w = np.atleast_1d(layer.weight.scale.astype(np.float32))
    scales32 = (np.float32(layer.inputs[0].scale) * s_w / np.float32(out.scale)).astype(np.float32)
    return requantize_float(acc, scales32, out.zero_point, qmin, qmax, axis)


def _add(layer: QLayer, a: np.ndarray, b: np.ndarray, mode: str) -> Optional[np.ndarray]:
    ta, tb, out = layer.inputs[0], layer.inputs[1], layer.output
    qmin, qmax = output_clamp(layer)
    if mode == "fixed":
        return add_int32(a, ta.zero_point, b, tb.zero_point, add_int32_params(layer), out.zero_point, qmin, qmax)
    if mode == "int16":
        params = add_int16_params(layer)
        if not params["representable"]:
            return None
        return add_int16(a, ta.zero_point, b, tb.zero_point, params, out.zero_point, qmin, qmax)
    return add_float(a, ta.scale, ta.zero_point, b, tb.scale, tb.zero_point, out.scale, out.zero_point, qmin, qmax)


def _pool(layer: QLayer, x: np.ndarray, mode: str) -> np.ndarray:
    t, out = layer.inputs[0], layer.output
    qmin, qmax = output_clamp(layer)
    spatial = x.ndim - 2
    if layer.op_type == "MaxPool":
        if layer.attr("ceil_mode", 0) or any(d != 1 for d in layer.attr("dilations", [1] * spatial)):
            raise NotImplementedError("ceil_mode/dilations")
        peak = max_pool(x, layer.attr("kernel_shape"), layer.attr("strides", [1] * spatial),
                        layer.attr("pads", [0] * 2 * spatial))
        return _rescale(peak - t.zero_point, t.scale / out.scale, out.zero_point, qmin, qmax, mode)
    if layer.op_type == "GlobalAveragePool":
        count = int(np.prod(x.shape[2:]))
        sums = (x.astype(np.int64) - t.zero_point).sum(axis=tuple(range(2, x.ndim)), keepdims=True)
        if mode == "fixed":
            return _rescale(sums, t.scale / (out.scale * count), out.zero_point, qmin, qmax, mode)
        scale = np.float32(np.float32(t.scale) / np.float32(np.float32(out.scale) * np.float32(count)))
        return requantize_float(sums, np.array([scale]), out.zero_point, qmin, qmax)
    if layer.attr("ceil_mode", 0) or layer.attr("auto_pad", b"NOTSET") not in (b"NOTSET", "NOTSET"):
        raise NotImplementedError("ceil_mode/auto_pad")
    kernel = layer.attr("kernel_shape")
    strides = layer.attr("strides", [1] * spatial)
    pads = layer.attr("pads", [0] * 2 * spatial)
    include_pad = bool(layer.attr("count_include_pad", 0))
    if mode == "ort":
        return avg_pool_float(x, t.scale, t.zero_point, out.scale, out.zero_point, kernel, strides, pads,
                              include_pad, qmin, qmax)
    sums, counts = pool_sums(x, t.zero_point, kernel, strides, pads, include_pad)
    result = np.empty(sums.shape, np.int64)
    for count in np.unique(counts):
        where = np.broadcast_to(counts == count, sums.shape)
        result[where] = _rescale(sums[where], t.scale / (out.scale * int(count)), out.zero_point, qmin, qmax, mode)
    return result


def _rescale(values, real: float, zero_point: int, qmin: int, qmax: int, mode: str) -> np.ndarray:
    if mode == "fixed":
        return requantize_fixed(np.asarray(values, np.int64), np.array([real]), zero_point, qmin, qmax)
    return requantize_float(np.asarray(values, np.int64), np.array([np.float32(real)]), zero_point, qmin, qmax)


def integer_output(layer: QLayer, inputs: list[np.ndarray], mode: str) -> Optional[np.ndarray]:
    """The layer's integer output from its integer inputs; None if `mode` does not apply."""
    if layer.op_type == "Add":
        return _add(layer, inputs[0], inputs[1], mode)
    if mode == "int16":
        return None
    if layer.op_type in ("Conv", "Gemm", "MatMul"):
        return _weighted(layer, inputs[0], mode)
    return _pool(layer, inputs[0], mode)


def _checkable(layers: list[QLayer]) -> tuple[list[QLayer], list[str]]:
    keep, skipped = [], []
    for layer in layers:
        if layer.op_type not in CHECKED_OPS:
            skipped.append(f"{layer.name} ({layer.op_type}: no integer kernel here)")
        elif layer.output is None:
            skipped.append(f"{layer.name} ({layer.op_type}: output stays float)")
        else:
            keep.append(layer)
    return keep, skipped


def ort_kernels(model: onnx.ModelProto) -> dict[str, int]:
    """How many integer kernels onnxruntime's optimizer made of the QDQ graph (a layer it did
    not fuse runs as DequantizeLinear, float op, QuantizeLinear), at the level it runs."""
    counts = optimized_ops(model, ort.GraphOptimizationLevel.ORT_ENABLE_ALL)
    return {op: counts[op] for op in _ORT_KERNELS if counts[op]}


def verify(model_path: str | Path, data: str | Path, preprocess: PreprocessConfig, num_samples: Optional[int],
           batch_size: int = 1, threads: int = 1) -> dict:
    model = load_model(model_path)
    all_layers, not_qdq = find_layers(model)
    layers, skipped = _checkable(all_layers)
    if not layers:
        raise QtoolError("no quantized Conv/Gemm/MatMul/Add/pool layer in QDQ form", model_path)
    constants = {name: codes for layer in layers for name, codes in layer.constants.items()}
    names = list(dict.fromkeys(t.name for layer in layers for t in layer.inputs + [layer.output]
                               if t.name not in constants))
    # shape inference gives the integer tensors their types, which the exposed outputs need
    session = create_session(with_outputs(with_shapes(model, data_prop=False), names), threads, str(model_path))
    results = {layer.name: LayerResult(layer, {m: Agreement() for m in MODES}) for layer in layers}
    seen = 0
    source = open_data(data, input_specs(model), preprocess)
    for batch in batches(source, batch_size, num_samples):
        values = {**constants, **dict(zip(names, session.run(names, batch.feeds)))}
        seen += len(batch)
        for layer in layers:
            inputs = [values[t.name] for t in layer.inputs]
            for mode, agreement in results[layer.name].modes.items():
                try:
                    ours = integer_output(layer, inputs, mode)
                except (NotImplementedError, AccumulatorOverflow) as exc:
                    raise QtoolError(f"layer {layer.name} ({layer.op_type}): {exc}", model_path) from None
                if ours is not None:
                    agreement.add(ours, values[layer.output.name])
    if seen == 0:
        raise QtoolError("no samples could be read", data)
    return _report(model_path, model, seen, list(results.values()), skipped + not_qdq)


def _report(model_path, model, samples: int, results: list[LayerResult], skipped: list[str]) -> dict:
    totals = {mode: Agreement() for mode in MODES}
    rows = []
    for result in results:
        row = {"name": result.layer.name, "op_type": result.layer.op_type}
        for mode, agreement in result.modes.items():
            if agreement.outputs:
                totals[mode].merge(agreement)
                row[mode] = agreement.to_json()
        rows.append(row)
    return {"model": str(model_path), "samples": samples, "layers": rows,
            "totals": {mode: a.to_json() for mode, a in totals.items() if a.outputs},
            "not_checked": skipped, "ort_kernels": ort_kernels(model)}


def _pct(value) -> str:
    return "-" if value is None else f"{100.0 * value:.4f}%"


def render(report: dict) -> str:
    head = ("layer", "op", "outputs", "fixed exact", "max LSB", "ort-float exact", "max LSB", "int16 Add exact",
            "max LSB")
    rows = [head]
    for row in report["layers"]:
        cells = [row["name"], row["op_type"], str(row["fixed"]["outputs"])]
        for mode in MODES:
            item = row.get(mode)
            cells += [_pct(item["fraction_exact"]), str(item["max_lsb"])] if item else ["", ""]
        rows.append(tuple(cells))
    widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
    lines = ["  ".join(c.ljust(widths[i]) if i < 2 else c.rjust(widths[i]) for i, c in enumerate(r)).rstrip()
             for r in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    lines.append("")
    for mode, label in (("fixed", "integer-only (31-bit multiplier + shift)"),
                        ("ort", "float requantization as onnxruntime does it"),
                        ("int16", "Add layers in TPU-MLIR's int16 form")):
        total = report["totals"].get(mode)
        if total:
            lines.append(f"{label}: {_pct(total['fraction_exact'])} of {total['outputs']} outputs bit-exact, "
                         f"max {total['max_lsb']} LSB, differences {total['lsb_histogram']}")
    kernels = ", ".join(f"{k} {v}" for k, v in report["ort_kernels"].items())
    lines.append(f"{len(report['layers'])} layers checked on {report['samples']} samples; onnxruntime ran: {kernels}")
    if report["not_checked"]:
        lines.append(f"not checked: {', '.join(report['not_checked'])}")
    return "\n".join(lines)
