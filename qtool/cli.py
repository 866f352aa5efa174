"""Command line: parse options, check their combinations, call the API (qtool.api), print, exit.

No quantization logic here: a job the CLI runs is one call of the API (sharded calibration,
table conversion and the integer tools call their stage modules, which are folder-based).
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import sys
import time
import traceback
import warnings
from dataclasses import replace
from pathlib import Path
from typing import Optional

import click

from qtool import __version__

from qtool import interrupt, progress
from qtool.atomic import check_output_path, write_text
from qtool.config import TASKS, load_config, override
from qtool.errors import EXIT_BUG, EXIT_THRESHOLD, QtoolError, allocation_failure, not_enough_memory
from qtool.targets import TARGETS


def _show_warning(message, category, filename, lineno, file=None, line=None):
    progress.write(f"warning: {message}")  # below a progress bar being drawn, on a line of its own


def _command(func):
    """Run a command body: user errors become one line and an exit code, bugs a short note.
    The one place exceptions become exit codes: QtoolError its own (2, 1), running out of
    memory 2, an interrupt 130/143, anything else 3."""

    @functools.wraps(func)
    def wrapper(*args, **kwargs):
        debug = click.get_current_context().find_root().params.get("debug", False)
        warnings.showwarning = _show_warning
        progress.thread_lock()
        try:
            with interrupt.signals_raise():
                return func(*args, **kwargs)
        except QtoolError as exc:
            if debug:
                traceback.print_exc()
            click.echo(f"error: {exc}", err=True)
            sys.exit(exc.exit_code)
        except click.ClickException:
            raise  # usage errors: click prints them and exits 2
        except (KeyboardInterrupt, interrupt.Terminated) as exc:
            output = _output_file(click.get_current_context())
            if output is not None and interrupt.was_committed(output):  # nothing was lost: done
                click.echo(f"interrupted after the output was written whole: {output}", err=True)
                sys.exit(0)
            sigint = isinstance(exc, KeyboardInterrupt)
            click.echo("interrupted" if sigint else "terminated", err=True)
            sys.exit(interrupt.EXIT_SIGINT if sigint else interrupt.EXIT_SIGTERM)
        except Exception as exc:  # a bug in qtool: say so briefly, traceback with --debug
            if debug:
                traceback.print_exc()
            if allocation_failure(exc):  # the machine's memory, not a bug (the API's jobs say so themselves)
                context = click.get_current_context()
                error = not_enough_memory(exc, _input_file(context), f"run {context.info_name} on it")
                click.echo(f"error: {error}", err=True)
                sys.exit(error.exit_code)
            click.echo(f"internal error: {type(exc).__name__}: {exc} (run with --debug for the traceback)", err=True)
            sys.exit(EXIT_BUG)

    return wrapper


def _input_file(context: click.Context) -> Optional[Path]:
    """The model (or table) a command works on, for an error about the whole run."""
    for name in ("model", "fp32_model", "int8_model", "table_in"):
        if context.params.get(name) is not None:
            return context.params[name]
    return None


def _output_file(context: click.Context) -> Optional[Path]:
    """The file a command writes last (-o), whose being in place means the command is done."""
    return context.params.get("output") or context.params.get("shard_output")


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="qtool")
@click.option("--debug", is_flag=True, help="Show tracebacks for errors.")
def main(debug: bool) -> None:
    """Post-training int8 quantization of ONNX models: calibrate, quantize, search, evaluate."""


def entry() -> None:
    """The `qtool` command (and `python -m qtool`): main(), then the process ends at once with its
    exit code. A command has written, closed and synced everything it writes when main() returns,
    so Python's teardown (freeing every object, closing onnxruntime's sessions and threads one by
    one) would only delay the exit; the output streams are flushed first. Tests call main()
    (click's runner), which returns as any function does."""
    try:
        main()
        code = 0
    except SystemExit as done:
        code = done.code
    if code is None:
        code = 0
    elif not isinstance(code, int):  # sys.exit("message"): Python prints it and exits 1
        print(code, file=sys.stderr)
        code = 1
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError):  # a closed pipe: what is lost is lost either way
            stream.flush()
    os._exit(code)


def _existing(kind: str):
    return click.Path(exists=False, dir_okay=(kind == "dir"), path_type=Path)


