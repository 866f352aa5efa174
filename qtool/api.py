"""The Python front door: calibrate, quantize, search, evaluate (docs/api.md).

These functions are the whole jobs the CLI runs; the CLI only parses options, checks
their combinations, prints and picks exit codes, so the same call gives the same bytes
from Python and from the command line. Three things are accepted in several forms:

* model: a path to an ONNX file (the table records its name and sha256; a model with
  external data keeps it when saved);
* data: a folder (or file) path, any iterable of {input name: numpy array} dicts, one
  sample each, or a callable returning such an iterable (qtool.data.dataset);
* config: a YAML path, a dict of sections with the file's keys, or a Config (load_config).
"""

from __future__ import annotations

import contextlib
import itertools
from concurrent.futures import Executor
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Iterable, Iterator, Optional, Union

import onnx

from qtool.calibration.calibrate import calibrate as run_calibration, calibrate_methods
from qtool.calibration.ranges import AUTO
from qtool.config import Config, load_config
from qtool.data.batching import LOOK_AHEAD, batch_refusal
from qtool.data.dataset import Batch, DataLike, batches, count_samples, open_data
from qtool.data.labels import labels_for
from qtool.errors import InternalError, MissingRanges, QtoolError, reports_memory
from qtool.choices import Decision, Scoring, apply, built, settle
from qtool.choices.ranges import choose_ranges
from qtool.config import config_mapping
from qtool.evaluation.mixed_precision import Target, describe_figures, search as run_search
from qtool.atomic import write_text
from qtool.graph.executor import Engine, as_engine, open_engine
from qtool.graph.kernels import KernelCounts
from qtool.graph.modelio import InputSpec, has_external_data, input_specs, load_model, save_model, sha256_file
from qtool.graph.runtime import job_model, usable_cores
from qtool.plan.planner import unquantizable
from qtool.quantization.quantize import QuantizedGraph, SharedGraphs, quantize_model
from qtool.table.table import CalibrationTable, smoothed_options

if TYPE_CHECKING:
    from qtool.evaluation.report import EvaluationReport

ConfigLike = Union[str, Path, dict, Config, None]
Log = Callable[[str], None]


@dataclass(frozen=True)
class MixedPrecisionSearch:
    """Keep the fewest layers in float so that the int8 model meets a target on evaluation
    data (qtool.search; qtool search --target-agreement/--target-top1-drop/--target-sqnr/
    --target-cosine; the search is described in qtool.evaluation.mixed_precision). Set at least
    one target."""

    data: DataLike  # evaluation data, batched by the config's evaluation section
    agreement: Optional[float] = None  # percent of samples whose top-1 matches fp32
    top1_drop: Optional[float] = None  # points of top-1 lost at most (needs labels)
    sqnr: Optional[float] = None  # dB, worst model output
    labels: Optional[str] = None  # label file, or "folders" (folder data only)
    max_float_layers: int = 10  # fail (ThresholdError) when the target needs more
    min_int8_macs: float = 0.0  # percent of the MACs that must stay int8
    cosine: Optional[float] = None  # mean over samples of the worst output's cosine to fp32
    # With calibration data: when the all-int8 model misses the target, these range methods are
    # measured too (one more calibration pass) and the search starts from the closest
    range_methods: tuple[str, ...] = ("percentile", "mse")
    int16: bool = False  # also offer a layer's activations in 16 bits (weights int8) as a move
    # processes scoring the candidates (and sharding the calibration); None: one per core this
    # process may use, unless the config asks for workers or Dask
    workers: Optional[int] = None


def search_workers(cfg: Config, search: MixedPrecisionSearch) -> int:
    """The processes a search runs on: the config's calibration.workers when it asks for more
    than one, else search.workers, else one per core the process may use. A ranking scores
    dozens of candidates that do not depend on each other; a process each, with the cores
    divided among them (one thread each when the job may use every core), beats one process
    running each candidate's small batches on every core."""
    if cfg.calibration.workers > 1:
        return cfg.calibration.workers
    if search.workers is not None:
        return search.workers
    return usable_cores()


