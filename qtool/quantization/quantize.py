"""Quantization: calibration table + fp32 model -> int8 QDQ model."""

from __future__ import annotations

import threading
import warnings
from concurrent.futures import Future
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Callable, Iterable, Optional

import numpy as np
import onnx

from qtool.quantization.rounding import adaptive_rounding
from qtool.quantization.bias_correction import WeightShifts, correct_biases
from qtool.quantization.checks import check_bias_scales, check_finite_constants, check_no_bad_scales, target_problems
from qtool.quantization import run_check
from qtool.quantization.ort_cpu import PASSES as ORT_CPU_PASSES
from qtool.data.dataset import Batch
from qtool.config import AdvancedConfig, QuantizeConfig, with_options
from qtool.errors import InternalError, QtoolError
from qtool.graph.index import GraphIndex, node_label, scoped_nodes
from qtool.graph.kernels import KernelCounts, count_kernels
from qtool.graph.modelio import check_model, input_specs, sha256_file
from qtool.graph.runtime import create_session, in_background, tensor_dims
from qtool.graph.shapes import declared_shapes, inferred
from qtool.plan.dynamic import matmul_strategy
from qtool.plan.planner import (EQUALIZED_NOTE, QuantPlan, build_plan, prepared_model, prepared_with_strategy,
                                unreached_bodies)
from qtool.prepare.equalize import equalized_chains
from qtool.table.resolve import params_from_table
from qtool.quantization.rewrite import quantize_with
from qtool.table.table import CalibrationTable, smoothed_options
from qtool.targets import target_of


@dataclass
class QuantizedGraph:
    """The int8 model with the plan it was made by (internal; the API's QuantizeResult is the public face)."""

    model: onnx.ModelProto
    plan: QuantPlan
    notes: list[str] = field(default_factory=list)
    source: Optional[onnx.ModelProto] = None  # the prepared fp32 graph `model` was quantized from
    canonical: Optional[onnx.ModelProto] = None  # `model` before onnxruntime's kernel forms (hard_activations)
    form_notes: tuple[str, ...] = ()  # the notes of those kernel forms (among `notes`)
    kept_float: tuple[str, ...] = ()  # nodes the run check kept float: onnxruntime cannot run them in int8
    data_steps: dict = field(default_factory=dict)  # bias_correction, weight_rounding: what ran
    # the kernels onnxruntime makes of `model` (a written build on a target that runs onnxruntime's
    # kernels; None otherwise, or where they could not be counted from memory)
    kernels: Optional[KernelCounts] = None


def needs_data(options: QuantizeConfig) -> bool:
    """Whether a data-driven step (bias correction, adaptive rounding) is asked for explicitly, not as `auto`."""
    return options.bias_correction == "fast" or options.weight_rounding == "adaptive"


def resolve_data_steps(options: QuantizeConfig, have_data: bool, have_means: bool) -> tuple[str, str]:
    """(bias correction, weight rounding) to run. Bias correction's `auto` is settled before the
    build (qtool.choices.bias_correction): met here, it builds as off. Adaptive rounding's `auto` is
    on when calibration data is at hand. Asking explicitly for a step without what it reads (data;
    the table's channel means for bias correction `weights`) is a user error."""
    if needs_data(options) and not have_data:
        raise QtoolError("bias correction fast and adaptive weight rounding need calibration data (--data)")
    if options.bias_correction == "weights" and not have_means:
        raise QtoolError(MEANS_MISSING)
    bias = "off" if options.bias_correction == "auto" else options.bias_correction
    rounding = "adaptive" if options.weight_rounding == "auto" and have_data else options.weight_rounding
    return bias, ("nearest" if rounding == "auto" else rounding)


MEANS_MISSING = ("bias correction weights reads the channel means a qtool calibration keeps when it is asked for: "
                 "quantize with --data, or with a qtool table calibrated with quantization.bias_correction: weights "
                 "in its config (it holds \"channel_means\")")


def _optional(setting: str, what: str, notes: list[str], step: Callable):
    """Run a data-driven step; in `auto` mode a graph it cannot handle keeps the plain result, with a note."""
    if setting != "auto":
        return step()
    try:
        return step()
    except Exception as exc:  # auto mode must never make quantization fail where it used to succeed
        notes.append(f"{what} skipped: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}")
        return None


