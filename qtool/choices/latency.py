"""Latency tuning (opt-in, `quantization.advanced.latency_aware: on`): nodes whose int8 form
onnxruntime runs slower than float on this machine stay float.

Whether an int8 layer pays depends on the CPU, onnxruntime's version and the shapes, so this step
times whole candidate models (1 thread, the candidates taking turns, medians) and keeps a float
choice only when it measures MARGIN faster twice in a row: op types greedily, cheap elementwise
types first; then each weighted type with the elementwise types; then the nodes with the largest
outputs. The last weighted op type always stays int8. Its outcome depends on the machine and its
load, so it is never a default: the nodes it keeps float are a Decision on
`quantization.advanced.float_nodes`, which a settled config replays anywhere without timing.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass
from typing import Callable, Mapping, Optional, Sequence

import numpy as np
import onnx

from qtool.graph.modelio import InputSpec
from qtool.graph.runtime import create_session, time_sessions
from qtool.plan.ops import rule_for

MARGIN = 0.05  # a float candidate must be this much faster than the int8 model it replaces, twice;
# and the int8 model this much faster than fp32, or the fallback goes on
BUDGET_S = 0.3  # timing per comparison: runs are chosen so the two models take about this long
MIN_RUNS, MAX_RUNS = 7, 200
SLOW_S, FEW_RUNS = 1.0, 3  # models taking SLOW_S together for one run each: FEW_RUNS runs
WEIGHTED = ("Conv", "ConvTranspose", "Gemm", "MatMul", "LSTM")  # tried last: where int8 usually pays
LARGEST_LEVELS = 6  # output sizes tried by _largest_float, the largest first

# {name: model (a proto or a path)} -> median seconds per run of each per feed set (batch 1, then
# the batch), timed together
Measure = Callable[[Mapping[str, "onnx.ModelProto | str"]], dict[str, list[float]]]


@dataclass(frozen=True)
class LatencyChoice:
    labels: tuple[str, ...]  # the nodes kept float
    notes: tuple[str, ...]  # one per choice


def feed_sets(feeds: Mapping[str, np.ndarray], specs: Sequence[InputSpec]) -> list[dict[str, np.ndarray]]:
    """The batch, and its first sample alone when every input is batched along axis 0 (its spec
    declares that axis dynamic: a fixed first dimension is the model's own, whatever its length):
    a choice must hold at batch 1 and at the batch the model is fed with."""
    dynamic = {s.name for s in specs if len(s.shape) and s.shape[0] is None}
    leading = {v.shape[0] for v in feeds.values() if v.ndim}
    if (len(leading) == 1 and leading.pop() > 1 and all(v.ndim for v in feeds.values())
            and all(name in dynamic for name in feeds)):
        return [{k: v[:1] for k, v in feeds.items()}, dict(feeds)]
    return [dict(feeds)]


def timer(feeds: Mapping[str, np.ndarray], specs: Sequence[InputSpec]) -> Measure:
    """Per feed set (feed_sets), median seconds per run, the models taking turns; enough runs for
    about BUDGET_S per feed set, at least MIN_RUNS. Where one run of each takes SLOW_S or more (a
    table recogniser's 500-step decoder at batch 8), FEW_RUNS runs after the probe, which warmed
    them: a run of seconds averages over thousands of kernels, and MIN_RUNS runs of such models
    made up most of their time to quantize."""
    def measure(models: Mapping[str, onnx.ModelProto]) -> dict[str, list[float]]:
        sessions = {name: create_session(model, 1, name) for name, model in models.items()}
        medians: dict[str, list[float]] = {name: [] for name in models}
        for batch in feed_sets(feeds, specs):
            once = sum(t[0] for t in time_sessions(sessions, batch, warmup=1, runs=1).values())
            if once >= SLOW_S:
                warmup, runs = 0, FEW_RUNS
            else:
                warmup, runs = 1, int(min(MAX_RUNS, max(MIN_RUNS, BUDGET_S / max(once, 1e-6))))
            for name, values in time_sessions(sessions, batch, warmup=warmup, runs=runs).items():
                medians[name].append(statistics.median(values))
        return medians
    return measure


def _ratio(times: dict[str, list[float]], new: str, old: str) -> float:
    """Geometric mean over the feed sets of new's time over old's."""
    return math.prod(n / o for n, o in zip(times[new], times[old])) ** (1 / len(times[new]))


def _ms(values: list[float]) -> str:
    return " / ".join(f"{v * 1e3:.2f}" for v in values) + " ms"


def choose(fp32: Callable[[], "onnx.ModelProto | str"], quantized: Mapping[str, str],
           build: Callable[[list[str]], onnx.ModelProto], measure: Measure,
           sizes: Optional[Callable[[], Mapping[str, int]]] = None) -> LatencyChoice:
    """fp32(): the model as the user gave it (a proto or a path), what the int8 model must beat;
    quantized: node label -> op type of the nodes the plan quantizes; build(labels): the int8
    model with those nodes kept float; sizes(): node label -> values in its output (on the run
    check's batch), for the last resort by size."""
    by_type: dict[str, list[str]] = {}
    for label, op_type in quantized.items():
        by_type.setdefault(op_type, []).append(label)
    decision = _decide(fp32(), by_type, build, measure, sizes)
    labels = tuple(label for t in decision["float_op_types"] for label in by_type[t])
    labels += tuple(label for label in decision["float_nodes"] if label not in labels)
    return LatencyChoice(labels, tuple(decision["notes"]))


def _decide(fp32: "onnx.ModelProto | str", by_type: dict[str, list[str]], build: Callable[[list[str]], onnx.ModelProto],
            measure: Measure, sizes: Optional[Callable[[], Mapping[str, int]]]) -> dict:
    """Greedy over op types; every choice is confirmed by a second, independent measurement (new
    sessions: two sessions of one model can differ by a few percent, and a neighbour's load comes
    and goes), so noise alone rarely makes one."""
    kept: list[str] = []
    float_types: list[str] = []
    notes: list[str] = []
    current = build([])
    # Movement ops (Reshape, Flatten...) follow their producer into float on their own: not tried.
    weighted = {t for t in by_type if t in WEIGHTED}
    tried: set[tuple[str, int]] = set()  # (op type, float types chosen when it was tried)
    changed = True
    while changed:  # once a weighted type is float, the elementwise ops around it are worth another try
        changed = False
        for op_type in sorted((t for t in by_type if not _movement(t) and t not in float_types),
                              key=lambda t: (t in WEIGHTED, t)):
            if (weighted and weighted <= {*float_types, op_type}) or (op_type, len(float_types)) in tried:
                continue  # the last weighted layers stay int8: the model must still be an int8 model
            tried.add((op_type, len(float_types)))
            candidate, faster = _faster(build, measure, current, kept + by_type[op_type])
            if faster:
                kept += by_type[op_type]
                float_types.append(op_type)
                current, changed = candidate, True
                count = len(by_type[op_type])
                notes.append(f"{count} {op_type} node{'s' if count > 1 else ''} kept float (latency-aware): "
                             + _ran(faster))
    slower = _slower(measure, current, fp32)
    # still not MARGIN faster than fp32: one op type at a time can miss it when the Q/DQ pairs around
    # a weighted type only go with the elementwise ops beside it (a small classifier's Conv ->
    # HardSigmoid -> Mul blocks); try each weighted type together with every elementwise type, and
    # every elementwise type alone (the weighted type may have gone float already, on its own)
    for op_type in [*sorted(weighted - set(float_types)), None] if slower else ():
        if op_type is not None and weighted <= {*float_types, op_type}:
            continue
        group = [t for t in by_type if t not in float_types and t not in weighted and not _movement(t)]
        group += [op_type] if op_type is not None else []
        if not group:
            continue
        candidate, faster = _faster(build, measure, current, kept + [label for t in group for label in by_type[t]])
        if faster:
            kept += [label for t in group for label in by_type[t]]
            float_types += group
            current = candidate
            count = sum(len(by_type[t]) for t in group)
            notes.append(f"{count} nodes of types {', '.join(group)} kept float (latency-aware): " + _ran(faster))
            slower = _slower(measure, current, fp32)
            if not slower:
                break
    float_nodes: list[str] = []
    if slower and sizes is not None:  # the last resort: the layers with the largest activations float
        slower, float_nodes, by_size = _largest_float(fp32, by_type, build, measure, dict(sizes()), kept, current,
                                                      slower)
        notes += by_size
    if slower:
        notes.append(f"onnxruntime runs this int8 model no more than {MARGIN:.0%} faster than fp32 on this CPU: "
                     f"{_ms(slower['int8'])} "
                     f"against {_ms(slower['fp32'])} ({_BATCHES[len(slower['int8'])]}; 1 thread, median): keep the "
                     f"fp32 model where speed matters")
    return {"float_op_types": float_types, "float_nodes": float_nodes, "notes": notes}


def _largest_float(fp32, by_type: dict[str, list[str]], build: Callable[[list[str]], onnx.ModelProto],
                   measure: Measure, sizes: dict[str, int], kept: list[str], current: onnx.ModelProto,
                   slower: dict[str, list[float]]) -> tuple[Optional[dict], list[str], list[str]]:
    """Still not MARGIN faster than fp32 with every op type choice made: per node, not per type. An
    int8 node pays per value of its tensors (the Q/DQ around it, QLinearMul/QLinearAdd, a depthwise
    Conv's few MACs per value) and gains per MAC, so the layers of the largest activations (a CNN's
    high-resolution first stages) are the ones that can run slower than float. Every quantized node
    whose output holds at least as many values as the k-th largest size goes float, k = 1, 2, ...
    (LARGEST_LEVELS at most), each extension taken when 5% faster, twice, until the model is MARGIN
    ahead of fp32. The last weighted layers stay int8. Returns (the last comparison with fp32 if
    still not MARGIN ahead of it, else None; the nodes sent float; the notes of those choices)."""
    weighted = {label for t, labels in by_type.items() if t in WEIGHTED for label in labels}
    done = set(kept)
    float_nodes: list[str] = []
    notes: list[str] = []
    levels = sorted({size for label, size in sizes.items() if label not in done}, reverse=True)[:LARGEST_LEVELS]
    for level in levels:
        group = [label for label, size in sizes.items() if size >= level and label not in done]
        if not group or (weighted and weighted <= done | set(group)):
            break
        candidate, faster = _faster(build, measure, current, [*kept, *float_nodes, *group])
        if not faster:
            continue  # a larger group may be: the Q/DQ between a float and an int8 stage go with it
        float_nodes += group
        done |= set(group)
        current = candidate
        notes.append(f"{len(float_nodes)} nodes whose outputs hold at least {level} values kept float "
                     "(latency-aware, by size): " + _ran(faster))
        slower = _slower(measure, current, fp32)
        if not slower:
            return None, float_nodes, notes
    return slower, float_nodes, notes


def _faster(build: Callable[[list[str]], onnx.ModelProto], measure: Measure, current: onnx.ModelProto,
            labels: list[str]) -> tuple[Optional[onnx.ModelProto], Optional[dict[str, list[float]]]]:
    """(the candidate with `labels` float, its comparison with `current`) when it ran more than MARGIN
    faster twice in a row; (None, None) when not, or when onnxruntime cannot build or run it (a
    candidate that fails is simply not taken)."""
    try:
        candidate = build(labels)
        faster = _twice(measure, {"int8": current, "float": candidate},
                        lambda times: _ratio(times, "float", "int8") < 1 - MARGIN)
    except Exception:
        return None, None
    return (candidate, faster) if faster else (None, None)


def _ran(times: dict[str, list[float]]) -> str:
    """A choice's note: the times that made it."""
    return (f"onnxruntime ran the model in {_ms(times['float'])} with them float against {_ms(times['int8'])} "
            f"with them int8 on this CPU ({_BATCHES[len(times['int8'])]}; 1 thread, median)")


def _slower(measure: Measure, current: onnx.ModelProto, fp32) -> Optional[dict[str, list[float]]]:
    """A comparison with fp32 where the int8 model ran slower than fp32, or less than MARGIN faster, at
    either batch size; None when it ran MARGIN faster at both in two measurements in a row. Being
    ahead of fp32 must be shown twice, like every float choice: one lucky run of an int8 model
    level with fp32 would otherwise end the fallback."""
    models = {"int8": current, "fp32": fp32}
    for _ in range(2):
        times = measure(models)
        if any(q > (1 - MARGIN) * f for q, f in zip(times["int8"], times["fp32"])):
            return times
    return None


def _movement(op_type: str) -> bool:
    rule = rule_for(op_type, "")
    return rule is not None and rule.output == "tie"


def _twice(measure: Measure, models: Mapping[str, onnx.ModelProto],
           holds: Callable[[dict[str, list[float]]], bool]) -> Optional[dict[str, list[float]]]:
    """The second measurement if `holds` is true of two in a row, else None."""
    times = measure(models)
    if not holds(times):
        return None
    times = measure(models)
    return times if holds(times) else None


_BATCHES = {1: "the first calibration batch", 2: "batch 1 / the calibration batch"}
