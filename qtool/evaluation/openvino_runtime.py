"""OpenVINO as the runtime an evaluation measures on (`qtool evaluate --runtime openvino`).

OpenVINO reads the QDQ model itself, folding each Q/DQ pair (a FakeQuantize) into int8 kernels.
Both models run on the CPU with `threads` threads, the fp32 one at OpenVINO's default precision (bf16
where the CPU has it) and at f32 too, so the report shows both baselines. What the int8 model runs
in int8 is read from its runtime model: each heavy op's precision and the FakeQuantize ops left on
their own. A plugin that gives its Convolutions uint8 inputs only (CPUs without AMX) loses the scale
of int8 codes that reach a Concat on the way (benchmarks/openvino_int8_readers.py); the report names
such tensors (codes_lost_at_concat). Optional extra: pip install "qtool[openvino]".
"""

from __future__ import annotations

import functools
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional

import numpy as np

from qtool.errors import QtoolError

RUNTIMES = ("onnxruntime", "openvino")
INSTALL = 'pip install "qtool[openvino]"'
# layer types of the CPU plugin's runtime model that do the multiply-accumulate work
HEAVY_OPS = ("Convolution", "Deconvolution", "FullyConnected", "MatMul")
INT8 = ("u8", "i8")


def require(why: str = "--runtime openvino"):
    """The openvino module, or a one-line error (exit 2) saying how to install it."""
    try:
        import openvino
    except ImportError:
        raise QtoolError(f"{why} needs OpenVINO, which is not installed: {INSTALL}") from None
    return openvino


def version() -> str:
    """The installed package's version (2026.4.1)."""
    from importlib.metadata import PackageNotFoundError, version as package_version

    try:
        return package_version("openvino")
    except PackageNotFoundError:  # a build from source
        return require().get_version().split("-")[0]


def default_precision() -> str:
    """OpenVINO's default inference precision on this CPU: bf16 or f32 (f16 on some ARM CPUs)."""
    ov = require()
    return ov.Core().get_property("CPU", "INFERENCE_PRECISION_HINT").get_type_name()


# compiles each model at the default precision and at f32 (what evaluate compiles), naming it first
_COMPILE = ("import sys, openvino as ov; core = ov.Core()\n"
            "for path in sys.argv[1:]:\n"
            "    print(path, flush=True)\n"
            "    for extra in ({}, {'INFERENCE_PRECISION_HINT': 'f32'}):\n"
            "        core.compile_model(path, 'CPU', {'INFERENCE_NUM_THREADS': 1, **extra})")


def check_compiles(*paths: str | Path) -> None:
    """Compile `paths` in one child process first: OpenVINO's CPU plugin can kill the process that
    compiles a model (a signal, no exception: 2026.4.1 on a Concat whose quantizer has a zero
    point, requantized before a Convolution), which would end qtool with no message. Such a model
    gets a one-line error naming it (exit 2); other failures are the in-process compile's to report."""
    require()
    done = subprocess.run([sys.executable, "-c", _COMPILE, *map(str, paths)], capture_output=True, text=True)
    if done.returncode < 0:
        crashed = (done.stdout.strip().splitlines() or [str(paths[0])])[-1]  # the last one it named
        raise QtoolError(f"OpenVINO {version()}'s CPU plugin crashes compiling it (signal {-done.returncode}); "
                         "a model quantized with --target openvino avoids the patterns known to do this", crashed)


