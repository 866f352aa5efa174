"""Automatic mixed precision: keep the fewest layers in float that meet a quality target.

The model is quantized once, all int8, and evaluated; if it misses the target, layers change
precision. Every move (an int8 layer to float, a static MatMul/Gemm to dynamic int8, and when asked
for, to 16-bit activations) is scored once on the samples at stake (`focus_samples`: for an
agreement or top-1 target the near-ties, which are the images int8 flips), which ranks them (ties:
fewer int8 MACs lost); then the search bisects on how many of the top-ranked moves to take together,
each prefix evaluated on the whole set: about 2 log2(n) evaluations, not one scoring round per
layer. Only when no prefix within the float-layer and MAC budgets meets the target (layers that
help only together, a float layer's output staying quantized while an int8 layer reads it) does it
keep the best move and rank again from there; it fails (ThresholdError) when the budgets run out.
Precisions change inside the finished int8 model (qtool.quantization.float_fallback), so a
candidate costs one session, no re-calibration, and the model verified is the one written.
Design: docs/design/mixed-precision.md."""

from __future__ import annotations

import contextlib
import copy
import functools
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Callable, Iterable, Optional, Sequence

import numpy as np
import onnx

from qtool.config import QuantizeConfig
from qtool.data.dataset import Batch
from qtool.errors import ThresholdError
from qtool.graph.executor import Engine, resolve, run_in_order, shared
from qtool.quantization.float_fallback import (Precisions, blocks, dynamic_candidates, float_nodes, int16_tensors,
                                               mixed_model, restorable_layers)
from qtool.data.labels import Labels
from qtool.evaluation.macs import int8_macs, node_macs, sample_shapes
from qtool.graph.index import GraphIndex, node_label
from qtool.evaluation.metrics import ClassificationAccumulator, FidelityAccumulator, rows
from qtool.plan.planner import QuantPlan
from qtool.quantization.quantize import QuantizedGraph, kernel_forms, quantize_model
from qtool.graph.runtime import create_session
from qtool.table.table import CalibrationTable
from qtool.targets import weight_qmax


@dataclass(frozen=True)
class Target:
    agreement: Optional[float] = None  # percent of samples whose top-1 matches fp32
    top1_drop: Optional[float] = None  # points of top-1 accuracy lost at most (needs labels)
    sqnr: Optional[float] = None  # dB, worst model output
    cosine: Optional[float] = None  # mean over samples of the worst output's cosine to fp32

    def given(self) -> bool:
        return any(v is not None for v in (self.agreement, self.top1_drop, self.sqnr, self.cosine))

    def classifies(self) -> bool:
        return self.agreement is not None or self.top1_drop is not None

    def met(self, figures: dict) -> bool:
        if self.agreement is not None and not 100.0 * figures["agreement"] >= self.agreement:
            return False
        if self.top1_drop is not None and not 100.0 * figures["top1_drop"] <= self.top1_drop:
            return False
        if self.sqnr is not None and not figures["sqnr_db"] >= self.sqnr:
            return False
        if self.cosine is not None and not figures["cosine"] >= self.cosine:
            return False
        return True

    def describe(self) -> str:
        parts = []
        if self.agreement is not None:
            parts.append(f"agreement >= {self.agreement:g}%")
        if self.top1_drop is not None:
            parts.append(f"top-1 drop <= {self.top1_drop:g} points")
        if self.sqnr is not None:
            parts.append(f"SQNR >= {self.sqnr:g} dB")
        if self.cosine is not None:
            parts.append(f"mean cosine >= {self.cosine:g}")
        return ", ".join(parts)


@dataclass
class Candidate:
    float_layers: list[str]
    figures: dict
    result: QuantizedGraph
    int8_mac_fraction: float
    dynamic_layers: list[str] = field(default_factory=list)  # static MatMul/Gemm made dynamic int8
    int16_layers: list[str] = field(default_factory=list)  # int8 weights, 16-bit activations


