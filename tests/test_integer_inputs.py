"""Models with integer and bool inputs (token ids, masks): calibration from .npz samples of any
sequence length, Q/DQ on float tensors only, and embedding tables stored int8 per row."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from qtool import api
from qtool.config import AdvancedConfig, Config, PreprocessConfig, QuantizeConfig
from qtool.data.dataset import batches, open_data
from qtool.errors import QtoolError
from qtool.graph.modelio import InputSpec
from qtool.quantization.rewrite import SCALE_SUFFIX, WEIGHT_SUFFIX

from tests import graphs

VOCAB, DIM, HIDDEN = 50, 16, 8
LENGTHS = [5, 9, 5, 7, 12, 3, 9, 6]


def _encoder(rng, vocab=VOCAB, tied_output=False, then_float=False) -> onnx.ModelProto:
    """ids int64 [N,S] (+ 0, an int64 Add) -> Gather(table) -> Where(mask) -> MatMul+Add -> * Cast(mask)
    -> y [N,S,H]; also lengths = ReduceSum(Cast(mask, int64)) * 1 (an int64 Mul) as an int64 output.
    tied_output: the table is read by a MatMul as well (logits over the vocabulary). then_float: y goes
    through a float op (no int8 rule), as through the rest of a model, so that the ops before it are
    int8 (otherwise the bias Add and the mask Mul compute the graph's output in float)."""
    table = rng.normal(0, 0.5, (vocab, DIM)).astype(np.float32)
    w = rng.normal(0, 0.3, (DIM, HIDDEN)).astype(np.float32)
    b = rng.normal(0, 0.1, HIDDEN).astype(np.float32)
    nodes = [
        helper.make_node("Add", ["ids", "zero_i"], ["ids_shifted"], name="shift"),
        helper.make_node("Gather", ["table", "ids_shifted"], ["emb"], name="embed"),
        helper.make_node("Unsqueeze", ["mask", "last"], ["mask3"], name="mask3"),
        helper.make_node("Where", ["mask3", "emb", "zero"], ["masked"], name="where"),
        helper.make_node("MatMul", ["masked", "w"], ["mm"], name="mm"),
        helper.make_node("Add", ["mm", "b"], ["h"], name="bias"),
        helper.make_node("Cast", ["mask3"], ["maskf"], name="maskf", to=TensorProto.FLOAT),
        helper.make_node("Mul", ["h", "maskf"], ["y0" if then_float else "y"], name="apply_mask"),
        helper.make_node("Cast", ["mask"], ["mask_i"], name="mask_i", to=TensorProto.INT64),
        helper.make_node("ReduceSum", ["mask_i", "one"], ["sums"], name="sums", keepdims=0),
        helper.make_node("Mul", ["sums", "one"], ["lengths"], name="lengths"),
    ]
    if then_float:
        nodes.append(helper.make_node("Softsign", ["y0"], ["y"], name="next"))
    outputs = [graphs.tensor("y", ["N", "S", HIDDEN]), graphs.tensor("lengths", ["N"], TensorProto.INT64)]
    inits = [graphs.init("table", table), graphs.init("w", w), graphs.init("b", b),
             graphs.init("last", np.array([-1], np.int64)), graphs.init("one", np.array([1], np.int64)),
             graphs.init("zero", np.array(0, np.float32)), graphs.init("zero_i", np.array(0, np.int64))]
    if tied_output:
        nodes += [helper.make_node("Transpose", ["table"], ["table_t"], name="table_t", perm=[1, 0]),
                  helper.make_node("MatMul", ["emb", "table_t"], ["logits"], name="logits")]
        outputs.append(graphs.tensor("logits", ["N", "S", vocab]))
    inputs = [graphs.tensor("ids", ["N", "S"], TensorProto.INT64), graphs.tensor("mask", ["N", "S"], TensorProto.BOOL)]
    return graphs.model(nodes, inputs, outputs, inits)


def _samples(folder, rng, vocab=VOCAB, lengths=LENGTHS):
    """One .npz per sample, batch 1, a different sequence length on most samples."""
    folder.mkdir()
    for i, length in enumerate(lengths):
        mask = np.ones((1, length), bool)
        mask[0, -1] = i % 2 == 0  # some padding at the end
        np.savez(folder / f"{i:03d}.npz", ids=rng.integers(0, vocab, (1, length)).astype(np.int64), mask=mask)
    return folder


def _quantize(tmp_path, model, options=QuantizeConfig(), vocab=VOCAB):
    rng = np.random.default_rng(1)
    tmp_path.mkdir(exist_ok=True)
    path = tmp_path / "model.onnx"
    onnx.save(model, path)
    data = _samples(tmp_path / "data", rng, vocab)
    result = api.quantize(path, data=data, config=Config(quantization=options), progress=False)
    onnx.checker.check_model(result.model, full_check=True)
    return path, result, data


def _typed(model: onnx.ModelProto) -> dict[str, int]:
    inferred = onnx.shape_inference.infer_shapes(model, strict_mode=True).graph
    types = {v.name: v.type.tensor_type.elem_type for v in
             list(inferred.value_info) + list(inferred.input) + list(inferred.output)}
    types.update({t.name: t.data_type for t in inferred.initializer})
    return types


def _outputs(model, feeds):
    src = model if isinstance(model, str) else model.SerializeToString()
    return ort.InferenceSession(src, providers=["CPUExecutionProvider"]).run(None, feeds)


def _cosine(a, b):
    a, b = a.ravel().astype(np.float64), b.ravel().astype(np.float64)
    return float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b)))


