"""onnxruntime sessions, created the same way everywhere so fp32 and int8 compare fairly."""

from __future__ import annotations

import contextlib
import contextvars
import functools
import os
import platform
import re
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Callable, Iterator, Mapping, Optional

import numpy as np
import onnx
import onnxruntime as ort
from google.protobuf.message import DecodeError
from onnxruntime.capi import onnxruntime_pybind11_state as _ort_state

from qtool.graph import modelio
from qtool.graph.edit import untied_int8, with_outputs
from qtool.graph.index import names_read, tensor_bytes
from qtool.graph.shapes import declared_shapes, inferred
from qtool.errors import InternalError, LoadRefused, QtoolError, RunRefused, allocation_failure


_ENABLE_ALL = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
# what onnxruntime raises from its C++ side (Fail, InvalidArgument, RuntimeException, ...)
ORT_ERRORS = tuple(c for c in vars(_ort_state).values() if isinstance(c, type) and issubclass(c, Exception))
_ORT_PREFIX = re.compile(r"\[ONNXRuntimeError\] : \d+ : \w+ : ")
# a C++ source location, and the function signature after it when there is one
_SOURCE_LOCATION = re.compile(r"/\S+\.(?:h|cc|cpp):\d+ (?:(?:[\w:~<>&*]+ )*[\w:~<>]+\([^()]*\)(?: const)? )?")
_ANSI = re.compile(r"\x1b\[[0-9;]*m")
_STATUS = "Status Message:"
MAX_REASON = 300  # characters of onnxruntime's message kept in a note or an error
# the model file the job at hand reads (api.quantize, calibrate, evaluate): named when onnxruntime
# refuses to run a model qtool derived from it (a candidate, the observing graph)
_JOB_MODEL: contextvars.ContextVar[Optional[str]] = contextvars.ContextVar("qtool_job_model", default=None)


@contextlib.contextmanager
def job_model(path: object) -> Iterator[None]:
    """Within this block, a run onnxruntime refuses names `path` as the model (RunRefused). A model
    qtool derived from `path` that onnxruntime cannot load is qtool's bug (InternalError, exit 3)
    when onnxruntime loads `path` itself; when it does not, that refusal is the error (exit 2)."""
    token = _JOB_MODEL.set(str(path))
    try:
        yield
    except LoadRefused as exc:
        if exc.path == str(path) or not os.path.isfile(str(path)):
            raise
        create_session(str(path), label=str(path))  # raises the model's own refusal
        raise InternalError(f"{exc} (onnxruntime loads {path} itself)") from exc
    finally:
        _JOB_MODEL.reset(token)


def ort_message(exc: BaseException) -> str:
    """onnxruntime's message as one line, without its status prefixes and C++ source locations."""
    cause = exc.__cause__ if isinstance(exc, QtoolError) and exc.__cause__ is not None else exc
    text = " ".join(_ANSI.sub("", str(cause)).split())
    text = _ORT_PREFIX.split(text)[-1]
    if text.count(_STATUS) > 1:  # onnxruntime repeats its log line inside the status: keep the last
        text = f"{text.split(_STATUS)[0]}{_STATUS}{text.rsplit(_STATUS, 1)[1]}"
    text = _SOURCE_LOCATION.sub("", text).strip()
    if len(text) <= MAX_REASON:
        return text
    tail = MAX_REASON // 3  # onnxruntime ends with the op ("... in the Resize operator")
    return f"{text[:MAX_REASON - tail - 5]} ... {text[-tail:]}"


class Session(ort.InferenceSession):
    """An onnxruntime session whose run, when onnxruntime refuses it, raises RunRefused (one line,
    exit 2) naming the model and what was refused, not onnxruntime's own exception types."""

    _qtool_label = "model"

    def run(self, output_names, input_feed, run_options=None):
        try:
            return super().run(output_names, input_feed, run_options)
        except ORT_ERRORS as exc:
            if allocation_failure(exc):
                raise  # the machine's memory, not the model: the job names its model file (NotEnoughMemory)
            reason = ort_message(exc)
            label, job = self._qtool_label, _JOB_MODEL.get()
            if job is None or label == job:
                raise RunRefused(f"onnxruntime refused to run it: {reason}", label, reason) from exc
            raise RunRefused(f"onnxruntime refused to run a model made from it ({label}): {reason}", job,
                             reason) from exc


