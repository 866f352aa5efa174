"""Dynamic int8 MatMul/Gemm (--matmul): the integer pattern, what stays float, and `auto`'s choice."""

from __future__ import annotations

from collections import Counter

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from click.testing import CliRunner
from onnx import helper

from qtool import api
from qtool.cli import main
from qtool.config import AdvancedConfig, Config, QuantizeConfig, load_config
from qtool.choices import dynamic_weights as weight_choice
from qtool.choices.measure import Scoring
from qtool.evaluation.macs import int8_macs
from qtool.quantization.dynamic_matmul import CODES, SCALE
from tests import graphs
from tests.conftest import kit_path

T, D = 8, 16


def _block(rng, then_float: bool = False) -> onnx.ModelProto:
    """A transformer-ish block: LayerNorm, query/key projections with bias Adds, attention
    (MatMul of two activations, Softmax), an output projection and a residual Add. `then_float`: a
    float op (no int8 rule) reads the residual sum, as the rest of a model would, so that static int8
    quantizes the Add (otherwise the ops before the graph's output compute in float)."""
    w = {name: rng.normal(0, 0.3, (D, D)).astype(np.float32) for name in ("wq", "wk", "wo")}
    b = {name: rng.normal(0, 0.1, D).astype(np.float32) for name in ("bq", "bk")}
    nodes = [
        helper.make_node("LayerNormalization", ["x", "gamma", "beta"], ["h"], name="ln", axis=-1),
        helper.make_node("MatMul", ["h", "wq"], ["q0"], name="q"),
        helper.make_node("Add", ["q0", "bq"], ["q1"], name="q_bias"),
        helper.make_node("MatMul", ["h", "wk"], ["k0"], name="k"),
        helper.make_node("Add", ["k0", "bk"], ["k1"], name="k_bias"),
        helper.make_node("Transpose", ["k1"], ["kt"], name="kt", perm=[0, 2, 1]),
        helper.make_node("MatMul", ["q1", "kt"], ["scores"], name="scores"),
        helper.make_node("Softmax", ["scores"], ["p"], name="softmax", axis=-1),
        helper.make_node("MatMul", ["p", "q1"], ["context"], name="context"),
        helper.make_node("MatMul", ["context", "wo"], ["o"], name="o"),
        helper.make_node("Add", ["o", "x"], ["sum" if then_float else "y"], name="residual"),
    ] + ([helper.make_node("Softsign", ["sum"], ["y"], name="next")] if then_float else [])
    inits = [graphs.init(k, v) for k, v in {**w, **b}.items()]
    inits += [graphs.init("gamma", np.ones(D, np.float32)), graphs.init("beta", np.zeros(D, np.float32))]
    return graphs.model(nodes, [graphs.tensor("x", [1, T, D])], [graphs.tensor("y", None)], inits)


def _samples(tmp_path, rng):
    folder = graphs.write_samples(tmp_path / "data", rng, (T, D))
    for f in folder.glob("*.npy"):  # an outlier channel, as in a transformer's residual stream
        x = np.load(f)
        x[..., 3] *= 40.0
        np.save(f, x)
    return folder


def _quantize(tmp_path, model, **options):
    """The dynamic MatMuls' mechanics: the speed rule off (on layers this small it keeps some float)."""
    path = tmp_path / "model.onnx"
    onnx.save(model, path)
    data = _samples(tmp_path, np.random.default_rng(1))
    options = {**options, "advanced": {**graphs.RULE_OFF, **options.get("advanced", {})}}
    result = api.quantize(path, data=data, config={"quantization": options}, progress=False)
    onnx.checker.check_model(result.model, full_check=True)
    return path, result, data


def _cosine_to_fp32(path, qmodel, data) -> float:
    worst = 1.0
    sessions = [ort.InferenceSession(m, providers=["CPUExecutionProvider"])
                for m in (str(path), qmodel.SerializeToString())]
    for f in sorted(data.glob("*.npy")):
        a, b = (s.run(None, {"x": np.load(f)})[0].ravel().astype(np.float64) for s in sessions)
        worst = min(worst, float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b))))
    return worst