@dataclass
class MixedPrecisionResult:
    chosen: Candidate
    tried: list[dict] = field(default_factory=list)  # every candidate's k and figures
    ranking: list[str] = field(default_factory=list)  # the first ranking's moves, most helpful first
    table: Optional[CalibrationTable] = None  # the table of the chosen model's ranges


def describe_figures(figures: dict) -> str:
    text = f"agreement {100 * figures['agreement']:.1f}%, mean KL {figures['mean_kl']:.4f}, " \
           f"SQNR {figures['sqnr_db']:.1f} dB, mean cosine {figures['cosine']:.5f}"
    if "top1" in figures:
        text += f", top-1 {100 * figures['top1']:.1f} (fp32 {100 * figures['top1_fp32']:.1f})"
    return text


def _worst_cosines(fidelity: list[FidelityAccumulator], reference: list[np.ndarray], test: list[np.ndarray],
                   samples: int) -> np.ndarray:
    """Adds one batch of `samples` to each output's accumulator; per sample, the smallest cosine to
    fp32 over the outputs. An output whose first axis is not the batch (a recurrent state
    [layers, batch, hidden], a 0-d scalar at batch > 1) counts with its mean cosine for every sample."""
    cosines = [acc.update(r, t, samples) for acc, r, t in zip(fidelity, reference, test)]
    return np.minimum.reduce([c if len(c) == samples else np.full(samples, np.mean(c)) for c in cosines])


CEILING_DB = 50.0


def cosine_db(cosines: np.ndarray) -> float:
    """The mean over samples of -10 log10(1 - cosine), each sample's distance to fp32 in dB, up to
    CEILING_DB. Unlike the mean cosine it is not carried by one or two samples whose outputs a
    small change moves a lot. The ceiling (1 - cosine = 1e-5) keeps the samples that are as good
    as fp32 from carrying it instead: past it a sample's dB measures single rounding flips, which
    moved one by 10 dB when every input moved by 2^-20 of itself, more than the choices' margins."""
    return float(np.mean(np.minimum(-10.0 * np.log10(np.maximum(1.0 - cosines, 1e-12)), CEILING_DB)))


class Evaluator:
    """fp32 outputs computed once; each candidate's outputs compared with them."""

    def __init__(self, model_path: Path, data: list[Batch], labels: Optional[Labels], threads: int,
                 runtime: str = "onnxruntime", as_written: bool = False):
        """runtime: where the models run ("openvino": compiled at f32 by OpenVINO's CPU plugin,
        qtool.evaluation.openvino_runtime, as a target that deploys there computes them);
        `as_written`: onnxruntime computes the candidates' Q/DQ as written (session_options)."""
        self.data, self.labels, self.threads, self.runtime = data, labels, threads, runtime
        self.as_written = as_written
        session = self._session(str(model_path), str(model_path))
        self.outputs = [o.name for o in session.get_outputs()]
        self.reference = [session.run(self.outputs, batch.feeds) for batch in data]

    def __call__(self, qmodel: onnx.ModelProto, session=None) -> tuple[dict, list[np.ndarray]]:
        """(figures, the candidate's first output per batch). `session`: one of `qmodel` already made
        (onnxruntime, on this evaluator's threads and `as_written`: the run check's), used where the
        candidates run alike."""
        if session is None or self.runtime != "onnxruntime":
            session = self._session(qmodel, "candidate")
        fidelity = [FidelityAccumulator() for _ in self.outputs]
        classes = ClassificationAccumulator()
        first, cosines = [], []
        for batch, ref in zip(self.data, self.reference):
            test = session.run(self.outputs, batch.feeds)
            first.append(test[0])
            cosines.append(_worst_cosines(fidelity, ref, test, len(batch)))
            labels = [self.labels.get(k) if self.labels else None for k in batch.keys]
            classes.update(ref[0], test[0], labels)
        result = classes.result()
        cosines = np.concatenate(cosines)
        each = {name: acc.result() for name, acc in zip(self.outputs, fidelity)}
        figures = {"agreement": result["agreement"], "mean_kl": result["mean_kl"],
                   "sqnr_db": min(r["sqnr_db"] for r in each.values()),
                   "outputs": {name: {"sqnr_db": r["sqnr_db"], "cosine": r["cosine"]} for name, r in each.items()},
                   "cosine": float(np.mean(cosines)), "cosine_db": cosine_db(cosines), "samples": result["samples"]}
        if "top1" in result:
            figures.update(top1=result["top1"]["int8"], top1_fp32=result["top1"]["fp32"],
                           top1_drop=result["top1_drop"])
        return figures, first

    def _session(self, model, label: str):
        if self.runtime == "openvino":
            from qtool.evaluation.openvino_runtime import CompiledModel, require

            require("--target openvino's measured choices (scored on OpenVINO)")
            return CompiledModel(model, self.threads, "f32", label=label)
        return create_session(model, self.threads, label, batch_pass=True, as_written=self.as_written)


