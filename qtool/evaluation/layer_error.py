"""Per-layer error of a quantized model: every int8 tensor against its fp32 twin, in one run.

The QDQ rewrite names the DequantizeLinear output that stands for fp32 tensor T `T + DQ_SUFFIX`;
a dynamic int8 MatMul (or LSTM) has none, and its output, which keeps the fp32 name, is the twin.
Both models run once over the same batches with those tensors exposed (which leaves onnxruntime's
integer kernels and the outputs unchanged). The error at T is cumulative, which shows where in the
graph it grows. Tensors an exact rewrite rescaled per channel (their names in the int8 model's
metadata, qtool.graph.edit.mark_rescaled) keep their names but not their values: left out.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Iterator

import onnx

from qtool.data.dataset import Batch
from qtool.graph.index import GraphIndex, node_label
from qtool.evaluation.metrics import FidelityAccumulator
from qtool.graph.edit import rescaled_tensors, with_outputs
from qtool.quantization import dynamic_matmul
from qtool.quantization.ort_cpu.channel_pad import PAD_SUFFIX
from qtool.quantization.ort_cpu.stem_s2d import S2D_SUFFIX, undo
from qtool.quantization.rewrite import DQ_SUFFIX
from qtool.graph.runtime import create_session
from qtool.prepare.graph_prep import inline_functions


@dataclass(frozen=True)
class TensorPair:
    tensor: str  # the fp32 tensor
    node: str  # the fp32 node producing it ("" for a graph input)
    op_type: str
    position: int  # index of the producing node in the fp32 graph (-1 for a graph input)
    test_name: str = ""  # the int8 model's DequantizeLinear output, if not tensor + DQ_SUFFIX


@dataclass(frozen=True)
class LayerError:
    tensor: str
    node: str
    op_type: str
    sqnr_db: float
    cosine: float
    max_abs_error: float
    mean_abs_error: float


DYNAMIC_KERNELS = (*dynamic_matmul.DYNAMIC_KERNELS, "DynamicQuantizeLSTM")
DYNAMIC_REACH = 4  # nodes from a dynamic kernel to its fp32-named output: Cast, Mul, merged bias Add, Split


def _dynamic_outputs(int8: onnx.ModelProto, named: set[str]) -> set[str]:
    """The tensors of `named` (fp32 activations) that `int8` computes with a dynamic int8 kernel:
    along each kernel's outputs, the first tensors that carry an fp32 name."""
    readers = GraphIndex(int8).consumers
    found: set[str] = set()
    for node in int8.graph.node:
        if node.op_type not in DYNAMIC_KERNELS:
            continue
        frontier = [name for name in node.output if name]
        for _ in range(DYNAMIC_REACH + 1):  # the kernel's outputs, then each node after it
            found.update(name for name in frontier if name in named)
            frontier = [out for name in frontier if name not in named
                        for reader in readers.get(name, []) for out in reader.output if out]
    return found