def test_dynamic_quantizes_weighted_matmuls_and_keeps_the_rest_float(tmp_path):
    path, result, data = _quantize(tmp_path, _block(np.random.default_rng(0)), matmul="dynamic",
                                   advanced={"dynamic_weights": "column"})
    ops = Counter(n.op_type for n in result.model.graph.node)
    assert ops["MatMulInteger"] == 2  # q and k merged into one (qtool.prepare.merge_matmuls), o
    assert ops["Split"] == 1  # the merged product back into q and k
    assert ops["MatMul"] == 2  # the attention MatMuls of two activations
    assert ops["DynamicQuantizeLinear"] == 2  # h is quantized once for q and k, context once for o
    assert ops["LayerNormalization"] == 1 and ops["Softmax"] == 1
    assert ops["QuantizeLinear"] == ops["DequantizeLinear"] == 0
    inits = {t.name: t for t in result.model.graph.initializer}
    assert "wq" not in inits and inits["wq_merged_quantized"].data_type == onnx.TensorProto.INT8
    assert list(inits["wq_merged_scale"].dims) == [2 * D]  # per output column
    assert list(inits["wo_scale"].dims) == [D]
    assert result.int8_weights == 2 and result.activations == 0
    assert _cosine_to_fp32(path, result.model, data) > 0.999
    macs = int8_macs(result.model)  # the projections are int8, the attention MatMuls float
    assert macs.int8_nodes == 2 and macs.counted_nodes == 4 and macs.int8 == 3 * T * D * D


def test_dynamic_beats_static_on_an_outlier_channel(tmp_path):
    model = _block(np.random.default_rng(0), then_float=True)
    (tmp_path / "d").mkdir()
    (tmp_path / "s").mkdir()
    path, dynamic, data = _quantize(tmp_path / "d", model, matmul="dynamic")
    _, static, _ = _quantize(tmp_path / "s", model, matmul="static")
    assert sum(n.op_type == "QuantizeLinear" for n in static.model.graph.node) > 0
    assert _cosine_to_fp32(path, dynamic.model, data) > _cosine_to_fp32(path, static.model, data)


def test_auto_chooses_dynamic_for_attention_and_says_why(tmp_path):
    model = _block(np.random.default_rng(0))
    (tmp_path / "a").mkdir()
    (tmp_path / "d").mkdir()
    _, auto, _ = _quantize(tmp_path / "a", model)
    _, dynamic, _ = _quantize(tmp_path / "d", model, matmul="dynamic")
    assert auto.model.SerializeToString() == dynamic.model.SerializeToString()
    chosen = [n for n in auto.notes if "quantized dynamically" in n]
    assert len(chosen) == 1 and "1 LayerNormalization" in chosen[0] and "2 MatMul(s) of two activations" in chosen[0]
    assert not any("quantized dynamically" in n for n in dynamic.notes)  # asked for, not chosen


def test_auto_keeps_static_on_other_targets(tmp_path):
    _, result, _ = _quantize(tmp_path, _block(np.random.default_rng(0)), target="tensorrt")
    assert sum(n.op_type == "QuantizeLinear" for n in result.model.graph.node) > 0
    assert not any(n.op_type == "MatMulInteger" for n in result.model.graph.node)


def test_auto_leaves_a_cnn_unaffected(tmp_path):
    model = graphs.conv_model(np.random.default_rng(0), activation="Relu")
    results = []
    for matmul in ("auto", "static"):
        path = tmp_path / f"{matmul}.onnx"
        onnx.save(model, path)
        data = graphs.write_samples(tmp_path / "data", np.random.default_rng(1), (8, 12, 12))
        results.append(api.quantize(path, data=data, progress=False,
                                    config=Config(quantization=QuantizeConfig(matmul=matmul))))
    assert results[0].model.SerializeToString() == results[1].model.SerializeToString()
    assert not any("dynamic" in n for n in results[0].notes)


def test_gemm_trans_b_with_bias_under_dynamic(tmp_path):
    rng = np.random.default_rng(0)
    model = graphs.gemm_model(rng, k=32, n=10, trans_b=1)
    path, data, out = tmp_path / "gemm.onnx", graphs.write_samples(tmp_path / "data", rng, (32,)), tmp_path / "q.onnx"
    onnx.save(model, path)
    result = CliRunner().invoke(main, ["quantize", str(path), "--data", str(data), "--matmul", "dynamic",
                                       "-o", str(out)])
    assert result.exit_code == 0, result.stderr
    qmodel = onnx.load(str(out))
    ops = Counter(n.op_type for n in qmodel.graph.node)
    assert ops["MatMulInteger"] == 1 and ops["Gemm"] == 0 and ops["Add"] == 1  # the bias C added after
    inits = {t.name: t for t in qmodel.graph.initializer}
    weight = next(t for name, t in inits.items() if name.endswith("_transposed_quantized"))
    assert list(weight.dims) == [32, 10]  # [K, N]: transB's weight stored transposed
    assert _cosine_to_fp32(path, qmodel, data) > 0.999


