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


def test_candidates_are_scored_on_their_qdq_as_written(tmp_path, monkeypatch):
    """The choices score a candidate on its quantization grid as the graph writes it: every
    QuantizeLinear/DequantizeLinear computed as such, the ops between them in float (which every
    CPU computes alike up to the last bits), not fused into onnxruntime's integer kernels, whose
    rounding differs between CPU families. The model qtool writes is still checked on those kernels."""
    import onnxruntime as ort

    from qtool import api
    from qtool.graph import runtime

    rng = np.random.default_rng(3)
    nodes = [helper.make_node("Conv", ["x", "w1", "b1"], ["a"], name="c1", pads=[1, 1, 1, 1]),
             helper.make_node("Conv", ["x", "w2", "b2"], ["b"], name="c2", pads=[1, 1, 1, 1]),
             helper.make_node("Mul", ["a", "b"], ["m"], name="mul"),
             helper.make_node("Add", ["m", "a"], ["s"], name="add"),
             helper.make_node("Conv", ["s", "w3", "b3"], ["c"], name="c3", pads=[1, 1, 1, 1]),
             helper.make_node("Softsign", ["c"], ["y"], name="out")]
    shapes = {"w1": (16, 8, 3, 3), "b1": (16,), "w2": (16, 8, 3, 3), "b2": (16,), "w3": (16, 16, 3, 3), "b3": (16,)}
    inits = [graphs.init(name, rng.normal(0, 0.3, shape).astype(np.float32)) for name, shape in shapes.items()]
    path = tmp_path / "m.onnx"
    onnx.save(graphs.model(nodes, [graphs.tensor("x", [1, 8, 12, 12])], [graphs.tensor("y", None)], inits), path)
    data = graphs.write_samples(tmp_path / "data", rng, (8, 12, 12), count=8)
    made = []  # (source, options, label) of every onnxruntime session the job makes
    original = runtime._session

    def recording(source, options, label):
        made.append((source, options, label))
        return original(source, options, label)

    monkeypatch.setattr(runtime, "_session", recording)
    result = api.quantize(path, data=data, config={"quantization": {"advanced": dict(graphs.RULE_OFF)}})
    assert [d for d in result.decisions if d.option == "calibration.method"][0].measured

    def kernels(source, options) -> set[str]:
        """The op types of the graph onnxruntime runs for `source` with `options`."""
        options.optimized_model_filepath = str(tmp_path / "optimized.onnx")
        ort.InferenceSession(source, options, providers=["CPUExecutionProvider"])
        return {n.op_type for n in onnx.load(tmp_path / "optimized.onnx").graph.node}

    int8 = [(source, options) for source, options, label in made if label in ("int8 model", "candidate")]

    def as_written(options) -> bool:
        try:
            return options.get_session_config_entry("session.disable_quant_qdq") == "1"
        except RuntimeError:  # onnxruntime's answer for a key never set
            return False

    scored = [(s, o) for s, o in int8 if as_written(o)]
    checked = [(s, o) for s, o in int8 if not as_written(o)]
    assert scored and checked  # the candidates' sessions; the written model's run check
    for source, options in scored:
        assert not {op for op in kernels(source, options) if op.startswith("QLinear")}
    assert len(checked) == 1 and {"QLinearConv", "QLinearMul"} <= kernels(*checked[0])