class CompiledModel:
    """A model compiled for OpenVINO's CPU plugin, run like an onnxruntime session:
    `run(output_names, feeds)` returns the outputs in the order asked."""

    def __init__(self, model, threads: int = 1, precision: Optional[str] = None, label: Optional[str] = None,
                 counters: bool = False):
        """model: a path, or an onnx.ModelProto (read from its bytes). `counters`: the plugin's
        per-layer counters on (layer_seconds), which cost a little time on every run."""
        ov = require()
        config = {"INFERENCE_NUM_THREADS": threads}
        if precision is not None:
            config["INFERENCE_PRECISION_HINT"] = precision
        if counters:
            config["PERF_COUNT"] = "YES"
        core = ov.Core()
        try:
            source = str(model) if isinstance(model, (str, Path)) else core.read_model(model.SerializeToString(), b"")
            self.compiled = core.compile_model(source, "CPU", config)
        except Exception as exc:  # OpenVINO raises RuntimeError with a multi-line message
            raise QtoolError(f"OpenVINO cannot compile it: {_reason(exc)}",
                             label or (model if isinstance(model, (str, Path)) else "model")) from exc
        self.request = self.compiled.create_infer_request()
        # a port has several names (an output behind an Identity: the graph output's and the node's);
        # it answers to any of them and is listed by the graph's own output name where it has one
        graph_outputs = _graph_outputs(model)
        ports = [o.get_names() for o in self.compiled.outputs]
        self.names = [next((n for n in sorted(names) if n in graph_outputs), o.get_any_name())
                      for names, o in zip(ports, self.compiled.outputs)]
        self.port = {name: i for i, names in enumerate(ports) for name in names}
        # OpenVINO drops a graph input no node reads (when read from bytes): such an input is not fed
        self.inputs = {name for i in self.compiled.inputs for name in i.get_names()}

    def get_outputs(self) -> list:
        """The outputs' names, as onnxruntime's session lists them (`.name`)."""
        from types import SimpleNamespace

        return [SimpleNamespace(name=name) for name in self.names]

    def run(self, outputs: Optional[list[str]], feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
        values = list(self.request.infer({k: v for k, v in feeds.items() if k in self.inputs}).values())
        return [np.array(values[self.port[name]]) for name in (outputs or self.names)]

    def layer_seconds(self) -> float:
        """The sum of the runtime model's per-layer times in the last run (compiled with `counters`):
        the kernels' own time, without what the machine adds around them."""
        return sum(p.real_time.total_seconds() for p in self.request.profiling_info)

    def layers(self) -> dict:
        """The runtime model's heavy ops and how many run in int8, and the FakeQuantize ops left
        unfused (each a separate pass over its tensor)."""
        kinds = []
        for op in self.compiled.get_runtime_model().get_ordered_ops():
            info = op.get_rt_info()
            kinds.append((info["layerType"].astype(str), info["runtimePrecision"].astype(str)))
        heavy = [precision for kind, precision in kinds if kind in HEAVY_OPS]
        return {"heavy_ops": len(heavy), "int8_heavy_ops": sum(p in INT8 for p in heavy),
                "unfused_fake_quantize": sum(kind == "FakeQuantize" for kind, _ in kinds)}


def converts_int8_codes() -> bool:
    """Whether this CPU's plugin runs a Convolution reading int8 codes with uint8 inputs (it then
    converts the codes): a one-Convolution QDQ model compiled, its runtime precision read."""
    from onnx import TensorProto, helper, numpy_helper

    nodes = [helper.make_node("QuantizeLinear", ["x", "s", "z"], ["q"]),
             helper.make_node("DequantizeLinear", ["q", "s", "z"], ["d"]),
             helper.make_node("DequantizeLinear", ["w", "s"], ["wd"]), helper.make_node("Conv", ["d", "wd"], ["y"])]
    constants = [numpy_helper.from_array(np.array(0.1, np.float32), "s"),
                 numpy_helper.from_array(np.array(0, np.int8), "z"),
                 numpy_helper.from_array(np.ones((1, 1, 1, 1), np.int8), "w")]
    graph = helper.make_graph(nodes, "probe", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 1, 2, 2])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 1, 2, 2])], constants)
    probe = CompiledModel(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)]), label="probe")
    kinds = [op.get_rt_info() for op in probe.compiled.get_runtime_model().get_ordered_ops()]
    return not any(info["layerType"].astype(str) == "Convolution" and info["runtimePrecision"].astype(str) == "i8"
                   for info in kinds)


