"""Automatic mixed precision: keep the fewest layers in float that meet a quality target.

1. The all-int8 model is evaluated on the evaluation data; if it meets the target,
   nothing stays float.
2. Otherwise layers are ranked by the one-layer-at-a-time sensitivity (qtool.sensitivity:
   output SQNR with only that layer in int8, worst first).
3. The number k of top-ranked layers kept in float is searched: k = 1, 2, 4, ... until
   a candidate meets the target (or --max-float-layers is reached), then a binary
   search between the last failing and the first passing k. Every candidate is
   quantized and evaluated for real on the evaluation data: the sensitivity ranking
   only orders the layers, the verdict always comes from the full model's figures.
   (The search assumes that keeping more top-ranked layers float does not make the
   model worse, which holds up to noise; the answer is always a verified model.)
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Callable, Iterable, Optional

import onnx

from qtool.config import QuantizeConfig
from qtool.dataset import Batch
from qtool.errors import ThresholdError
from qtool.labels import Labels
from qtool.macs import int8_macs, sample_shapes
from qtool.metrics import ClassificationAccumulator, FidelityAccumulator
from qtool.quantize import QuantizeResult, quantize_model
from qtool.runtime import create_session
from qtool.sensitivity import layer_sensitivity
from qtool.table import CalibrationTable


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
    result: QuantizeResult
    int8_mac_fraction: float


@dataclass
class MixedPrecisionResult:
    chosen: Candidate
    tried: list[dict] = field(default_factory=list)  # every candidate's k and figures
    ranking: list[str] = field(default_factory=list)


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

    def __call__(self, qmodel: onnx.ModelProto) -> dict:
        session = create_session(qmodel, self.threads, "candidate")
        fidelity = [FidelityAccumulator() for _ in self.outputs]
        classes = ClassificationAccumulator()
        for batch, ref in zip(self.data, self.reference):
            test = session.run(self.outputs, batch.feeds)
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
        return figures


def search(model_path: str | Path, table: CalibrationTable, options: QuantizeConfig, target: Target,
           eval_data: list[Batch], labels: Optional[Labels], max_float_layers: int,
           calib_data: Optional[Callable[[int], Iterable[Batch]]] = None, sensitivity_samples: int = 32,
           threads: int = 0, log: Callable[[str], None] = lambda message: None) -> MixedPrecisionResult:
    """The verified model with the fewest top-ranked layers in float; ThresholdError if none
    within `max_float_layers` meets `target`."""
    model_path = Path(model_path)
    if target.top1_drop is not None and labels is None:
        raise ThresholdError("--target-top1-drop needs --labels for the evaluation data")
    evaluate = _Evaluator(model_path, eval_data, labels, threads)
    shapes = sample_shapes(eval_data[0].feeds)
    tried: list[dict] = []
    cache: dict[int, Candidate] = {}

    def candidate(k: int, ranking: list) -> Candidate:
        if k in cache:
            return cache[k]
        layers = ranking[:k]
        nodes = tuple(n for layer in layers for n in layer.nodes)
        opts = replace(options, exclude_nodes=tuple(options.exclude_nodes) + nodes)
        result = quantize_model(model_path, table, opts, allow_missing=True, data=calib_data)
        figures = evaluate(result.model)
        fraction = int8_macs(result.model, shapes).fraction
        cache[k] = Candidate([layer.node for layer in layers], figures, result, fraction)
        tried.append({"float_layers": k, "int8_mac_fraction": fraction, **figures, "met": target.met(figures)})
        log(f"  {k} layer(s) float: {describe_figures(figures)}, {100 * fraction:.1f}% of MACs int8"
            f"{' -> meets the target' if target.met(figures) else ''}")
        return cache[k]

    first = candidate(0, [])
    if target.met(first.figures):
        return MixedPrecisionResult(first, tried, [])
    subset, count = [], 0
    for batch in eval_data:
        if count >= sensitivity_samples:
            break
        subset.append(batch)
        count += len(batch)
    log(f"ranking layers by sensitivity on {count} samples ...")
    ranking = layer_sensitivity(model_path, table, options, subset, threads=threads)
    budget = min(max_float_layers, len(ranking))
    lo, hi = 0, None  # lo: largest k known to fail; hi: smallest k known to pass
    k = 1
    while k <= budget:
        if target.met(candidate(k, ranking).figures):
            hi = k
            break
        lo = k
        k = budget if k * 2 > budget and k < budget else k * 2
    if hi is None:
        best = max(cache.values(), key=lambda c: (c.figures["agreement"], c.figures["sqnr_db"]))
        raise ThresholdError(f"target ({target.describe()}) not met with up to {budget} layer(s) in float "
                             f"(--max-float-layers {max_float_layers}); best: {len(best.float_layers)} float, "
                             f"{describe_figures(best.figures)}")
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if target.met(candidate(mid, ranking).figures):
            hi = mid
        else:
            lo = mid
    return MixedPrecisionResult(cache[hi], tried, [layer.node for layer in ranking])
