"""load_model keeps the last checked model and hands out copies: a job's later loads must see the
file as it is now and never a copy an earlier caller changed."""

from __future__ import annotations

import numpy as np
import onnx

from qtool.graph.modelio import load_model
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