@dataclass(frozen=True)
class SearchOutcome:
    """The model the search chose: its float layers, the MatMul/Gemm it made dynamic int8, and
    the figures it was verified with."""

    float_layers: tuple[str, ...]
    int8_mac_fraction: float
    figures: dict  # agreement, mean_kl, sqnr_db, cosine (and top1, top1_fp32 with labels)
    dynamic_layers: tuple[str, ...] = ()
    method: str = "minmax"  # the range method of the chosen model's table
    int16_layers: tuple[str, ...] = ()  # int8 weights, 16-bit activations

    def describe(self) -> str:
        layers = f": {', '.join(self.float_layers)}" if self.float_layers else ""
        layers += f"; {len(self.dynamic_layers)} dynamic int8: {', '.join(self.dynamic_layers)}" \
            if self.dynamic_layers else ""
        layers += f"; {len(self.int16_layers)} with 16-bit activations: {', '.join(self.int16_layers)}" \
            if self.int16_layers else ""
        return (f"target met with {len(self.float_layers)} layer(s) in float{layers}; "
                f"{100 * self.int8_mac_fraction:.1f}% of MACs in int8, {self.method} ranges; "
                f"{describe_figures(self.figures)}")


@dataclass(frozen=True)
class QuantizeResult:
    """The int8 QDQ model, what was quantized, and what the user should know about it."""

    model: onnx.ModelProto
    table: CalibrationTable  # the table it was made from (calibrated here when only data was given)
    notes: tuple[str, ...]  # steps skipped, layers kept float, inputs rearranged, target problems
    quantized_nodes: int
    int8_weights: int
    activations: int  # activation tensors with int8 parameters
    float_nodes: int  # nodes left in float
    external_data: bool = False  # the source model keeps its tensors in a side file: so does save()
    int8_embeddings: int = 0  # embedding tables stored int8 per row
    search: Optional[SearchOutcome] = None  # what qtool.search chose
    decisions: tuple[Decision, ...] = ()  # every `auto` settled, in order (qtool.choices)
    settled: Optional[Config] = None  # the config with those values: replays this model, measuring nothing
    kernels: Optional[KernelCounts] = None  # the kernels onnxruntime makes of it (targets that run its kernels)

    def save(self, path: str | Path) -> None:
        """Write the model atomically (a failure leaves no partial file); tensors go to
        `<name>.<sha256[:16]>.data` beside it when the source had external data or the model is over 2 GiB."""
        save_model(self.model, path, external=self.external_data)

    def save_config(self, path: str | Path) -> None:
        """Write the settled config as YAML: `quantize` with it and the same model, data and versions
        writes the same bytes without measuring anything."""
        import yaml

        write_text(path, yaml.safe_dump(config_mapping(self.settled), sort_keys=False))

    def to_dict(self) -> dict:
        """The summary `quantize --json` prints: counts, notes, decisions, the search's outcome."""
        return {"quantized_nodes": self.quantized_nodes, "int8_weights": self.int8_weights,
                "activations": self.activations, "float_nodes": self.float_nodes,
                "int8_embeddings": self.int8_embeddings, "notes": list(self.notes),
                "decisions": [d.to_dict() for d in self.decisions],
                "search": None if self.search is None else {
                    "float_layers": list(self.search.float_layers), "dynamic_layers": list(self.search.dynamic_layers),
                    "int16_layers": list(self.search.int16_layers), "method": self.search.method,
                    "int8_mac_fraction": self.search.int8_mac_fraction, "figures": self.search.figures},
                "kernels": None if self.kernels is None else asdict(self.kernels)}


@reports_memory("calibrate it")
def calibrate(model: str | Path, data: DataLike, config: ConfigLike = None, *,
              progress: bool = True, executor: Optional[Executor] = None) -> CalibrationTable:
    """Run `data` through `model` and return the calibration table (`.save(path)` writes its JSON).

    executor: any concurrent.futures.Executor (Dask's `client.get_executor()`, a process pool)
    runs the shards of a data folder; without one, the config's `calibration.dask` or
    `calibration.workers` say where they run (default: here)."""
    cfg = load_config(config)
    with job_model(model), _engine(executor, cfg.calibration.dask, cfg.calibration.workers) as engine:
        data, cfg, sized = _batch_sizes(model, input_specs(load_model(model)), data, cfg)
        table = _calibrated(model, data, cfg, progress, engine)[0]
    return replace(table, notes=table.notes + tuple(d.note() for d in sized if d.details))