def test_integer_and_bool_inputs_quantize_the_float_part_only(tmp_path):
    path, result, data = _quantize(tmp_path, _encoder(np.random.default_rng(0)))
    qmodel = result.model
    types = _typed(qmodel)
    quantized = [n.input[0] for n in qmodel.graph.node if n.op_type == "QuantizeLinear"]
    assert quantized, "the float part (Gather output, MatMul, Add, Mul) is quantized"
    assert all(types[name] == TensorProto.FLOAT for name in quantized), \
        {name: types[name] for name in quantized if types[name] != TensorProto.FLOAT}
    for node in qmodel.graph.node:
        if node.op_type == "DequantizeLinear" and node.input[0] not in types:
            pytest.fail(f"untyped DequantizeLinear input {node.input[0]}")
    assert not {"ids", "ids_shifted", "mask", "mask3", "mask_i", "sums", "lengths"} & set(quantized)
    assert result.int8_weights == 1 and result.int8_embeddings == 0  # the 3 KB table stays float by default
    assert "table" in {t.name for t in qmodel.graph.initializer}
    for name in sorted(data.glob("*.npz")):
        feeds = dict(np.load(name))
        ref, got = _outputs(str(path), feeds), _outputs(qmodel, feeds)
        assert got[1].dtype == np.int64 and np.array_equal(ref[1], got[1])
        assert _cosine(ref[0], got[0]) > 0.99


def _int8_table_checks(qmodel, table: np.ndarray) -> None:
    inits = {t.name: numpy_helper.to_array(t) for t in qmodel.graph.initializer}
    assert "table" not in inits  # the float table is gone from the file
    codes, scales = inits["table" + WEIGHT_SUFFIX], inits["table" + SCALE_SUFFIX]
    assert codes.dtype == np.int8 and codes.shape == table.shape and codes.min() >= -127
    assert scales.shape == (table.shape[0], 1)
    np.testing.assert_allclose(scales[:, 0], np.abs(table).max(axis=1) / 127, rtol=1e-6)
    assert np.abs(codes.astype(np.float32) * scales - table).max() <= scales.max() / 2 + 1e-7
    gathers = [n for n in qmodel.graph.node if n.op_type == "Gather"]
    assert {tuple(n.input) for n in gathers} == {("table" + WEIGHT_SUFFIX, "ids_shifted"),
                                                   ("table" + SCALE_SUFFIX, "ids_shifted")}
    assert not any(n.op_type == "DequantizeLinear" and n.input[0].startswith("table") for n in qmodel.graph.node)