@dataclass
class _Prepared:
    """The prepared graph and the plan the back end builds from, after the run check: what every
    build of the model with these options shares (the job's, and a tuning step's candidates)."""

    model_path: str | Path
    model: onnx.ModelProto
    plan: QuantPlan
    options: QuantizeConfig
    steps: "_Steps"
    ref: run_check.Reference
    samples: list[Batch]
    bias_correction: str
    rounding_mode: str
    unreached: list[str]
    kept: list[str]  # nodes the run check kept float
    fixes: list[str]  # the notes of those
    first: tuple  # steps.quantize's result for `plan`
    kernels: Optional[KernelCounts] = None  # of `first`'s model: a written build on an onnxruntime-kernels target

    @property
    def op_type(self) -> dict[str, str]:
        return {node_label(n): n.op_type for n in scoped_nodes(self.model.graph)}


@dataclass
class _Graph:
    """The prepared graph and plan of one model file for one table's smoothing and reach (what the
    run check starts from)."""

    model: onnx.ModelProto
    plan: QuantPlan
    unreached: list[str]
    # the MatMul strategy it was prepared for, and `matmul: auto`'s note (None: not auto, or nothing to say)
    strategy: str = "static"
    chosen: Optional[str] = None


# the options that change only what is built on the prepared graph and plan, not them
_BUILD_ONLY = ("bias_correction", "weight_rounding", "correction_samples")
_BUILD_ONLY_ADVANCED = ("hard_activations", "dynamic_weights", "latency_aware", "speed_rule", "head_tails")
# the value an `auto` of these builds as where the back end meets it (a measured candidate's, made
# before the choice is settled): each choice's first candidate
AUTO_BUILDS_AS = (("hard_activations", "integer"), ("dynamic_weights", "column"))


def as_built(options: QuantizeConfig) -> QuantizeConfig:
    """`options` with each `auto` of AUTO_BUILDS_AS replaced by the value it builds as."""
    values = {name: value for name, value in AUTO_BUILDS_AS if getattr(options.advanced, name) == "auto"}
    return with_options(options, **values) if values else options


def build_options(options: QuantizeConfig) -> tuple:
    """What of `options` a build reads beyond its prepared graph and plan (SharedGraphs.graph's):
    two builds of one table on the same prepared graph with equal build_options are the same model.
    The settle stage's switches (latency_aware, speed_rule, head_tails) build nothing."""
    options = as_built(options)
    return (*(getattr(options, name) for name in _BUILD_ONLY),
            options.advanced.hard_activations, options.advanced.dynamic_weights)