def _session(source, options: ort.SessionOptions, label: str) -> Session:
    session = Session(source, options, providers=["CPUExecutionProvider"])
    session._qtool_label = label
    return session


def cpu_flags(cpuinfo: str | Path = "/proc/cpuinfo") -> Optional[frozenset[str]]:
    """The first CPU's flags on Linux (x86 `flags`, ARM `Features`); None where they cannot be read."""
    try:
        text = Path(cpuinfo).read_text(errors="replace")
    except OSError:
        return None
    for line in text.splitlines():
        if line.startswith(("flags", "Features")):
            return frozenset(line.split(":", 1)[1].split())
    return None


def cpu_has_vnni(cpuinfo: str | Path = "/proc/cpuinfo") -> Optional[bool]:
    """True/False on x86 Linux; None where it cannot be told (other OS or architecture)."""
    if platform.machine().lower() not in ("x86_64", "amd64", "i686", "i386"):
        return None
    flags = cpu_flags(cpuinfo)
    return None if flags is None else bool(flags & {"avx512_vnni", "avx_vnni"})


EXACT_PRODUCTS = ("session.x64quantprecision", "1")  # onnxruntime's session option for exact u8s8 products
QDQ_AS_WRITTEN = ("session.disable_quant_qdq", "1")  # ... for Q/DQ pairs left unfused (session_options)


@functools.lru_cache(maxsize=1)
def exact_int8_products() -> bool:
    """Whether qtool's sessions ask onnxruntime for exact int8 products (session.x64quantprecision):
    on an x86 CPU without VNNI its u8s8 kernels add pairs of products in saturating int16, so an
    int8 model's outputs, and every choice scored on them, would differ from a VNNI CPU's. The
    option runs those products as u8u8 (exact, slower) on such CPUs only; where VNNI sums in int32
    the default kernels are exact already and stay."""
    return cpu_has_vnni() is False


def session_options(threads: int = 0, level: ort.GraphOptimizationLevel = _ENABLE_ALL,
                    optimized_path: str | None = None, log_level: int = 4,
                    order: ort.ExecutionOrder = ort.ExecutionOrder.DEFAULT, batch_pass: bool = False,
                    as_written: bool = False) -> ort.SessionOptions:
    """`level` and `optimized_path` (where onnxruntime writes its optimized graph) are for
    asking which kernels onnxruntime makes (qtool.graph.kernels). `log_level` 4 (fatal only):
    a failure in onnxruntime reaches qtool as an exception, which qtool reports in its own one
    line; onnxruntime's log of it would be a second one. `order`: onnxruntime's node order (PRIORITY_BASED
    for a model with many side branches that reduce tensors: each runs soon after its tensor is made,
    which then need not stay alive until the whole network has run). `batch_pass`: a pass over
    many batches whose time and memory are the job's (calibration, scoring candidates), not a
    latency: without the worker threads spinning between kernels (which shortens a latency but
    costs CPU time) and without the memory pattern (one block planned for every tensor of a run's
    shapes, kept for the next run of those shapes; with batches of 8 that block set the job's
    peak RSS). The same results either way (docs/design/observer.md). Exact int8 products
    wherever onnxruntime's defaults would saturate them (exact_int8_products). `as_written`: every
    QuantizeLinear and DequantizeLinear computed as the graph writes it, the ops between them in
    float (onnxruntime fuses no Q/DQ pair into an integer kernel): the quantization grid itself,
    the same on every CPU up to the float kernels' last bits, where the integer kernels round and
    requantize differently on ARM and on x86 (qtool.choices.measure)."""
    options = ort.SessionOptions()
    options.execution_order = order
    if batch_pass:
        options.add_session_config_entry("session.intra_op.allow_spinning", "0")
        options.enable_mem_pattern = False
    options.graph_optimization_level = level
    options.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    options.intra_op_num_threads = threads or allowed_cores()
    options.inter_op_num_threads = 1
    options.log_severity_level = log_level
    if exact_int8_products():
        options.add_session_config_entry(*EXACT_PRODUCTS)
    if optimized_path is not None:
        options.optimized_model_filepath = optimized_path
    if as_written:
        options.add_session_config_entry(*QDQ_AS_WRITTEN)
    return options


