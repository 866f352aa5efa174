"""How the measured choices score a candidate: the all-int8 model (ranges only: the data-driven
weight steps run once, on the choice) against fp32 on SAMPLES calibration samples spread over the
data, by the worst output's cosine; a distance in dB, the mean of -10 log10(1 - cosine) up to a
ceiling (qtool.evaluation.mixed_precision.cosine_db), so that a few samples a rounding moves a
lot do not carry the mean. On onnxruntime a candidate's Q/DQ pairs run as written, its other ops
in float: the grid it writes, which every CPU computes alike up to float last bits, where the
integer kernels requantize otherwise, and otherwise on ARM than on x86 (up to a dB on a
candidate), so that a choice does not go another way on another CPU. The choices of one job
share a Scoring: one evaluator, one prepared graph and plan for all their candidates, each
candidate built once and each distinct model measured once."""

from __future__ import annotations

import hashlib
from concurrent.futures import Future
from pathlib import Path
from typing import Callable, ContextManager, Iterable, Optional

import numpy as np
import onnx

from qtool.choices.speed import speed_rule
from qtool.config import Config, QuantizeConfig
from qtool.data.dataset import (Batch, DataLike, DataSource, MemorySource, batches, keeping_samples, open_data,
                                spread_samples)
from qtool.evaluation.macs import node_macs, sample_shapes
from qtool.evaluation.mixed_precision import Evaluator
from qtool.graph.modelio import InputSpec, input_specs, load_model
from qtool.graph.runtime import in_background
from qtool.quantization import run_check
from qtool.quantization.quantize import QuantizedGraph, SharedGraphs, build_options, quantize_model, ranges_only
from qtool.table.table import CalibrationTable, smoothed_options
from qtool.targets import target_of

SAMPLES = 16  # calibration samples the candidates are measured on
# ... and at most this many input values over them (16 images of 3 x 320 x 320): a candidate's
# run costs about what its activations hold, so large inputs (a detector at 960 px) are measured
# on fewer samples, and the choices cost about the same work whatever the input size
SCORED_VALUES = SAMPLES * 3 * 320 * 320
KEEP = 0.99  # a mean cosine at which the first candidate is kept without measuring the others
MARGIN_DB = 0.5  # what another candidate must gain over the first to be chosen
# a scored run (one batch of the samples through fp32 or a candidate) of this many MACs or more
# runs on SCORING_THREADS intra-op threads: smaller runs spend more on waking threads than they
# save. A fixed count, not the machine's cores, so that every machine computes the same figures.
PARALLEL_MACS = 5 * 10**8
SCORING_THREADS = 2
MAX_KEYED_BYTES = 2**31 - 1  # protobuf's message limit: larger candidates are measured without a key
KEPT_BUILD_BYTES = 2**28  # the candidates a job keeps built, in all (a later choice may ask for one again)