class SharedGraphs:
    """The prepared graphs and plans of one quantize job, made once and shared by every build of it:
    each measured choice's candidates and the final model (prepared_model re-reads, re-prepares and
    re-plans the file; the candidates differ only in their tables and the build-only options). A
    cached graph is never changed: builds copy what they edit."""

    def __init__(self):
        self._graphs: dict = {}
        self._references: dict = {}
        self._sha256: dict[str, str] = {}
        self._dims: dict[int, object] = {}  # by the graph's id; each graph in _held
        self._held: list[onnx.ModelProto] = []
        self._lock = threading.RLock()

    def graph(self, model_path: str | Path, table: CalibrationTable, options: QuantizeConfig) -> _Graph:
        """`options`: smoothed by the table already. Candidates built side by side (Scoring.measured)
        prepare a graph once: the first to ask makes it, the other waits."""
        key = self._key(model_path, table, options)
        with self._lock:
            if key not in self._graphs:
                graph, strategy = _prepared_graph(model_path, table, options)
                self._graphs[key] = graph
                if strategy is not None:  # naming the strategy `auto` settled to makes the same graph, less auto's note
                    named = graph if graph.chosen is None else replace(
                        graph, plan=replace(graph.plan, notes=[n for n in graph.plan.notes if n != graph.chosen]),
                        chosen=None)
                    self._graphs[(key[0], replace(key[1], matmul=strategy), key[2])] = named
            return self._graphs[key]

    def alias(self, model_path: str | Path, table: CalibrationTable, options: QuantizeConfig,
              same: QuantizeConfig) -> None:
        """`same` (smoothed) makes the graph `options` made: a choice settled to the value it took."""
        graph = self.graph(model_path, table, options)
        self._graphs[self._key(model_path, table, same)] = graph
        named = self._key(model_path, table, replace(options, matmul=graph.strategy))
        if options.matmul == "auto" and named in self._graphs:  # and with the strategy named, as graph() keeps it
            self._graphs[self._key(model_path, table, replace(same, matmul=graph.strategy))] = self._graphs[named]

    def reference(self, model_path: str | Path, model: onnx.ModelProto,
                  data: Optional[Callable[[int], Iterable[Batch]]]) -> run_check.Reference:
        """The run check's input (the first calibration sample, else made up from the input specs)
        and fp32's outputs on it, once per model file and source of data: every graph prepared from
        the file (`model` is one) computes the file's function, the same output shapes, finite where
        the file's are. The speed rule reads its shapes on the same input."""
        key = (str(model_path), data)
        if key not in self._references:
            self._references[key] = _reference(model, data)
        return _resolved(self._references, key)

    def sha256(self, model_path: str | Path) -> str:
        """The model file's sha256, hashed once per job (each build checks its table against it)."""
        if str(model_path) not in self._sha256:
            self._sha256[str(model_path)] = sha256_file(model_path)
        return self._sha256[str(model_path)]

    def reference_soon(self, model_path: str | Path, model: onnx.ModelProto,
                       data: Optional[Callable[[int], Iterable[Batch]]], dims: bool = False) -> None:
        """Start reference()'s fp32 run in the background (qtool.graph.runtime.in_background), for
        a build about to need it, and with `dims` then dims()'s of `model` (for the speed rule)."""
        key = (str(model_path), data)
        if key not in self._references:
            self._references[key] = in_background(_reference, model, data)
        if dims and id(model) not in self._dims:
            self._held.append(model)  # its id is not reused while its dims are kept
            self._dims[id(model)] = in_background(self._tensor_dims, model_path, model, data)

    def dims(self, model_path: str | Path, model: onnx.ModelProto,
             data: Optional[Callable[[int], Iterable[Batch]]]) -> Optional[dict[str, tuple[int, ...]]]:
        """The static dims of `model`'s tensors (a graph of this job) on reference()'s input, once
        per graph (qtool.graph.runtime.tensor_dims); None when fp32 runs on no input."""
        if id(model) not in self._dims:
            self._held.append(model)
            self._dims[id(model)] = self._tensor_dims(model_path, model, data)
        return _resolved(self._dims, id(model))

    def _tensor_dims(self, model_path: str | Path, model: onnx.ModelProto,
                     data: Optional[Callable[[int], Iterable[Batch]]]) -> Optional[dict[str, tuple[int, ...]]]:
        feeds = self.reference(model_path, model, data).runs
        return tensor_dims(model, feeds) if feeds is not None else None

    @staticmethod
    def _key(model_path: str | Path, table: CalibrationTable, options: QuantizeConfig) -> tuple:
        defaults, advanced = QuantizeConfig(), AdvancedConfig()
        return (str(model_path), with_options(options, **{k: getattr(defaults, k) for k in _BUILD_ONLY},
                                              **{k: getattr(advanced, k) for k in _BUILD_ONLY_ADVANCED}),
                frozenset(name for name in table.tensors if _seen(table)(name)))


def _resolved(cache: dict, key):
    """cache[key], the result in place of a Future started in the background."""
    if isinstance(cache[key], Future):
        cache[key] = cache[key].result()
    return cache[key]


def _prepared_graph(model_path: str | Path, table: CalibrationTable, options: QuantizeConfig
                    ) -> tuple[_Graph, Optional[str]]:
    """(the graph, the strategy `matmul: auto` settled to where naming it instead makes the same graph
    but for auto's note)."""
    # the graph calibration saw, equalized if asked
    model, plan, strategy, chosen = prepared_with_strategy(model_path, options)
    # If branches and loop bodies the calibration data never ran have no ranges: they stay float
    unreached, unreached_notes = unreached_bodies(model.graph, plan.activations, _seen(table))
    if unreached:
        plan = _replan(model, options, plan, unreached)
        plan.notes += unreached_notes
    model, plan = _unequalize_float_chains(model_path, model, plan, options, unreached)  # excluded, or dynamic
    check_finite_constants(model, plan, model_path)
    same = (options.matmul == "auto"
            and matmul_strategy(model, GraphIndex(model), options)[0] == strategy)  # build_plan's too
    return _Graph(model, plan, unreached, strategy=strategy, chosen=chosen), strategy if same else None


