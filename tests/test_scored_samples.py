"""The measured choices score candidates on a bounded number of input values: large inputs (a
detector at 960 px) are measured on fewer of the spread samples, small ones on all SAMPLES."""

from __future__ import annotations

import numpy as np
import onnx
from onnx import helper

from qtool.choices.measure import SAMPLES, SCORED_VALUES, scored_samples
from qtool.config import load_config
from qtool.graph.modelio import input_specs

from tests import graphs


def _dynamic_conv(tmp_path) -> str:
    rng = np.random.default_rng(0)
    model = graphs.model([helper.make_node("Conv", ["x", "w"], ["y"], name="conv")],
                         [graphs.tensor("x", ["N", 3, "H", "W"])], [graphs.tensor("y", None)],
                         [graphs.init("w", rng.normal(0, 0.3, (4, 3, 1, 1)).astype(np.float32))])
    path = tmp_path / "m.onnx"
    onnx.save(model, path)
    return str(path)


def test_large_inputs_are_scored_on_fewer_samples(tmp_path):
    path = _dynamic_conv(tmp_path)
    specs = input_specs(onnx.load(path))
    cfg = load_config(None)
    rng = np.random.default_rng(1)
    small = graphs.write_samples(tmp_path / "small", rng, (3, 32, 32), count=24)
    samples = scored_samples(path, specs, small, cfg)[0]
    assert SAMPLES == sum(len(b) for b in samples)
    large = graphs.write_samples(tmp_path / "large", rng, (3, 640, 640), count=8)  # 1.2 M values each
    samples = scored_samples(path, specs, large, cfg)[0]
    assert SCORED_VALUES // (3 * 640 * 640) == sum(len(b) for b in samples) == 4
    # spread over the data, not its first files
    assert [k for b in samples for k in b.keys] == ["s000.npy", "s002.npy", "s004.npy", "s006.npy"]


def test_a_job_decodes_its_scored_samples_once(tmp_path, monkeypatch):
    """Calibration reads the samples the range choice scores later: the job decodes each file once
    (one sample a batch: no batch-size probe reading the first files ahead)."""
    from collections import Counter

    from qtool import api
    from qtool.data.dataset import DataSource

    path = _dynamic_conv(tmp_path)
    data = graphs.write_samples(tmp_path / "data", np.random.default_rng(2), (3, 16, 16), count=24)
    decoded = Counter()
    decode = DataSource._decode
    monkeypatch.setattr(DataSource, "_decode", lambda self, file: decoded.update([file.name]) or decode(self, file))
    result = api.quantize(path, data=data, config={"calibration": {"batch_size": 1}}, progress=False)
    ranges = next(d for d in result.decisions if d.option == "calibration.method")
    assert ranges.measured and ranges.samples == SAMPLES  # candidates were scored
    assert sorted(decoded) == [f"s{i:03d}.npy" for i in range(24)] and set(decoded.values()) == {1}, decoded


def test_kept_samples_stay_within_their_budget_and_are_read_only(tmp_path):
    from qtool.config import PreprocessConfig
    from qtool.data.dataset import iter_samples, keeping_samples, open_data

    path = _dynamic_conv(tmp_path)
    specs = input_specs(onnx.load(path))
    data = graphs.write_samples(tmp_path / "data", np.random.default_rng(3), (3, 4, 4), count=4)  # 48 values each
    files = open_data(data, specs, PreprocessConfig()).files
    with keeping_samples(files[:3], budget=100):  # room for two
        first = [s.feeds["x"] for s in iter_samples(open_data(data, specs, PreprocessConfig()))]
        again = [s.feeds["x"] for s in iter_samples(open_data(data, specs, PreprocessConfig()))]
    assert [a is b for a, b in zip(first, again)] == [True, True, False, False]
    assert not first[0].flags.writeable and first[3].flags.writeable
    outside = [s.feeds["x"] for s in iter_samples(open_data(data, specs, PreprocessConfig()))]
    assert not any(a is b for a, b in zip(first, outside))


def test_only_the_named_files_are_kept(tmp_path):
    from qtool.config import PreprocessConfig
    from qtool.data.dataset import iter_samples, keeping_samples, open_data

    path = _dynamic_conv(tmp_path)
    specs = input_specs(onnx.load(path))
    data = graphs.write_samples(tmp_path / "data", np.random.default_rng(4), (3, 4, 4), count=4)
    files = open_data(data, specs, PreprocessConfig()).files
    with keeping_samples(files[1:2], budget=10**6):  # room for every file, one named
        first = [s.feeds["x"] for s in iter_samples(open_data(data, specs, PreprocessConfig()))]
        again = [s.feeds["x"] for s in iter_samples(open_data(data, specs, PreprocessConfig()))]
    assert [a is b for a, b in zip(first, again)] == [False, True, False, False]
