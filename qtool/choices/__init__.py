"""Settle, then build: every `auto` of the config is decided here, before the back end runs.

The order is written once, in `settle`: each choice sees the ones before it. A choice decided
from the data measures quantized candidates (qtool.choices.measure); one decided from the graph
reads it (the MatMul strategy, the embedding tables, the nodes kept float for speed). Each gives a
Decision (qtool.choices.decision) whose value goes into the config, so the settled config
(quantize --save-config) replays the same model without measuring anything. Timing
the quantizing machine (qtool.choices.latency) runs only when asked for.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Callable, Iterable, Optional

import onnx

from qtool.choices.bias_correction import choose_bias_correction
from qtool.choices.decision import Decision, apply, replaced
from qtool.choices.dynamic_weights import choose_dynamic_weights
from qtool.choices.hard_forms import choose_hard_forms
from qtool.choices.heads import choose_head_tails
from qtool.choices.measure import Scoring
from qtool.config import Config
from qtool.data.dataset import Batch, DataLike
from qtool.graph.modelio import InputSpec, input_specs
from qtool.choices.embeddings import choose_embeddings
from qtool.choices.speed import choose_float_for_speed
from qtool.quantization.quantize import QuantizedGraph, SharedGraphs, candidates, ranges_only
from qtool.table.table import CalibrationTable, smoothed_options

__all__ = ["Decision", "Scoring", "apply", "settle", "built"]


def settle(model_path: str | Path, model: onnx.ModelProto, table: CalibrationTable, data: Optional[DataLike],
           cfg: Config, calib_data: Optional[Callable[[int], Iterable[Batch]]] = None,
           ranges: Optional[Decision] = None, scoring: Optional[Scoring] = None,
           shared: Optional[SharedGraphs] = None) -> tuple[Config, list[Decision]]:
    """(cfg with every `auto` the back end would meet replaced by a value, the decisions in order).
    `model`: the one at `model_path`, loaded; `data`: the calibration data (None: only the table);
    `ranges`: the range method's decision, made with the table (qtool.choices.ranges); `scoring`:
    the job's (its evaluator and prepared graphs; the range choice's when it measured); `shared`: the
    job's prepared graphs where there is no scoring."""
    decisions = [ranges] if ranges is not None else []
    if cfg.calibration.method == "auto" and ranges is None:
        decisions.append(Decision("calibration.method", table.method, "the table's"))
    measurable = data  # what the measured choices may score candidates on
    if scoring is None and measurable is not None:
        scoring = Scoring(model_path, measurable, cfg, specs=input_specs(model), calib_data=calib_data)
    shared = scoring.shared if scoring is not None else (shared or SharedGraphs())
    # 1. MatMul strategy and embedding tables (the prepared graph, which every build of the job shares)
    prepared = smoothed_options(ranges_only(cfg.quantization), table)
    graph = shared.graph(model_path, table, prepared)
    strategy = graph.strategy
    if cfg.quantization.matmul == "auto":
        decisions.append(Decision("quantization.matmul", strategy,
                                  graph.chosen or "no transformer or recurrent structure"))
    tables = choose_embeddings(graph.plan, cfg.quantization)
    if tables:
        decisions += tables
        cfg = apply(cfg, tables)
        shared.alias(model_path, table, prepared, smoothed_options(ranges_only(cfg.quantization), table))
    # 2. dynamic MatMuls' weight scales (measured)
    if measurable is not None:
        options, decision = choose_dynamic_weights(model_path, strategy, measurable, table, cfg, scoring)
        decisions += [decision] if decision else []
        cfg = replace(cfg, quantization=options)
    elif cfg.quantization.advanced.dynamic_weights == "auto":
        decisions.append(Decision("quantization.advanced.dynamic_weights", "column",
                                  "no calibration data to measure per-tensor scales on"))
    # 3. HardSigmoid/HardSwish form (measured)
    options, decision = choose_hard_forms(model_path, model, measurable, table, cfg, scoring)
    decisions += [decision] if decision else []
    cfg = replace(cfg, quantization=options)
    # 4. the tails of heads that int8 moves far from fp32, each output on its own scale (measured)
    options, decision = choose_head_tails(model, table, cfg, scoring if measurable is not None else None)
    decisions += [decision] if decision else []
    cfg = replace(cfg, quantization=options)
    cfg = apply(cfg, decisions)
    # 5. float for speed (the graph's shapes and onnxruntime CPU's kernel costs)
    decision = choose_float_for_speed(model_path, table, cfg, calib_data, shared)
    if decision is not None:
        decisions.append(decision)
        cfg = apply(cfg, [decision])
    # 6. bias correction's auto: the target's rule (on OpenVINO measured, on the model with the nodes
    # kept float for speed: the one that is built)
    options, decision = choose_bias_correction(table, cfg.quantization, scoring if measurable is not None else None)
    if decision is not None:
        decisions.append(decision)
        cfg = replace(cfg, quantization=options)
    # 7. latency tuning (opt-in: it times candidates on this machine)
    if cfg.quantization.advanced.latency_aware == "on":
        decisions.append(_latency(model_path, input_specs(model), table, cfg, calib_data, shared))
        cfg = apply(cfg, decisions[-1:])
    return _settled(cfg), decisions


def _latency(model_path, specs: list[InputSpec], table: CalibrationTable, cfg: Config,
             calib_data: Optional[Callable[[int], Iterable[Batch]]], shared: Optional[SharedGraphs]) -> Decision:
    from qtool.choices.latency import choose as choose_latency, timer  # opt-in: not every job's import

    built = candidates(model_path, table, cfg.quantization, calib_data, shared)
    if built.feeds is None:
        return Decision("quantization.advanced.float_nodes", (), "latency tuning: no inputs the model runs on")
    choice = choose_latency(built.fp32, built.quantized, built.build, timer(built.feeds, specs), built.sizes)
    return Decision("quantization.advanced.float_nodes", choice.labels,
                    "latency tuning: faster in float on this machine (1 thread, medians)", details=choice.notes)


def _settled(cfg: Config) -> Config:
    """Nothing left to measure or read: the latency tuning's, the head tails' and the speed rule's
    outcomes are in advanced.float_nodes."""
    options = replaced(cfg.quantization, "advanced.latency_aware", "off")
    options = replaced(options, "advanced.head_tails", "off")
    return replace(cfg, quantization=replaced(options, "advanced.speed_rule", "off"))


_ON_WITH_DATA = "auto: on with calibration data, unless it fails on the graph"


def built(graph: QuantizedGraph, cfg: Config) -> tuple[Config, list[Decision]]:
    """What the build settled: the data-driven weight step `auto` ran (adaptive rounding: on with
    calibration data, unless it fails on the graph), and the nodes the run check kept float (onnxruntime
    cannot run them in int8). The config returned replays the build with nothing left `auto`."""
    decisions = []
    for option, value in graph.data_steps.items():
        if getattr(cfg.quantization, option) == "auto":
            decisions.append(Decision(f"quantization.{option}", value, _ON_WITH_DATA))
    if graph.kept_float:
        decisions.append(Decision("quantization.advanced.float_nodes", graph.kept_float,
                                  "onnxruntime cannot run them in int8 (run check)"))
    return apply(cfg, decisions), decisions
