"""Single QDQ Convs on onnxruntime CPU: int8 against float by input channels, the evidence behind
benchmarks/README.md's "Small CNNs with few input channels".

One Conv (3x3 or 1x1, pads keeping the size, 24 x 24, batch 1, 1 thread), float against the same Conv
written as qtool writes an int8 layer (QuantizeLinear/DequantizeLinear on its input and output,
int8 symmetric per-channel weight, int32 bias), for input channels 3 and 4 (and 6, 8, 16) and output
channels 12-32. The two sessions take turns, medians of `--runs`.

    python benchmarks/unaligned_convs.py [--runs 600]
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper

SHAPES = [(3, 32), (4, 32), (3, 28), (4, 28), (3, 20), (4, 20), (4, 18), (4, 12), (6, 16), (8, 16), (8, 28), (16, 32)]
SIZE = 24


def _session(cin: int, cout: int, k: int, int8: bool) -> ort.InferenceSession:
    rng = np.random.default_rng(0)
    w = rng.normal(0, 1, (cout, cin, k, k)).astype(np.float32)
    conv = {"kernel_shape": [k, k], "pads": [k // 2] * 4}
    if int8:
        scales = (np.abs(w).max(axis=(1, 2, 3)) / 127).astype(np.float32)
        codes = np.clip(np.rint(w / scales[:, None, None, None]), -127, 127).astype(np.int8)
        inits = [numpy_helper.from_array(codes, "wq"),
                 numpy_helper.from_array(scales, "ws"), numpy_helper.from_array(np.zeros(cout, np.int8), "wz"),
                 numpy_helper.from_array(np.zeros(cout, np.int32), "bq"),
                 numpy_helper.from_array((0.02 * scales).astype(np.float32), "bs"),
                 numpy_helper.from_array(np.zeros(cout, np.int32), "bz"),
                 numpy_helper.from_array(np.array(0.02, np.float32), "s"),
                 numpy_helper.from_array(np.array(128, np.uint8), "z")]
        nodes = [helper.make_node("QuantizeLinear", ["x", "s", "z"], ["xq"]),
                 helper.make_node("DequantizeLinear", ["xq", "s", "z"], ["xd"]),
                 helper.make_node("DequantizeLinear", ["wq", "ws", "wz"], ["wd"], axis=0),
                 helper.make_node("DequantizeLinear", ["bq", "bs", "bz"], ["bd"], axis=0),
                 helper.make_node("Conv", ["xd", "wd", "bd"], ["y"], **conv),
                 helper.make_node("QuantizeLinear", ["y", "s", "z"], ["yq"]),
                 helper.make_node("DequantizeLinear", ["yq", "s", "z"], ["out"])]
    else:
        inits = [numpy_helper.from_array(w, "w"), numpy_helper.from_array(np.zeros(cout, np.float32), "b")]
        nodes = [helper.make_node("Conv", ["x", "w", "b"], ["out"], **conv)]
    graph = helper.make_graph(nodes, "conv",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, cin, SIZE, SIZE])],
                              [helper.make_tensor_value_info("out", TensorProto.FLOAT, None)], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    model.ir_version = 8
    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    return ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=600)
    args = parser.parse_args()
    print("| kernel | input channels | output channels | float us | int8 (with its Q/DQ) us | int8 speed |")
    print("|---|---|---|---|---|---|")
    for k in (3, 1):
        for cin, cout in SHAPES:
            sessions = {"float": _session(cin, cout, k, False), "int8": _session(cin, cout, k, True)}
            x = np.random.default_rng(1).normal(size=(1, cin, SIZE, SIZE)).astype(np.float32)
            times = {name: [] for name in sessions}
            for r in range(args.runs):
                for name in (("float", "int8") if r % 2 == 0 else ("int8", "float")):
                    start = time.perf_counter()
                    sessions[name].run(None, {"x": x})
                    times[name].append(time.perf_counter() - start)
            f, q = (float(np.median(times[name])) * 1e6 for name in ("float", "int8"))
            print(f"| {k}x{k} | {cin} | {cout} | {f:.1f} | {q:.1f} | {f / q:.2f}x |", flush=True)


if __name__ == "__main__":
    main()
