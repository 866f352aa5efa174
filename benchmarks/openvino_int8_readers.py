"""Which ops OpenVINO's CPU plugin passes int8 activation codes through correctly on a CPU without AMX.

    python benchmarks/openvino_int8_readers.py

Tiny QDQ models, each a Q/DQ pair on the input (scale 0.03, written int8 with zero point 0 and
written uint8 with zero point 128: the same grid, the same values), then one op that passes the
codes on (or none), then a 1x1 Convolution whose int8 weights copy its input channels, so the
output is the dequantized codes themselves. Each model runs in onnxruntime (the reference: the
exact QDQ arithmetic) and in OpenVINO at f32, here and in child processes whose oneDNN is capped
at AVX-512 VNNI and at AVX-512 BF16 (ONEDNN_MAX_CPU_ISA: what CPUs without AMX run; OpenVINO then
runs every int8 Convolution with uint8 inputs and converts int8 codes). Prints, per ISA, op and
code type, the largest difference from onnxruntime in codes (0 = computed exactly; int8 / uint8)
and the Convolution's runtime precision. The `openvino` target writes uint8 codes wherever they
pass an op other than a layer, an Add or a Resize (qtool.targets, signed_as_uint8).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

# benchmarks/openvino.py would shadow the openvino package: this file's folder leaves sys.path
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]

import numpy as np  # noqa: E402
import onnx  # noqa: E402
from onnx import TensorProto, helper, numpy_helper  # noqa: E402

CAPS = ("", "AVX512_CORE_VNNI", "AVX512_CORE_BF16")
SCALE = 0.03
CHANNELS, SIZE = 16, 8
READERS = ("none", "Split", "Slice", "MaxPool", "AveragePool", "Transpose", "Resize", "Concat", "Split+Concat",
           "MaxPool+Concat")


def build(reader: str, codes: str) -> onnx.ModelProto:
    """input -> Q/DQ (`codes`) -> `reader` -> 1x1 Conv copying the channels it reads."""
    zero = helper.make_tensor("z", TensorProto.INT8 if codes == "int8" else TensorProto.UINT8, [],
                              [0 if codes == "int8" else 128])
    inits = [numpy_helper.from_array(np.array(SCALE, np.float32), "s"), zero]
    nodes = [helper.make_node("QuantizeLinear", ["x", "s", "z"], ["q"]),
             helper.make_node("DequantizeLinear", ["q", "s", "z"], ["d"])]
    channels, last = CHANNELS, "d"

    def add(op, inputs, outputs=1, **attrs):
        names = [f"{op.lower()}{len(nodes)}_{k}" for k in range(outputs)]
        nodes.append(helper.make_node(op, inputs, names, **attrs))
        return names

    for op in reader.split("+"):
        if op == "Split":
            inits.append(numpy_helper.from_array(np.array([channels // 2] * 2, np.int64), "halves"))
            first, second = add("Split", [last, "halves"], 2, axis=1)
            last, channels = second, channels // 2
            if reader == "Split+Concat":
                last, channels = add("Concat", [first, add("Neg", [second])[0]], axis=1)[0], CHANNELS
                break
        elif op == "Slice":
            for name, value in (("start", 0), ("end", channels // 2), ("axis", 1)):
                inits.append(numpy_helper.from_array(np.array([value], np.int64), name))
            last, channels = add("Slice", [last, "start", "end", "axis"])[0], channels // 2
        elif op == "MaxPool":
            last = add("MaxPool", [last], kernel_shape=[3, 3], pads=[1, 1, 1, 1])[0]
        elif op == "AveragePool":
            last = add("AveragePool", [last], kernel_shape=[2, 2], strides=[2, 2])[0]
        elif op == "Transpose":
            last = add("Transpose", [last], perm=[0, 1, 3, 2])[0]
        elif op == "Resize":
            inits.append(numpy_helper.from_array(np.array([1, 1, 2, 2], np.float32), "scales"))
            last = add("Resize", [last, "", "scales"], mode="nearest")[0]
        elif op == "Concat":
            source = "d" if reader == "MaxPool+Concat" else last
            last, channels = add("Concat", [source, last] if reader == "MaxPool+Concat" else [last, last],
                                 axis=1)[0], 2 * channels
    weights = np.zeros((CHANNELS, channels, 1, 1), np.int8)
    for k in range(CHANNELS):
        weights[k, k % channels] = 127
    inits += [numpy_helper.from_array(weights, "wq"),
              numpy_helper.from_array(np.full(CHANNELS, 1 / 127, np.float32), "ws"),
              helper.make_tensor("wz", TensorProto.INT8, [CHANNELS], [0] * CHANNELS)]
    nodes += [helper.make_node("DequantizeLinear", ["wq", "ws", "wz"], ["w"], axis=0),
              helper.make_node("Conv", [last, "w"], ["y"], kernel_shape=[1, 1])]
    graph = helper.make_graph(nodes, "probe", [helper.make_tensor_value_info("x", TensorProto.FLOAT,
                                                                             [1, CHANNELS, SIZE, SIZE])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])


def measure() -> dict:
    """reader -> codes -> (largest difference from onnxruntime in codes, the Convolution's precision)."""
    import onnxruntime as ort
    import openvino as ov

    core = ov.Core()
    x = np.linspace(-5, 5, CHANNELS * SIZE * SIZE, dtype=np.float32).reshape(1, CHANNELS, SIZE, SIZE)
    found = {}
    for reader in READERS:
        for codes in ("int8", "uint8"):
            model = build(reader, codes).SerializeToString()
            expected = ort.InferenceSession(model, providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
            compiled = core.compile_model(core.read_model(model, b""), "CPU",
                                          {"INFERENCE_PRECISION_HINT": "f32", "INFERENCE_NUM_THREADS": 1})
            got = compiled({"x": x})[compiled.outputs[0]]
            precision = [op.get_rt_info()["runtimePrecision"].astype(str)
                         for op in compiled.get_runtime_model().get_ordered_ops()
                         if op.get_rt_info()["layerType"].astype(str) == "Convolution"]
            found.setdefault(reader, {})[codes] = (float(np.abs(got - expected).max() / SCALE), precision[0])
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    if parser.parse_args().child:
        print(json.dumps(measure()))
        return
    found = {}
    for cap in CAPS:
        env = {k: v for k, v in os.environ.items() if k != "ONEDNN_MAX_CPU_ISA"}
        if cap:
            env["ONEDNN_MAX_CPU_ISA"] = cap
        done = subprocess.run([sys.executable, __file__, "--child"], env=env, capture_output=True, text=True,
                              check=True)
        found[cap] = json.loads(done.stdout.strip().splitlines()[-1])
    print("| codes pass | " + " | ".join(cap or "as the CPU has" for cap in CAPS) + " |")
    print("|---" * (len(CAPS) + 1) + "|")
    for reader in READERS:
        cells = []
        for cap in CAPS:
            (i8, pi8), (u8, pu8) = found[cap][reader]["int8"], found[cap][reader]["uint8"]
            cells.append(f"{i8:.1f} ({pi8}) / {u8:.1f} ({pu8})")
        print(f"| {reader} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