def _prepare(model_path: str | Path, table: CalibrationTable, options: QuantizeConfig, table_path: object,
             allow_missing: bool, data: Optional[Callable[[int], Iterable[Batch]]],
             shared: Optional[SharedGraphs] = None, candidate: bool = False) -> _Prepared:
    shared = shared or SharedGraphs()
    if table.model_sha256 and table.model_sha256 != shared.sha256(model_path):
        warnings.warn(f"{table_path}: calibration table was made for a different model file "
                      f"({table.model_file}, sha256 {table.model_sha256[:12]}...)", stacklevel=3)
    options = as_built(smoothed_options(options, table))  # the table's SmoothQuant scales: the graph it was made on
    graph = shared.graph(model_path, table, options)
    model, plan, unreached = graph.model, graph.plan, graph.unreached
    op_type = {node_label(n): n.op_type for n in scoped_nodes(model.graph)}
    bias_correction, rounding_mode = resolve_data_steps(options, data is not None, table.channel_means is not None)
    samples = list(data(options.correction_samples)) if bias_correction == "fast" or rounding_mode != "nearest" else []
    shared.reference_soon(model_path, model, data)  # fp32's run goes on while the model is built
    steps = _Steps(table, options, table_path, allow_missing, written=not candidate)
    kept: list[str] = []
    fixes: list[str] = []
    counting = not candidate and target_of(options).onnxruntime_kernels
    while True:
        built = steps.quantize(model, plan, samples, bias_correction, rounding_mode)
        # the kernels onnxruntime makes of a written build, counted beside its run check where two
        # sessions of the model at once cost little memory, else after it
        size = built[0].ByteSize() if counting else 0
        pending = in_background(_kernel_counts, built[0], size) if counting and size <= COUNT_BESIDE_BYTES else None
        ref = shared.reference(model_path, model, data)
        failure = run_check.check(built[0], ref)
        if failure is None:
            kernels = None
            if counting:
                kernels = pending.result() if pending is not None else _kernel_counts(built[0], size)
            break
        found = None
        if len(kept) < MAX_KEPT_FLOAT:
            candidates = [(label, op_type[label]) for label in plan.quantized_nodes]
            found = run_check.locate(failure, candidates, lambda labels: run_check.check(
                steps.structure(model, build_plan(model, options, keep_float=[*unreached, *kept, *labels])),
                ref) is None)
        if found is None:
            raise InternalError(f"the quantized model does not pass onnxruntime's run check: {failure.reason}"
                                + (f" (after keeping {', '.join(kept)} in float)" if kept else ""))
        kept.append(found)
        before = plan.quantized_nodes
        plan = _replan(model, options, plan, [*unreached, *kept])
        along = [f"'{label}' ({op_type[label]})" for label in before
                 if label != found and label not in plan.quantized_nodes]
        fixes.append(f"'{found}' ({op_type[found]}) kept in float"
                     + (f" (and with it {', '.join(along)})" if along else "")
                     + f", because onnxruntime cannot run the model with it in int8: {failure.reason}")
    return _Prepared(model_path, model, plan, options, steps, ref, samples, bias_correction, rounding_mode,
                     unreached, kept, fixes, built, kernels)


COUNT_BESIDE_BYTES = 16 << 20  # a written build up to this size has its kernels counted beside its run check


def _kernel_counts(model: onnx.ModelProto, size: int) -> Optional[KernelCounts]:
    """count_kernels of an in-memory model of `size` bytes; None where it cannot be counted so (over
    protobuf's 2 GiB, or onnxruntime fails to optimize it: the report then counts the written file)."""
    if size > 2**31 - 1:
        return None
    try:
        return count_kernels(model)
    except Exception:  # advisory, as kernel_summary: the written file is counted instead
        return None


