"""Automatic mixed precision: keep the fewest layers in float that meet a quality target.

1. The model is quantized once, all int8, with every data-driven step asked for (bias
   correction, adaptive rounding), and evaluated on the evaluation data; if it meets the
   target, nothing stays float.
2. Otherwise layers go back to float one at a time, greedily. Each step measures, for
   every layer still in int8, the model with that layer (and those already chosen) in
   float: the one-layer-at-a-time sensitivity in the direction mixed precision uses it
   (evaluate --sensitivity measures the other direction, one layer alone in int8). The
   layer whose return to float helps most is kept float, the model is evaluated on the
   whole evaluation data, and the search stops as soon as the target holds, or fails
   (ThresholdError) when --max-float-layers or the MAC budget (--min-int8-macs) runs out.
3. What a step measures: for an agreement or top-1 target, the evaluation samples at
   stake (`focus_samples` of them): those whose fp32 top-1 wins by the smallest logit
   margin, or whose fp32 class has the smallest (or a negative) margin in the all-int8
   model. On EfficientNet-Lite0 the images that the int8 model flips are near-ties (fp32
   probability margins below 0.5%), which is why the output SQNR of one layer alone in
   int8 did not rank the layers that matter (measured: 8 layers kept float by that
   ranking left agreement at 99.2%). The score is (top-1 flips among them, mean shortfall
   of the int8 margin below half the fp32 margin). For an SQNR target: the worst output
   SQNR on the first `focus_samples` samples.

Layers go back to float inside the finished int8 model (qtool.float_fallback), so each
candidate costs one onnxruntime session and a run over the focus samples, and the model
that is verified on the evaluation data and written is exactly the one that was measured.
"""

from __future__ import annotations

import contextlib
import copy
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Callable, Iterable, Optional

import numpy as np
import onnx

from qtool.config import QuantizeConfig
from qtool.data.dataset import Batch
from qtool.errors import ThresholdError
from qtool.graph.executor import Engine, resolve, run_in_order, shared
from qtool.quantization.float_fallback import Restorable, restorable_layers, restore_float
from qtool.data.labels import Labels
from qtool.evaluation.macs import int8_macs, node_macs, sample_shapes
from qtool.graph.index import node_label
from qtool.evaluation.metrics import ClassificationAccumulator, FidelityAccumulator
from qtool.plan.planner import QuantPlan
from qtool.quantization.quantize import QuantizedGraph, quantize_model
from qtool.graph.runtime import create_session
from qtool.table.table import CalibrationTable


@dataclass(frozen=True)
class Target:
    agreement: Optional[float] = None  # percent of samples whose top-1 matches fp32
    top1_drop: Optional[float] = None  # points of top-1 accuracy lost at most (needs labels)
    sqnr: Optional[float] = None  # dB, worst model output

    def given(self) -> bool:
        return any(v is not None for v in (self.agreement, self.top1_drop, self.sqnr))

    def met(self, figures: dict) -> bool:
        if self.agreement is not None and not 100.0 * figures["agreement"] >= self.agreement:
            return False
        if self.top1_drop is not None and not 100.0 * figures["top1_drop"] <= self.top1_drop:
            return False
        if self.sqnr is not None and not figures["sqnr_db"] >= self.sqnr:
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
        return ", ".join(parts)


@dataclass
class Candidate:
    float_layers: list[str]
    figures: dict
    result: QuantizedGraph
    int8_mac_fraction: float


@dataclass
class MixedPrecisionResult:
    chosen: Candidate
    tried: list[dict] = field(default_factory=list)  # every candidate's k and figures
    ranking: list[str] = field(default_factory=list)  # the first step's order: most helpful in float first


def describe_figures(figures: dict) -> str:
    text = f"agreement {100 * figures['agreement']:.1f}%, mean KL {figures['mean_kl']:.4f}, " \
           f"SQNR {figures['sqnr_db']:.1f} dB"
    if "top1" in figures:
        text += f", top-1 {100 * figures['top1']:.1f} (fp32 {100 * figures['top1_fp32']:.1f})"
    return text


class _Evaluator:
    """fp32 outputs computed once; each candidate's outputs compared with them."""

    def __init__(self, model_path: Path, data: list[Batch], labels: Optional[Labels], threads: int):
        self.data, self.labels, self.threads = data, labels, threads
        session = create_session(str(model_path), threads, str(model_path))
        self.outputs = [o.name for o in session.get_outputs()]
        self.reference = [session.run(self.outputs, batch.feeds) for batch in data]

    def __call__(self, qmodel: onnx.ModelProto) -> tuple[dict, list[np.ndarray]]:
        """(figures, the candidate's first output per batch)."""
        session = create_session(qmodel, self.threads, "candidate")
        fidelity = [FidelityAccumulator() for _ in self.outputs]
        classes = ClassificationAccumulator()
        first = []
        for batch, ref in zip(self.data, self.reference):
            test = session.run(self.outputs, batch.feeds)
            first.append(test[0])
            for acc, r, t in zip(fidelity, ref, test):
                acc.update(r, t)
            labels = [self.labels.get(k) if self.labels else None for k in batch.keys]
            classes.update(ref[0], test[0], labels)
        result = classes.result()
        figures = {"agreement": result["agreement"], "mean_kl": result["mean_kl"],
                   "sqnr_db": min(acc.result()["sqnr_db"] for acc in fidelity), "samples": result["samples"]}
        if "top1" in result:
            figures.update(top1=result["top1"]["int8"], top1_fp32=result["top1"]["fp32"],
                           top1_drop=result["top1_drop"])
        return figures, first