def test_matmul_option_parses():
    assert load_config({"quantization": {"matmul": "dynamic"}}).quantization.matmul == "dynamic"
    assert QuantizeConfig().matmul == "auto"
    with pytest.raises(ValueError, match="matmul must be one of auto, static, dynamic"):
        QuantizeConfig(matmul="int16")
    result = CliRunner().invoke(main, ["quantize", "m.onnx", "--data", "d", "--matmul", "float", "-o", "o.onnx"])
    assert result.exit_code == 2 and "--matmul" in result.stderr


def test_float_fallback_restores_a_dynamic_matmul(tmp_path):
    from qtool.plan.planner import prepared_model
    from qtool.quantization.float_fallback import restorable_layers, restore_float
    from qtool.table.table import smoothed_options  # the graph the table's smoothing scales were made for

    model = _block(np.random.default_rng(0))  # k's product a graph output too: q and k stay apart
    model.graph.output.append(graphs.tensor("k0", [1, T, D]))
    path, result, data = _quantize(tmp_path, model, matmul="dynamic")
    prepared, _ = prepared_model(path, smoothed_options(QuantizeConfig(matmul="dynamic"), result.table))
    layers = restorable_layers(result.model, prepared)
    assert sorted(layers) == ["k", "o", "q"]
    mixed = restore_float(result.model, prepared, [layers["q"], layers["k"], layers["o"]])
    onnx.checker.check_model(mixed, full_check=True)
    ops = Counter(n.op_type for n in mixed.graph.node)
    assert ops["MatMulInteger"] == ops["DynamicQuantizeLinear"] == ops["Cast"] == 0 and ops["MatMul"] == 5
    assert _cosine_to_fp32(path, mixed, data) > 0.999999
    partial = restore_float(result.model, prepared, [layers["k"]])  # h's DynamicQuantizeLinear stays for q
    ops = Counter(n.op_type for n in partial.graph.node)
    assert ops["MatMulInteger"] == ops["DynamicQuantizeLinear"] == 2


def test_float_fallback_restores_a_merged_projection(tmp_path):
    """q and k merged in the prepared graph are one layer for the fallback, restored to one float MatMul."""
    from qtool.plan.planner import prepared_model
    from qtool.quantization.float_fallback import restorable_layers, restore_float
    from qtool.table.table import smoothed_options  # the graph the table's smoothing scales were made for

    path, result, data = _quantize(tmp_path, _block(np.random.default_rng(0)), matmul="dynamic")
    prepared, _ = prepared_model(path, smoothed_options(QuantizeConfig(matmul="dynamic"), result.table))
    layers = restorable_layers(result.model, prepared)
    assert sorted(layers) == ["o", "q_merged"]
    mixed = restore_float(result.model, prepared, [layers["q_merged"]])
    onnx.checker.check_model(mixed, full_check=True)
    ops = Counter(n.op_type for n in mixed.graph.node)
    assert ops["MatMulInteger"] == ops["DynamicQuantizeLinear"] == 1 and ops["MatMul"] == 3 and ops["Split"] == 1
    assert _cosine_to_fp32(path, mixed, data) > 0.999


def _weight_scales(model: onnx.ModelProto) -> list[tuple[int, ...]]:
    """The shape of every dynamic MatMul's weight scale: () per tensor, (N,) per column."""
    inits = {t.name: t for t in model.graph.initializer}
    return [tuple(inits[n.input[1][:-len(CODES)] + SCALE].dims) for n in model.graph.node
            if n.op_type == "MatMulInteger"]


def _even_columns(model: onnx.ModelProto) -> onnx.ModelProto:
    """The block with weights whose columns share one range: per tensor loses nothing to per column."""
    rng = np.random.default_rng(5)
    for t in model.graph.initializer:
        if t.name in ("wq", "wk", "wo"):
            w = rng.uniform(-0.3, 0.3, (D, D)).astype(np.float32)
            w[0] = 0.3
            t.CopyFrom(graphs.init(t.name, w))
    return model


def test_dynamic_weights_per_tensor_when_measured_lossless(tmp_path):
    path, result, data = _quantize(tmp_path, _even_columns(_block(np.random.default_rng(0))))
    assert _weight_scales(result.model) == [(), ()]
    [chosen] = [d for d in result.decisions if d.option == "quantization.advanced.dynamic_weights"]
    assert chosen.value == "tensor" and [c for c, _ in chosen.measured] == ["column", "tensor"]
    assert chosen.samples > 0 and chosen.note() in result.notes
    assert _cosine_to_fp32(path, result.model, data) > 0.999