config_option = click.option("--config", "config_path", type=click.Path(path_type=Path),
                             help="YAML config (preprocess, calibration, quantization, evaluation sections).")
data_option = click.option("--data", type=click.Path(path_type=Path),
                           help="Folder of images (.jpg/.png/.bmp) or of .npy/.npz tensors, one sample per file.")


dask_option = click.option(
    "--dask", metavar="ADDRESS|local[:N]",
    help="Run the shards on a Dask cluster: a scheduler address (tcp://host:8786), or local:N for N "
         "single-threaded worker processes here (needs: pip install \"qtool[dask]\"; docs/scale-out.md).")


def _calibration_options(func):
    for option in reversed([
        click.option("--num-samples", type=click.IntRange(min=1), help="Use at most this many samples."),
        click.option("--batch-size", type=click.IntRange(min=1), help="Samples per batch (dynamic-batch models)."),
        click.option("--method", type=str, help="Range method: auto (the default: minmax, mse and percentile "
                                                "measured on the data, the closest to fp32 kept), minmax, "
                                                "percentile, entropy, mse, aciq."),
        click.option("--workers", type=click.IntRange(min=1),
                     help="onnxruntime sessions in separate processes over shards of the data."),
        dask_option,
        click.option("--activation-dtype", type=click.Choice(["uint8", "int8"]), help="Activation integer type."),
        click.option("--keep-opset", is_flag=True, default=None,
                     help="Never convert a model older than opset 13 (converted with onnx's version converter by "
                          "default): per-tensor weights at opset 10-12, an error below 10."),
    ]):
        func = option(func)
    return func


def _names(values: tuple[str, ...]) -> Optional[tuple[str, ...]]:
    """Repeated and/or comma-separated CLI values; None when the flag was not given."""
    names = tuple(n.strip() for v in values for n in v.split(",") if n.strip())
    return names or None


def _target_options(func):
    """Options that shape the quantization plan, so calibrate and quantize both take them."""
    for option in reversed([
        click.option("--target", type=click.Choice(list(TARGETS)),
                     help="Runtime preset (default ort-cpu); options given explicitly override it one by one."),
        click.option("--reduce-range", is_flag=True, default=None, help="7-bit weights (x86 CPUs without VNNI)."),
        click.option("--exclude-op-types", multiple=True, metavar="OPS",
                     help="Keep these op types in float (comma-separated or repeated), e.g. Softmax,Sigmoid."),
        click.option("--exclude-nodes", multiple=True, metavar="NAMES",
                     help="Keep these nodes in float: names or glob patterns (comma-separated or repeated)."),
        click.option("--matmul", type=click.Choice(["auto", "static", "dynamic"]),
                     help="MatMul/Gemm with a constant weight: static int8 (calibrated Q/DQ), or dynamic (int8 "
                          "weights, activations quantized at run time, every other node float); auto, the default: "
                          "dynamic for graphs with LayerNorm, attention or recurrent layers (also onnxruntime's fused "
                          "ones) and at most one Conv per two weighted MatMul/Gemm (a stem, kept float), with target "
                          "ort-cpu."),
        click.option("--smooth-quant", "smooth_quant", type=click.FloatRange(0, 1), metavar="ALPHA",
                     help="SmoothQuant: move per-channel activation ranges of LayerNorm/linear outputs into the "
                          "MatMul/Gemm weights reading them, measured on the calibration data (exact in fp32; "
                          "0.5 is usual; default off; quantize --table: the alpha the table records)."),
    ]):
        func = option(func)
    return func


def _stage_configs(config_path, num_samples, batch_size, method, activation_dtype, keep_opset,
                   workers=None, dask=None, target=None, reduce_range=None, exclude_op_types=(), exclude_nodes=(),
                   matmul=None, smooth_quant=None):
    """The config file with the calibration and quantization flags applied over it."""
    cfg = load_config(config_path)
    calib = override(cfg.calibration, num_samples=num_samples, batch_size=batch_size, method=method,
                     workers=workers, dask=dask)
    quant = override(cfg.quantization, activation_dtype=activation_dtype, keep_opset=keep_opset, target=target,
                     reduce_range=reduce_range, exclude_op_types=_names(exclude_op_types),
                     exclude_nodes=_names(exclude_nodes), matmul=matmul, smooth_quant=smooth_quant)
    return replace(cfg, calibration=calib, quantization=quant)