def _plan_with_float(plan: QuantPlan, layers: list[Restorable], prepared: onnx.ModelProto) -> QuantPlan:
    """The plan as it holds for the model with `layers` back in float (what the CLI reports)."""
    if not layers:
        return plan
    names = {layer.node for layer in layers}
    restored = {name for layer in layers for _, name in layer.slots}
    ops = {node_label(n): n.op_type for n in prepared.graph.node}
    return replace(plan, quantized_nodes=[n for n in plan.quantized_nodes if n not in names],
                   float_nodes=plan.float_nodes + [f"{n} ({ops.get(n, '?')})" for n in sorted(names)],
                   weights={k: v for k, v in plan.weights.items() if k not in restored},
                   biases={k: v for k, v in plan.biases.items() if k not in restored})


class _Focus:
    """The evaluation samples a search step measures, and how it scores a candidate (lower is better)."""

    def __init__(self, evaluate: _Evaluator, target: Target, count: int, int8_first: list[np.ndarray]):
        """`int8_first`: the all-int8 model's first output per evaluation batch."""
        self.classify = target.agreement is not None or target.top1_drop is not None
        first = [ref[0].reshape(len(batch), -1) for batch, ref in zip(evaluate.data, evaluate.reference)]
        self.classify = self.classify and first[0].shape[1] > 1
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
            rows = [i for i in range(len(batch)) if offset + i in chosen]
            offset += len(batch)
            if rows:
                self.batches.append(Batch([batch.keys[i] for i in rows], {k: v[rows] for k, v in batch.feeds.items()}))
                self.reference.append([r[rows] for r in ref])
        self.outputs, self.threads = evaluate.outputs, evaluate.threads

    @contextlib.contextmanager
    def on_workers(self, engine: Optional[Engine], qmodel: onnx.ModelProto, prepared: onnx.ModelProto):
        """The handle `scores` needs on an engine (None without one): the int8 model, the prepared
        model and the focus samples, sent once per worker for the whole search (executor.shared)."""
        if engine is None:
            yield None
            return
        focus = copy.copy(self)
        focus.threads = engine.threads
        with shared(engine, (focus, qmodel, prepared)) as common:
            yield common

    def scores(self, qmodel: onnx.ModelProto, prepared: onnx.ModelProto, chosen: list[Restorable],
               layers: list[Restorable], engine: Optional[Engine], common: object) -> list[tuple]:
        """The score of `qmodel` with `chosen` and each of `layers` in float; on an engine, on its
        workers (one layer list per task, `common` from on_workers): the same scores as here."""
        if engine is None:
            return [self.score(restore_float(qmodel, prepared, chosen + [layer])) for layer in layers]
        jobs = [tuple(chosen) + (layer,) for layer in layers]
        return list(run_in_order(engine, _score, jobs, "candidates", common=common))

    def score(self, qmodel: onnx.ModelProto) -> tuple:
        session = create_session(qmodel, self.threads, "candidate")
        if not self.classify:
            fidelity = [FidelityAccumulator() for _ in self.outputs]
            for batch, ref in zip(self.batches, self.reference):
                for acc, r, t in zip(fidelity, ref, session.run(self.outputs, batch.feeds)):
                    acc.update(r, t)
            return (-min(acc.result()["sqnr_db"] for acc in fidelity),)
        flips, shortfall = 0, 0.0
        for batch, ref in zip(self.batches, self.reference):
            logits = ref[0].reshape(len(batch), -1)
            test = session.run(self.outputs[:1], batch.feeds)[0].reshape(len(batch), -1)
            classes = logits.argmax(axis=1)
            kept = _margins(test, classes)
            flips += int(np.sum(kept <= 0))
            shortfall += float(np.sum(np.maximum(0.0, 0.5 * _margins(logits, classes) - kept)))
        return flips, shortfall / max(1, sum(len(b) for b in self.batches))


def _score(layers: tuple[Restorable, ...], common: object) -> tuple:
    """On a worker: the score of the shared int8 model with `layers` in float."""
    focus, qmodel, prepared = resolve(common)
    return focus.score(restore_float(qmodel, prepared, list(layers)))