def test_dynamic_weights_stay_per_column_when_measured_worse(tmp_path, monkeypatch):
    monkeypatch.setattr(weight_choice, "TOLERANCE", -1.0)  # per tensor would have to beat per column by 1
    _, result, _ = _quantize(tmp_path, _even_columns(_block(np.random.default_rng(0))))
    assert _weight_scales(result.model) == [(2 * D,), (D,)]  # q and k merged
    [chosen] = [d for d in result.decisions if d.option == "quantization.advanced.dynamic_weights"]
    assert chosen.value == "column" and [c for c, _ in chosen.measured] == ["column", "tensor"]


def test_dynamic_weights_per_column_without_measuring_where_a_column_is_large(tmp_path, monkeypatch):
    model = _block(np.random.default_rng(0))
    for t in model.graph.initializer:
        if t.name == "wo":
            w = onnx.numpy_helper.to_array(t).copy()
            w[:, 3] *= 300.0
            t.CopyFrom(graphs.init("wo", w))
    measured = []
    build = Scoring.build  # the range choice's candidates leave dynamic_weights auto
    monkeypatch.setattr(Scoring, "build", lambda self, table, options: measured.append(options)
                        if options.advanced.dynamic_weights != "auto" else build(self, table, options))
    _, result, _ = _quantize(tmp_path, model)
    assert not measured and _weight_scales(result.model) == [(2 * D,), (D,)]
    [chosen] = [d for d in result.decisions if d.option == "quantization.advanced.dynamic_weights"]
    assert chosen.value == "column" and not chosen.measured and "SQNR" in chosen.rule


@pytest.mark.parametrize("options", [{"advanced": {"dynamic_weights": "tensor"}}, {"per_channel": False}])
def test_dynamic_weights_per_tensor_when_asked(tmp_path, options):
    path, result, data = _quantize(tmp_path, _block(np.random.default_rng(0)), **options)
    assert _weight_scales(result.model) == [(), ()]
    assert not any(d.option == "quantization.advanced.dynamic_weights" and d.measured for d in result.decisions)
    assert _cosine_to_fp32(path, result.model, data) > 0.99


def test_dynamic_weights_option_parses():
    assert QuantizeConfig().advanced.dynamic_weights == "auto"
    loaded = load_config({"quantization": {"advanced": {"dynamic_weights": "column"}}})
    assert loaded.quantization.advanced.dynamic_weights == "column"
    with pytest.raises(ValueError, match="dynamic_weights must be one of auto, column, tensor"):
        AdvancedConfig(dynamic_weights="row")


def test_kit_gru_decoder_takes_per_tensor_weights(tmp_path):
    """The romanizer decoder step (batch 1, small Gemms): per-tensor scales lose nothing measurable."""
    model = kit_path("models", "arabic_name_romanizer_decoder.onnx")
    calib = tmp_path / "calib"
    calib.mkdir()
    for f in sorted(kit_path("inputs", "arabic_name_romanizer_decoder", "calib").glob("*.npz"))[:16]:
        (calib / f.name).symlink_to(f)
    result = api.quantize(model, data=calib, progress=False)
    assert _weight_scales(result.model) == [()] * 7
    [chosen] = [d for d in result.decisions if d.option == "quantization.advanced.dynamic_weights"]
    assert chosen.value == "tensor" and "7 dynamic MatMuls" in chosen.rule


def _with_conv_stem(model: onnx.ModelProto, convs: int) -> onnx.ModelProto:
    """The block behind a Conv1d front end of `convs` layers, as a speech encoder has: mel [1, D, 2T]
    -> Conv1d (stride 2, then 1) ... -> Transpose -> the block's input x [1, T, D]."""
    rng = np.random.default_rng(3)
    nodes, inits, tensor = [], [], "mel"
    for i in range(convs):
        inits.append(graphs.init(f"stem{i}_w", rng.normal(0, 0.2, (D, D, 3)).astype(np.float32)))
        nodes.append(helper.make_node("Conv", [tensor, f"stem{i}_w"], [f"stem{i}"], name=f"stem{i}", kernel_shape=[3],
                                      pads=[1, 1], strides=[2 if i == 0 else 1]))
        tensor = f"stem{i}"
    nodes.append(helper.make_node("Transpose", [tensor], ["x"], name="to_tokens", perm=[0, 2, 1]))
    block = [n for n in model.graph.node]
    return graphs.model(nodes + block, [graphs.tensor("mel", [1, D, 2 * T])], [graphs.tensor("y", None)],
                        inits + list(model.graph.initializer))


