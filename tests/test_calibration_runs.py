"""How many samples a calibration run of the fp32 graph takes (qtool.calibration.observer.run_batch):
the configured batch, or fewer where the activations the graph's fixed shapes declare for one
sample add up to more than RUN_BYTES over that batch; the observing pass and the equalization's
measuring pass alike."""

from __future__ import annotations

import numpy as np
import onnx
from onnx import helper

import qtool.calibration.observer as observer_module
import qtool.calibration.smoothing as smoothing_module
from qtool import api
from qtool.calibration.observer import RUN_BYTES, run_batch
from qtool.config import QuantizeConfig
from qtool.plan.planner import prepared_model
from tests import graphs

SIDE = 128


def _wide_cnn(rng, dims) -> onnx.ModelProto:
    """x -> Conv 3->64 -> Relu -> depthwise Conv -> y: three 64 x SIDE x SIDE float tensors per
    sample (12 MB at SIDE 128)."""
    inits = [graphs.init("w1", rng.normal(0, 0.3, (64, 3, 3, 3)).astype(np.float32)),
             graphs.init("w2", rng.normal(0, 0.3, (64, 1, 3, 3)).astype(np.float32))]
    nodes = [helper.make_node("Conv", ["x", "w1"], ["c"], name="conv", pads=[1, 1, 1, 1]),
             helper.make_node("Relu", ["c"], ["r"], name="relu"),
             helper.make_node("Conv", ["r", "w2"], ["y"], name="dw", pads=[1, 1, 1, 1], group=64)]
    return graphs.model(nodes, [graphs.tensor("x", dims)], [graphs.tensor("y", None)], inits)


def test_a_run_holds_at_most_run_bytes_of_activations(tmp_path):
    rng = np.random.default_rng(0)
    path = tmp_path / "m.onnx"
    onnx.save(_wide_cnn(rng, ["N", 3, SIDE, SIDE]), path)
    prepared, _ = prepared_model(path, QuantizeConfig())
    per_sample = 3 * 64 * SIDE * SIDE * 4  # c, r and y, float32
    expected = max(1, min(64, RUN_BYTES // per_sample))
    assert run_batch(prepared, 64) == expected < 64
    assert run_batch(prepared, 2) == 2  # never more than asked
    # dims the graph leaves open are not counted: no cap from guesses
    onnx.save(_wide_cnn(rng, ["N", 3, "H", "W"]), tmp_path / "dyn.onnx")
    assert run_batch(prepared_model(tmp_path / "dyn.onnx", QuantizeConfig())[0], 64) == 64


def test_calibration_runs_take_the_capped_batch(tmp_path, monkeypatch):
    """The plain command's runs of the fp32 graph (the observer's and the equalization's measuring
    pass, here a Conv -> Relu -> depthwise Conv chain) feed batches of at most run_batch samples."""
    rng = np.random.default_rng(0)
    path = tmp_path / "m.onnx"
    onnx.save(_wide_cnn(rng, ["N", 3, SIDE, SIDE]), path)
    data = graphs.write_samples(tmp_path / "data", rng, (3, SIDE, SIDE), count=24)
    fed: dict[str, list[int]] = {}

    def recording(module, name):
        made = getattr(module, name)

        def create(model, *args, **kwargs):
            session = made(model, *args, **kwargs)
            run = session.run

            def counted(names, feeds, *a, **k):
                fed.setdefault(module.__name__, []).append(len(next(iter(feeds.values()))))
                return run(names, feeds, *a, **k)
            session.run = counted
            return session
        monkeypatch.setattr(module, name, create)

    recording(observer_module, "create_session")
    recording(smoothing_module, "create_session")
    api.quantize(str(path), data=str(data), config={"calibration": {"method": "minmax", "batch_size": 16}},
                 progress=False)
    cap = run_batch(prepared_model(path, QuantizeConfig())[0], 16)
    assert cap < 16
    assert fed[observer_module.__name__] and max(fed[observer_module.__name__]) == cap
    assert fed[smoothing_module.__name__] and max(fed[smoothing_module.__name__]) == cap