def twins(fp32: onnx.ModelProto, int8: onnx.ModelProto) -> list[TensorPair]:
    """Activations of `fp32` that `int8` quantizes, in fp32 graph order (weights and biases excluded).
    The tensors inside `fp32`'s local functions are named as quantization's inlining names them."""
    fp32, _ = inline_functions(fp32)
    producers = GraphIndex(fp32).producer
    position = {id(node): i for i, node in enumerate(fp32.graph.node)}
    inputs = {i.name for i in fp32.graph.input} - {t.name for t in fp32.graph.initializer}
    rescaled = rescaled_tensors(int8)  # same name, other values: no twin
    pairs = []
    for node in int8.graph.node:
        out = node.output[0] if node.output else ""
        if node.op_type != "DequantizeLinear" or not out.endswith(DQ_SUFFIX):
            continue
        tensor = out[: -len(DQ_SUFFIX)]
        if tensor in rescaled:
            continue
        suffix = next((s for s in (PAD_SUFFIX, S2D_SUFFIX) if tensor.endswith(s)), "")
        base = tensor[: -len(suffix)] if suffix else tensor
        if suffix and base in inputs:
            # an input padded with zero channels (qtool.quantization.ort_cpu.channel_pad: compared on its real
            # channels) or rearranged into 2x2 blocks (stem_s2d: compared in the input's layout)
            pairs.append(TensorPair(base, "", "input", -1, out))
        elif suffix and base in producers:  # the same, behind the input's NHWC-to-NCHW Transpose
            producer = producers[base]
            pairs.append(TensorPair(base, node_label(producer), producer.op_type, position[id(producer)], out))
        elif tensor in inputs:
            pairs.append(TensorPair(tensor, "", "input", -1))
        elif tensor in producers and producers[tensor].op_type != "Constant":
            producer = producers[tensor]
            pairs.append(TensorPair(tensor, node_label(producer), producer.op_type, position[id(producer)]))
    named = {name for name, producer in producers.items() if producer.op_type != "Constant" and name not in rescaled}
    for tensor in sorted(_dynamic_outputs(int8, named)):
        producer = producers[tensor]
        pairs.append(TensorPair(tensor, node_label(producer), producer.op_type, position[id(producer)], tensor))
    return sorted(pairs, key=lambda p: p.position)


def layer_errors(fp32: onnx.ModelProto, int8: onnx.ModelProto, batches: Iterable[Batch],
                 threads: int = 0) -> list[LayerError]:
    """SQNR, cosine and absolute errors of every quantized activation, in graph order."""
    return summarize(twins(fp32, int8), batch_fidelity(fp32, int8, batches, threads))


def batch_fidelity(fp32: onnx.ModelProto, int8: onnx.ModelProto, batches: Iterable[Batch],
                   threads: int = 0) -> Iterator[dict[str, FidelityAccumulator]]:
    """Per batch, the accumulators of that batch alone for every twin tensor (a worker's share of
    the per-layer error: merged in batch order, they are the floats of one pass)."""
    fp32, _ = inline_functions(fp32)  # twins then finds nothing more to inline
    pairs = twins(fp32, int8)
    feeds_only = [p.tensor for p in pairs if p.position < 0]
    ref_names = [p.tensor for p in pairs if p.position >= 0]
    test_names = [p.test_name or p.tensor + DQ_SUFFIX for p in pairs]
    ref_session = create_session(with_outputs(fp32, ref_names), threads, "fp32 with per-layer outputs")
    test_session = create_session(with_outputs(int8, test_names), threads, "int8 with per-layer outputs")
    for batch in batches:
        fidelity = {p.tensor: FidelityAccumulator() for p in pairs}
        ref = dict(zip(ref_names, ref_session.run(ref_names, batch.feeds) if ref_names else []))
        ref.update({name: batch.feeds[name] for name in feeds_only})
        for pair, array in zip(pairs, test_session.run(test_names, batch.feeds)):
            if pair.test_name.endswith(S2D_SUFFIX + DQ_SUFFIX) and array.ndim == 4:
                array = undo(array)
            if array.ndim >= 2 and array.shape[1] != ref[pair.tensor].shape[1]:
                array = array[:, :ref[pair.tensor].shape[1]]  # drop padded zero channels
            fidelity[pair.tensor].update(ref[pair.tensor], array)
        yield fidelity


def summarize(pairs: list[TensorPair], per_batch: Iterable[dict[str, FidelityAccumulator]]) -> list[LayerError]:
    """The layer errors of batch_fidelity's accumulators for the twin tensors `pairs`, merged in batch order."""
    total = {p.tensor: FidelityAccumulator() for p in pairs}
    for fidelity in per_batch:
        for name, acc in total.items():
            acc.merge(fidelity[name])
    errors = []
    for pair in pairs:
        figures = total[pair.tensor].result()
        errors.append(LayerError(pair.tensor, pair.node, pair.op_type, figures["sqnr_db"], figures["cosine"],
                                 figures["max_abs_error"], figures["mean_abs_error"]))
    return errors


def worst(errors: list[LayerError], count: int = 10) -> list[LayerError]:
    return sorted(errors, key=lambda e: e.sqnr_db)[:count]