def in_background(function: Callable, *args) -> Future:
    """function(*args) in the background thread, in the caller's context (its job model, its run
    check's keeping): onnxruntime leaves Python's lock while it loads and runs a model, so the
    caller's Python goes on meanwhile. One thread for the process, the calls in the order they
    were made: each thread that allocates gets memory pools of its own from the C library, which
    a thread per call would multiply. A call the background thread itself waits for before its
    turn (made there, or queued behind the call waiting) runs there and then (_Call)."""
    global _BACKGROUND
    if _BACKGROUND is None:
        _BACKGROUND = ThreadPoolExecutor(1, thread_name_prefix=_BACKGROUND_NAME)
    call = _Call(function, args, contextvars.copy_context())
    _BACKGROUND.submit(call.run)
    return call


class _Call(Future):
    """A background call, run once by whichever comes first: its turn on the background thread, or
    the background thread waiting for its result (queued behind the waiting call, it would never
    come)."""

    def __init__(self, function: Callable, args: tuple, context: contextvars.Context):
        super().__init__()
        self._call = (function, args, context)
        self._claimed = threading.Lock()  # held for good by the one run

    def run(self) -> None:
        if not self._claimed.acquire(blocking=False):
            return  # run already, or running
        function, args, context = self._call
        try:
            self.set_result(context.run(function, *args))
        except BaseException as exc:  # the caller meets it at result()
            self.set_exception(exc)

    def result(self, timeout: Optional[float] = None):
        if _on_background_thread():
            self.run()
        return super().result(timeout)


def _on_background_thread() -> bool:
    return threading.current_thread().name.startswith(_BACKGROUND_NAME)


_BACKGROUND: Optional[ThreadPoolExecutor] = None
_BACKGROUND_NAME = "qtool-fp32"


def allowed_cores() -> int:
    """0 (onnxruntime's default: one thread per core, pinned to the cores) when the process may
    run on every core, else the number of cores it may run on. onnxruntime's default ignores
    the process's CPU affinity (taskset, a cpuset): under `taskset -c 0` it still starts a
    thread per core and pins them, so a run meant for one core used two."""
    try:
        allowed = len(os.sched_getaffinity(0))
    except AttributeError:  # no affinity on this platform (macOS, Windows)
        return 0
    return 0 if allowed >= (os.cpu_count() or allowed) else allowed


def usable_cores() -> int:
    """How many cores this process may run on (its affinity where the platform has one)."""
    return allowed_cores() or os.cpu_count() or 1


class SharedWeights:
    """A model's large initializers held once as onnxruntime values, for building several
    sessions of variants of one model (the observer's) without serialising and parsing the
    weights each time: `light` is the model with their payloads replaced by a reference
    that `create_session(..., weights=)` resolves to these values (onnxruntime's external
    initializers), so a session build serialises the graph alone."""

    MIN_BYTES = 1024  # smaller initializers (shape constants, Clip bounds) stay in the graph
    # element types whose numpy array is the tensor's own layout (not sub-byte, bfloat16 or strings)
    _PLAIN_TYPES = frozenset({onnx.TensorProto.FLOAT, onnx.TensorProto.DOUBLE, onnx.TensorProto.FLOAT16,
                              onnx.TensorProto.INT8, onnx.TensorProto.UINT8, onnx.TensorProto.INT16,
                              onnx.TensorProto.UINT16, onnx.TensorProto.INT32, onnx.TensorProto.UINT32,
                              onnx.TensorProto.INT64, onnx.TensorProto.UINT64, onnx.TensorProto.BOOL})
    LOCATION = "qtool-shared-weights"

    def __init__(self, model: onnx.ModelProto):
        from onnx import numpy_helper

        self.light = onnx.ModelProto()  # built field by field: the weights are never copied as protobuf
        _copy_fields(model, self.light, skip="graph")
        _copy_fields(model.graph, self.light.graph, skip="initializer")
        self.arrays: dict[str, object] = {}
        self.values: dict[str, ort.OrtValue] = {}
        # onnxruntime drops an initializer no node reads before it resolves the shared ones, and
        # then fails to find it ("Failed to find existing initializer"): those stay in the graph
        read = {name for node in model.graph.node for name in names_read(node)}
        read |= {o.name for o in model.graph.output}
        for tensor in model.graph.initializer:
            if (tensor.data_location == onnx.TensorProto.EXTERNAL or tensor.data_type not in self._PLAIN_TYPES
                    or tensor_bytes(tensor) < self.MIN_BYTES or tensor.name not in read):
                self.light.graph.initializer.append(tensor)
                continue
            array = numpy_helper.to_array(tensor)
            self.arrays[tensor.name] = array  # the OrtValue shares this buffer: keep it alive
            self.values[tensor.name] = ort.OrtValue.ortvalue_from_numpy(array)
            reference = onnx.TensorProto(name=tensor.name, dims=tensor.dims, data_type=tensor.data_type,
                                         data_location=onnx.TensorProto.EXTERNAL)
            entry = reference.external_data.add()
            entry.key, entry.value = "location", self.LOCATION
            self.light.graph.initializer.append(reference)