@dataclass(frozen=True)
class _Mixer:
    """The all-int8 model and what `mixed_model` needs to change its precisions."""

    qmodel: onnx.ModelProto
    prepared: onnx.ModelProto
    plan: QuantPlan
    chains: dict
    weight_qmax: int

    @functools.cached_property
    def index(self) -> GraphIndex:
        return GraphIndex(self.prepared)

    def __call__(self, precisions: Precisions) -> onnx.ModelProto:
        return mixed_model(self.qmodel, self.prepared, self.plan, self.chains, precisions, self.weight_qmax,
                           self.index)

    def plan_for(self, precisions: Precisions, model: onnx.ModelProto) -> QuantPlan:
        """The plan as it holds for `model`, the mixed model (what the CLI reports)."""
        if not precisions.floats and not precisions.dynamic:
            return self.plan  # 16-bit activations change no part of the plan: their tensors stay quantized
        plan, floats = self.plan, float_nodes(self.prepared, self.plan, self.chains, precisions, self.index)
        gone = {name for layer in precisions.floats for _, name in layer.slots}
        gone |= {name for label in precisions.dynamic for name, w in plan.weights.items() if w.node == label}
        gone |= {name for label in precisions.dynamic for name, b in plan.biases.items() if b.node == label}
        ops = {node_label(n): n.op_type for n in self.prepared.graph.node}
        quantized = {n.input[0] for n in model.graph.node if n.op_type == "QuantizeLinear"}
        return replace(plan, quantized_nodes=[n for n in plan.quantized_nodes if n not in floats],
                       float_nodes=plan.float_nodes + [f"{n} ({ops.get(n, '?')})" for n in sorted(floats)],
                       activations=[a for a in plan.activations if a in quantized],
                       weights={k: v for k, v in plan.weights.items() if k not in gone},
                       biases={k: v for k, v in plan.biases.items() if k not in gone},
                       dynamic_matmuls=plan.dynamic_matmuls + list(precisions.dynamic))