@pytest.mark.parametrize("convs, strategy", [(1, "dynamic"), (2, "static")])
def test_auto_takes_dynamic_behind_a_conv_stem_but_not_in_a_conv_net(tmp_path, convs, strategy):
    """The block has 3 weighted MatMuls (q, k, o): one Conv in front is a stem (a speech encoder's
    front end, a ViT's patch embedding) and stays float; two are a Conv net's share."""
    path = tmp_path / "model.onnx"
    onnx.save(_with_conv_stem(_block(np.random.default_rng(0)), convs), path)
    data = graphs.write_samples(tmp_path / "data", np.random.default_rng(1), (D, 2 * T), name="mel")
    result = api.quantize(path, data=data, progress=False, config={"quantization": {"advanced": graphs.RULE_OFF}})
    ops = Counter(n.op_type for n in result.model.graph.node)
    chosen = [n for n in result.notes if "quantized dynamically" in n]
    if strategy == "dynamic":
        assert ops["MatMulInteger"] == 2 and ops["Conv"] == 1 and ops["QuantizeLinear"] == 0
        assert len(chosen) == 1 and "3 weighted MatMul/Gemm, 1 Conv kept float" in chosen[0]
    else:
        assert ops["MatMulInteger"] == 0 and ops["QuantizeLinear"] > 0 and not chosen


def _fused_minilm(tmp_path):
    """The kit's MiniLM fused by onnxruntime's transformer optimizer (opt level 0: graph rewriting only)."""
    from onnxruntime.transformers import optimizer

    fused = optimizer.optimize_model(str(kit_path("models", "minilm_l6_v2_sentence.onnx")), model_type="bert",
                                     num_heads=0, hidden_size=0, opt_level=0)
    path = tmp_path / "fused.onnx"
    fused.save_model_to_file(str(path))
    return path


def test_embed_layer_norm_written_out_computes_the_same(tmp_path):
    """Padded rows (mask_index counts the ones), segment ids of both kinds."""
    from qtool.prepare.embed_layer_norm import write_out_embed_layer_norms

    path = _fused_minilm(tmp_path)
    model = onnx.load(path)
    gathers = sum(n.op_type == "Gather" for n in model.graph.node)
    assert write_out_embed_layer_norms(model) == 1
    ops = Counter(n.op_type for n in model.graph.node)
    assert ops["EmbedLayerNormalization"] == 0 and ops["LayerNormalization"] == 1
    assert ops["Gather"] == gathers + 4  # word, position and segment rows, and the ids' length
    ids = np.array([[101, 2000, 2001, 102, 0, 0], [101, 2000, 2001, 2002, 2003, 102]], np.int64)
    feeds = {"input_ids": ids, "attention_mask": (ids > 0).astype(np.int64),
             "token_type_ids": np.array([[0, 0, 1, 1, 0, 0], [0, 1, 0, 1, 0, 1]], np.int64)}
    fused, written = (ort.InferenceSession(m, providers=["CPUExecutionProvider"]).run(None, feeds)
                      for m in (str(path), model.SerializeToString()))
    for a, b in zip(fused, written):
        np.testing.assert_allclose(a, b, atol=1e-5)
    masked = np.array(feeds["attention_mask"])
    masked[1, 2:] = 0  # the second row's padding changes what every Attention reads
    feeds["attention_mask"] = masked
    fused, written = (ort.InferenceSession(m, providers=["CPUExecutionProvider"]).run(None, feeds)
                      for m in (str(path), model.SerializeToString()))
    for a, b in zip(fused, written):
        np.testing.assert_allclose(a, b, atol=1e-5)