@main.command()
@click.argument("model", type=click.Path(path_type=Path))
@data_option
@config_option
@_calibration_options
@_target_options
@click.option("-o", "--output", type=click.Path(path_type=Path), required=True,
              help="Calibration table to write (with --shard: the shard's statistics file, .npz).")
@click.option("--format", "table_format", default="qtool", show_default=True, metavar="FORMAT",
              help="Table format to write: qtool, tensorrt, tengine, tpu-mlir, ncnn, amct, amct-binary, onnxruntime.")
@click.option("--shard", metavar="K/N", help="Only shard K of N (0-based) of the data; write its statistics to -o.")
@click.option("--merge", "merge", is_flag=True, help="Merge the statistics FILES of shards into the table -o.")
@click.argument("stats_files", nargs=-1, type=click.Path(path_type=Path))
@_command
def calibrate(model, data, config_path, num_samples, batch_size, method, workers, dask, activation_dtype, keep_opset,
              target, reduce_range, exclude_op_types, exclude_nodes, matmul, smooth_quant, output,
              table_format, shard, merge, stats_files):
    """Run calibration data through MODEL and write a calibration table.

    \b
    Sharded:  qtool calibrate MODEL --data D --shard 0/2 -o s0.npz   (and 1/2 -> s1.npz)
              qtool calibrate MODEL --merge s0.npz s1.npz -o table.json
    """
    from qtool import api
    from qtool.table.formats import get_format, write_table
    from qtool.calibration.calibrate import calibrate_shard, merge_tables
    from qtool.calibration.shards import parse_shard
    from qtool.graph.executor import open_engine

    if stats_files and not merge:
        raise click.UsageError(f"unexpected argument '{stats_files[0]}' (statistics files go with --merge)")
    if merge and (not stats_files or data is not None or shard):
        raise click.UsageError("--merge takes statistics FILES, without --data or --shard")
    if not merge and data is None:
        raise click.UsageError("--data is required")
    check_output_path(output, model)
    cfg = _stage_configs(config_path, num_samples, batch_size, method, activation_dtype, keep_opset,
                         workers, dask, target, reduce_range, exclude_op_types, exclude_nodes, matmul, smooth_quant)
    calib, quant = cfg.calibration, cfg.quantization
    start = time.perf_counter()
    if shard:
        k, n = parse_shard(shard)
        with open_engine(calib.dask, calib.workers) as engine:
            count, samples = calibrate_shard(model, data, cfg.preprocess, calib, quant, (k, n), output, engine)
        click.echo(f"shard {k}/{n}: statistics of {count} tensors on {samples} samples in "
                   f"{time.perf_counter() - start:.1f} s -> {output}")
        return
    get_format(table_format)
    if merge:
        table = merge_tables(model, list(stats_files), calib, quant)
    else:
        table = api.calibrate(model, data, cfg)
    if table.smoothing and table_format != "qtool":
        raise click.UsageError("a SmoothQuant table holds its smoothing scales: write it in the qtool format")
    write_table(table, output, table_format, model, quant)
    for note in table.notes:
        click.echo(f"note: {note}", err=True)
    click.echo(f"calibrated {len(table.tensors)} tensors on {table.num_samples} samples "
               f"({table.method}) in {time.perf_counter() - start:.1f} s -> {output} ({table_format})")


