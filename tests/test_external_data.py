"""External tensor data: loaded from relative locations, written as one side file, and
locations escaping the model's directory refused before anything is read (CVE-2024-27318)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from click.testing import CliRunner
from onnx import TensorProto, helper, numpy_helper

from qtool.graph import modelio, shapes
from qtool.cli import main
from qtool.prepare import graph_prep
from tests.conftest import run_qtool


def _convnet() -> onnx.ModelProto:
    rng = np.random.default_rng(0)
    inits = [numpy_helper.from_array(rng.normal(0, 0.2, (16, 3, 3, 3)).astype(np.float32), "W1"),
             numpy_helper.from_array(rng.normal(0, 0.1, (16,)).astype(np.float32), "B1"),
             numpy_helper.from_array(rng.normal(0, 0.1, (32, 16, 3, 3)).astype(np.float32), "W2"),
             numpy_helper.from_array(rng.normal(0, 0.1, (32,)).astype(np.float32), "B2"),
             numpy_helper.from_array(rng.normal(0, 0.1, (32, 10)).astype(np.float32), "W3")]
    nodes = [helper.make_node("Conv", ["x", "W1", "B1"], ["c1"], pads=[1, 1, 1, 1]),
             helper.make_node("Relu", ["c1"], ["r1"]),
             helper.make_node("Conv", ["r1", "W2", "B2"], ["c2"], pads=[1, 1, 1, 1], strides=[2, 2]),
             helper.make_node("Relu", ["c2"], ["r2"]),
             helper.make_node("GlobalAveragePool", ["r2"], ["g"]),
             helper.make_node("Flatten", ["g"], ["f"]),
             helper.make_node("MatMul", ["f", "W3"], ["y"])]
    graph = helper.make_graph(nodes, "convnet", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 3, 16, 16])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 10])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return model


def _data(folder: Path, count: int = 4) -> Path:
    folder.mkdir(parents=True)
    rng = np.random.default_rng(1)
    for i in range(count):
        np.save(folder / f"{i}.npy", rng.normal(size=(1, 3, 16, 16)).astype(np.float32))
    return folder


def _external_model(folder: Path, location: str = "weights/convnet.bin") -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "convnet.onnx"
    (folder / location).parent.mkdir(parents=True, exist_ok=True)
    onnx.save_model(_convnet(), str(path), save_as_external_data=True, all_tensors_to_one_file=True,
                    location=location, size_threshold=0)
    return path


def _initializers(path: Path) -> dict[str, np.ndarray]:
    return {t.name: numpy_helper.to_array(t) for t in onnx.load(str(path)).graph.initializer}


def _external_locations(path: Path) -> set[str]:
    model = onnx.load(str(path), load_external_data=False)
    return {e.value for t in model.graph.initializer for e in t.external_data if e.key == "location"}


def _data_file(model: Path) -> Path:
    """The one data file beside `model`, checked to be named `<model name>.<its sha256[:16]>.data`."""
    [data_file] = [p for p in model.parent.iterdir() if p.name.startswith(model.name + ".")]
    assert data_file.name == modelio.data_file_name(model, modelio.sha256_file(data_file))
    return data_file


def test_external_data_model_round_trip(tmp_path):
    data = _data(tmp_path / "data")
    plain = tmp_path / "plain" / "convnet.onnx"
    plain.parent.mkdir()
    onnx.save(_convnet(), str(plain))
    external = _external_model(tmp_path / "ext")
    assert _external_locations(external) == {"weights/convnet.bin"}

    outputs = tmp_path / "out"
    outputs.mkdir()
    for name, model in (("plain", plain), ("external", external)):
        proc = run_qtool("quantize", model, "--data", data, "-o", outputs / f"{name}.onnx")
        assert proc.returncode == 0, proc.stderr
    # The external-data input gives an external-data output: one file, relative, beside it,
    # named by its content.
    data_file = _data_file(outputs / "external.onnx")
    assert sorted(os.listdir(outputs)) == ["external.onnx", data_file.name, "plain.onnx"]
    assert _external_locations(outputs / "external.onnx") == {data_file.name}
    assert _external_locations(outputs / "plain.onnx") == set()
    # ... and it is the same int8 model.
    a, b = _initializers(outputs / "plain.onnx"), _initializers(outputs / "external.onnx")
    assert a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a)
    x = np.load(data / "0.npy")
    ya = ort.InferenceSession(str(outputs / "plain.onnx")).run(None, {"x": x})[0]
    yb = ort.InferenceSession(str(outputs / "external.onnx")).run(None, {"x": x})[0]
    assert np.array_equal(ya, yb)
    proc = run_qtool("evaluate", external, outputs / "external.onnx", "--data", data, "--runs", "1",
                     "--json", tmp_path / "report.json")
    assert proc.returncode == 0, proc.stderr
    # sizes count the data files the models name
    models = json.loads((tmp_path / "report.json").read_text())["models"]
    assert models["fp32"]["size_bytes"] == sum(p.stat().st_size for p in external.parent.rglob("*") if p.is_file())
    assert models["int8"]["size_bytes"] == (outputs / "external.onnx").stat().st_size + data_file.stat().st_size


def test_symlink_inside_the_model_directory_is_refused_cleanly(tmp_path):
    """onnx itself refuses symlinked external data; qtool reports it as one line."""
    model = _external_model(tmp_path / "m", location="convnet.bin")
    (tmp_path / "m" / "real").mkdir()
    os.replace(tmp_path / "m" / "convnet.bin", tmp_path / "m" / "real" / "convnet.bin")
    os.symlink("real/convnet.bin", tmp_path / "m" / "convnet.bin")
    proc = run_qtool("calibrate", model, "--data", _data(tmp_path / "data"), "-o", tmp_path / "t.json")
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip().splitlines()[-1].startswith(f"error: {model}: cannot read external tensor data: ")


def _retarget(model_path: Path, location: str) -> None:
    model = onnx.load(str(model_path), load_external_data=False)
    for tensor in model.graph.initializer:
        for entry in tensor.external_data:
            if entry.key == "location":
                entry.value = location
    model_path.write_bytes(model.SerializeToString())


@pytest.mark.parametrize("how", ["dotdot", "absolute", "symlink_file", "symlink_dir"])
def test_escaping_locations_are_refused_before_reading(tmp_path, how):
    """The outside target is a FIFO: opening it to read would block, so the timeout proves it was never opened."""
    model = _external_model(tmp_path / "models" / "m", location="convnet.bin")
    outside = tmp_path / "outside"
    outside.mkdir()
    os.mkfifo(outside / "secret.bin")
    folder = model.parent
    location = {"dotdot": "../../outside/secret.bin", "absolute": str(outside / "secret.bin"),
                "symlink_file": "link.bin", "symlink_dir": "linkdir/secret.bin"}[how]
    if how == "symlink_file":
        os.symlink(outside / "secret.bin", folder / "link.bin")
    if how == "symlink_dir":
        os.symlink(outside, folder / "linkdir")
    _retarget(model, location)
    proc = run_qtool("calibrate", model, "--data", _data(tmp_path / "data"), "-o", tmp_path / "t.json", timeout=60)
    assert proc.returncode == 2, proc.stderr
    line = proc.stderr.strip().splitlines()[-1]
    assert line.startswith(f"error: {model}: refusing external data of tensor '")
    assert "CVE-2024-27318" in line
    assert not (tmp_path / "t.json").exists()


def test_models_over_the_protobuf_limit(tmp_path, monkeypatch):
    """The >2 GiB code paths, driven by lowering the limit to 5 kB (the fp32 convnet is 22 kB, int8 9 kB).

    Sessions then get a temporary file with external data, shape inference runs on a copy
    without weight payloads, the checker gets a path, and the output is written with one
    external data file, all as they would for a real 2 GB model. The results must be
    identical to the ordinary path's.
    """
    data = _data(tmp_path / "data")
    model = tmp_path / "convnet.onnx"
    onnx.save(_convnet(), str(model))
    assert model.stat().st_size > 20_000
    runner = CliRunner()
    normal = runner.invoke(main, ["quantize", str(model), "--data", str(data), "--save-table",
                                  str(tmp_path / "normal.json"), "-o", str(tmp_path / "normal.onnx")])
    assert normal.exit_code == 0, normal.output

    calls = {"on_disk": 0, "shapes_only": 0}
    real_on_disk, real_shapes_only = modelio.on_disk, shapes._shapes_only

    def counting(name, real):
        def wrapper(*args, **kwargs):
            calls[name] += 1
            return real(*args, **kwargs)
        return wrapper

    monkeypatch.setattr(modelio, "PROTOBUF_LIMIT", 5_000)
    monkeypatch.setattr(shapes, "_SHAPE_ONLY_BYTES", 1_000)  # so the shape-inference copy drops payloads
    monkeypatch.setattr(graph_prep, "_prepared", {})  # prepared again, not the first job's graph
    monkeypatch.setattr(modelio, "on_disk", counting("on_disk", real_on_disk))
    monkeypatch.setattr(shapes, "_shapes_only", counting("shapes_only", real_shapes_only))
    large = runner.invoke(main, ["quantize", str(model), "--data", str(data), "--save-table",
                                 str(tmp_path / "large.json"), "-o", str(tmp_path / "large.onnx")])
    assert large.exit_code == 0, large.output
    # sessions/checker (the observer's sessions need no file: they share the weights in memory,
    # qtool.graph.runtime.SharedWeights), and prepare x2
    assert calls["on_disk"] >= 1 and calls["shapes_only"] >= 2
    assert _external_locations(tmp_path / "large.onnx") == {_data_file(tmp_path / "large.onnx").name}
    assert json.loads((tmp_path / "large.json").read_text())["tensors"] == \
        json.loads((tmp_path / "normal.json").read_text())["tensors"]
    a, b = _initializers(tmp_path / "normal.onnx"), _initializers(tmp_path / "large.onnx")
    assert a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a)
    evaluated = runner.invoke(main, ["evaluate", str(model), str(tmp_path / "large.onnx"), "--data", str(data),
                                     "--runs", "1"])
    assert evaluated.exit_code == 0, evaluated.output
    assert not [p for p in os.listdir(tmp_path) if p.startswith(".")]  # no temporaries left


def test_shared_weights_leave_an_initializer_no_node_reads_in_the_graph():
    """onnxruntime drops an initializer no node reads before it resolves the shared ones, then fails
    to find it ("Failed to find existing initializer"): such a tensor is not shared."""
    from qtool.graph.runtime import SharedWeights, create_session

    w = np.random.default_rng(0).normal(0, 1, (64, 64)).astype(np.float32)
    graph = helper.make_graph([helper.make_node("MatMul", ["x", "w"], ["y"])], "g",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 64])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 64])],
                              [numpy_helper.from_array(w, "w"), numpy_helper.from_array(w * 2, "unread")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    weights = SharedWeights(model)
    assert set(weights.values) == {"w"}
    x = np.ones((1, 64), np.float32)
    np.testing.assert_allclose(create_session(weights.light, weights=weights).run(None, {"x": x})[0], x @ w,
                               rtol=1e-5)


def test_a_session_of_a_large_model_proto_shares_its_weights_and_computes_the_same(tmp_path):
    """A proto with SHARE_MIN_BYTES of initializers hands them to onnxruntime as shared values
    instead of serialising them: the session must compute what the file's own session computes."""
    from qtool.graph.runtime import SHARE_MIN_BYTES, create_session

    side = 2048  # one float32 2048 x 2048 weight: 16 MiB, the threshold
    assert side * side * 4 >= SHARE_MIN_BYTES
    rng = np.random.default_rng(0)
    w = rng.normal(0, 1, (side, side)).astype(np.float32)
    b = rng.normal(0, 1, side).astype(np.float32)
    nodes = [helper.make_node("MatMul", ["x", "w"], ["m"]), helper.make_node("Add", ["m", "b"], ["y"])]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, side])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, side])],
                              [numpy_helper.from_array(w, "w"), numpy_helper.from_array(b, "b")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    onnx.save(model, str(tmp_path / "m.onnx"))
    shared = create_session(model)
    assert shared._qtool_weights is not None and set(shared._qtool_weights.values) == {"w", "b"}
    x = rng.normal(0, 1, (2, side)).astype(np.float32)
    np.testing.assert_array_equal(shared.run(None, {"x": x})[0],
                                  create_session(str(tmp_path / "m.onnx")).run(None, {"x": x})[0])
    assert len(model.graph.initializer[0].raw_data) == side * side * 4  # the caller's model keeps its weights


def test_keep_initializers_deletes_the_others_in_place_and_keeps_the_order():
    from qtool.graph.index import keep_initializers

    graph = helper.make_graph([], "g", [], [], [numpy_helper.from_array(np.full(3, i, np.float32), f"t{i}")
                                                for i in range(6)])
    keep_initializers(graph, lambda t: t.name in {"t1", "t2", "t4"})
    assert [t.name for t in graph.initializer] == ["t1", "t2", "t4"]
    assert [float(numpy_helper.to_array(t)[0]) for t in graph.initializer] == [1.0, 2.0, 4.0]
