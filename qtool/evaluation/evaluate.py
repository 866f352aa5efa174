"""Evaluation: fp32 and int8 side by side on the same data -> an EvaluationReport.

Both models see exactly the same batches: per-output fidelity for every model, plus the
task's figures (classification: accuracy, agreement, KL; detection: int8 boxes matched
to fp32 boxes). Latency is measured afterwards on one batch, warm-up first, then the
two models alternate run by run in this process so that a noisy neighbour slows both
alike; medians and p90 are reported. The per-layer error and the one-layer-at-a-time
sensitivity run on the first `layer_samples` samples. Threshold verdicts come last.
"""

from __future__ import annotations

import itertools
import os
import time
import warnings
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Optional

import onnx
import onnxruntime as ort

from qtool import __version__
from qtool.config import DetectionConfig, EvaluateConfig, PreprocessConfig, QuantizeConfig, load_section
from qtool.data.batching import batch_refusal
from qtool.data.dataset import Batch, DataLike, batches, check_shippable, count_samples, open_data
from qtool.errors import QtoolError
from qtool.data.labels import Labels, labels_for
from qtool.evaluation import openvino_runtime, shards
from qtool.evaluation.latency import measure_latency
from qtool.evaluation.layer_error import layer_errors, twins, worst
from qtool.evaluation.macs import int8_macs, sample_shapes
from qtool.evaluation.metrics import FidelityAccumulator
from qtool.evaluation.task import Task, compare_batch, resolve_task
from qtool.graph.executor import Engine
from qtool.graph.modelio import external_files, input_specs, load_model, output_names
from qtool.graph.index import scoped_nodes
from qtool.quantization.rewrite import DQ_SUFFIX
from qtool.graph.runtime import create_session, exact_int8_products, tensor_dims
from qtool.progress import bar as progress_bar
from qtool.evaluation.report import EvaluationReport
from qtool.evaluation.sensitivity import layer_sensitivity
from qtool.table.table import load_table, smoothed_options
from qtool.evaluation.thresholds import check_thresholds


@dataclass(frozen=True)
class EvaluateInputs:
    fp32: Path
    int8: Path
    data: DataLike  # a folder, or samples in memory (dataset.open_data)
    labels: Optional[str] = None  # a label file, or "folders"
    table: Optional[Path] = None  # the calibration table: needed by the sensitivity ranking


def _check_requests(inputs: EvaluateInputs, cfg: EvaluateConfig) -> None:
    """Fail before the long run when a requested figure cannot be computed."""
    if cfg.max_top1_drop is not None and not inputs.labels:
        raise QtoolError("max_top1_drop (--max-top1-drop) needs labels (--labels)")
    if cfg.sensitivity and inputs.table is None:
        raise QtoolError("the sensitivity ranking (--sensitivity) re-quantizes one layer at a time and needs the "
                         "calibration table the int8 model was made from (--table)")
    if cfg.min_texts_kept is not None and cfg.task != "ctc":
        raise QtoolError(f"min_texts_kept (--min-texts-kept) is a figure of --task ctc, not {cfg.task}")
    if cfg.task_config and cfg.task != "detection":
        raise QtoolError(f"a task config (--task-config) is for --task detection, not {cfg.task}")
    if cfg.runtime == "openvino":
        openvino_runtime.require()
        if cfg.dask:
            raise QtoolError("--runtime openvino measures in this process: drop --dask")