def scored_samples(model_path: str | Path, specs: list[InputSpec], data: DataLike, cfg: Config
                   ) -> tuple[list[Batch], int]:
    """(`SAMPLES` calibration samples spread over them, fewer when they hold more than SCORED_VALUES
    input values, in batches; the intra-op threads their runs take: scoring_threads). `specs`: the
    model's inputs."""
    source = _spread(specs, data, cfg)
    samples = list(batches(source, cfg.calibration.batch_size, SAMPLES))
    count = sum(len(b) for b in samples)
    values = sum(int(np.size(array)) for batch in samples for array in batch.feeds.values())
    if values > SCORED_VALUES and count > 1:
        fewer = max(1, SCORED_VALUES * count // values)
        source = spread_samples(open_data(data, specs, cfg.preprocess), cfg.calibration.num_samples, fewer)
        samples = list(batches(source, cfg.calibration.batch_size, fewer))
    return samples, scoring_threads(onnx.load(str(model_path), load_external_data=False), samples)


def _spread(specs: list[InputSpec], data: DataLike, cfg: Config) -> DataSource | MemorySource:
    """SAMPLES calibration samples spread over the data."""
    return spread_samples(open_data(data, specs, cfg.preprocess), cfg.calibration.num_samples, SAMPLES)


def evaluator(model_path: str | Path, samples: list[Batch], threads: int, cfg: Config) -> Evaluator:
    """The fidelity of a candidate int8 model to fp32 on `samples` (fp32 runs on them now)."""
    return Evaluator(Path(model_path), samples, None, threads, runtime=target_of(cfg.quantization).measured_on,
                     as_written=as_written(cfg))


def as_written(cfg: Config) -> bool:
    """Whether candidates run with their Q/DQ as written (on onnxruntime: the module docstring)."""
    return target_of(cfg.quantization).measured_on == "onnxruntime"


def scoring_threads(model: onnx.ModelProto, samples: list[Batch]) -> int:
    """SCORING_THREADS when the first scored batch's run holds PARALLEL_MACS or more (its
    Conv/Gemm/MatMul/recurrent MACs on the shapes of its first sample, times its samples), else 1."""
    if not samples:
        return 1
    first = samples[0]
    macs = sum(node_macs(model, sample_shapes(first.feeds)).values()) * len(first)
    return SCORING_THREADS if macs >= PARALLEL_MACS else 1


def figures(measured: dict) -> dict:
    """The figures a Decision records of one candidate."""
    return {"cosine_db": round(float(measured["cosine_db"]), 3), "cosine": round(float(measured["cosine"]), 5)}


class Scoring:
    """What the measured choices of one quantize job share: the fp32 outputs on the SAMPLES
    calibration samples (one Evaluator, made when first needed), the prepared graphs and plans of
    their candidates (`shared`, which the job's final build uses too), and the figures of each
    distinct candidate model (two choices may build the same one)."""

    def __init__(self, model_path: str | Path, data: DataLike, cfg: Config, shared: Optional[SharedGraphs] = None,
                 specs: Optional[list[InputSpec]] = None,
                 calib_data: Optional[Callable[[int], Iterable[Batch]]] = None):
        """`calib_data`: the job's calibration batches, which the candidates' run check runs on as
        the final build's does (the same fp32 outputs, computed once); None: made-up inputs."""
        self.model_path, self.data, self.cfg, self.calib_data = model_path, data, cfg, calib_data
        self.shared = shared if shared is not None else SharedGraphs()
        self._specs = specs
        self._evaluator: Optional[Evaluator] = None
        self._pending: Optional[Future] = None  # the Evaluator, made beside the first candidate's build
        self._samples: Optional[list[Batch]] = None
        self._threads = 0
        self._measured: dict[bytes, dict] = {}
        self._kept = run_check.Kept()  # the last built candidate's run-check session
        # (table, prepared graph, build_options, the candidate) of each candidate built
        self._built: list[tuple[CalibrationTable, object, tuple, QuantizedGraph]] = []
        self._built_bytes = 0

    def build(self, table: CalibrationTable, options: QuantizeConfig) -> QuantizedGraph:
        """The all-int8 candidate of `table` and `options` (ranges only), as quantize_model makes it;
        its run check's session is kept for scoring it next. A candidate built before is given
        again (a later choice measures the earlier ones' pick: the head tails, the chosen ranges)."""
        graph, self._kept = self._build(table, options)
        return graph

    def measured(self, pairs: list[tuple[CalibrationTable, QuantizeConfig]]) -> list[dict]:
        """The figures of the candidate of each (table, options), as build() then self() give them.
        Where a scored run takes one thread (scoring_threads), the first is built and scored on this
        thread while the background thread (in_background) builds and scores the others; where it
        takes more, each next candidate is built there while the one before is scored (_pipelined).
        onnxruntime leaves Python's lock while it loads and runs a candidate, so the two cores work
        at once. Each candidate is built and scored alone, on the scoring's threads, so the figures
        are the same either way."""
        self._read()  # the scoring's threads
        if len(pairs) < 2:
            return [self._measure(table, options) for table, options in pairs]
        if self._threads > 1:
            return self._pipelined(pairs)
        later = [in_background(self._measure, table, options) for table, options in pairs[1:]]
        return [self._measure(*pairs[0])] + [pending.result() for pending in later]

    def _pipelined(self, pairs: list[tuple[CalibrationTable, QuantizeConfig]]) -> list[dict]:
        """measured() where a scored run takes SCORING_THREADS: the candidates scored one after
        another on this thread, each next one built on the background thread meanwhile (a build is
        mostly Python on one core)."""
        scored, built = [], self._build(*pairs[0])
        for i in range(len(pairs)):
            following = in_background(self._build, *pairs[i + 1]) if i + 1 < len(pairs) else None
            graph, kept = built
            scored.append(self._figures(graph.model, kept.take(graph.model)))
            if following is not None:
                built = following.result()
        return scored

    def _measure(self, table: CalibrationTable, options: QuantizeConfig) -> dict:
        graph, kept = self._build(table, options)
        return self._figures(graph.model, kept.take(graph.model))

    def _build(self, table: CalibrationTable, options: QuantizeConfig) -> tuple[QuantizedGraph, run_check.Kept]:
        options = ranges_only(options)
        prepared = self.shared.graph(self.model_path, table, smoothed_options(options, table))
        # while the first candidate builds: fp32 on the run check's input (and the speed rule's
        # shapes on it), which its run check needs first, then on the scored samples
        self.shared.reference_soon(self.model_path, prepared.model, self.calib_data,
                                   dims=speed_rule(self.cfg.quantization) is not None)
        self._start()
        key = build_options(options)
        for made, graph_of, same, graph in self._built:
            if graph_of is prepared and same == key and (made is table or made == table):
                return graph, run_check.Kept()
        with run_check.keeping(self._threads, as_written(self.cfg)) as kept:  # the session it is scored on next
            graph = quantize_model(self.model_path, table, options, allow_missing=True,
                                   data=self.calib_data, shared=self.shared, candidate=True)
        size = graph.model.ByteSize() + (graph.canonical.ByteSize() if graph.canonical is not None else 0)
        if self._built_bytes + size <= KEPT_BUILD_BYTES:
            self._built.append((table, prepared, key, graph))
            self._built_bytes += size
        return graph, kept

    def keeping(self) -> ContextManager[None]:
        """Calibration reads the samples scored later first: within this, those of a folder are
        decoded once (qtool.data.dataset.keeping_samples), up to SCORED_VALUES input values (what
        the scoring reads)."""
        source = _spread(self._model_specs(), self.data, self.cfg)
        return keeping_samples(source.files if isinstance(source, DataSource) else [], SCORED_VALUES)

    @property
    def count(self) -> int:
        """Samples the candidates are measured on."""
        return sum(len(b) for b in self._read())

    def _read(self) -> list[Batch]:
        """The scored samples (read once, the threads their runs take set)."""
        if self._samples is None:
            self._samples, self._threads = scored_samples(self.model_path, self._model_specs(), self.data, self.cfg)
        return self._samples

    def _model_specs(self) -> list[InputSpec]:
        """The model's inputs: the job's, else read from the file once."""
        if self._specs is None:
            self._specs = input_specs(load_model(self.model_path))
        return self._specs

    def _start(self) -> None:
        """Start the fp32 runs on the scored samples in the background (qtool.graph.runtime.in_background):
        they run while the first candidate is built (onnxruntime leaves Python's lock while it runs)."""
        if self._pending is None:
            self._pending = in_background(evaluator, self.model_path, self._read(), self._threads, self.cfg)

    def _ready(self) -> Evaluator:
        if self._evaluator is None:
            self._start()
            self._evaluator = self._pending.result()
        return self._evaluator

    def __call__(self, qmodel: onnx.ModelProto) -> dict:
        """The figures of `qmodel` against fp32 (Evaluator's)."""
        return self._figures(qmodel, self._kept.take(qmodel))

    def _figures(self, qmodel: onnx.ModelProto, session) -> dict:
        evaluate = self._ready()
        if qmodel.ByteSize() > MAX_KEYED_BYTES:  # no serialising a model protobuf cannot hold in one message
            return evaluate(qmodel, session)[0]
        key = hashlib.sha256(qmodel.SerializeToString()).digest()
        if key not in self._measured:
            self._measured[key] = evaluate(qmodel, session)[0]
        return self._measured[key]