def _margins(logits: np.ndarray, classes: np.ndarray) -> np.ndarray:
    """Per row: the logit of `classes` minus the largest other logit (negative when another class wins)."""
    logits = logits.astype(np.float64)
    rows = np.arange(len(classes))
    own = logits[rows, classes]
    others = logits.copy()
    others[rows, classes] = -np.inf
    return own - others.max(axis=1)


def search(model_path: str | Path, table: CalibrationTable, options: QuantizeConfig, target: Target,
           eval_data: list[Batch], labels: Optional[Labels], max_float_layers: int,
           calib_data: Optional[Callable[[int], Iterable[Batch]]] = None, focus_samples: int = 64,
           threads: int = 0, min_int8_macs: float = 0.0,
           log: Callable[[str], None] = lambda message: None,
           engine: Optional[Engine] = None) -> MixedPrecisionResult:
    """The verified model with the fewest layers in float found by the greedy search (module
    doc); ThresholdError if none within `max_float_layers` and `min_int8_macs` (a fraction of
    the MACs that must stay int8) meets `target`. With an engine, each step's candidates are
    scored on its workers (`_Focus.scores`)."""
    model_path = Path(model_path)
    if target.top1_drop is not None and labels is None:
        raise ThresholdError("--target-top1-drop needs --labels for the evaluation data")
    evaluate = _Evaluator(model_path, eval_data, labels, threads)
    shapes = sample_shapes(eval_data[0].feeds)
    base = quantize_model(model_path, table, options, allow_missing=True, data=calib_data)
    prepared = base.source
    tried: list[dict] = []

    def candidate(layers: list[Restorable]) -> tuple[Candidate, list[np.ndarray]]:
        """The model with `layers` float, evaluated; and its first output per evaluation batch."""
        qmodel = restore_float(base.model, prepared, layers)
        figures, first = evaluate(qmodel)
        fraction = int8_macs(qmodel, shapes).fraction
        names = [layer.node for layer in layers]
        met = target.met(figures)
        tried.append({"float_layers": len(layers), "layers": names, "int8_mac_fraction": fraction, **figures,
                      "met": met})
        log(f"  {len(layers)} layer(s) float{': ' + ', '.join(names) if names else ''}: "
            f"{describe_figures(figures)}, {100 * fraction:.1f}% of MACs int8{' -> meets the target' if met else ''}")
        notes = base.notes + ([f"kept in float to meet {target.describe()}: {', '.join(names)}"] if names else [])
        result = QuantizedGraph(qmodel, _plan_with_float(base.plan, layers, prepared), notes, prepared)
        return Candidate(names, figures, result, fraction), first

    current, int8_first = candidate([])
    if target.met(current.figures):
        return MixedPrecisionResult(current, tried, [])
    pool = restorable_layers(base.model, prepared)
    # a layer's MACs are the same in float and in int8: the budget is exact before any candidate is built
    macs = node_macs(base.model, shapes)
    summary = int8_macs(base.model, shapes)
    total, int8_now = summary.total or 1, summary.int8
    focus = _Focus(evaluate, target, focus_samples, int8_first)
    log(f"keeping layers in float one at a time, measured on the {sum(len(b) for b in focus.batches)} "
        f"evaluation samples{' whose top-1 is most at stake' if focus.classify else ''} ...")
    chosen: list[Restorable] = []
    ranking: list[str] = []
    budget = min(max_float_layers, len(pool))
    with focus.on_workers(engine, base.model, prepared) as common:
        while len(chosen) < budget:
            spent = sum(macs.get(layer.node, 0) for layer in chosen)
            options_left = [layer for name, layer in pool.items() if layer not in chosen
                            and (int8_now - spent - macs.get(name, 0)) / total >= min_int8_macs]
            if not options_left:
                break
            scores = focus.scores(base.model, prepared, chosen, options_left, engine, common)
            scored = sorted(((score, i, layer) for i, (score, layer) in enumerate(zip(scores, options_left))),
                            key=lambda s: (s[0], s[1]))
            if not ranking:
                ranking = [layer.node for _, _, layer in scored]
            chosen.append(scored[0][2])
            current, _ = candidate(list(chosen))
            if target.met(current.figures):
                return MixedPrecisionResult(current, tried, ranking)
    sqnr_only = target.agreement is None and target.top1_drop is None
    best = max(tried, key=lambda t: (t["sqnr_db"],) if sqnr_only else (t["agreement"], t["sqnr_db"]))
    limit = f"--max-float-layers {max_float_layers}"
    if min_int8_macs > 0:
        limit += f", --min-int8-macs {100 * min_int8_macs:g}"
    raise ThresholdError(f"target ({target.describe()}) not met with up to {len(chosen)} layer(s) in float "
                         f"({limit}); best: {best['float_layers']} float, {describe_figures(best)}")