# a proto model whose initializers hold at least this many bytes hands them to onnxruntime as
# shared values instead of serialising them into the model's bytes, which onnxruntime parses
# again: on a 90 MB transformer a session builds in half the time (the same kernels, the same outputs)
SHARE_MIN_BYTES = 16 << 20


def _shares_weights(model: onnx.ModelProto) -> bool:
    size = sum(tensor_bytes(t) for t in model.graph.initializer
               if t.data_location != onnx.TensorProto.EXTERNAL)
    return SHARE_MIN_BYTES <= size < modelio.PROTOBUF_LIMIT


def _copy_fields(source, target, skip: str) -> None:
    for field, value in source.ListFields():
        if field.name == skip:
            continue
        repeated = field.is_repeated if hasattr(field, "is_repeated") else field.label == field.LABEL_REPEATED
        if repeated:
            getattr(target, field.name).extend(value)
        elif field.message_type is not None:
            getattr(target, field.name).CopyFrom(value)
        else:
            setattr(target, field.name, value)


def untied_source(source: str | bytes) -> onnx.ModelProto | None:
    """untied_int8 of a model file or serialized model that exact products failed to load; None
    where it shares nothing or cannot be read (the load's own error stands)."""
    try:
        return untied_int8(modelio.load_model(source) if isinstance(source, str) else onnx.load_from_string(source))
    except (QtoolError, DecodeError):
        return None


def create_session(model: onnx.ModelProto | str, threads: int = 0, label: str = "model",
                   weights: "SharedWeights | None" = None, level: ort.GraphOptimizationLevel = _ENABLE_ALL,
                   optimized_path: str | None = None, log_level: int = 4,
                   order: ort.ExecutionOrder = ort.ExecutionOrder.DEFAULT, batch_pass: bool = False,
                   as_written: bool = False) -> Session:
    """A session of `model` (a path or a proto); with `weights`, `model` is a variant of
    `weights.light` whose large initializers are the shared values (a proto with SHARE_MIN_BYTES of
    initializers shares its own). The other options
    are session_options'. Its runs raise RunRefused where onnxruntime refuses them."""
    options = session_options(threads, level, optimized_path, log_level, order, batch_pass, as_written)
    if exact_int8_products() and weights is None and not isinstance(model, str):
        model = untied_int8(model) or model  # (session_options' exact products fail on shared int8 weights)
    if weights is None and optimized_path is None and not isinstance(model, str) and _shares_weights(model):
        weights = SharedWeights(model)
        model = weights.light
    if weights is not None:
        options.add_external_initializers(list(weights.values), list(weights.values.values()))
        try:
            session = _session(model.SerializeToString(), options, label)
        except Exception as exc:
            if allocation_failure(exc):
                raise  # the machine's memory, not the model: the job names its model file
            raise LoadRefused(f"onnxruntime cannot load it: {str(exc).strip().splitlines()[0]}", label) from exc
        session._qtool_weights = weights  # onnxruntime reads the shared buffers while the session lives
        return session
    source = model if isinstance(model, str) else modelio.serialized(model)
    if source is None:
        # Over 2 GiB a model cannot be serialised to bytes: hand onnxruntime a file with external
        # data. onnxruntime has read the initializers once the session exists.
        with modelio.on_disk(model) as path:
            return create_session(str(path), threads, label, level=level, optimized_path=optimized_path,
                                  log_level=log_level, order=order, batch_pass=batch_pass, as_written=as_written)
    try:
        return _session(source, options, label)
    except Exception as exc:  # onnxruntime raises its own Fail/InvalidGraph types
        if allocation_failure(exc):
            raise
        untied = untied_source(model) if exact_int8_products() and isinstance(model, str) else None
        if untied is not None:
            return create_session(untied, threads, label, level=level, optimized_path=optimized_path,
                                  log_level=log_level, order=order, batch_pass=batch_pass, as_written=as_written)
        raise LoadRefused(f"onnxruntime cannot load it: {str(exc).strip().splitlines()[0]}", label) from exc


