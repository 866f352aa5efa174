"""Where qtool's --target openvino models trail NNCF's on OpenVINO: two probes of the files that
benchmarks/openvino.py --out DIR wrote.

    python benchmarks/openvino.py --nncf-python PY --out DIR [--models NAME,...]
    python benchmarks/openvino_gaps.py --out DIR [--models NAME,...] [--rounds 12]

For each model folder of DIR holding qtool_openvino.onnx and nncf.onnx, on its held-out samples
(as benchmarks/openvino.py picks them), two edits of qtool's model are written beside it:
- `no_tail_shift`: the additive constant of each equalized chain's tail (the `+ b` of a scalar
  affine after a hard-swish, before the per-channel Mul that rescales the chain) set to 0. Not the
  same function: a timing probe. OpenVINO folds the Mul and that constant into the quantizer
  after them, whose input shift is then per channel, and its CPU plugin runs such a quantizer as
  its general post-op instead of one scale;
- `int8_codes`: every uint8 zero-point-128 Q/DQ pair (the int8 grid written uint8, target trait
  signed_as_uint8) written int8 with zero point 0: the same values.

1. Layers: each model compiled with OpenVINO's per-layer counters, 1 thread, batch 1, the models
   taking turns round by round over every held-out sample; per model, the median over rounds of
   the wall time per sample and of the sum of its layers' times, the Convolutions' share, and the
   Convolutions by kernel (exec type: "I8" is OpenVINO's name for an unsigned int8 input).
2. Codes without AMX: the mean worst-output cosine to fp32 at f32 (as benchmarks/openvino.py) of
   qtool's model, NNCF's, `int8_codes` and each uint8 zero-point-128 pair alone written int8, here
   and in a child process whose oneDNN is capped at AVX-512 VNNI (ONEDNN_MAX_CPU_ISA, what a CPU
   without AMX runs).
Prints one JSON line per model.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import time
from collections import Counter, defaultdict
from pathlib import Path

import numpy as np
import onnx
from onnx import numpy_helper

_spec = importlib.util.spec_from_file_location("ov_bench", Path(__file__).with_name("openvino.py"))
ov_bench = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(ov_bench)  # noqa: E305 - sets sys.path for qtool and openvino too

from qtool.graph.index import GraphIndex  # noqa: E402 - after ov_bench put qtool on sys.path

CAP = "AVX512_CORE_VNNI"


def _constant(name: str, index: GraphIndex) -> tuple[onnx.TensorProto | None, np.ndarray | None]:
    """The tensor holding a constant input (GraphIndex.constant_tensor) and its values."""
    tensor = index.constant_tensor(name)
    return (tensor, numpy_helper.to_array(tensor)) if tensor is not None else (None, None)


def without_tail_shift(model: onnx.ModelProto) -> int:
    """Zero the constant of each Add that feeds an equalized chain's rescaling Mul; how many."""
    index = GraphIndex(model)
    done = 0
    for node in model.graph.node:
        add = index.producer.get(node.input[0]) if node.op_type == "Mul" and node.name.endswith("_equalized_out") \
            else None
        if add is None or add.op_type != "Add":
            continue
        for name in add.input:
            tensor, value = _constant(name, index)
            if tensor is not None:
                tensor.CopyFrom(numpy_helper.from_array(np.zeros_like(value), tensor.name))
                done += 1
                break
    return done


def uint8_grid_pairs(model: onnx.ModelProto) -> list[onnx.NodeProto]:
    """The QuantizeLinear nodes with a uint8 zero point of 128, in graph order."""
    index = GraphIndex(model)
    found = []
    for node in model.graph.node:
        if node.op_type == "QuantizeLinear" and len(node.input) > 2:
            _, zero = _constant(node.input[2], index)
            if zero is not None and zero.dtype == np.uint8 and np.all(zero == 128):
                found.append(node)
    return found


def as_int8(base: onnx.ModelProto, picks: list[int]) -> onnx.ModelProto:
    """A copy of `base` with the picked uint8 zero-point-128 pairs (indices into uint8_grid_pairs)
    written int8 with zero point 0: each Q and the DQs reading it take a new int8 zero point."""
    model = onnx.ModelProto()
    model.CopyFrom(base)
    pairs, index = uint8_grid_pairs(model), GraphIndex(model)
    for k in picks:
        q = pairs[k]
        _, zero = _constant(q.input[2], index)
        name = f"{q.output[0]}_zero_int8"
        model.graph.initializer.append(numpy_helper.from_array(np.zeros(zero.shape, np.int8), name))
        for node in (q, *(r for r in index.consumers.get(q.output[0], []) if r.op_type == "DequantizeLinear")):
            node.input[2] = name
    return model


def _samples(held: Path, model: Path) -> list[dict]:
    proto = onnx.load(str(model), load_external_data=False)
    inits = {t.name for t in proto.graph.initializer}
    return ov_bench._feeds(held, [i.name for i in proto.graph.input if i.name not in inits])