class _Focus:
    """The evaluation samples a search step measures, and how it scores a candidate (lower is better)."""

    def __init__(self, evaluate: Evaluator, target: Target, count: int, int8_first: list[np.ndarray]):
        """`int8_first`: the all-int8 model's first output per evaluation batch."""
        first = [rows(ref[0], len(batch)) for batch, ref in zip(evaluate.data, evaluate.reference)]
        self.classify = (target.classifies() and first[0].shape[1] > 1
                         and all(len(f) == len(batch) for f, batch in zip(first, evaluate.data)))
        self.cosine = target.cosine is not None
        if self.classify:
            # at stake: a small fp32 margin (a near-tie), or a small or negative margin of the fp32
            # class in the int8 model (flipped, or about to), wherever the sample is
            margins = np.concatenate([np.minimum(_margins(logits, logits.argmax(axis=1)),
                                                 _margins(test.reshape(len(logits), -1), logits.argmax(axis=1)))
                                      for logits, test in zip(first, int8_first)])
            chosen = set(np.argsort(margins, kind="stable")[:count].tolist())
        else:
            chosen = set(range(count))
        self.batches, self.reference = [], []
        offset = 0
        for batch, ref in zip(evaluate.data, evaluate.reference):
            picked = [i for i in range(len(batch)) if offset + i in chosen]
            offset += len(batch)
            whole = len(picked) == len(batch) or any(np.ndim(r) == 0 or np.shape(r)[0] != len(batch) for r in ref)
            if picked and whole:  # a model fed one sample at a time has scalar and state inputs; an output
                # without the batch axis cannot be cut to the samples at stake: the batch goes whole
                self.batches.append(batch)
                self.reference.append(ref)
            elif picked:
                self.batches.append(Batch([batch.keys[i] for i in picked],
                                          {k: v[picked] for k, v in batch.feeds.items()}))
                self.reference.append([r[picked] for r in ref])
        self.outputs, self.threads = evaluate.outputs, evaluate.threads

    @contextlib.contextmanager
    def on_workers(self, engine: Optional[Engine], mixer: _Mixer):
        """The handle `scores` needs on an engine (None without one): the mixer and the focus
        samples, sent once per worker for the whole search (executor.shared)."""
        if engine is None:
            yield None
            return
        focus = copy.copy(self)
        focus.threads = engine.threads
        with shared(engine, (focus, mixer)) as common:
            yield common

    def scores(self, mixer: _Mixer, moves: list[Precisions], engine: Optional[Engine], common: object) -> list[tuple]:
        """The score of each of `moves`; on an engine, on its workers (one move per task, `common`
        from on_workers): the same scores as here."""
        if engine is None:
            return [self.score(mixer(move)) for move in moves]
        return list(run_in_order(engine, _score, moves, "candidates", common=common))

    def score(self, qmodel: onnx.ModelProto) -> tuple:
        session = create_session(qmodel, self.threads, "candidate")
        if not self.classify:
            fidelity = [FidelityAccumulator() for _ in self.outputs]
            cosines = []
            for batch, ref in zip(self.batches, self.reference):
                test = session.run(self.outputs, batch.feeds)
                cosines.append(_worst_cosines(fidelity, ref, test, len(batch)))
            sqnr = -min(acc.result()["sqnr_db"] for acc in fidelity)
            return (-float(np.mean(np.concatenate(cosines))), sqnr) if self.cosine else (sqnr,)
        flips, shortfall = 0, 0.0
        for batch, ref in zip(self.batches, self.reference):
            logits = ref[0].reshape(len(batch), -1)
            test = session.run(self.outputs[:1], batch.feeds)[0].reshape(len(batch), -1)
            classes = logits.argmax(axis=1)
            kept = _margins(test, classes)
            flips += int(np.sum(kept <= 0))
            shortfall += float(np.sum(np.maximum(0.0, 0.5 * _margins(logits, classes) - kept)))
        return flips, shortfall / max(1, sum(len(b) for b in self.batches))


def _score(move: Precisions, common: object) -> tuple:
    """On a worker: the score of the shared int8 model with `move`'s precisions."""
    focus, mixer = resolve(common)
    return focus.score(mixer(move))


def _neighbours(prepared: onnx.ModelProto, plan: QuantPlan, chains: dict, layers: list[str]) -> dict[str, set[str]]:
    """Per layer, the nodes that read or write the activations its 16-bit move widens (they lose
    their int8 kernels with it)."""
    index = GraphIndex(prepared)
    found = {}
    for layer in layers:
        tensors = int16_tensors(prepared, plan, chains, (layer,))
        found[layer] = {node_label(n) for name in tensors for n in index.consumers.get(name, [])}
        found[layer] |= {node_label(index.producer[name]) for name in tensors if name in index.producer}
    return found


def _margins(logits: np.ndarray, classes: np.ndarray) -> np.ndarray:
    """Per row: the logit of `classes` minus the largest other logit (negative when another class wins)."""
    logits = logits.astype(np.float64)
    rows = np.arange(len(classes))
    own = logits[rows, classes]
    others = logits.copy()
    others[rows, classes] = -np.inf
    return own - others.max(axis=1)