def _calibrated(model: str | Path, data: DataLike, cfg: Config, progress: bool, engine: Optional[Engine],
                scoring: Optional[Scoring] = None) -> tuple[CalibrationTable, list[CalibrationTable], Optional[Decision]]:
    """The table of `data`, the tables of the other range methods measured with it, and the range
    method's decision: with method `auto`, the method measured best (qtool.choices.ranges), unless
    the data can be read only once (a generator: minmax, nothing else). `scoring`: the job's."""
    if cfg.calibration.method == AUTO:
        if not isinstance(data, Iterator):
            return choose_ranges(model, data, cfg, progress, engine, scoring)
        cfg = replace(cfg, calibration=replace(cfg.calibration, method="minmax"))
        table = run_calibration(model, data, cfg.preprocess, cfg.calibration, cfg.quantization, progress, engine)
        return table, [], Decision("calibration.method", "minmax", "data read once (an iterator): nothing measured")
    return run_calibration(model, data, cfg.preprocess, cfg.calibration, cfg.quantization, progress, engine), [], None


@contextlib.contextmanager
def _engine(executor: Optional[Executor], dask: Optional[str], workers: int) -> Iterator[Optional[Engine]]:
    """The caller's executor, else the one the config asks for (opened and closed here), else None."""
    if executor is not None:
        yield as_engine(executor)
    else:
        with open_engine(dask, workers) as engine:
            yield engine


@reports_memory("quantize it")
def quantize(model: str | Path, *, table: CalibrationTable | str | Path | None = None,
             data: Optional[DataLike] = None, config: ConfigLike = None, table_format: Optional[str] = None,
             allow_missing: bool = False, progress: bool = True,
             executor: Optional[Executor] = None) -> QuantizeResult:
    """The int8 QDQ model of `model`.

    table: a CalibrationTable, or a table file in any supported format (`table_format`
    forces one). Without a table, `data` is calibrated first. Data also feeds bias
    correction and adaptive rounding (on in `auto` mode whenever data is given).
    `executor` (else the config's `calibration.dask` or `calibration.workers`) runs the
    calibration's shards (calibrate).
    """
    return _quantize(model, table, data, config, table_format, allow_missing, None, None, progress, executor)


def search(model: str | Path, spec: MixedPrecisionSearch, *, table: CalibrationTable | str | Path | None = None,
           data: Optional[DataLike] = None, config: ConfigLike = None, table_format: Optional[str] = None,
           allow_missing: bool = False, log: Optional[Log] = None, progress: bool = True,
           executor: Optional[Executor] = None) -> QuantizeResult:
    """The int8 QDQ model of `model` with the fewest layers in float that meets `spec`'s target on
    its evaluation data (`result.search` says which); ThresholdError when the budgets run out.

    table, data, config, table_format, allow_missing: as for quantize, whose steps it runs.
    `log` receives the search's progress lines; `executor` (else the config's `calibration.dask`,
    else a pool of search_workers() processes) runs the calibration's shards and scores the
    search's candidates.
    """
    return _quantize(model, table, data, config, table_format, allow_missing, spec, log, progress, executor)


