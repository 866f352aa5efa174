"""Recurrent layers on real models: LSTM weights int8 (DynamicQuantizeLSTM) against fp32, and the
GRU note.

silero VAD (16 kHz, opset 15) keeps its LSTM in the then-branch of `/model/decoder/If_1` (the
branch taken whenever a state is fed, i.e. always in streaming use), with W, R and B computed
from Constant nodes by Slice/Concat. This script inlines the taken branch into the main graph and
folds W, R and B into initializers, so the LSTM can be measured on its own (qtool also rewrites the
LSTM in place in the original); the result computes exactly what the original does (checked on
every chunk). Then:

- variants: fp32; `lstm` (only the LSTM quantized: every other op type excluded); `full` (the
  default ort-cpu job on the kit's 64 calibration chunks); `full-no-lstm` (the same with LSTM
  excluded), so the LSTM's share of the full model's error shows;
- streaming: the kit's 13.9 s of speech, 512-sample chunks with the previous chunk's last 64
  samples as context, each model feeding back its own state (the LSTM's h and c, so errors can
  accumulate over 430 steps): the VAD probability and the state against fp32's, and how many
  chunks change side of the 0.5 speech threshold;
- one step: the kit's 64 calibration chunks, each with its recorded fp32 state;
- latency per chunk, batch 1, 1 thread, the variants taking turns run by run.

arabic_name_romanizer_encoder: its two GRUs alone (real weights, real inputs captured from the
fp32 encoder on the kit's samples) go through qtool, which must leave them float with a note.

    python benchmarks/recurrent.py                  # a few minutes on 2 cores
    python benchmarks/recurrent.py --runs 50        # fewer latency runs
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import wave
from pathlib import Path

import numpy as np
import onnx
from onnx import helper, numpy_helper

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import qtool  # noqa: E402
from qtool.evaluation.metrics import percentile_ms, sqnr_db  # noqa: E402
from qtool.graph.edit import with_outputs  # noqa: E402
from qtool.graph.index import GraphIndex, names_read  # noqa: E402
from qtool.graph.runtime import create_session, time_models  # noqa: E402

KIT = ROOT.parent / "shared" / "bench"
SILERO = KIT / "models" / "silero_vad_16k_op15.onnx"
SILERO_CALIB = KIT / "inputs" / "silero_vad_16k_op15" / "calib"
SPEECH = KIT / "data" / "audio" / "speech16k.wav"
ROMANIZER = KIT / "models" / "arabic_name_romanizer_encoder.onnx"
ROMANIZER_INPUTS = KIT / "inputs" / "arabic_name_romanizer_encoder"
LSTM_BRANCH = "/model/decoder/If_1"
CHUNK, CONTEXT = 512, 64


def inline_lstm_branch(model: onnx.ModelProto) -> onnx.ModelProto:
    """The model with If_1's then-branch in the main graph and the LSTM's W, R, B as initializers."""
    out = onnx.ModelProto()
    out.CopyFrom(model)
    graph = out.graph
    nodes = list(graph.node)
    index = next(i for i, n in enumerate(nodes) if n.name == LSTM_BRANCH)
    branch = next(a.g for a in nodes[index].attribute if a.name == "then_branch")
    exits = [helper.make_node("Identity", [inner.name], [outer], name=f"{LSTM_BRANCH}/then/{outer}")
             for inner, outer in zip(branch.output, nodes[index].output)]
    del graph.node[:]
    graph.node.extend(nodes[:index] + list(branch.node) + exits + nodes[index + 1:])
    graph.initializer.extend(branch.initializer)
    lstm = next(n for n in graph.node if n.op_type == "LSTM")
    computed = list(lstm.input[1:4])
    sample = dict(np.load(next(iter(sorted(SILERO_CALIB.glob("*.npz"))))))
    values = create_session(with_outputs(out, computed), 1, "inlined").run(computed, sample)
    for slot, (name, value) in enumerate(zip(["lstm.W", "lstm.R", "lstm.B"], values), start=1):
        graph.initializer.append(numpy_helper.from_array(value, name))
        lstm.input[slot] = name
    _prune(graph)
    return out


def _prune(graph: onnx.GraphProto) -> None:
    """Drop the nodes nothing reads any more (the Slice/Concat chains that built W, R, B)."""
    needed = {o.name for o in graph.output}
    kept = []
    for node in reversed(list(graph.node)):
        if any(o in needed for o in node.output):
            kept.append(node)
            needed |= names_read(node)
    del graph.node[:]
    graph.node.extend(reversed(kept))
    used = set(needed)
    keep = [t for t in graph.initializer if t.name in used]
    del graph.initializer[:]
    graph.initializer.extend(keep)


def speech_chunks() -> list[np.ndarray]:
    with wave.open(str(SPEECH)) as f:
        audio = np.frombuffer(f.readframes(f.getnframes()), np.int16).astype(np.float32) / 32768.0
    chunks, context = [], np.zeros(CONTEXT, np.float32)
    for start in range(0, len(audio) - CHUNK + 1, CHUNK):
        chunk = audio[start:start + CHUNK]
        chunks.append(np.concatenate([context, chunk])[None, :])
        context = chunk[-CONTEXT:]
    return chunks


def stream(path: str, chunks: list[np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """VAD probability per chunk and the state after each, the model feeding back its own state."""
    session = create_session(path, 1, path)
    state = np.zeros((2, 1, 128), np.float32)
    probs, states = [], []
    for chunk in chunks:
        prob, state = session.run(["output", "stateN"], {"input": chunk, "state": state, "sr": np.array(16000)})
        probs.append(float(prob.reshape(-1)[0]))
        states.append(state)
    return np.array(probs), np.stack(states)


def one_step(path: str, samples: list[dict]) -> tuple[np.ndarray, np.ndarray]:
    session = create_session(path, 1, path)
    out = [session.run(["output", "stateN"], s) for s in samples]
    return np.array([float(p.reshape(-1)[0]) for p, _ in out]), np.stack([s for _, s in out])


def fidelity(ref: np.ndarray, test: np.ndarray) -> dict:
    r, t = ref.astype(np.float64).reshape(-1), test.astype(np.float64).reshape(-1)
    cosine = float(r @ t / (np.linalg.norm(r) * np.linalg.norm(t)))
    return {"cosine": round(cosine, 6), "sqnr_db": round(sqnr_db(float(r @ r), float((r - t) @ (r - t))), 2),
            "max_abs": round(float(np.abs(r - t).max()), 5), "mean_abs": round(float(np.abs(r - t).mean()), 6)}


def silero(workdir: Path, runs: int) -> dict:
    original = onnx.load(str(SILERO))
    inlined = inline_lstm_branch(original)
    paths = {"fp32": workdir / "silero_inlined.onnx"}
    onnx.save(inlined, paths["fp32"])
    chunks = speech_chunks()
    samples = [dict(np.load(p)) for p in sorted(SILERO_CALIB.glob("*.npz"))]
    ref_probs, ref_states = stream(str(SILERO), chunks)
    inl_probs, inl_states = stream(str(paths["fp32"]), chunks)
    result = {"chunks": len(chunks), "inlined_vs_original_max_abs": float(max(np.abs(ref_probs - inl_probs).max(),
                                                                               np.abs(ref_states - inl_states).max()))}
    # the kit's chunks were made the same way: the recorded state matches ours (chunk index from the file name)
    kit_index = int(sorted(SILERO_CALIB.glob("*.npz"))[1].stem.split("chunk")[1])
    result["kit_state_protocol_max_abs"] = float(np.abs(ref_states[kit_index - 1] - samples[1]["state"]).max())

    others = sorted({n.op_type for n in inlined.graph.node} - {"LSTM"})
    variants = {"lstm": {"quantization": {"exclude_op_types": others}},
                "lstm-per-direction": {"quantization": {"exclude_op_types": others, "per_channel": False}},
                "full": None,
                "full-no-lstm": {"quantization": {"exclude_op_types": ["LSTM"]}}}
    for name, config in variants.items():
        quantized = qtool.quantize(paths["fp32"], data=SILERO_CALIB, config=config, progress=False)
        paths[name] = workdir / f"silero_{name}.onnx"
        quantized.save(paths[name])
        ops = sorted({n.op_type for n in quantized.model.graph.node} & {"LSTM", "DynamicQuantizeLSTM"})
        probs, states = stream(str(paths[name]), chunks)
        step_ref_probs, step_ref_states = one_step(str(paths["fp32"]), samples)
        step_probs, step_states = one_step(str(paths[name]), samples)
        result[name] = {
            "recurrent_op": ops, "notes": list(quantized.notes),
            "stream_probability": fidelity(ref_probs, probs),
            "stream_state": fidelity(ref_states, states),
            "stream_decision_flips": int(np.sum((ref_probs > 0.5) != (probs > 0.5))),
            "step_probability": fidelity(step_ref_probs, step_probs),
            "step_state": fidelity(step_ref_states, step_states),
        }
    times = time_models({k: str(v) for k, v in paths.items()}, samples[0], threads=1, warmup=20, runs=runs)
    result["latency_ms_batch1_1thread"] = {k: round(percentile_ms(v, 50), 4) for k, v in times.items()}
    result["speech_chunks_fp32"] = int(np.sum(ref_probs > 0.5))
    result["lstm_alone_ms_100_steps"] = lstm_alone_latency(inlined, workdir, runs)
    return result


def lstm_alone_latency(inlined: onnx.ModelProto, workdir: Path, runs: int, steps: int = 100) -> dict:
    """The kernel's own speed: silero's LSTM (real weights) alone over a 100-step sequence, batch 1."""
    index = GraphIndex(inlined)
    lstm = next(n for n in inlined.graph.node if n.op_type == "LSTM")
    node = helper.make_node("LSTM", ["x", *lstm.input[1:4]], ["y", "h", "c"], name="lstm", hidden_size=128)
    hidden = [1, 1, 128]
    graph = helper.make_graph([node], "lstm", [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT,
                                                                             [steps, 1, 128])],
                              [helper.make_tensor_value_info(o, onnx.TensorProto.FLOAT, shape)
                               for o, shape in (("y", [steps, 1, 1, 128]), ("h", hidden), ("c", hidden))],
                              [index.initializers[n] for n in lstm.input[1:4]])
    alone = helper.make_model(graph, opset_imports=list(inlined.opset_import))
    alone.ir_version = inlined.ir_version
    paths = {"fp32": workdir / "lstm_alone.onnx", "int8": workdir / "lstm_alone.int8.onnx"}
    onnx.save(alone, paths["fp32"])
    data = workdir / "lstm_alone_data"
    data.mkdir()
    x = np.random.default_rng(0).normal(0, 0.5, (steps, 1, 128)).astype(np.float32)
    np.save(data / "x.npy", x)
    qtool.quantize(paths["fp32"], data=data, progress=False).save(paths["int8"])
    times = time_models({k: str(v) for k, v in paths.items()}, {"x": x}, threads=1, warmup=20, runs=runs)
    return {k: round(percentile_ms(v, 50), 4) for k, v in times.items()}


def romanizer_grus(workdir: Path) -> dict:
    """Each GRU of the encoder alone, fed its real inputs, through qtool: it must stay float, with a note."""
    model = onnx.load(str(ROMANIZER))
    index = GraphIndex(model)
    found = {}
    grus = [n for n in model.graph.node if n.op_type == "GRU"]
    feeds = [dict(np.load(p)) for p in sorted((ROMANIZER_INPUTS / "eval").glob("*.npz"))]
    wanted = [name for gru in grus for name in gru.input if name and not index.is_constant(name)]
    session = create_session(with_outputs(model, wanted), 1, "encoder")
    captured = [dict(zip(wanted, session.run(wanted, f))) for f in feeds]
    for number, gru in enumerate(grus):
        inputs = [name for name in gru.input if name and not index.is_constant(name)]
        data = workdir / f"gru{number}"
        data.mkdir()
        for i, sample in enumerate(captured):
            np.savez(data / f"{i:03d}.npz", **{name: sample[name] for name in inputs})
        dynamic = [[f"{n}_{axis}" for axis in range(captured[0][n].ndim)] for n in inputs]
        graph = helper.make_graph([gru], f"gru{number}",
                                  [helper.make_tensor_value_info(n, onnx.TensorProto.FLOAT, dims)
                                   for n, dims in zip(inputs, dynamic)],
                                  [helper.make_tensor_value_info(o, onnx.TensorProto.FLOAT,
                                                                 [f"{o}_{axis}" for axis in range(4 - slot)])
                                   for slot, o in enumerate(gru.output) if o],  # Y [L, dirs, N, H], Y_h
                                  [index.initializers[n] for n in gru.input if n in index.initializers])
        alone = helper.make_model(graph, opset_imports=list(model.opset_import))
        alone.ir_version = model.ir_version
        path = workdir / f"gru{number}.onnx"
        onnx.save(alone, path)
        quantized = qtool.quantize(path, data=data, progress=False)
        found[gru.name] = {"ops": sorted({n.op_type for n in quantized.model.graph.node}),
                           "notes": list(quantized.notes),
                           "params": int(sum(index.const(n).size for n in gru.input if index.is_constant(n)))}
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=300, help="latency runs per variant")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "recurrent.json")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        result = {"silero_vad_16k_op15": silero(Path(tmp), args.runs),
                  "arabic_name_romanizer_encoder": romanizer_grus(Path(tmp))}
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