def evaluate(inputs: EvaluateInputs, preprocess: PreprocessConfig, cfg: EvaluateConfig,
             quantization: QuantizeConfig = QuantizeConfig(), progress: bool = True,
             engine: Optional[Engine] = None) -> EvaluationReport:
    """The whole report: task figures, per-output fidelity, size, MACs, latency, optional
    per-layer error and sensitivity, and the threshold verdicts. With an engine, the data's
    batches, the latency and the sensitivity's layers run on its workers (qtool.evaluation.shards)."""
    _check_requests(inputs, cfg)
    detection = detection_config(cfg)
    fp32_model, int8_model, specs, outputs = open_models(inputs, cfg)
    source = open_data(inputs.data, specs, preprocess)
    if engine is not None:
        check_shippable(source, "evaluation on workers (--dask, executor=)")
    cfg = per_sample_if_quantized_at_run_time(int8_model, runnable_batch_size(inputs.fp32, source, cfg))
    labels = labels_for(source, inputs.labels) if inputs.labels else None
    if engine is None:
        run = _compare(inputs, source, labels, outputs, cfg, detection, progress)
        latency = measure_latency(str(inputs.fp32), str(inputs.int8), run.first_batch, cfg) \
            if cfg.runtime == "onnxruntime" else openvino_runtime.measure_latency(
                inputs.fp32, inputs.int8, run.first_batch.feeds, cfg.threads, cfg.warmup, cfg.runs)
    else:
        run = _compare_on(engine, inputs, source, labels, outputs, cfg, detection, progress)
        latency = shards.latency_on(engine, inputs.fp32, inputs.int8, source, run.first_batch, cfg)
    per_layer = _per_layer(inputs, fp32_model, int8_model, run.subset, engine, source, cfg.batch_size, progress) \
        if cfg.per_layer else None
    sensitivity = _sensitivity(inputs, quantization, run.subset, progress, engine, source, cfg.batch_size) \
        if cfg.sensitivity else None
    return build_report(inputs, int8_model, source.root is not None, run.task, run.fidelity, run.samples,
                        _sample_dims(int8_model, run.first_batch.feeds), latency, cfg, per_layer, sensitivity)


def _sample_dims(int8: onnx.ModelProto, feeds: dict) -> dict:
    """Every tensor's dims for one sample of the first batch: the inputs', and the others' from
    inference and, where it leaves them open, a run of the int8 model (tensor_dims)."""
    return {**sample_shapes(feeds), **tensor_dims(int8, feeds)}


def runnable_batch_size(fp32: Path, source, cfg: EvaluateConfig) -> EvaluateConfig:
    """cfg with batch_size 1, and a warning saying why, when the fp32 model refuses the configured
    batch on the first batch of the data (qtool.data.batching)."""
    reason = batch_refusal(str(fp32), source, cfg.batch_size) if cfg.batch_size > 1 else None
    if reason is None:
        return cfg
    warnings.warn(f"evaluating one sample at a time: the model does not take the batches its "
                  f"dynamic first axis declares: {reason}", stacklevel=2)
    return replace(cfg, batch_size=1)


# ops that quantize an activation at run time with one range over the whole tensor, batch included
RUN_TIME_RANGES = ("DynamicQuantizeLinear", "DynamicQuantizeMatMul", "DynamicQuantizeLSTM")


def per_sample_if_quantized_at_run_time(int8: onnx.ModelProto, cfg: EvaluateConfig) -> EvaluateConfig:
    """cfg with batch_size 1, and a warning saying why, when the int8 model quantizes activations at
    run time: their range spans the batch, so in a batch of several a sample's int8 output would
    depend on the samples beside it, and the figures would not be those of any one input."""
    if cfg.batch_size == 1:
        return cfg
    found = sorted({n.op_type for n in scoped_nodes(int8.graph) if n.op_type in RUN_TIME_RANGES})
    if not found:
        return cfg
    warnings.warn(f"evaluating one sample at a time: the int8 model quantizes activations at run time "
                  f"({', '.join(found)}) with one range per batch, so batched samples would change each "
                  f"other's int8 outputs", stacklevel=2)
    return replace(cfg, batch_size=1)


def detection_config(cfg: EvaluateConfig) -> DetectionConfig:
    return load_section(DetectionConfig, cfg.task_config) if cfg.task_config else DetectionConfig()


