"""load_model keeps the last checked model and prepare_file the last prepared graph, and both hand
out copies: a job's later loads must see the file as it is now and never a copy an earlier caller
changed."""

from __future__ import annotations

import numpy as np
import onnx

from qtool.graph.modelio import load_model
from qtool.prepare import graph_prep
from qtool.prepare.graph_prep import prepare, prepare_file
from tests.graphs import conv_model


def test_a_loaded_model_changed_by_its_caller_does_not_change_the_next_load(tmp_path):
    path = tmp_path / "m.onnx"
    onnx.save(conv_model(np.random.default_rng(0)), str(path))
    count = len(load_model(path).graph.node)
    for _ in range(2):  # the first load reads the file, the second is handed the kept model
        loaded = load_model(path)
        loaded.graph.node.pop()
        loaded.graph.initializer[0].name = "renamed"
    again = load_model(path)
    assert len(again.graph.node) == count
    assert again.graph.initializer[0].name != "renamed"


def test_a_rewritten_file_of_the_same_size_is_read_again(tmp_path):
    """Same path, same size, same second: only the content tells the two files apart."""
    path = tmp_path / "m.onnx"
    model = conv_model(np.random.default_rng(0))
    onnx.save(model, str(path))
    before = onnx.numpy_helper.to_array(load_model(path).graph.initializer[0])
    weight = model.graph.initializer[0]
    weight.CopyFrom(onnx.numpy_helper.from_array(onnx.numpy_helper.to_array(weight) + 1.0, weight.name))
    onnx.save(model, str(path))
    after = onnx.numpy_helper.to_array(load_model(path).graph.initializer[0])
    np.testing.assert_allclose(after, before + 1.0)


def test_a_job_prepares_its_model_file_once_and_each_caller_gets_its_own_copy(tmp_path, monkeypatch):
    import qtool

    path = tmp_path / "m.onnx"
    onnx.save(conv_model(np.random.default_rng(0)), str(path))
    fresh = prepare(load_model(path)).model.SerializeToString()
    for _ in range(2):  # the first call prepares the file, the second is handed the kept graph
        prepared = prepare_file(path)
        prepared.model.graph.node.pop()
    assert prepare_file(path).model.SerializeToString() == fresh
    calls = []
    monkeypatch.setattr(graph_prep, "prepare", lambda *a, **k: calls.append(1) or prepare(*a, **k))
    data = [{"x": np.random.default_rng(i).normal(0, 1, (1, 8, 12, 12)).astype(np.float32)} for i in range(8)]
    for limit, once in ((1 << 20, True), (1_000, False)):  # a graph over the limit is prepared each time
        graph_prep._prepared.clear()
        calls.clear()
        monkeypatch.setattr(graph_prep, "_KEPT_PREPARED_BYTES", limit)
        qtool.quantize(path, data=data, progress=False)  # calibration, the candidates, the build
        assert (len(calls) == 1) == once and calls


def test_a_rewritten_file_is_prepared_again(tmp_path):
    path = tmp_path / "m.onnx"
    model = conv_model(np.random.default_rng(0))
    onnx.save(model, str(path))
    before = prepare_file(path).model
    weight = model.graph.initializer[0]
    weight.CopyFrom(onnx.numpy_helper.from_array(onnx.numpy_helper.to_array(weight) + 1.0, weight.name))
    onnx.save(model, str(path))
    after = prepare_file(path).model
    assert after.SerializeToString() == prepare(load_model(path)).model.SerializeToString()
    assert after.SerializeToString() != before.SerializeToString()