def test_embedding_table_int8_per_row_when_asked(tmp_path):
    model = _encoder(np.random.default_rng(0))
    table = numpy_helper.to_array(next(t for t in model.graph.initializer if t.name == "table"))
    path, result, data = _quantize(tmp_path, model, QuantizeConfig(advanced=AdvancedConfig(embeddings="int8")))
    assert result.int8_embeddings == 1
    _int8_table_checks(result.model, table)
    # the gathered rows are the dequantized table's rows, exactly
    emb = onnx.helper.make_tensor_value_info("emb", TensorProto.FLOAT, None)
    with_emb = onnx.ModelProto()
    with_emb.CopyFrom(result.model)
    with_emb.graph.output.append(emb)
    feeds = dict(np.load(sorted(data.glob("*.npz"))[0]))
    rows = _outputs(with_emb, feeds)[-1]
    codes = {t.name: numpy_helper.to_array(t) for t in result.model.graph.initializer}
    expected = (codes["table" + WEIGHT_SUFFIX].astype(np.float32) * codes["table" + SCALE_SUFFIX])[feeds["ids"]]
    np.testing.assert_array_equal(rows, expected)
    ref, got = _outputs(str(path), feeds), _outputs(result.model, feeds)
    assert _cosine(ref[0], got[0]) > 0.99


def test_embedding_auto_takes_tables_of_1_mib_on_ort_cpu_and_float_keeps_them(tmp_path):
    vocab = (1 << 20) // (4 * DIM)  # exactly 1 MiB of float32
    model = _encoder(np.random.default_rng(0), vocab=vocab)
    table = numpy_helper.to_array(next(t for t in model.graph.initializer if t.name == "table"))
    _, result, _ = _quantize(tmp_path / "auto", model, vocab=vocab)
    _int8_table_checks(result.model, table)
    _, kept, _ = _quantize(tmp_path / "float", model, QuantizeConfig(advanced=AdvancedConfig(embeddings="float")), vocab=vocab)
    assert kept.int8_embeddings == 0 and "table" in {t.name for t in kept.model.graph.initializer}
    assert kept.model.ByteSize() > 3 * result.model.ByteSize()
    _, other_target, _ = _quantize(tmp_path / "tensorrt", model, QuantizeConfig(target="tensorrt"), vocab=vocab)
    assert other_target.int8_embeddings == 0  # auto: measured in onnxruntime only


@pytest.mark.parametrize("case", ["tied", "excluded"])
def test_embedding_table_stays_float_when_not_only_gathered_or_excluded(tmp_path, case):
    model = _encoder(np.random.default_rng(0), tied_output=case == "tied")
    options = QuantizeConfig(exclude_nodes=("embed",) if case == "excluded" else (), advanced=AdvancedConfig(embeddings="int8"))
    _, result, _ = _quantize(tmp_path, model, options)
    assert result.int8_embeddings == 0
    assert "table" in {t.name for t in result.model.graph.initializer}
    assert not any(t.name == "table" + WEIGHT_SUFFIX for t in result.model.graph.initializer)


def test_in_memory_integer_samples_of_varying_length(tmp_path):
    path = tmp_path / "model.onnx"
    onnx.save(_encoder(np.random.default_rng(0), then_float=True), path)
    rng = np.random.default_rng(2)
    samples = [{"ids": rng.integers(0, VOCAB, (n,)).astype(np.int64), "mask": np.ones(n, bool)} for n in LENGTHS]
    table = api.calibrate(path, samples, progress=False)
    assert table.num_samples == len(LENGTHS)
    assert set(table.tensors) == {"masked", "mm", "h", "maskf", "y0"}  # float tensors only, never ids or masks
    assert table.tensors["maskf"].min == table.tensors["maskf"].max == 1.0