def _quantize(model: str | Path, table: CalibrationTable | str | Path | None, data: Optional[DataLike],
              config: ConfigLike, table_format: Optional[str], allow_missing: bool,
              search: Optional[MixedPrecisionSearch], log: Optional[Log], progress: bool,
              executor: Optional[Executor]) -> QuantizeResult:
    """quantize, and with `search` the mixed-precision search over the same settled config."""
    cfg = load_config(config)
    if table is None and data is None:
        raise QtoolError("quantize needs a calibration table (table=) or calibration data (data=)")
    sharded = table is None or search is not None  # what runs on an engine: the calibration, the search
    workers = search_workers(cfg, search) if search is not None else cfg.calibration.workers
    with job_model(model), _engine(executor, cfg.calibration.dask, workers) if sharded \
            else contextlib.nullcontext() as engine:
        table_path, measured, ranges = None, [], None
        fp32_model = load_model(model)
        nothing = unquantizable(fp32_model)
        if nothing is not None:
            table = CalibrationTable(Path(model).name, sha256_file(model), cfg.calibration.method, {}, 0)
            return QuantizeResult(fp32_model, table, (nothing,), quantized_nodes=0, int8_weights=0, activations=0,
                                  float_nodes=len(fp32_model.graph.node), external_data=has_external_data(model),
                                  settled=cfg)
        specs = input_specs(fp32_model)
        sized = []
        if data is not None:  # before anything runs on batches: calibration, the choices, the search
            data, cfg, sized = _batch_sizes(model, specs, data, cfg)
        if search is not None:
            search, cfg, more = _search_batch_size(model, specs, search, cfg)
            sized += more
        measurable = data if data is not None and not isinstance(data, Iterator) else None
        calib_data = _calibration_batches(data, specs, cfg) if data is not None else None
        # one evaluator and one prepared graph for every candidate the choices measure, and the final build
        shared = SharedGraphs()
        scoring = Scoring(model, measurable, cfg, shared, specs, calib_data) if measurable is not None else None
        own_table = table is None
        with scoring.keeping() if own_table and scoring is not None else contextlib.nullcontext():
            if own_table:
                table, measured, ranges = _calibrated(model, data, cfg, progress, engine, scoring)
            elif not isinstance(table, CalibrationTable):
                from qtool.table.formats import read_table  # the formats' modules only when a table is read

                table_path = table
                table, _ = read_table(table, table_format, model, cfg.quantization)
            cfg = replace(cfg, quantization=smoothed_options(cfg.quantization, table))
            cfg, decisions = settle(model, fp32_model, table, measurable, cfg, calib_data, ranges, scoring,
                                     shared)
        decisions = sized + decisions
        scoring = None  # every choice is settled: its fp32 session and candidates go before the final build
        outcome = None
        if search is not None:
            graph, outcome, table = _search(model, specs, table, measured, data, cfg, search, calib_data,
                                            log or (lambda message: None), engine, progress)
        else:
            try:
                graph = quantize_model(model, table, cfg.quantization, table_path, allow_missing, data=calib_data,
                                       shared=shared)
            except MissingRanges as exc:
                if not own_table:
                    raise
                raise InternalError(f"the settled options plan tensors the job's own calibration left without a "
                                    f"range: {exc}") from exc
    settled, after = built(graph, cfg)
    decisions += after
    plan = graph.plan
    if outcome is not None:  # the search's float layers and range method replay as settled options
        decisions.append(Decision("quantization.advanced.float_nodes", outcome.float_layers, "mixed-precision search"))
        settled = apply(replace(settled, calibration=replace(settled.calibration, method=outcome.method)),
                        decisions[-1:])
    # how the table was made before what quantizing it did, then the decisions that compared candidates
    notes = tuple(dict.fromkeys([*table.notes, *graph.notes,
                                 *(d.note() for d in decisions if len(d.measured) > 1 or d.details)]))
    return QuantizeResult(graph.model, table, notes, len(plan.quantized_nodes), plan.int8_weights(),
                          len(plan.activations), len(plan.float_nodes), has_external_data(model), len(plan.embeddings),
                          outcome, tuple(decisions), settled, graph.kernels)


@reports_memory("evaluate it")
def evaluate(fp32: str | Path, int8: str | Path, data: DataLike, config: ConfigLike = None, *,
             labels: Optional[str] = None, table: str | Path | None = None,
             progress: bool = True, executor: Optional[Executor] = None) -> EvaluationReport:
    """fp32 and int8 side by side on `data`: task figures, fidelity, size, MACs, latency, and the
    verdicts of the config's thresholds (`report.passed`). labels: a label file or "folders"
    (folder data only); table: the int8 model's calibration table (for the sensitivity ranking);
    executor (else the config's `evaluation.dask`): where the batches and layers run, as for calibrate."""
    from qtool.evaluation.evaluate import EvaluateInputs, evaluate as run_evaluation  # not a quantize job's

    cfg = load_config(config)
    inputs = EvaluateInputs(Path(fp32), Path(int8), data, labels, Path(table) if table is not None else None)
    with _engine(executor, cfg.evaluation.dask, 1) as engine:
        return run_evaluation(inputs, cfg.preprocess, cfg.evaluation, cfg.quantization, progress, engine)


def _batch_sizes(model: str | Path, specs: list[InputSpec], data: DataLike, cfg: Config
                 ) -> tuple[DataLike, Config, list[Decision]]:
    """(data, cfg, decisions) with calibration.batch_size settled to 1 when the model refuses the
    configured batch on the first batch of the data (qtool.data.batching), and the evaluation's with
    it (the same graph)."""
    data, reason = _refusal(model, specs, data, cfg, cfg.calibration.batch_size)
    if reason is None:
        return data, cfg, []
    decisions = [Decision("calibration.batch_size", 1, _ONE_AT_A_TIME, details=(reason,)),
                 Decision("evaluation.batch_size", 1, "as calibration.batch_size")]
    return data, apply(cfg, decisions), decisions