class _GroupedCommand(click.Command):
    """A command whose --help lists its options under headings: GROUPS maps an option's name to its
    heading, in the order the headings print (click has no option groups of its own)."""

    GROUPS = {
        "Input": ("table_path", "table_format", "data", "config_path", "allow_missing"),
        "Calibration": ("num_samples", "batch_size", "method", "workers", "dask"),
        "Target and precision": ("target", "activation_dtype", "reduce_range", "keep_opset", "exclude_op_types",
                                 "exclude_nodes", "int16_activations", "matmul"),
        "Data-driven steps": ("smooth_quant", "equalize", "bias_correction", "weight_rounding", "latency_aware"),
        "Outputs": ("output", "save_table", "save_config", "json_path"),
        "Search (the fewest layers in float that meet a target)": (
            "eval_data", "labels", "target_agreement", "target_top1_drop", "target_sqnr", "target_cosine",
            "max_float_layers", "min_int8_macs", "search_int16", "search_ranges"),
    }

    def format_options(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        place = {name: (heading, i) for heading, names in self.GROUPS.items() for i, name in enumerate(names)}
        rows: dict[str, list[tuple[int, tuple[str, str]]]] = {heading: [] for heading in [*self.GROUPS, "Other"]}
        for param in self.get_params(ctx):
            record = param.get_help_record(ctx) if isinstance(param, click.Option) else None
            if record is not None:
                heading, i = place.get(param.name, ("Other", 0))
                rows[heading].append((i, record))
        for heading, records in rows.items():
            if records:
                with formatter.section(heading):
                    formatter.write_dl([record for _, record in sorted(records, key=lambda r: r[0])])


def _quantize_options(func):
    """The options of a quantization job, shared by quantize and search: model, table or data,
    config, calibration, target and precision, the data-driven steps, outputs."""
    for option in reversed([
        click.argument("model", type=click.Path(path_type=Path)),
        click.option("--table", "table_path", type=click.Path(path_type=Path),
                     help="Calibration table to use, in any supported format (detected from its content)."),
        click.option("--table-format", metavar="FORMAT", help="Read --table as this format instead of detecting it."),
        data_option,
        config_option,
        click.option("--allow-missing", is_flag=True, help="Keep tensors the table lacks in float instead of failing."),
        _calibration_options,
        _target_options,
        click.option("--int16-activations", multiple=True, metavar="NAMES",
                     help="Quantize these activation tensors (names or glob patterns; comma-separated or repeated) "
                          "to 16 bits over their calibrated ranges; onnxruntime runs their readers and writers in "
                          "float."),
        click.option("--equalize", is_flag=True, default=None,
                     help="Cross-layer equalization of Conv->Relu/ReLU6->Conv weights before calibration (exact in "
                          "fp32)."),
        click.option("--bias-correction", type=click.Choice(["auto", "weights", "fast", "off"]),
                     help="Correct int32 biases for the mean output shift of rounding: weights (each layer's shift "
                          "from its int8 weights, on the channel means calibration measured; no extra pass), fast "
                          "(the shift the --data samples agree on, measured on them: a pass of each model), off, or "
                          "auto (the default: the target's rule, off on ort-cpu, measured with --data on openvino)."),
        click.option("--weight-rounding", type=click.Choice(["auto", "nearest", "adaptive"]),
                     help="Weight rounding: nearest, or adaptive (each weight down or up for the least layer "
                          "output error on calibration inputs; auto: adaptive when --data is given; default nearest)."),
        click.option("--latency-aware", "latency_aware", is_flag=True, default=None,
                     help="Opt-in tuning: time candidates on this machine and keep float the nodes onnxruntime runs "
                          "faster in float (the outcome depends on the machine: save it with --save-config)."),
        click.option("-o", "--output", type=click.Path(path_type=Path), required=True, help="Int8 QDQ model to write."),
        click.option("--save-table", type=click.Path(path_type=Path), help="With --data: also write the table."),
        click.option("--save-config", type=click.Path(path_type=Path),
                     help="Also write the settled config (every auto replaced by its value): quantize with it to "
                          "replay this model without measuring."),
        click.option("--json", "json_path", type=click.Path(path_type=Path),
                     help="Write the summary, notes and decisions as JSON."),
    ]):
        func = option(func)
    return func


def _search_options(func):
    for option in reversed([
        click.option("--eval-data", type=click.Path(path_type=Path), required=True,
                     help="Evaluation data the targets are verified on (as --data: a folder of samples)."),
        click.option("--labels", type=str, help="Labels of --eval-data ('filename<TAB>class_index' file, or "
                                                "'folders')."),
        click.option("--target-agreement", type=click.FloatRange(0, 100),
                     help="Keep the fewest sensitive layers float so top-1 agreement with fp32 reaches this "
                          "percent."),
        click.option("--target-top1-drop", type=click.FloatRange(min=0),
                     help="... so top-1 drops by at most this many points (needs --labels)."),
        click.option("--target-sqnr", type=float, help="... so every output's SQNR reaches this many dB."),
        click.option("--target-cosine", type=click.FloatRange(-1, 1),
                     help="... so the mean over samples of the worst output's cosine to fp32 reaches this "
                          "(models without labels or classes)."),
        click.option("--max-float-layers", type=click.IntRange(min=0), default=10, show_default=True,
                     help="Layer budget; exit 1 when the target needs more."),
        click.option("--min-int8-macs", type=click.FloatRange(0, 100), default=0.0, show_default=True,
                     help="MAC budget: at least this percent of the MACs stays int8."),
        click.option("--search-int16", is_flag=True,
                     help="Also offer a layer's activations in 16 bits (weights int8) as a move; off by default: "
                          "onnxruntime's CPU provider runs such layers in float, slower than float alone."),
        click.option("--search-ranges", default="percentile,mse", show_default=True, metavar="METHODS",
                     help="Range methods also measured (one more calibration pass) when the all-int8 model misses "
                          "the target; the search starts from the closest ('none': --method only)."),
    ]):
        func = option(func)
    return func


def _quantize_job(options: dict, search=None) -> None:
    """Quantize MODEL as the options say (and with `search`, qtool.api.search), write the outputs, print."""
    from qtool import api
    from qtool.graph.executor import open_engine
    from qtool.graph.kernels import kernel_summary
    from qtool.quantization.quantize import needs_data
    from qtool.graph.runtime import cpu_has_vnni
    from qtool.targets import describe as describe_target, vnni_warning

    o = options
    model, table_path, data, output = o["model"], o["table_path"], o["data"], o["output"]
    cfg = _stage_configs(o["config_path"], o["num_samples"], o["batch_size"], o["method"], o["activation_dtype"],
                         o["keep_opset"], o["workers"], o["dask"], o["target"], o["reduce_range"],
                         o["exclude_op_types"], o["exclude_nodes"], o["matmul"], o["smooth_quant"])
    quant = override(cfg.quantization, equalize=o["equalize"], bias_correction=o["bias_correction"],
                     weight_rounding=o["weight_rounding"], int16_activations=_names(o["int16_activations"]),
                     advanced=override(cfg.quantization.advanced,
                                       latency_aware="on" if o["latency_aware"] else None))
    cfg = replace(cfg, quantization=quant)
    if (table_path is None and data is None) or (table_path is not None and data is not None and not needs_data(quant)):
        raise click.UsageError("give exactly one of --table TABLE or --data PATH (both only when --data feeds "
                               "bias correction or adaptive rounding)")
    check_output_path(output, model, table_path)
    for extra in (o["save_table"], o["save_config"], o["json_path"]):
        if extra:
            check_output_path(extra, model, output)
    start = time.perf_counter()
    sharded = table_path is None or search is not None  # one engine for the calibration and the search
    workers = api.search_workers(cfg, search) if search is not None else cfg.calibration.workers
    with open_engine(cfg.calibration.dask, workers) if sharded else contextlib.nullcontext() as engine:
        executor = engine.executor if engine is not None else None
        common = dict(table=table_path, data=data, config=cfg, table_format=o["table_format"],
                      allow_missing=o["allow_missing"], executor=executor)
        if search is None:
            result = api.quantize(model, **common)
        else:
            result = api.search(model, search, **common, log=lambda message: click.echo(message, err=True))
    if result.search is not None:
        click.echo(result.search.describe())
    for note in result.notes:
        click.echo(f"note: {note}", err=True)
    result.save(output)
    if o["save_table"]:
        result.table.save(o["save_table"])
    if o["save_config"]:
        result.save_config(o["save_config"])
    if o["json_path"]:
        write_text(o["json_path"], json.dumps(result.to_dict(), indent=1) + "\n")
    tables = f"{result.int8_embeddings} int8 embedding tables, " if result.int8_embeddings else ""
    click.echo(f"quantized {result.quantized_nodes} nodes ({result.int8_weights} int8 weights, {tables}"
               f"{result.activations} activations, {result.float_nodes} nodes left float) "
               f"in {time.perf_counter() - start:.1f} s -> {output}")
    click.echo(describe_target(quant))
    if TARGETS[quant.target].onnxruntime_kernels:
        click.echo(kernel_summary(result.kernels if result.kernels is not None else output))
    warning = vnni_warning(quant, cpu_has_vnni())  # once everything is written: an error stays one line
    if warning:
        click.echo(f"warning: {warning}", err=True)


@main.command(cls=_GroupedCommand)
@_quantize_options
@_command
def quantize(**options):
    """Write an int8 QDQ model of MODEL, from a table or by calibrating on --data first.

    Every other setting is a key of the --config file (docs/config.md); the fewest layers in float
    that meet an accuracy target: qtool search.
    """
    _quantize_job(options)


@main.command(cls=_GroupedCommand)
@_quantize_options
@_search_options
@_command
def search(eval_data, labels, target_agreement, target_top1_drop, target_sqnr, target_cosine, max_float_layers,
           min_int8_macs, search_int16, search_ranges, **options):
    """Write the int8 QDQ model of MODEL that keeps the fewest layers in float (or dynamic int8, or
    16-bit) so that it meets a --target-* on --eval-data; exit 1 when the budgets run out. The
    candidates are scored in one process per core (--workers N: N processes; 1: in this one).

    \b
    qtool search MODEL --data CALIB --eval-data EVAL --target-cosine 0.99 -o OUT
    """
    from qtool import api
    from qtool.calibration.ranges import METHODS

    if all(v is None for v in (target_agreement, target_top1_drop, target_sqnr, target_cosine)):
        raise click.UsageError("give a target: --target-agreement, --target-top1-drop, --target-sqnr or "
                               "--target-cosine")
    methods = () if search_ranges.strip() == "none" else tuple(filter(None, map(str.strip, search_ranges.split(","))))
    for name in methods:
        if name not in METHODS:
            raise click.UsageError(f"--search-ranges: unknown range method '{name}' "
                                   f"(choose from {', '.join(METHODS)}, or none)")
    _quantize_job(options, api.MixedPrecisionSearch(eval_data, target_agreement, target_top1_drop, target_sqnr,
                                                    labels, max_float_layers, min_int8_macs, target_cosine, methods,
                                                    search_int16, options["workers"]))


@main.command()
@click.argument("fp32_model", type=click.Path(path_type=Path))
@click.argument("int8_model", type=click.Path(path_type=Path))
@data_option
@click.option("--labels", type=str, help="'filename<TAB>class_index' file, or 'folders' (one folder per class).")
@config_option
@click.option("--task", type=click.Choice(list(TASKS)),
              help="What the figures mean (default auto: classification when the first output is [N, C]; "
                   "ctc: greedy CTC texts of an [N, T, C] recognizer output, blank = class 0).")
@click.option("--task-config", type=click.Path(path_type=Path), help="YAML decode settings for --task detection.")
@click.option("--num-samples", type=click.IntRange(min=1), help="Evaluate at most this many samples.")
@click.option("--batch-size", type=click.IntRange(min=1), help="Samples per batch.")
@click.option("--threads", type=click.IntRange(min=1), help="Intra-op threads for the latency runs (default 1).")
@click.option("--runs", type=click.IntRange(min=1), help="Timed runs per model (default 20).")
@click.option("--runtime", type=click.Choice(["onnxruntime", "openvino"]),
              help="Measure fidelity and latency on this runtime (default onnxruntime; openvino needs: "
                   'pip install "qtool[openvino]").')
@click.option("--per-layer", is_flag=True, default=None, help="Error of every quantized tensor vs its fp32 twin.")
@click.option("--sensitivity", is_flag=True, default=None,
              help="Rank layers by the output error each causes alone in int8 (needs --table).")
@click.option("--table", "table_path", type=click.Path(path_type=Path),
              help="Calibration table the int8 model was made from (for --sensitivity).")
@click.option("--layer-samples", type=click.IntRange(min=1), help="Samples for --per-layer/--sensitivity (32).")
@click.option("--max-top1-drop", type=float, help="Fail (exit 1) if top-1 drops by more points than this.")
@click.option("--min-agreement", type=float, help="Fail if top-1 agreement with fp32 is below this percent.")
@click.option("--min-texts-kept", type=float,
              help="Fail if fewer than this percent of decoded texts are identical to fp32's (--task ctc).")
@click.option("--min-cosine", type=float, help="Fail if any output's mean cosine is below this.")
@click.option("--min-sqnr", type=float, help="Fail if any output's SQNR is below this many dB.")
@click.option("--min-speedup", type=float, help="Fail if int8 is not at least this many times faster.")
@click.option("--json", "json_path", type=click.Path(path_type=Path), help="Write every figure to this JSON file.")
@click.option("--junit", "junit_path", type=click.Path(path_type=Path), help="JUnit XML, one test per threshold.")
@click.option("--html", "html_path", type=click.Path(path_type=Path), help="Self-contained HTML report.")
@dask_option
@click.option("--shard", metavar="K/N", help="Only shard K of N (0-based) of the data; write its figures to -o.")
@click.option("-o", "--output", "shard_output", type=click.Path(path_type=Path),
              help="With --shard: the shard's figures file to write (.json), for --merge.")
@click.option("--merge", "merge", is_flag=True, help="Report on the figures FILES of shards (no --data).")
@click.argument("shard_files", nargs=-1, type=click.Path(path_type=Path))
@_command
def evaluate(fp32_model, int8_model, data, labels, config_path, task, task_config, num_samples, batch_size, threads,
             runs, runtime, per_layer, sensitivity, table_path, layer_samples, max_top1_drop, min_agreement, min_texts_kept,
             min_cosine, min_sqnr, min_speedup, json_path, junit_path, html_path, dask, shard, shard_output, merge, shard_files):
    """Compare FP32_MODEL and INT8_MODEL on --data: accuracy, fidelity, latency, size; exit 1 on a failed threshold.

    \b
    Sharded:  qtool evaluate FP32 INT8 --data D --shard 0/2 -o e0.json   (and 1/2 -> e1.json)
              qtool evaluate FP32 INT8 --merge e0.json e1.json --json report.json
    """
    from qtool import api
    from qtool.atomic import write_text
    from qtool.calibration.shards import parse_shard
    from qtool.evaluation.evaluate import EvaluateInputs
    from qtool.evaluation.html_report import write_html
    from qtool.evaluation.junit import write_junit
    from qtool.evaluation.report import render_table
    from qtool.evaluation.shard_files import evaluate_shard, merge_evaluations

    if shard_files and not merge:
        raise click.UsageError(f"unexpected argument '{shard_files[0]}' (shard files go with --merge)")
    if merge and (not shard_files or data is not None or shard):
        raise click.UsageError("--merge takes the shard FILES, without --data or --shard")
    if not merge and data is None:
        raise click.UsageError("--data is required")
    if bool(shard) != bool(shard_output):
        raise click.UsageError("--shard K/N and -o FILE go together")
    for path in (json_path, junit_path, html_path, shard_output):
        if path:
            check_output_path(path, fp32_model, int8_model)
    cfg = load_config(config_path)
    eval_cfg = override(cfg.evaluation, num_samples=num_samples, batch_size=batch_size, threads=threads, runs=runs,
                        task=task, task_config=str(task_config) if task_config else None, per_layer=per_layer,
                        sensitivity=sensitivity, layer_samples=layer_samples, max_top1_drop=max_top1_drop,
                        min_agreement=min_agreement, min_texts_kept=min_texts_kept, min_cosine=min_cosine,
                        min_sqnr=min_sqnr, min_speedup=min_speedup, dask=dask, runtime=runtime)
    if eval_cfg.runtime != "onnxruntime" and (shard or merge):
        raise click.UsageError(f"--runtime {eval_cfg.runtime} measures in one process: no --shard or --merge")
    if shard:
        k, n = parse_shard(shard)
        start = time.perf_counter()
        samples = evaluate_shard(EvaluateInputs(fp32_model, int8_model, data, labels), cfg.preprocess, eval_cfg,
                                 (k, n), shard_output)
        click.echo(f"shard {k}/{n}: figures of {samples} samples in {time.perf_counter() - start:.1f} s "
                   f"-> {shard_output}")
        return
    if merge:
        report = merge_evaluations(EvaluateInputs(fp32_model, int8_model, None), list(shard_files), eval_cfg)
    else:
        report = api.evaluate(fp32_model, int8_model, data, replace(cfg, evaluation=eval_cfg), labels=labels,
                              table=table_path)
    click.echo(render_table(report))
    if json_path:
        write_text(json_path, report.to_json())
    if junit_path:
        write_junit(report, junit_path)
    if html_path:
        write_html(report, html_path)
    for verdict in report.thresholds:
        click.echo(verdict.message, err=not verdict.passed)
    if not report.passed:
        sys.exit(EXIT_THRESHOLD)


@main.group()
def table() -> None:
    """Calibration tables of other toolchains: TensorRT, Tengine, TPU-MLIR, ncnn, AMCT, onnxruntime."""


@table.command()
@click.argument("table_in", type=click.Path(path_type=Path))
@click.option("-o", "--output", type=click.Path(path_type=Path), required=True, help="Table to write.")
@click.option("--to", "to_format", required=True, metavar="FORMAT", help="Format to write.")
@click.option("--table-format", metavar="FORMAT", help="Read TABLE_IN as this format instead of detecting it.")
@click.option("--model", type=click.Path(path_type=Path),
              help="The fp32 model: needed by layer-keyed formats (ncnn, amct), recorded in qtool tables.")
@config_option
@click.option("--activation-dtype", type=click.Choice(["uint8", "int8"]), help="Activation integer type.")
@_command
def convert(table_in, output, to_format, table_format, model, config_path, activation_dtype):
    """Convert calibration table TABLE_IN to another format."""
    from qtool.table.formats import get_format, read_table, write_table

    check_output_path(output, table_in, model)
    get_format(to_format)
    quant = override(load_config(config_path).quantization, activation_dtype=activation_dtype)
    table_data, source = read_table(table_in, table_format, model, quant)
    write_table(table_data, output, to_format, model, quant)
    click.echo(f"converted {len(table_data.tensors)} entries: {source.name} -> {to_format} -> {output}")


@main.command("export-params")
@click.argument("int8_model", type=click.Path(path_type=Path))
@click.option("-o", "--output", type=click.Path(path_type=Path), required=True, help="JSON file to write.")
@_command
def export_params(int8_model, output):
    """Write the fixed-point form of every quantized layer of INT8_MODEL (a QDQ model):
    int32 multipliers and shifts per output channel, int32 biases, zero points, Add/pool/LeakyReLU/PReLU
    parameters."""
    from qtool.integer.fixed_point import describe, export_params as run_export, write_params
    from qtool.graph.modelio import load_model

    check_output_path(output, int8_model)
    params = run_export(load_model(int8_model))
    write_params(params, output)
    click.echo(describe(output, params))


@main.command("verify-int")
@click.argument("int8_model", type=click.Path(path_type=Path))
@data_option
@config_option
@click.option("--num-samples", type=click.IntRange(min=1), default=8, show_default=True, help="Samples to run.")
@click.option("--json", "json_path", type=click.Path(path_type=Path), help="Write every figure to this JSON file.")
@click.option("--min-exact", type=click.FloatRange(0, 1), help="Fail (exit 1) if fewer integer-only outputs "
              "than this fraction are bit-exact.")
@click.option("--max-lsb", type=click.IntRange(min=0), help="Fail (exit 1) if any output differs by more LSB.")
@_command
def verify_int(int8_model, data, config_path, num_samples, json_path, min_exact, max_lsb):
    """Run INT8_MODEL's quantized layers in integer-only numpy and compare each with onnxruntime."""
    from qtool.errors import ThresholdError
    from qtool.evaluation.report import write_json
    from qtool.integer.verify_int import render, verify

    if data is None:
        raise click.UsageError("--data is required")
    if json_path:
        check_output_path(json_path, int8_model)
    report = verify(int8_model, data, load_config(config_path).preprocess, num_samples)
    click.echo(render(report))
    if json_path:
        write_json(report, json_path)
    fixed = report["totals"]["fixed"]
    if min_exact is not None and fixed["fraction_exact"] < min_exact:
        raise ThresholdError(f"only {100 * fixed['fraction_exact']:.4f}% of outputs bit-exact (< {100 * min_exact}%)")
    if max_lsb is not None and fixed["max_lsb"] > max_lsb:
        raise ThresholdError(f"an output differs by {fixed['max_lsb']} LSB (> {max_lsb})")


if __name__ == "__main__":  # pragma: no cover
    main()