def test_npz_integer_and_bool_arrays_keep_their_dtype_and_batch_by_length(tmp_path):
    specs = [InputSpec("ids", np.dtype("int64"), (None, None)), InputSpec("mask", np.dtype("bool"), (None, None))]
    _samples(tmp_path / "d", np.random.default_rng(0), lengths=[5, 5, 7, 3, 3])
    got = list(batches(open_data(tmp_path / "d", specs, PreprocessConfig()), batch_size=8))
    assert [b.feeds["ids"].shape for b in got] == [(2, 5), (1, 7), (2, 3)]
    assert all(b.feeds["ids"].dtype == np.int64 and b.feeds["mask"].dtype == np.bool_ for b in got)


def test_single_int_input_from_npy(tmp_path):
    spec = InputSpec("ids", np.dtype("int32"), (None, None))
    np.save(tmp_path / "a.npy", np.arange(6, dtype=np.int32))  # no batch dimension: one is added
    got = list(batches(open_data(tmp_path, [spec], PreprocessConfig()), batch_size=1))
    assert got[0].feeds["ids"].shape == (1, 6) and got[0].feeds["ids"].dtype == np.int32


@pytest.mark.parametrize("name, array, message", [
    ("ids", np.zeros((1, 4), np.int32), r"s\.npz: array 'ids' has dtype int32, the model expects int64 "
                                        r"\(only float arrays are converted"),
    ("mask", np.zeros((1, 4), np.int64), r"s\.npz: array 'mask' has dtype int64, the model expects bool"),
    ("ids", np.zeros((1, 4), np.float32), r"s\.npz: array 'ids' has dtype float32, the model expects int64"),
    ("ids", np.zeros((1, 2, 4), np.int64), r"s\.npz: array 'ids' has shape \[1, 2, 4\], the model expects rank 2"),
])
def test_wrong_integer_dtype_or_shape_is_one_line_naming_the_file(tmp_path, name, array, message):
    specs = [InputSpec("ids", np.dtype("int64"), (None, None)), InputSpec("mask", np.dtype("bool"), (None, None))]
    arrays = {"ids": np.zeros((1, 4), np.int64), "mask": np.ones((1, 4), bool), name: array}
    np.savez(tmp_path / "s.npz", **arrays)
    with pytest.raises(QtoolError, match=message) as caught:
        list(batches(open_data(tmp_path, specs, PreprocessConfig()), 1))
    assert "\n" not in str(caught.value)


def test_embedding_auto_is_settled_to_its_tables_and_the_settled_config_replays_them(tmp_path):
    vocab = (1 << 20) // (4 * DIM)  # 1 MiB: auto takes it
    _, result, _ = _quantize(tmp_path / "big", _encoder(np.random.default_rng(0), vocab=vocab))
    settled = {d.option: d.value for d in result.decisions}
    assert settled["quantization.advanced.embeddings"] == "int8"
    assert settled["quantization.advanced.embedding_tables"] == ("table",)
    assert result.settled.quantization.advanced.embedding_tables == ("table",) and result.int8_embeddings == 1
    # the 3 KB table: auto settles to no table, and the settled value is what a replay reads (int8
    # with no list would store this table int8 too)
    _, small, _ = _quantize(tmp_path / "small", _encoder(np.random.default_rng(0)))
    advanced = small.settled.quantization.advanced
    assert (advanced.embeddings, advanced.embedding_tables) == ("int8", ()) and small.int8_embeddings == 0
    _, replay, _ = _quantize(tmp_path / "replay", _encoder(np.random.default_rng(0)), small.settled.quantization)
    assert replay.int8_embeddings == 0
    assert replay.model.SerializeToString() == small.model.SerializeToString()