def quantize_model(model_path: str | Path, table: CalibrationTable, options: QuantizeConfig,
                   table_path: object = None, allow_missing: bool = False,
                   data: Optional[Callable[[int], Iterable[Batch]]] = None,
                   shared: Optional[SharedGraphs] = None, candidate: bool = False) -> QuantizedGraph:
    """`data(n)`: at most n calibration samples in batches (bias correction and adaptive rounding need them).
    `shared`: the prepared graphs of the job's other builds (made here when missing; the result is
    the same with or without). `candidate`: a model the measured choices score and never write:
    the checks of what qtool writes (onnx's checker, the target's constraints) are left to the
    build that is written; the same model either way.
    The back end builds what the options say and measures nothing: every choice is settled before
    (qtool.choices).

    The model is run once in onnxruntime before it is returned (qtool.quantization.run_check);
    a node whose int8 form onnxruntime cannot run is kept float with a note (QuantizedGraph.kept_float),
    and a model that still does not run after MAX_KEPT_FLOAT such nodes is an InternalError."""
    prepared = _prepare(model_path, table, options, table_path, allow_missing, data, shared, candidate)
    qmodel, notes, canonical, forms, ran = prepared.first
    if prepared.ref.skipped:
        notes.append(f"the int8 model was only loaded, not run: {prepared.ref.skipped}")
    return QuantizedGraph(qmodel, prepared.plan, prepared.fixes + notes, prepared.model, canonical, forms,
                          tuple(prepared.kept), ran, prepared.kernels)


@dataclass
class Candidates:
    """What a tuning step needs to build ranges-only int8 candidates of one model quickly: the
    prepared graph and its plan are made once (qtool.choices.latency)."""

    prepared: _Prepared
    batch: Optional[dict] = None  # the first calibration batch (None: the run check's inputs)

    @property
    def quantized(self) -> dict[str, str]:
        """Label -> op type of the nodes the plan quantizes."""
        op_type = self.prepared.op_type
        return {label: op_type[label] for label in self.prepared.plan.quantized_nodes}

    @property
    def feeds(self) -> Optional[dict]:
        """The first calibration batch, else the run check's made-up inputs where fp32 runs on them
        (None: no inputs it runs on)."""
        return self.batch if self.batch is not None else self.prepared.ref.runs

    def build(self, labels: list[str]) -> onnx.ModelProto:
        """The candidate with `labels` kept float, as quantize would write it: an equalized chain it
        keeps wholly float goes back to the form the model was exported in."""
        p = self.prepared
        keep_float = [*p.unreached, *p.kept, *labels]
        candidate, replanned = _unequalize_float_chains(p.model_path, p.model,
                                                        build_plan(p.model, p.options, keep_float=keep_float),
                                                        p.options, keep_float)
        return p.steps.structure(candidate, replanned)

    def sizes(self) -> dict[str, int]:
        """Values in each quantized node's first output on the run check's batch."""
        return _output_sizes(self.prepared.model, self.quantized, self.feeds)

    def fp32(self) -> onnx.ModelProto | str:
        """The model file as given, what the int8 model must beat (the prepared graph where the file
        does not take the batch)."""
        path = str(self.prepared.model_path)
        try:
            create_session(path, 1, path).run(None, self.feeds)
        except Exception:
            return self.prepared.model
        return path


def ranges_only(options: QuantizeConfig) -> QuantizeConfig:
    """The options of a measured candidate: the steps that run on data (fast bias correction,
    adaptive rounding) run once, on the choice; the weights form of bias correction, which reads
    only the table, is built into every candidate as it will be into the model."""
    bias = "weights" if options.bias_correction == "weights" else "off"
    return replace(options, bias_correction=bias, weight_rounding="nearest")


def candidates(model_path: str | Path, table: CalibrationTable, options: QuantizeConfig,
               data: Optional[Callable[[int], Iterable[Batch]]] = None,
               shared: Optional[SharedGraphs] = None) -> Candidates:
    """The prepared model of `options` (ranges only) ready to build candidates from."""
    prepared = _prepare(model_path, table, ranges_only(options), None, True, data, shared)
    first = next(iter(data(options.correction_samples)), None) if data is not None else None
    return Candidates(prepared, first.feeds if first is not None and prepared.ref.runs is not None else None)


