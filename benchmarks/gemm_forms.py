"""One 256x256 Gemm + Tanh at batch 1 (the romanizer encoder's bridge layer) in fp32 and in the int8
forms onnxruntime CPU has for it, timed alone: median thread CPU time per run, 1 thread, the forms
taking turns.

    python benchmarks/gemm_forms.py [--runs 3000]

Forms: fp32 (onnxruntime fuses Gemm+Tanh into FusedGemm), dynamic (DynamicQuantizeLinear,
MatMulInteger, rescale, bias: fused into DynamicQuantizeMatMul, then Tanh; what `matmul: dynamic`
writes), static with a calibrated input scale (QuantizeLinear, MatMulIntegerToFloat with the bias,
Tanh) and static as QGemm with float output (QuantizeLinear, QGemm, Tanh).
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper as nh


def _model(nodes, inits):
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 256])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 256])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)])
    model.ir_version = 8
    return model


def forms() -> dict:
    rng = np.random.default_rng(0)
    w = rng.normal(0, 0.05, (256, 256)).astype(np.float32)
    b = rng.normal(0, 0.1, 256).astype(np.float32)
    wt = w.T.copy()
    ws = (np.abs(wt).max(0) / 127).astype(np.float32)
    wq = np.round(wt / ws).astype(np.int8)
    xs, xz = np.array(4 / 255, np.float32), np.array(128, np.uint8)
    common = [nh.from_array(wq, "wq"), nh.from_array(np.zeros(256, np.int8), "wz"), nh.from_array(ws, "ws")]
    tanh = helper.make_node("Tanh", ["g"], ["y"])
    return {
        "fp32": _model([helper.make_node("Gemm", ["x", "w", "b"], ["g"], transB=1), tanh],
                       [nh.from_array(w, "w"), nh.from_array(b, "b")]),
        "dynamic": _model([helper.make_node("DynamicQuantizeLinear", ["x"], ["xq", "xs", "xz"]),
                           helper.make_node("MatMulInteger", ["xq", "wq", "xz", "wz"], ["i32"]),
                           helper.make_node("Cast", ["i32"], ["f"], to=TensorProto.FLOAT),
                           helper.make_node("Mul", ["xs", "ws"], ["s"]), helper.make_node("Mul", ["f", "s"], ["p"]),
                           helper.make_node("Add", ["p", "b"], ["g"]), tanh], [*common, nh.from_array(b, "b")]),
        "static MatMulIntegerToFloat": _model(
            [helper.make_node("QuantizeLinear", ["x", "xs", "xz"], ["xq"]),
             helper.make_node("MatMulIntegerToFloat", ["xq", "wq", "xs", "ws", "xz", "wz", "b"], ["g"],
                              domain="com.microsoft"), tanh],
            [*common, nh.from_array(b, "b"), nh.from_array(xs, "xs"), nh.from_array(xz, "xz")]),
        "static QGemm, float output": _model(
            [helper.make_node("QuantizeLinear", ["x", "xs", "xz"], ["xq"]),
             helper.make_node("QGemm", ["xq", "xs", "xz", "wqt", "ws", "wz", "bi"], ["g"], domain="com.microsoft",
                              transB=1), tanh],
            [nh.from_array(wq.T.copy(), "wqt"), nh.from_array(np.zeros(256, np.int8), "wz"), nh.from_array(ws, "ws"),
             nh.from_array(np.round(b / (xs * ws)).astype(np.int32), "bi"), nh.from_array(xs, "xs"),
             nh.from_array(xz, "xz")]),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3000)
    args = parser.parse_args()
    options = ort.SessionOptions()
    options.intra_op_num_threads = options.inter_op_num_threads = 1
    sessions = {name: ort.InferenceSession(m.SerializeToString(), options, providers=["CPUExecutionProvider"])
                for name, m in forms().items()}
    feeds = {"x": np.random.default_rng(1).normal(0, 1, (1, 256)).astype(np.float32)}
    for session in sessions.values():
        session.run(None, feeds)
    times = {name: [] for name in sessions}
    for _ in range(args.runs):
        for name, session in sessions.items():
            start = time.thread_time_ns()
            session.run(None, feeds)
            times[name].append(time.thread_time_ns() - start)
    for name, values in times.items():
        print(f"{name}: {np.median(values) / 1e3:.1f} us")


if __name__ == "__main__":
    main()