def _moves(state: Precisions, pool: dict, dynamic_pool: list[str], floats_left: bool,
           int16_pool: list[str] = ()) -> list[tuple[str, Precisions]]:
    """Every one-layer change from `state`: (what it is, the precisions after it)."""
    moves = []
    float_names = {layer.node for layer in state.floats}

    def without(names: tuple[str, ...], name: str) -> tuple[str, ...]:
        return tuple(n for n in names if n != name)

    if floats_left:
        for name, layer in pool.items():
            if name not in float_names:
                moves.append((name, Precisions(state.floats + (layer,), without(state.dynamic, name),
                                               without(state.int16, name))))
    for name in dynamic_pool:
        if name not in float_names and name not in state.dynamic and name not in state.int16:
            moves.append((f"{name} (dynamic)", Precisions(state.floats, state.dynamic + (name,), state.int16)))
    for name in int16_pool:
        if name not in float_names and name not in state.int16:
            moves.append((f"{name} (int16)", Precisions(state.floats, without(state.dynamic, name),
                                                        state.int16 + (name,))))
    return moves


def _prefixes(state: Precisions, ranked: list[Precisions], max_float_layers: int,
              within: Callable[[Precisions], bool]) -> list[Precisions]:
    """`state` with the changes of the first 1, 2, ... of the `ranked` one-layer moves from it taken
    together (a layer counts once, at its best-ranked move), skipping a move that would break the
    float-layer or MAC budget (`within`)."""
    had = {layer.node for layer in state.floats}
    found: list[Precisions] = []
    now, seen = state, set()
    for move in ranked:
        floats = tuple(layer for layer in move.floats if layer.node not in had)
        dynamic = tuple(name for name in move.dynamic if name not in state.dynamic)
        wide = tuple(name for name in move.int16 if name not in state.int16)
        names = {layer.node for layer in floats} | set(dynamic) | set(wide)
        if not names or names & seen:
            continue
        after = Precisions(now.floats + floats,
                           tuple(n for n in now.dynamic if n not in names) + dynamic,
                           tuple(n for n in now.int16 if n not in names) + wide)
        if len(after.floats) > max_float_layers or not within(after):
            continue
        seen |= names
        now = after
        found.append(now)
    return found


def _bisect(prefixes: list[Precisions], build: Callable[[Precisions], Candidate], target: Target
            ) -> Optional[Candidate]:
    """The candidate of the shortest prefix that meets `target` found by bisection (the all-int8
    model, prefix 0, misses it): prefixes of 1, 2, 4, ... moves up to the longest until one meets
    (None when none does), then halving the interval between the last that missed and it: at most
    about 2 log2(len) evaluations. Short prefixes first, since a longer one need not do better (a
    float layer can move the error onto an int8 neighbour)."""
    low, high, met = 0, 0, None  # prefix `low` misses, `high` meets (counted in moves)
    while met is None:
        if high == len(prefixes):
            return None
        low, high = high, min(len(prefixes), max(1, 2 * high))
        found = build(prefixes[high - 1])
        met = found if target.met(found.figures) else None
    while high - low > 1:
        middle = (low + high) // 2
        found = build(prefixes[middle - 1])
        if target.met(found.figures):
            high, met = middle, found
        else:
            low = middle
    return met

@dataclass(frozen=True)
class _Start:
    """The all-int8 model of one calibration table, and what the search changes in it."""

    table: CalibrationTable
    graph: QuantizedGraph
    pool: dict  # label -> Restorable: the layers that can go float
    mixer: _Mixer


def _rank(target: Target) -> Callable[[dict], tuple]:
    """Figures -> a key that grows as a candidate gets closer to `target`."""
    figure = (lambda t: (t["cosine"], t["sqnr_db"])) if target.cosine is not None else (lambda t: (t["sqnr_db"],))
    return (lambda t: (t["agreement"],) + figure(t)) if target.classifies() else figure


