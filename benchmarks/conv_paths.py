"""Which onnxruntime int8 convolution path is fastest, and could qtool's QDQ choices pick a faster
one? The evidence behind benchmarks/README.md's measurements of onnxruntime's int8 convolution paths.

Three measurements, each interleaved in one process (medians, 1 thread, batch 8):

1. per layer: onnxruntime's profiler on the kit's EfficientNet-Lite0, fp32 against qtool `ort-cpu`
   int8, layer by layer (both graphs run their convs in the same order).
2. kernels: one QLinearConv per shape (channels-last, as onnxruntime runs it after its NHWC
   transformer), with the three parameter choices that select MLAS's three int8 paths:
   - "u8s8 sym": uint8 activations, int8 weights with zero point 0 -> ConvSym (what qtool writes);
   - "u8s8 wzp": the same with a non-zero weight zero point -> MlasConvDepthwise / MlasGemm + requantize;
   - "s8s8": int8 activations (litert/tensorrt presets) -> no ConvSym on x86.
   plus, for depthwise 3x3 at 112x112, a channel sweep (the per-output-pixel cost).
3. stem: qtool's space-to-depth stem (qtool/quantization/ort_cpu/stem_s2d.py) against a 4-channel padded
   stem (qtool/quantization/ort_cpu/channel_pad.py), whole model, outputs compared bit for bit.

    python benchmarks/conv_paths.py            # about 3 minutes
    python benchmarks/conv_paths.py --runs 50  # more runs per measurement
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import numpy as np
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from qtool.calibration.calibrate import calibrate  # noqa: E402
from qtool.config import CalibrationConfig, QuantizeConfig, load_config  # noqa: E402
from qtool.graph.runtime import time_models  # noqa: E402
from qtool.graph.modelio import save_model  # noqa: E402
import qtool.quantization.ort_cpu as ort_cpu  # noqa: E402
import qtool.quantization.quantize as quantize_module  # noqa: E402
from speed import kernel_events  # noqa: E402  (benchmarks/speed.py, same folder)
from qtool.quantization.quantize import quantize_model  # noqa: E402

KIT = ROOT.parent / "shared" / "bench"
FP32 = KIT / "models" / "efficientnet_lite0_dyn.onnx"
BATCH = 8


def _session(model) -> ort.InferenceSession:
    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    options.log_severity_level = 3
    return ort.InferenceSession(model, options, providers=["CPUExecutionProvider"])


def _interleaved(cases: dict[str, tuple[bytes, dict]], runs: int) -> dict[str, float]:
    sessions = {name: (_session(model), feeds) for name, (model, feeds) in cases.items()}
    times = defaultdict(list)
    for session, feeds in sessions.values():
        session.run(None, feeds)
    for _ in range(runs):
        for name, (session, feeds) in sessions.items():
            start = time.perf_counter()
            session.run(None, feeds)
            times[name].append(time.perf_counter() - start)
    return {name: 1000 * float(np.median(t)) for name, t in times.items()}


def conv_ms(path: str, feeds: dict, runs: int) -> list[tuple[str, float, list]]:
    """(op, median ms, input shapes) of every Conv/QLinearConv in execution order."""
    events = [e for e in kernel_events(path, feeds, 1, runs)
              if e["args"]["op_name"] in ("Conv", "FusedConv", "QLinearConv")]
    per_run = len(events) // (runs + 1)
    rows = []
    for i in range(per_run):
        durations = [events[r * per_run + i]["dur"] / 1000 for r in range(1, runs + 1)]
        shapes = [list(s.values())[0] for s in events[i]["args"]["input_type_shape"]]
        rows.append((events[i]["args"]["op_name"], float(np.median(durations)), shapes))
    return rows


def per_layer(fp32: str, int8: str, feeds: dict, runs: int) -> None:
    f_rows, q_rows = conv_ms(fp32, feeds, runs), conv_ms(int8, feeds, runs)
    assert len(f_rows) == len(q_rows), "conv counts differ"
    totals = defaultdict(lambda: [0.0, 0.0])
    print("\n1. per layer (fp32 NCHWc Conv vs qtool QLinearConv, ms, batch 8, 1 thread)")
    print(f"{'layer':34s} {'fp32':>6s} {'int8':>6s} {'ratio':>6s}")
    for (_, f_ms, f_shapes), (_, q_ms, q_shapes) in zip(f_rows, q_rows):
        x, w = f_shapes[0], f_shapes[1]  # NCHW input, OIHW weight
        depthwise = w[1] == 1 and w[0] > 1
        kind = f"depthwise {w[2]}x{w[3]}" if depthwise else "pointwise" if w[2:] == [1, 1] else f"conv {w[2]}x{w[3]}"
        totals[kind.split()[0]][0] += f_ms
        totals[kind.split()[0]][1] += q_ms
        label = f"{kind} {w[1] * (1 if not depthwise else w[0])}->{w[0]} @{x[2]}"
        print(f"{label:34s} {f_ms:6.2f} {q_ms:6.2f} {f_ms / q_ms:5.2f}x")
    for kind, (f_ms, q_ms) in totals.items():
        print(f"total {kind:28s} {f_ms:6.2f} {q_ms:6.2f} {f_ms / q_ms:5.2f}x")


def qlinearconv(h: int, c: int, m: int, k: int, stride: int, group: int, act: str = "u8",
                weight_zero: int = 0) -> tuple[bytes, dict]:
    """One channels-last QLinearConv (com.microsoft, as onnxruntime's NHWC transformer writes it)."""
    rng = np.random.default_rng(0)
    act_type, np_act, zero = (TensorProto.UINT8, np.uint8, 128) if act == "u8" else (TensorProto.INT8, np.int8, 0)
    weight = rng.integers(-127, 128, (m, c // group, k, k)).astype(np.int8)
    inits = [numpy_helper.from_array(np.array(0.02, np.float32), "xs"), numpy_helper.from_array(np.array(zero, np_act), "xz"),
             numpy_helper.from_array(weight, "w"), numpy_helper.from_array(np.full(m, 0.01, np.float32), "ws"),
             numpy_helper.from_array(np.full(m, weight_zero, np.int8), "wz"),
             numpy_helper.from_array(np.array(0.05, np.float32), "ys"), numpy_helper.from_array(np.array(zero, np_act), "yz"),
             numpy_helper.from_array(rng.integers(-100, 100, m).astype(np.int32), "b")]
    node = helper.make_node("QLinearConv", ["x", "xs", "xz", "w", "ws", "wz", "ys", "yz", "b"], ["y"],
                            domain="com.microsoft", channels_last=1, kernel_shape=[k, k], strides=[stride] * 2,
                            pads=[k // 2] * 4, group=group)
    graph = helper.make_graph([node], "g", [helper.make_tensor_value_info("x", act_type, [BATCH, h, h, c])],
                              [helper.make_tensor_value_info("y", act_type, None)], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13), helper.make_opsetid("com.microsoft", 1)])
    x = rng.integers(0, 255, (BATCH, h, h, c)).astype(np.uint8).view(np_act)
    return model.SerializeToString(), {"x": x}


def kernels(runs: int) -> None:
    print("\n2. one channels-last QLinearConv per shape, ms (batch 8, 1 thread)")
    shapes = [  # (H, Cin, Cout, k, stride, group): EfficientNet-Lite0's depthwise shapes and a few pointwise
        (112, 32, 32, 3, 1, 32), (112, 96, 96, 3, 2, 96), (56, 144, 144, 3, 1, 144), (56, 144, 144, 5, 2, 144),
        (28, 240, 240, 5, 1, 240), (14, 480, 480, 3, 1, 480), (14, 672, 672, 5, 1, 672), (7, 1152, 1152, 5, 1, 1152),
        (112, 32, 16, 1, 1, 1), (112, 16, 96, 1, 1, 1), (56, 24, 144, 1, 1, 1), (56, 144, 24, 1, 1, 1)]
    print(f"{'shape':34s} {'u8s8 sym':>9s} {'u8s8 wzp':>9s} {'s8s8':>9s}")
    for h, c, m, k, s, g in shapes:
        cases = {"sym": qlinearconv(h, c, m, k, s, g), "wzp": qlinearconv(h, c, m, k, s, g, weight_zero=1),
                 "s8s8": qlinearconv(h, c, m, k, s, g, act="s8")}
        ms = _interleaved(cases, runs)
        label = f"{'depthwise' if g > 1 else 'conv'} {k}x{k}/{s} {c}->{m} @{h}"
        print(f"{label:34s} {ms['sym']:9.2f} {ms['wzp']:9.2f} {ms['s8s8']:9.2f}")
    sweep = {f"C={c}": qlinearconv(112, c, c, 3, 1, c) for c in (16, 32, 48, 64)}
    ms = _interleaved(sweep, runs)
    print("depthwise 3x3/1 @112, u8s8 sym, by channels: " + ", ".join(f"{n} {v:.2f}" for n, v in ms.items()))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=20, help="timed runs per measurement (median)")
    runs = parser.parse_args().runs
    print(f"onnxruntime {ort.__version__}, load average {os.getloadavg()}")
    cfg = load_config(ROOT / "configs" / "efficientnet_lite0.yaml")
    options = QuantizeConfig(target="ort-cpu")
    table = calibrate(FP32, KIT / "data" / "calib" / "images", cfg.preprocess,
                      CalibrationConfig(batch_size=1, num_samples=8), options, progress=False)
    with tempfile.TemporaryDirectory() as tmp:
        int8 = os.path.join(tmp, "ort_cpu.onnx")
        model = quantize_model(FP32, table, options).model
        save_model(model, int8)
        x = np.random.default_rng(0).standard_normal((BATCH, 3, 224, 224)).astype(np.float32)
        per_layer(str(FP32), int8, {"input": x}, runs)
        kernels(runs)
        padded = os.path.join(tmp, "padded.onnx")
        rewrite, ort_cpu.space_to_depth_stems = ort_cpu.space_to_depth_stems, lambda model: []
        save_model(quantize_module.quantize_model(FP32, table, options).model, padded)
        ort_cpu.space_to_depth_stems = rewrite
        same = np.array_equal(_session(int8).run(None, {"input": x})[0], _session(padded).run(None, {"input": x})[0])
        times = time_models({"fp32": str(FP32), "qtool padded stem": padded, "qtool s2d stem": int8}, {"input": x},
                            1, 3, runs)
        ms = {name: 1000 * float(np.median(t)) for name, t in times.items()}
        print(f"\n3. stem (outputs bit-identical: {same}), whole model ms (speedup): "
              + ", ".join(f"{n} {v:.1f} ({ms['fp32'] / v:.2f}x)" for n, v in ms.items()))
    print(f"load average at the end {os.getloadavg()}")


if __name__ == "__main__":
    main()