def time_models(models: dict[str, "str | onnx.ModelProto"], feeds: dict[str, np.ndarray], threads: int, warmup: int,
                runs: int) -> dict[str, list[float]]:
    """Seconds per run of each model (a path or a proto), timed by time_sessions. Same session
    options for all."""
    sessions = {name: create_session(model, threads, model if isinstance(model, str) else name)
                for name, model in models.items()}
    return time_sessions(sessions, feeds, warmup, runs)


def time_sessions(sessions: dict[str, ort.InferenceSession], feeds: dict[str, np.ndarray], warmup: int,
                  runs: int) -> dict[str, list[float]]:
    """Seconds per run of each session: warm-up, then the sessions take turns run by run, so a
    slowdown from a noisy neighbour hits all of them alike, in a fresh order each turn (seeded): the
    session run before another one changes the other's time (on a 0.1 ms model a fixed order moved
    the medians by 10%; a turning cycle, where each follows the same one, still by 5%)."""
    times: dict[str, list[float]] = {name: [] for name in sessions}
    for _ in range(warmup):
        for session in sessions.values():
            session.run(None, feeds)
    names, rng = list(sessions), np.random.default_rng(0)
    for _ in range(runs):
        for name in (names[i] for i in rng.permutation(len(names))):
            start = time.perf_counter()
            sessions[name].run(None, feeds)
            times[name].append(time.perf_counter() - start)
    return times


def tensor_dims(model: onnx.ModelProto, feeds: Mapping[str, np.ndarray]) -> dict[str, tuple[int, ...]]:
    """Static dims of the main graph's tensors for the first sample of `feeds` (batch 1 where every
    input is batched along axis 0): shape inference first, then one onnxruntime run for the tensors it
    leaves open (shapes computed at run time: Reshape targets from Shape, a transformer's sequence)."""
    one = dict(feeds)
    leading = {v.shape[0] for v in one.values() if getattr(v, "ndim", 0)}
    if len(leading) == 1 and all(getattr(v, "ndim", 0) for v in one.values()):
        one = {k: v[:1] for k, v in one.items()}
    # a large model's weights are held once, as the session's shared values: shape inference reads
    # their declared dims, and no copy of the model holds them again
    weights = SharedWeights(model) if _shares_weights(model) else None
    source = weights.light if weights is not None else model
    light = onnx.ModelProto()
    light.CopyFrom(source)
    del light.graph.value_info[:]  # the exporter's open dims would stay open
    for value in light.graph.output:
        value.type.tensor_type.ClearField("shape")
    known = declared_shapes(inferred(light, data_prop=True, input_shapes={k: v.shape for k, v in one.items()}))
    shapes = {name: tuple(dims) for name, dims in known.items() if _static(dims)}
    missing = [name for node in model.graph.node for name in node.output if name and name not in shapes]
    if missing:
        try:
            # shapes only: the graph as written, without onnxruntime's optimizations (less than half
            # the session's build; a tensor's shape is the model's, whatever kernels compute it)
            session = create_session(with_outputs(source, missing), 1, "shapes", weights=weights,
                                     level=ort.GraphOptimizationLevel.ORT_DISABLE_ALL)
            wanted = [o.name for o in session.get_outputs() if o.name in set(missing)]
            for name, value in zip(wanted, session.run(wanted, one)):
                if isinstance(value, np.ndarray):
                    shapes[name] = tuple(int(d) for d in value.shape)
        except Exception:  # noqa: BLE001 - those shapes stay unknown, and their nodes keep their plan
            pass
    return shapes


def _static(dims) -> bool:
    """Whether the dims are all known and hold values (an empty tensor's are learnt from the run)."""
    return dims is not None and all(isinstance(d, int) and d > 0 for d in dims)