def layers(paths: dict[str, Path], samples: list[dict], rounds: int) -> dict:
    """label -> wall and layer ms per sample, Convolution ms, Convolutions by kernel."""
    import openvino as ov

    core = ov.Core()
    config = {"INFERENCE_NUM_THREADS": 1, "NUM_STREAMS": 1, "PERF_COUNT": True}
    requests = {label: core.compile_model(str(path), "CPU", config).create_infer_request()
                for label, path in paths.items()}
    wall, layer, conv = (defaultdict(list) for _ in range(3))
    kernels: dict[str, Counter] = {}
    for turn in range(rounds + 1):
        for label, request in requests.items():
            seconds = summed = convs = 0.0
            found = Counter()
            for feeds in samples:
                start = time.perf_counter()
                request.infer(feeds)
                seconds += time.perf_counter() - start
                for info in request.profiling_info:
                    summed += info.real_time.total_seconds()
                    if info.node_type == "Convolution":
                        convs += info.real_time.total_seconds()
                        found[info.exec_type] += 1
            if turn:  # the first round warms up
                for store, value in ((wall, seconds), (layer, summed), (conv, convs)):
                    store[label].append(value * 1e3 / len(samples))
                kernels[label] = found
    return {label: {"wall_ms": statistics.median(wall[label]), "layer_ms": statistics.median(layer[label]),
                    "conv_ms": statistics.median(conv[label]),
                    "conv_kernels": {k: v // len(samples) for k, v in kernels[label].items()}}
            for label in requests}


def cosines(fp32: Path, paths: dict[str, Path], held: Path) -> dict[str, float]:
    """label -> mean worst-output cosine to fp32 at f32 on OpenVINO, in this process."""
    from qtool.evaluation.openvino_runtime import CompiledModel

    samples = _samples(held, fp32)
    reference = CompiledModel(fp32, 1, "f32")
    expected = [reference.run(None, s) for s in samples]
    found = {}
    for label, path in paths.items():
        compiled = CompiledModel(path, 1)
        found[label] = float(np.mean([ov_bench._worst_cosine(r, compiled.run(None, s))
                                      for r, s in zip(expected, samples)]))
    return found


def capped_cosines(fp32: Path, paths: dict[str, Path], held: Path) -> dict[str, float]:
    """cosines() in a child process whose oneDNN is capped at AVX-512 VNNI (no AMX)."""
    script = ("import json, sys; from pathlib import Path; sys.argv.pop(0); import importlib.util as u; "
              f"s = u.spec_from_file_location('gaps', {str(Path(__file__))!r}); g = u.module_from_spec(s); "
              "s.loader.exec_module(g); "
              "print(json.dumps(g.cosines(Path(sys.argv[0]), json.loads(sys.argv[1]), Path(sys.argv[2]))))")
    done = subprocess.run([sys.executable, "-c", script, str(fp32), json.dumps({k: str(v) for k, v in paths.items()}),
                           str(held)], env=dict(os.environ, ONEDNN_MAX_CPU_ISA=CAP), capture_output=True, text=True)
    if done.returncode:
        raise RuntimeError(done.stderr.strip().splitlines()[-1])
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kit", type=Path, default=ov_bench.ROOT.parent / "shared" / "bench")
    parser.add_argument("--out", type=Path, required=True, help="benchmarks/openvino.py's --out")
    parser.add_argument("--models", default="", help="comma-separated model stems (default: every folder)")
    parser.add_argument("--rounds", type=int, default=12)
    args = parser.parse_args()
    wanted = {m for m in args.models.split(",") if m}
    for work in sorted(p for p in args.out.iterdir() if p.is_dir()):
        ours, nncf, fp32 = work / "qtool_openvino.onnx", work / "nncf.onnx", args.kit / "models" / f"{work.name}.onnx"
        if (wanted and work.name not in wanted) or not (ours.exists() and nncf.exists() and fp32.exists()):
            continue
        _, held, _ = ov_bench._data(args.kit, fp32, work)
        base = onnx.load(str(ours))
        paths = {"qtool": ours, "nncf": nncf}
        model = onnx.ModelProto()
        model.CopyFrom(base)
        shifted = without_tail_shift(model)
        if shifted:
            paths["no_tail_shift"] = work / "probe_no_tail_shift.onnx"
            onnx.save(model, paths["no_tail_shift"])
        pairs = [q.name for q in uint8_grid_pairs(base)]
        if pairs:
            paths["int8_codes"] = work / "probe_int8_codes.onnx"
            onnx.save(as_int8(base, list(range(len(pairs)))), paths["int8_codes"])
        row = {"model": work.name, "tail_shifts": shifted, "uint8_grid_pairs": len(pairs),
               "layers": layers(paths, _samples(held, fp32), args.rounds)}
        if pairs:
            single = {f"pair_{k}": work / f"probe_pair_{k}.onnx" for k in range(len(pairs))}
            for k, path in enumerate(single.values()):
                onnx.save(as_int8(base, [k]), path)
            probed = {label: paths[label] for label in ("qtool", "nncf", "int8_codes")}
            row["cosine"] = cosines(fp32, probed, held)
            row["cosine_without_amx"] = capped_cosines(fp32, {**probed, **single}, held)
            row["pairs"] = pairs
            for path in single.values():
                path.unlink()
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