def test_a_bert_fused_by_onnxruntimes_transformer_optimizer_goes_dynamic_with_integer_attention(tmp_path):
    """The kit's MiniLM as onnxruntime's transformer optimizer writes it (what optimum ships as
    model_optimized.onnx): its LayerNorms and attention are com.microsoft EmbedLayerNormalization,
    SkipLayerNormalization and Attention ops, and only the output and FFN projections are MatMuls.
    `auto` takes dynamic int8 there (static loses the embedding: cosine about 0.94), and each
    Attention becomes QAttention on its input's DynamicQuantizeLinear codes; a layer sent back to
    float is the fp32 Attention again. The word table, written out of EmbedLayerNormalization, is
    int8 per row."""
    from qtool.evaluation.macs import sample_shapes
    from qtool.plan.planner import prepared_model
    from qtool.quantization.float_fallback import restorable_layers, restore_float
    from qtool.table.table import smoothed_options

    path = _fused_minilm(tmp_path)
    ops = Counter(n.op_type for n in onnx.load(path).graph.node)
    assert ops["Attention"] == 6 and ops["SkipLayerNormalization"] == 12 and ops["LayerNormalization"] == 0
    samples = sorted(kit_path("inputs", "minilm_l6_v2_sentence", "eval").glob("*.npz"))[:8]
    result = api.quantize(path, data=kit_path("inputs", "minilm_l6_v2_sentence", "calib"), progress=False)
    chosen = [n for n in result.notes if "quantized dynamically" in n]
    assert len(chosen) == 1 and "12 SkipLayerNormalization" in chosen[0] and "6 Attention" in chosen[0]
    written = Counter(n.op_type for n in result.model.graph.node)
    assert written["QAttention"] == 6 and written["Attention"] == 0 and written["QuantizeLinear"] == 0
    assert written["MatMulInteger"] + written["DynamicQuantizeMatMul"] == 18
    # onnxruntime's CPU kernels run Add + LayerNormalization several times faster than SkipLayerNormalization
    assert written["SkipLayerNormalization"] == written["EmbedLayerNormalization"] == 0
    assert written["LayerNormalization"] == 13
    tables = [t for t in result.model.graph.initializer if t.data_type == onnx.TensorProto.INT8 and t.dims[:1] == [30522]]
    assert len(tables) == 1 and result.model.ByteSize() < 30e6  # fp32: 90 MB, 47 of them the word table
    assert any("12 SkipLayerNormalization node(s) written as Add and LayerNormalization" in n for n in result.notes)

    def embedding_cosine(model) -> float:
        sessions = [ort.InferenceSession(m, providers=["CPUExecutionProvider"])
                    for m in (str(path), model.SerializeToString())]
        cosines = []
        for f in samples:
            feeds = dict(np.load(f))
            a, b = (s.run(["sentence_embedding"], feeds)[0].ravel().astype(np.float64) for s in sessions)
            cosines.append(a @ b / (np.linalg.norm(a) * np.linalg.norm(b)))
        return float(np.mean(cosines))

    assert embedding_cosine(result.model) > 0.995
    # the projections inside the fused attentions are counted, and run in int8 (shapes through the contrib ops)
    macs = int8_macs(result.model, sample_shapes(dict(np.load(samples[0]))))
    assert macs.counted_nodes == 24 and macs.int8 == macs.total > 0
    prepared, _ = prepared_model(path, smoothed_options(QuantizeConfig(), result.table))
    layers = restorable_layers(result.model, prepared)
    attentions = [layer for label, layer in layers.items() if label.startswith("Attention")]
    assert len(layers) == 24 and len(attentions) == 6
    everything = restore_float(result.model, prepared, list(layers.values()))
    restored = Counter(n.op_type for n in everything.graph.node)
    assert restored["Attention"] == 6 and restored["QAttention"] == restored["DynamicQuantizeLinear"] == 0
    assert embedding_cosine(everything) > 0.9999  # all but the int8 word table back in fp32


@pytest.mark.parametrize("bias, total", [(True, True), (True, False), (False, False)])
def test_skip_layer_norm_is_written_as_add_and_layer_norm_with_the_same_values(bias, total):
    from qtool.quantization.ort_cpu.written_form import written_form
    from qtool.quantization.quantize import kernel_forms

    rng = np.random.default_rng(0)
    inputs = ["x", "skip", "gamma", "beta"] + (["bias"] if bias else [])
    outputs = ["y", "", "", "sum"] if total else ["y"]
    nodes = [helper.make_node("SkipLayerNormalization", inputs, outputs, name="skip_ln", domain="com.microsoft",
                              epsilon=1e-6)]
    graph_outputs = [graphs.tensor("y", [2, T, D])] + ([graphs.tensor("sum", [2, T, D])] if total else [])
    inits = [graphs.init(n, rng.normal(0, 1, D).astype(np.float32)) for n in ("gamma", "beta", "bias")[:2 + bias]]
    graph = helper.make_graph(nodes, "skip", [graphs.tensor("x", [2, T, D]), graphs.tensor("skip", [2, T, D])],
                              graph_outputs, inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17),
                                                    helper.make_opsetid("com.microsoft", 1)])
    feeds = {"x": rng.normal(0, 3, (2, T, D)).astype(np.float32),
             "skip": rng.normal(0, 1, (2, T, D)).astype(np.float32)}
    before = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feeds)
    split = onnx.ModelProto()
    split.CopyFrom(model)
    assert written_form(split) == 1
    assert Counter(n.op_type for n in split.graph.node) == {"Add": 1 + bias, "LayerNormalization": 1}
    after = ort.InferenceSession(split.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feeds)
    for a, b in zip(before, after):
        np.testing.assert_allclose(a, b, atol=1e-5)
    kept = onnx.ModelProto()
    kept.CopyFrom(model)
    assert kernel_forms(kept, QuantizeConfig(target="tensorrt")) == []  # written_form is not among its passes
    assert kept.graph.node[0].op_type == "SkipLayerNormalization"