def _unequalize_float_chains(model_path: str | Path, model: onnx.ModelProto, plan: QuantPlan, options: QuantizeConfig,
                             keep_float: list[str]) -> tuple[onnx.ModelProto, QuantPlan]:
    """The graph without the activation equalization of chains with no int8 node (excluded, left to a
    dynamic strategy, or made float by the latency-aware choice): in float the rewrite only costs
    time (a depthwise 1x1 Conv where an Add was), and it is exact, so the float chain computes the
    same without it; the ranges of the tensors around it do not change."""
    quantized = set(plan.quantized_nodes)
    chains = equalized_chains(model, [tensor for tensor, _ in options.smooth_scales])
    undone = {tensor for tensor, chain in chains.items() if not chain & quantized}
    if not undone:
        return model, plan
    fewer = with_options(options, smooth_scales=tuple((t, s) for t, s in options.smooth_scales if t not in undone))
    before = {node_label(n) for n in scoped_nodes(model.graph)}
    model, prepared = prepared_model(model_path, fewer)
    # the nodes an undone chain brings back (a written-out hard-swish's Div, its affine Mul and Add)
    # belong to that float chain: calibration, which saw the equalized graph, has no range for them
    restored = [node_label(n) for n in scoped_nodes(model.graph) if node_label(n) not in before]
    replanned = build_plan(model, fewer, keep_float=[*keep_float, *restored])
    replanned.notes = ([n for n in plan.notes if EQUALIZED_NOTE not in n]
                       + [n for n in prepared.notes if EQUALIZED_NOTE in n]
                       + [f"the activation equalization of {len(undone)} chain(s) left out: they stay float "
                          "(excluded, or kept float for speed), where it costs time and changes nothing"])
    return model, replanned


def _seen(table: CalibrationTable) -> Callable[[str], bool]:
    """Whether calibration saw a value of a tensor: an unseen one has no extremes in the table (its
    range is no evidence: a Sigmoid's is fixed). A table imported from a format without extremes
    has none anywhere; its entries are taken as seen."""
    extremes = any(entry.min is not None for entry in table.tensors.values())
    return lambda name: name in table.tensors and (table.tensors[name].min is not None or not extremes)


MAX_KEPT_FLOAT = 3  # nodes kept float by the run check before a model that still fails is a bug


def _replan(model: onnx.ModelProto, options: QuantizeConfig, plan: QuantPlan, keep_float: list[str]) -> QuantPlan:
    """The plan with `keep_float` float; its notes (what preparing the graph did, the float notes) kept."""
    replanned = build_plan(model, options, keep_float=keep_float)
    replanned.notes = list(plan.notes)
    return replanned


MADE_UP_SIZES = (1, 64, 224)  # tried in turn for the open dims of made-up inputs until fp32 runs


def _output_sizes(model: onnx.ModelProto, labels: Iterable[str], feeds: dict) -> dict[str, int]:
    """Values in each labelled node's first output on `feeds` (shape inference on their shapes);
    nodes whose output shape stays unknown are left out."""
    shapes = declared_shapes(inferred(model, data_prop=False, input_shapes={k: v.shape for k, v in feeds.items()}))
    wanted = set(labels)
    sizes = {}
    for node in model.graph.node:
        dims = shapes.get(node.output[0]) if node.output else None
        if node_label(node) in wanted and dims and all(isinstance(d, int) and d > 0 for d in dims):
            sizes[node_label(node)] = int(np.prod(dims))
    return sizes


def _reference(model: onnx.ModelProto, data: Optional[Callable[[int], Iterable[Batch]]]) -> run_check.Reference:
    """The run check's input: the first calibration sample, else one made up from the input specs."""
    first = next(iter(data(1)), None) if data is not None else None
    if first is not None:
        return run_check.reference(model, first.feeds, "the first calibration sample")
    ref = None
    for size in MADE_UP_SIZES:  # open dims of 1 suit a sequence, not a strided CNN's image
        ref = run_check.reference(model, run_check.made_up_feeds(input_specs(model), size),
                                  "inputs made up from its input specs")
        if ref.outputs is not None:
            break
    return ref