def _search_batch_size(model: str | Path, specs: list[InputSpec], search: MixedPrecisionSearch, cfg: Config
                       ) -> tuple[MixedPrecisionSearch, Config, list[Decision]]:
    """The search's evaluation data and cfg with evaluation.batch_size settled as _batch_sizes does,
    on the evaluation data (nothing left to probe when calibration settled it)."""
    data, reason = _refusal(model, specs, search.data, cfg, cfg.evaluation.batch_size)
    search = replace(search, data=data)
    if reason is None:
        return search, cfg, []
    decision = Decision("evaluation.batch_size", 1, _ONE_AT_A_TIME, details=(f"on the evaluation data, {reason}",))
    return search, apply(cfg, [decision]), [decision]


_ONE_AT_A_TIME = "the model takes one sample at a time, not the batches its dynamic first axis declares"


def _refusal(model: str | Path, specs: list[InputSpec], data: DataLike, cfg: Config, size: int
             ) -> tuple[DataLike, Optional[str]]:
    """(data, why the model refuses batches of `size` samples of it: None when it does not); data
    read once (an iterator) comes back with its first samples read again."""
    if size <= 1:
        return data, None
    probe = data
    if isinstance(data, Iterator):
        probe = list(itertools.islice(data, LOOK_AHEAD * size))
        data = itertools.chain(probe, data)
    try:
        source = open_data(probe, specs, cfg.preprocess)
    except QtoolError:  # the data's own errors: reported where the job reads it, after the model's
        return data, None
    return data, batch_refusal(str(model), source, size)


def _calibration_batches(data: DataLike, specs: list[InputSpec], cfg: Config) -> Callable[[int], Iterable[Batch]]:
    """`n -> batches of at most n calibration samples`, read afresh on every call (bias correction,
    adaptive rounding and the search's all-int8 model each take their own pass)."""
    calib = cfg.calibration
    return lambda limit: batches(open_data(data, specs, cfg.preprocess), calib.batch_size,
                                 min(limit, calib.num_samples or limit))


def _search(model: str | Path, specs: list[InputSpec], table: CalibrationTable, measured: list[CalibrationTable],
            data: Optional[DataLike], cfg: Config, search: MixedPrecisionSearch,
            calib_data: Optional[Callable[[int], Iterable[Batch]]], log: Log, engine: Optional[Engine],
            progress: bool) -> tuple[QuantizedGraph, SearchOutcome, CalibrationTable]:
    """`measured`: tables of other range methods calibration already made from `data` (method auto)."""
    target = Target(search.agreement, search.top1_drop, search.sqnr, search.cosine)
    if not target.given():
        raise QtoolError("a mixed-precision search needs a target: agreement, top1_drop, sqnr or cosine")
    source = open_data(search.data, specs, cfg.preprocess)
    label_map = labels_for(source, search.labels) if search.labels else None
    eval_batches = list(batches(source, cfg.evaluation.batch_size, cfg.evaluation.num_samples))
    count = count_samples(source, None)
    count = sum(len(b) for b in eval_batches) if count is None else count
    methods = [m for m in dict.fromkeys(search.range_methods) if m != table.method]
    known = {t.method: t for t in measured}

    def alternatives() -> list[CalibrationTable]:
        missing = [m for m in methods if m not in known] if data is not None else []
        if missing:
            log(f"measuring {', '.join(missing)} ranges too (one calibration pass) ...")
            known.update((t.method, t) for t in calibrate_methods(model, data, cfg.preprocess, cfg.calibration,
                                                                  cfg.quantization, missing, progress, engine))
        return [known[m] for m in methods if m in known]

    log(f"searching the fewest float layers for {target.describe()} on {count} evaluation samples:")
    found = run_search(model, table, cfg.quantization, target, eval_batches, label_map, search.max_float_layers,
                       calib_data, min_int8_macs=search.min_int8_macs / 100.0, log=log, engine=engine,
                       alternatives=alternatives, int16=search.int16)
    chosen = found.chosen
    return chosen.result, SearchOutcome(tuple(chosen.float_layers), chosen.int8_mac_fraction, chosen.figures,
                                        tuple(chosen.dynamic_layers), found.table.method,
                                        tuple(chosen.int16_layers)), found.table