def _post_ln_residual(rng, vocab=50) -> onnx.ModelProto:
    """Token embedding, reshaped by a computed shape (as exporters write it), a projection with a
    bias and a residual Add into LayerNormalization: onnxruntime's own shape inference cannot tell
    that the Add's two operands have one shape, shape inference with data propagation can."""
    nodes = [
        helper.make_node("Gather", ["emb", "ids"], ["h"], name="embed"),
        helper.make_node("Shape", ["ids"], ["ids_shape"], name="shape"),
        helper.make_node("Concat", ["ids_shape", "width"], ["hidden_shape"], name="concat", axis=0),
        helper.make_node("Reshape", ["h", "hidden_shape"], ["h2"], name="reshape"),
        helper.make_node("MatMul", ["h2", "w"], ["m"], name="proj"),
        helper.make_node("Add", ["m", "b"], ["o"], name="proj_bias"),
        helper.make_node("Add", ["o", "h2"], ["r"], name="residual"),
        helper.make_node("LayerNormalization", ["r", "gamma", "beta"], ["y"], name="ln", axis=-1),
    ]
    inits = [graphs.init("emb", rng.normal(0, 1, (vocab, D)).astype(np.float32)),
             graphs.init("width", np.array([D], np.int64)),
             graphs.init("w", rng.normal(0, 0.3, (D, D)).astype(np.float32)),
             graphs.init("b", rng.normal(0, 0.1, D).astype(np.float32)),
             graphs.init("gamma", np.ones(D, np.float32)), graphs.init("beta", np.zeros(D, np.float32))]
    return graphs.model(nodes, [graphs.tensor("ids", ["batch", "seq"], onnx.TensorProto.INT64)],
                        [graphs.tensor("y", None)], inits)


def _optimized_ops(model: onnx.ModelProto, tmp_path) -> Counter:
    options = ort.SessionOptions()
    options.optimized_model_filepath = str(tmp_path / "optimized.onnx")
    options.log_severity_level = 3
    ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    return Counter(n.op_type for n in onnx.load(tmp_path / "optimized.onnx").graph.node)


def test_int8_model_is_written_without_value_info_so_onnxruntime_keeps_add_and_layer_norm(tmp_path):
    """With the front end's inferred shapes in the model, onnxruntime fuses the residual Add and
    the LayerNormalization into SkipLayerNormalization, slower on its CPU than the two ops
    (qtool.quantization.ort_cpu.written_form); the model qtool writes has none."""
    from qtool.graph.shapes import with_shapes

    path = tmp_path / "model.onnx"
    onnx.save(_post_ln_residual(np.random.default_rng(0)), path)
    data = tmp_path / "data"
    data.mkdir()
    rng = np.random.default_rng(1)
    for i in range(8):
        np.save(data / f"s{i}.npy", rng.integers(0, 50, (1, T), dtype=np.int64))
    result = api.quantize(path, data=data, config=Config(quantization=QuantizeConfig(matmul="dynamic")),
                          progress=False)
    assert Counter(n.op_type for n in result.model.graph.node)["MatMulInteger"] == 1
    assert not result.model.graph.value_info
    ops = _optimized_ops(result.model, tmp_path)
    assert ops["LayerNormalization"] == 1 and ops["SkipLayerNormalization"] == 0
    assert _optimized_ops(with_shapes(result.model), tmp_path)["SkipLayerNormalization"] == 1  # what it avoids
    other = api.quantize(path, data=data, config=load_config({"quantization": {"target": "tensorrt"}}),
                         progress=False)
    assert other.model.graph.value_info  # other targets keep them


def _embedded(rng, also_read: bool = False) -> onnx.ModelProto:
    """tokens (int64) -> Gather from a [V, D] table -> MatMul -> Add bias -> Tanh -> y: an RNN
    decoder's embedding and input projection. `also_read`: an Add reads the embedding too."""
    nodes = [helper.make_node("Gather", ["table", "tokens"], ["e"], name="embed"),
             helper.make_node("MatMul", ["e", "w"], ["p"], name="proj"),
             helper.make_node("Add", ["p", "b"], ["pb"], name="proj_bias"),
             helper.make_node("Tanh", ["pb"], ["y"], name="act")]
    outputs = [graphs.tensor("y", None)]
    if also_read:
        nodes.append(helper.make_node("Add", ["e", "b"], ["side"], name="side"))
        outputs.append(graphs.tensor("side", None))
    inits = [graphs.init("table", rng.normal(0, 1.0, (40, D)).astype(np.float32)),
             graphs.init("w", rng.normal(0, 0.3, (D, D)).astype(np.float32)),
             graphs.init("b", rng.normal(0, 0.1, D).astype(np.float32))]
    return graphs.model(nodes, [helper.make_tensor_value_info("tokens", onnx.TensorProto.INT64, [1, T])],
                        outputs, inits)