def codes_lost_at_concat(model, converts: Optional[bool] = None) -> list[str]:
    """The tensors of `model` (a path or ModelProto) quantized to int8 codes that reach a Concat
    whose output a Convolution reads (through ops that move codes), where the plugin converts int8
    codes (`converts`; None: this CPU's, converts_int8_codes); else none. Named by the
    QuantizeLinear's input."""
    import onnx

    from qtool.graph.index import GraphIndex
    from qtool.plan.ops import rule_for

    if isinstance(model, (str, Path)):
        model = onnx.load(str(model), load_external_data=False)
    index = GraphIndex(model)

    def int8_codes(q: onnx.NodeProto) -> bool:
        zero = index.constant_tensor(q.input[2]) if len(q.input) > 2 else None
        return zero is not None and zero.data_type == onnx.TensorProto.INT8

    def passes_codes(node: onnx.NodeProto, requantized: bool = False) -> bool:
        """A DequantizeLinear, or an op whose output ties its input's scale (it moves codes: a
        MaxPool, Reshape, Split, Concat...); with `requantized` a QuantizeLinear too: a Q/DQ pair
        on a Concat's output leaves its codes as they were, where one before it writes codes of
        its own (found as a QuantizeLinear of its own)."""
        rule = rule_for(node.op_type, node.domain)
        return node.op_type == "DequantizeLinear" or (requantized and node.op_type == "QuantizeLinear") \
            or (rule is not None and rule.output == "tie")

    def reached(start: str, stop, requantized: bool = False) -> bool:
        seen, todo = {start}, [start]
        while todo:
            for node in index.consumers.get(todo.pop(), []):
                if stop(node):
                    return True
                if passes_codes(node, requantized):
                    todo += [out for out in node.output if out and out not in seen]
                    seen.update(node.output)
        return False

    @functools.cache
    def conv_reads(concat_output: str) -> bool:  # one search per Concat, whichever codes reach it
        return reached(concat_output, lambda n: n.op_type == "Conv", True)

    def concat_into_conv(node: onnx.NodeProto) -> bool:
        return node.op_type == "Concat" and conv_reads(node.output[0])

    found = [q.input[0] for q in model.graph.node
             if q.op_type == "QuantizeLinear" and int8_codes(q) and reached(q.output[0], concat_into_conv)]
    return found if found and (converts_int8_codes() if converts is None else converts) else []


def _graph_outputs(model) -> set[str]:
    """The ONNX graph's output names (a path: read without its weights)."""
    if isinstance(model, (str, Path)):
        import onnx

        model = onnx.load(str(model), load_external_data=False)
    return {o.name for o in model.graph.output}


def _reason(exc: Exception) -> str:
    """OpenVINO's multi-line message in one line: its lines that say what failed, not where in
    OpenVINO's sources ("Exception from src/...", "Check ... failed at src/...")."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    said = [line for line in lines if not line.startswith(("Exception from", "Check '"))]
    text = " ".join(said[:4] or lines[:1])
    return text if len(text) <= 400 else text[:397] + "..."


def measure_latency(fp32_path: str | Path, int8_path: str | Path, feeds: dict[str, np.ndarray], threads: int,
                    warmup: int, runs: int) -> dict:
    """Median and p90 milliseconds per batch on OpenVINO, the models taking turns run by run: the
    fp32 model at the default precision (and at f32 where that is not f32) and the int8 model;
    the speedup is over the default precision's fp32."""
    default = default_precision()
    models = {"fp32": CompiledModel(fp32_path, threads), "int8": CompiledModel(int8_path, threads)}
    if default != "f32":
        models["fp32_f32"] = CompiledModel(fp32_path, threads, "f32")
    times: dict[str, list[float]] = {name: [] for name in models}
    for _ in range(warmup):
        for model in models.values():
            model.run(None, feeds)
    for _ in range(runs):
        for name, model in models.items():
            start = time.perf_counter()
            model.run(None, feeds)
            times[name].append(time.perf_counter() - start)
    result = {"runtime": "openvino", "batch_size": len(next(iter(feeds.values()))), "threads": threads,
              "runs": runs, "fp32_precision": default}
    for name, values in times.items():
        result[f"{name}_ms"] = {"median": 1e3 * float(np.median(values)),
                                "p90": 1e3 * float(np.percentile(values, 90))}
    result["speedup"] = result["fp32_ms"]["median"] / result["int8_ms"]["median"]
    if "fp32_f32_ms" in result:
        result["speedup_vs_f32"] = result["fp32_f32_ms"]["median"] / result["int8_ms"]["median"]
    result["int8_layers"] = models["int8"].layers()
    return result