def search(model_path: str | Path, table: CalibrationTable, options: QuantizeConfig, target: Target,
           eval_data: list[Batch], labels: Optional[Labels], max_float_layers: int,
           calib_data: Optional[Callable[[int], Iterable[Batch]]] = None, focus_samples: int = 64,
           threads: int = 0, min_int8_macs: float = 0.0,
           log: Callable[[str], None] = lambda message: None,
           engine: Optional[Engine] = None,
           alternatives: Callable[[], Sequence[CalibrationTable]] = tuple, int16: bool = False) -> MixedPrecisionResult:
    """The verified model with the fewest layers in float found by the ranked bisection (module
    doc); ThresholdError if none within `max_float_layers` and `min_int8_macs` (a fraction of
    the MACs that must stay int8) meets `target`. With an engine, each step's candidates are
    scored on its workers (`_Focus.scores`). `int16`: offer 16-bit activations as a layer's move.

    `alternatives`: tables of the same data by other range methods, asked for only when the
    all-int8 model of `table` misses the target; the search starts from the all-int8 model,
    of all of them, that comes closest to the target (or stops at the first that meets it)."""
    model_path = Path(model_path)
    if target.top1_drop is not None and labels is None:
        raise ThresholdError("--target-top1-drop needs --labels for the evaluation data")
    evaluate = Evaluator(model_path, eval_data, labels, threads)
    shapes = sample_shapes(eval_data[0].feeds)
    rank = _rank(target)
    tried: list[dict] = []

    def begin(table: CalibrationTable) -> _Start:
        graph = quantize_model(model_path, table, options, allow_missing=True, data=calib_data)
        base = graph.canonical or graph.model  # the search measures and writes the float forms
        pool = restorable_layers(base, graph.source)
        return _Start(table, graph, pool, _Mixer(base, graph.source, graph.plan,
                                                 blocks(graph.source, graph.plan, pool),
                                                 weight_qmax(options.reduce_range)))

    def candidate(start: _Start, state: Precisions) -> tuple[Candidate, list[np.ndarray]]:
        """The model with `state`'s precisions, evaluated; and its first output per evaluation batch."""
        qmodel = start.mixer(state)
        kernel_forms(qmodel, options, only=("written_form",))  # written as quantize writes it
        figures, first = evaluate(qmodel)
        summary = int8_macs(qmodel, shapes)
        fraction = summary.fraction
        names, dynamic, wide = [layer.node for layer in state.floats], list(state.dynamic), list(state.int16)
        met = target.met(figures)
        record = {"method": start.table.method, "float_layers": len(names), "layers": names,
                  "dynamic_layers": dynamic, "int8_mac_fraction": fraction, **figures, "met": met}
        if int16:
            record.update(int16_layers=wide, int16_mac_fraction=summary.int16 / (summary.total or 1))
        tried.append(record)
        what = f": {', '.join(names)}" if names else ""
        what += f"; dynamic int8: {', '.join(dynamic)}" if dynamic else ""
        what += f"; 16-bit activations: {', '.join(wide)}" if wide else ""
        macs_now = f"{100 * fraction:.1f}% of MACs int8"
        macs_now += f", {100 * summary.int16 / (summary.total or 1):.1f}% by 16-bit activations" if wide else ""
        log(f"  {len(names)} layer(s) float{what}: "
            f"{describe_figures(figures)}, {macs_now}{' -> meets the target' if met else ''}")
        notes = [note for note in start.graph.notes if note not in start.graph.form_notes]  # written without them
        if start.table is not table:
            notes.append(f"ranges by {start.table.method} instead of {table.method}: its all-int8 model came "
                         f"closer to {target.describe()} on the evaluation data")
        if names:
            notes.append(f"kept in float to meet {target.describe()}: {', '.join(names)}")
        if dynamic:
            notes.append(f"run as dynamic int8 MatMuls to meet {target.describe()}: {', '.join(dynamic)}")
        if wide:
            notes.append(f"activations in 16 bits (weights int8) to meet {target.describe()}: {', '.join(wide)}")
        result = QuantizedGraph(qmodel, start.mixer.plan_for(state, qmodel), notes, start.graph.source)
        return Candidate(names, figures, result, fraction, dynamic, wide), first

    state = Precisions()
    start = begin(table)
    current, int8_first = candidate(start, state)
    if target.met(current.figures):
        return MixedPrecisionResult(current, tried, [], table)
    for other in alternatives():
        log(f"  ... all int8 with {other.method} ranges:")
        other_start = begin(other)
        found, found_first = candidate(other_start, state)
        if target.met(found.figures):
            return MixedPrecisionResult(found, tried, [], other)
        if rank(found.figures) > rank(current.figures):
            start, current, int8_first = other_start, found, found_first
    pool, mixer, base = start.pool, start.mixer, start.graph
    dynamic_pool = dynamic_candidates(base.model, base.source, pool)
    int16_pool = sorted(pool) if int16 else []
    # a layer's MACs in int8 and in float (a rewritten stem's differ): the budget is exact before
    # any candidate is built
    macs, fp32_macs = node_macs(base.model, shapes), node_macs(base.source, shapes)
    summary = int8_macs(base.model, shapes)
    total, int8_now = summary.total or 1, summary.int8
    focus = _Focus(evaluate, target, focus_samples, int8_first)
    origin = f" from the {start.table.method} ranges" if start.table is not table else ""
    log(f"ranking the layers once (one float, or dynamic int8, at a time){origin}, measured on the "
        f"{sum(len(b) for b in focus.batches)} evaluation samples"
        f"{' whose top-1 is most at stake' if focus.classify else ''} ...")

    around = _neighbours(base.source, base.plan, mixer.chains, int16_pool)

    def lost(move: Precisions) -> int:
        floats = {layer.node for layer in move.floats}
        sixteen = {label for name in move.int16 for label in around[name]} - floats
        return sum(macs.get(label, 0) for label in floats | sixteen)

    def int8_share(move: Precisions) -> float:
        return (int8_now - lost(move)) / (total - sum(macs.get(layer.node, 0) for layer in move.floats)
                                          + sum(fp32_macs.get(layer.node, 0) for layer in move.floats))

    ranking: list[str] = []
    with focus.on_workers(engine, mixer) as common:
        while True:
            moves = [(name, move) for name, move in _moves(state, pool, dynamic_pool,
                                                             len(state.floats) < max_float_layers, int16_pool)
                     if int8_share(move) >= min_int8_macs]
            if not moves:
                break
            scores = focus.scores(mixer, [move for _, move in moves], engine, common)
            scored = sorted((score, lost(move), i) for i, (score, (_, move)) in enumerate(zip(scores, moves)))
            ranking = ranking or [moves[i][0] for _, _, i in scored]
            prefixes = _prefixes(state, [moves[i][1] for _, _, i in scored], max_float_layers,
                                 lambda after: int8_share(after) >= min_int8_macs)
            log(f"keeping the top-ranked of {len(moves)} moves, bisecting on how many (1 to {len(prefixes)}) ...")
            chosen = _bisect(prefixes, lambda after: candidate(start, after)[0], target)
            if chosen is not None:
                return MixedPrecisionResult(chosen, tried, ranking, start.table)
            if len(prefixes) <= 1:
                break
            # no prefix meets: layers that only help together with others (a layer's output
            # stays quantized while an int8 layer reads it) rank low alone. Keep the best move and
            # rank again from there.
            state = prefixes[0]
            log(f"  no prefix of the top {len(prefixes)} meets the target: keeping the first and ranking again ...")
    best = max(tried, key=rank)
    limit = f"--max-float-layers {max_float_layers}"
    if min_int8_macs > 0:
        limit += f", --min-int8-macs {100 * min_int8_macs:g}"
    method = f" ({best['method']} ranges)" if len({t['method'] for t in tried}) > 1 else ""
    most = max(t["float_layers"] for t in tried)
    raise ThresholdError(f"target ({target.describe()}) not met with up to {most} layer(s) in float "
                         f"({limit}); best: {best['float_layers']} float{method}, {describe_figures(best)}")