@dataclass(frozen=True)
class _Steps:
    """Quantization of the prepared graph by one plan: `quantize` is the whole back end,
    `structure` the same graph without the data-driven steps (which change only constants),
    as the run check's search tries it."""

    table: CalibrationTable
    options: QuantizeConfig
    table_path: object
    allow_missing: bool
    written: bool = True  # False: a measured candidate (no checks of what qtool writes: quantize_model's `candidate`)

    def quantize(self, model: onnx.ModelProto, plan: QuantPlan, samples: list[Batch], bias_correction: str,
                 rounding_mode: str) -> tuple[onnx.ModelProto, list[str], onnx.ModelProto, tuple[str, ...], dict]:
        """(the int8 model, its notes, the same model before onnxruntime's kernel forms, their notes,
        the data-driven steps that ran: bias_correction and weight_rounding as settled values)."""
        options = self.options
        params = params_from_table(plan, self.table, options, self.table_path, self.allow_missing)
        notes: list[str] = []
        ran = {"bias_correction": "off", "weight_rounding": "nearest"}  # the data-driven steps that ran
        rounding = None
        if rounding_mode == "adaptive":
            rounding = _optional(options.weight_rounding, "adaptive weight rounding", notes,
                                 lambda: adaptive_rounding(model, plan, params, samples, options))
        shifted = (WeightShifts(model, plan, self.table.channel_means or {}, self.table.spatial_sizes or {})
                   if bias_correction == "weights" else None)
        try:
            qmodel, graph_notes = quantize_with(model, plan, params, options, rounding, shifted)
            ran["weight_rounding"] = "adaptive" if rounding is not None else "nearest"
        except Exception as exc:
            if rounding is None or options.weight_rounding != "auto":
                raise
            notes.append(f"adaptive weight rounding skipped: {type(exc).__name__}: {exc}")
            qmodel, graph_notes = quantize_with(model, plan, params, options, bias_shift=shifted)
        if shifted is not None:
            ran["bias_correction"] = "weights"
        notes = plan.notes + graph_notes + notes
        if bias_correction == "fast":
            corrected = onnx.ModelProto()
            corrected.CopyFrom(qmodel)  # a step that fails half-way in auto mode leaves qmodel untouched
            report = _optional(options.bias_correction, "bias correction", notes,
                               lambda: correct_biases(model, corrected, plan, samples))
            if report is not None:
                qmodel = corrected
                ran["bias_correction"] = "fast"
                notes.append(f"bias correction: {report.layers} layers on {report.samples} samples, "
                             f"{report.channels_corrected} of {report.channels} channels with a significant shift "
                             f"(mean |output shift| before {report.mean_abs_shift_before:.3g})")
        notes += _target_rewrites(qmodel, options)
        check_no_bad_scales(qmodel)
        check_bias_scales(qmodel)
        problems = target_problems(qmodel, options, plan) if self.written else []
        if problems:
            shown = "; ".join(problems[:5]) + (f" and {len(problems) - 5} more" if len(problems) > 5 else "")
            notes.append(f"the model does not satisfy target {options.target}'s constraints "
                         f"({len(problems)} problem(s), from the options overriding the preset): {shown}")
        try:
            if self.written:
                check_model(qmodel, full_check=True)
        except onnx.checker.ValidationError as exc:
            raise AssertionError(f"internal error: quantized model fails the checker: {exc}") from None
        canonical = onnx.ModelProto()
        canonical.CopyFrom(qmodel)
        forms = kernel_forms(qmodel, options)
        return qmodel, notes + forms, canonical, tuple(forms), ran

    def structure(self, model: onnx.ModelProto, plan: QuantPlan) -> onnx.ModelProto:
        options = self.options
        params = params_from_table(plan, self.table, options, self.table_path, self.allow_missing)
        qmodel, _ = quantize_with(model, plan, params, options)
        _target_rewrites(qmodel, options)
        kernel_forms(qmodel, options)
        return qmodel


# The runtime-specific passes a target may name (Target.finish_passes, Target.form_passes), by name.
PASSES = {**ORT_CPU_PASSES}


def _run_passes(names: Iterable[str], qmodel: onnx.ModelProto, options: QuantizeConfig) -> list[str]:
    notes: list[str] = []
    for name in names:
        notes += PASSES[name](qmodel, options)
    return notes


def _target_rewrites(qmodel: onnx.ModelProto, options: QuantizeConfig) -> list[str]:
    """The target's passes on the quantized model before its checks (Target.finish_passes), in place;
    their notes."""
    return _run_passes(target_of(options).finish_passes, qmodel, options)


def kernel_forms(qmodel: onnx.ModelProto, options: QuantizeConfig, only: Optional[Iterable[str]] = None) -> list[str]:
    """The target's kernel forms (Target.form_passes; those among `only` when given), in place; their
    notes. Applied last to a quantized model (QuantizedGraph.canonical is the model before them)."""
    names = target_of(options).form_passes
    return _run_passes([n for n in names if only is None or n in only], qmodel, options)