@pytest.mark.parametrize("also_read", [False, True])
def test_rows_of_a_constant_table_feed_matmul_integer_as_gathered_codes(tmp_path, also_read):
    """The table is stored as uint8 codes (one scale, as DynamicQuantizeLinear would quantize its
    rows) and the MatMulInteger reads the gathered codes: no quantization at run time, the float
    table gone. Where something else reads the rows too, they stay float and are quantized at run
    time as before. The float fallback brings the float Gather back with the MatMul."""
    from qtool.plan.planner import prepared_model
    from qtool.quantization.float_fallback import restorable_layers, restore_float

    rng = np.random.default_rng(0)
    path = tmp_path / "model.onnx"
    onnx.save(_embedded(rng, also_read), path)
    data = tmp_path / "data"
    data.mkdir()
    for i in range(8):
        np.save(data / f"s{i}.npy", rng.integers(0, 40, (1, T)).astype(np.int64))
    result = api.quantize(path, data=data, config={"quantization": {"matmul": "dynamic"}},
                          progress=False)
    onnx.checker.check_model(result.model, full_check=True)
    ops = Counter(n.op_type for n in result.model.graph.node)
    inits = {t.name: t for t in result.model.graph.initializer}
    assert ops["MatMulInteger"] == 1
    if also_read:
        assert ops["DynamicQuantizeLinear"] == 1 and "table" in inits
        return
    assert ops["DynamicQuantizeLinear"] == 0 and "table" not in inits and ops["Gather"] == 1
    assert inits["table" + CODES].data_type == onnx.TensorProto.UINT8
    assert any(note.startswith("1 embedding table(s) read by dynamic int8 MatMuls") for note in result.notes)
    sessions = [ort.InferenceSession(m, providers=["CPUExecutionProvider"])
                for m in (str(path), result.model.SerializeToString())]
    for f in sorted(data.glob("*.npy")):
        a, b = (s.run(None, {"tokens": np.load(f)})[0].ravel().astype(np.float64) for s in sessions)
        assert a @ b / (np.linalg.norm(a) * np.linalg.norm(b)) > 0.999
    prepared, _ = prepared_model(path, QuantizeConfig(matmul="dynamic"))
    restored = restore_float(result.model, prepared, [restorable_layers(result.model, prepared)["proj"]])
    onnx.checker.check_model(restored, full_check=True)
    ops = Counter(n.op_type for n in restored.graph.node)
    assert ops["MatMulInteger"] == 0 and ops["MatMul"] == 1 and ops["Gather"] == 1
    float_run = ort.InferenceSession(restored.SerializeToString(), providers=["CPUExecutionProvider"])
    tokens = np.load(sorted(data.glob("*.npy"))[0])
    np.testing.assert_allclose(float_run.run(None, {"tokens": tokens})[0], sessions[0].run(None, {"tokens": tokens})[0],
                               rtol=1e-5, atol=1e-6)


def test_a_transformer_job_prepares_its_graph_once_for_every_choice_and_the_build(tmp_path, monkeypatch):
    """`matmul: auto` settles to dynamic, the embeddings and the rest settle too: the choices and the
    final build, which name those values (the build with every `auto` settled, head tails included),
    share the one graph the job prepared with `auto` (it differs only by auto's note). Calibration
    prepares twice (the smoothing is measured first). The speed rule is off so that no node it keeps
    float changes the final build's plan."""
    import qtool.plan.planner as planner
    import qtool.quantization.quantize as quantize

    calls = []
    original = planner.prepared_with_strategy

    def counted(model_path, options):
        calls.append(options.matmul)
        return original(model_path, options)

    monkeypatch.setattr(planner, "prepared_with_strategy", counted)
    monkeypatch.setattr(quantize, "prepared_with_strategy", counted)
    path = tmp_path / "model.onnx"
    onnx.save(_block(np.random.default_rng(0)), path)
    result = api.quantize(path, data=_samples(tmp_path, np.random.default_rng(1)), progress=False,
                          config={"quantization": {"advanced": graphs.RULE_OFF}})
    assert {d.option: d.value for d in result.decisions}["quantization.matmul"] == "dynamic"
    assert calls == ["auto"] * 3, calls