def open_models(inputs: EvaluateInputs, cfg: EvaluateConfig) -> tuple[onnx.ModelProto, onnx.ModelProto, list, list]:
    """(fp32 model, int8 model, their input specs, their output names), checked to be comparable."""
    fp32_model = load_model(inputs.fp32)
    int8_model = load_model(inputs.int8)
    if cfg.per_layer and not twins(fp32_model, int8_model):
        raise QtoolError(f"no DequantizeLinear output of the int8 model is named <fp32 tensor>{DQ_SUFFIX} and no "
                         "dynamic int8 MatMul output keeps an fp32 tensor's name, so the per-layer error cannot "
                         "pair its tensors with the fp32 model's", inputs.int8)
    specs = input_specs(fp32_model)
    if [s.name for s in input_specs(int8_model)] != [s.name for s in specs]:
        raise QtoolError("the int8 model's inputs differ from the fp32 model's", inputs.int8)
    outputs = output_names(fp32_model)
    if output_names(int8_model) != outputs:
        raise QtoolError("the int8 model's outputs differ from the fp32 model's", inputs.int8)
    return fp32_model, int8_model, specs, outputs


def build_report(inputs: EvaluateInputs, int8_model: onnx.ModelProto, folder: bool, task: Task,
                 fidelity: dict[str, FidelityAccumulator], samples: int, shapes: dict, latency: dict,
                 cfg: EvaluateConfig, per_layer: Optional[dict] = None,
                 sensitivity: Optional[dict] = None) -> EvaluationReport:
    """The report of the merged figures (`shapes`: one sample's tensor dims, for the MACs),
    with the threshold verdicts."""
    sizes = {"fp32": _size(inputs.fp32), "int8": _size(inputs.int8)}
    macs = int8_macs(int8_model, shapes)
    report = EvaluationReport(
        qtool_version=__version__,
        onnxruntime_version=ort.__version__,
        runtime=_runtime(cfg.runtime, int8_model),
        task=task.name,
        models={name: {"path": str(path), "size_bytes": sizes[name]}
                for name, path in (("fp32", inputs.fp32), ("int8", inputs.int8))},
        data={"path": str(inputs.data) if folder else None, "samples": samples, "labels": inputs.labels},
        outputs={name: acc.result() for name, acc in fidelity.items()},
        task_figures=task.result(),
        size={"fp32_bytes": sizes["fp32"], "int8_bytes": sizes["int8"], "ratio": sizes["fp32"] / max(1, sizes["int8"])},
        macs={"total": macs.total, "int8": macs.int8, "int8_fraction": macs.fraction,
              "int8_nodes": macs.int8_nodes, "counted_nodes": macs.counted_nodes},
        latency=latency,
        per_layer=per_layer,
        sensitivity=sensitivity)
    verdicts = check_thresholds(report, cfg)
    return replace(report, thresholds=tuple(verdicts), passed=all(v.passed for v in verdicts))


def _runtime(name: str, int8_model: onnx.ModelProto) -> dict:
    """The report's runtime section: its name and version, and what this CPU changes in its int8
    arithmetic (onnxruntime: exact products without VNNI; OpenVINO: codes it loses at a Concat)."""
    if name == "onnxruntime":
        return {"name": name, "version": ort.__version__, "exact_int8_products": exact_int8_products()}
    return {"name": name, "version": openvino_runtime.version(),
            "int8_codes_lost_at_concat": openvino_runtime.codes_lost_at_concat(int8_model)}


@dataclass
class _Comparison:
    task: Task
    fidelity: dict[str, FidelityAccumulator]
    samples: int
    first_batch: Batch  # timed for latency
    subset: list[Batch]  # the first layer_samples samples, for the per-layer runs


def _compare(inputs: EvaluateInputs, source, labels: Optional[Labels], outputs: list[str], cfg: EvaluateConfig,
             detection: DetectionConfig, progress: bool) -> _Comparison:
    """Both models over the data, batch by batch: per-output fidelity and the task's figures."""
    if cfg.runtime == "openvino":  # OpenVINO's default inference precision, as deployed
        openvino_runtime.check_compiles(inputs.fp32, inputs.int8)
        fp32, int8 = (openvino_runtime.CompiledModel(p, cfg.threads) for p in (inputs.fp32, inputs.int8))
    else:
        fp32 = create_session(str(inputs.fp32), label=str(inputs.fp32))
        int8 = create_session(str(inputs.int8), label=str(inputs.int8))
    fidelity = {name: FidelityAccumulator() for name in outputs}
    run: Optional[_Comparison] = None
    wanted = cfg.layer_samples if cfg.per_layer or cfg.sensitivity else 0
    total = count_samples(source, cfg.num_samples)
    seen = 0
    with progress_bar("evaluating", "sample", total, progress) as bar:
        for batch in batches(source, cfg.batch_size, cfg.num_samples):
            ref = fp32.run(outputs, batch.feeds)
            test = int8.run(outputs, batch.feeds)
            if run is None:
                run = _Comparison(resolve_task(cfg, outputs, ref[0], detection), fidelity, total, batch, [])
            compare_batch(run.task, fidelity, outputs, batch, ref, test, labels)
            kept = sum(len(b) for b in run.subset)
            if kept < wanted:
                run.subset.append(_head(batch, wanted - kept))
            bar.update(len(batch))
            seen += len(batch)
    if total is None:  # in-memory data of unknown length: the samples read
        run.samples = seen
    return run


def _compare_on(engine: Engine, inputs: EvaluateInputs, source, labels: Optional[Labels], outputs: list[str],
                cfg: EvaluateConfig, detection: DetectionConfig, progress: bool) -> _Comparison:
    """_compare's figures from the engine's workers; the first batch and the per-layer subset read here."""
    task, fidelity = shards.compare_on(engine, inputs.fp32, inputs.int8, source, labels, outputs, cfg, detection,
                                       progress)
    wanted = cfg.layer_samples if cfg.per_layer or cfg.sensitivity else 0
    head = batches(source, cfg.batch_size, cfg.num_samples)
    run = _Comparison(task, fidelity, count_samples(source, cfg.num_samples), next(head), [])
    for batch in itertools.chain([run.first_batch], head):
        kept = sum(len(b) for b in run.subset)
        if kept >= wanted:
            break
        run.subset.append(_head(batch, wanted - kept))
    return run


def _head(batch: Batch, count: int) -> Batch:
    if len(batch) <= count:
        return batch
    return Batch(batch.keys[:count], {name: array[:count] for name, array in batch.feeds.items()})


def _per_layer(inputs: EvaluateInputs, fp32_model, int8_model, subset: list[Batch], engine: Optional[Engine],
               source, batch_size: int, progress: bool) -> dict:
    start = time.perf_counter()
    if engine is not None:
        errors = shards.per_layer_on(engine, inputs.fp32, inputs.int8, fp32_model, int8_model, source, subset,
                                     batch_size, progress)
    else:
        errors = layer_errors(fp32_model, int8_model, subset)
    return {"samples": sum(len(b) for b in subset), "seconds": time.perf_counter() - start,
            "tensors": [asdict(e) for e in errors], "worst": [e.tensor for e in worst(errors)]}


def _sensitivity(inputs: EvaluateInputs, quantization: QuantizeConfig, subset: list[Batch], progress: bool,
                 engine: Optional[Engine], source, batch_size: int) -> dict:
    start = time.perf_counter()
    table = load_table(inputs.table)
    # the table's SmoothQuant scales, with its alpha: evaluate has no --smooth-quant of its own
    quantization = smoothed_options(replace(quantization, smooth_quant=table.settings.get("smooth_quant")), table)
    if engine is not None:
        ranking = shards.sensitivity_on(engine, inputs.fp32, table, quantization, source, subset, batch_size,
                                        progress)
    else:
        with progress_bar("one layer at a time", "layer", None, progress) as bar:
            ranking = layer_sensitivity(inputs.fp32, table, quantization, subset,
                                        on_layer=lambda layer: bar.update())
    return {"samples": sum(len(b) for b in subset), "seconds": time.perf_counter() - start,
            "table": str(inputs.table), "layers": [asdict(r) for r in ranking]}


def _size(path: Path) -> int:
    """The model file and the external data files it names."""
    return os.path.getsize(path) + sum(os.path.getsize(f) for f in external_files(path))
