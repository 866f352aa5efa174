"""Calibration tables of other toolchains: golden files, detection, exact round trips, CLI."""

from __future__ import annotations

import hashlib
import json
import struct
import warnings
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import helper

from qtool.calibration.calibrate import calibrate
from qtool.config import CalibrationConfig, PreprocessConfig, QuantizeConfig, load_config
from qtool.errors import QtoolError
from qtool.table.formats import FORMATS, amct, read_table, write_table
from qtool.table.qparams import QParams
from qtool.quantization.quantize import quantize_model

from tests import graphs
from tests.conftest import CALIB_SAMPLES, EFFNET, EFFNET_CONFIG, RANGES_ONLY, run_qtool

GOLDEN = Path(__file__).parent / "golden"
UINT8 = QuantizeConfig()
INT8_SYMMETRIC = QuantizeConfig(activation_dtype="int8", symmetric_activations=True)
# Formats that hold a float32 scale (or the range it came from) exactly.
EXACT_ASYMMETRIC = ("qtool", "onnxruntime", "tpu-mlir", "tengine")
EXACT_SYMMETRIC = ("qtool", "onnxruntime", "tengine", "tensorrt")


def f32(x) -> float:
    return float(np.float32(x))


def chain_model() -> onnx.ModelProto:
    """x -> conv1 -> Relu -> layer1.0.conv1 -> head -> y: every quantized tensor feeds a Conv."""
    rng = np.random.default_rng(0)
    inits = [graphs.init("w1", rng.normal(0, 0.3, (4, 3, 3, 3)).astype(np.float32)),
             graphs.init("b1", rng.normal(0, 0.1, 4).astype(np.float32)),
             graphs.init("w2", rng.normal(0, 0.3, (2, 4, 1, 1)).astype(np.float32)),
             graphs.init("w3", rng.normal(0, 0.3, (3, 2, 1, 1)).astype(np.float32))]
    nodes = [helper.make_node("Conv", ["x", "w1", "b1"], ["c1"], name="conv1", pads=[1, 1, 1, 1]),
             helper.make_node("Relu", ["c1"], ["r1"], name="relu1"),
             helper.make_node("Conv", ["r1", "w2"], ["c2"], name="layer1.0.conv1"),
             helper.make_node("Conv", ["c2", "w3"], ["y"], name="head")]
    return graphs.model(nodes, [graphs.tensor("x", ["N", 3, 8, 8])], [graphs.tensor("y", None)], inits)


@pytest.fixture(scope="module")
def chain(tmp_path_factory):
    folder = tmp_path_factory.mktemp("chain")
    path = folder / "chain.onnx"
    onnx.save(chain_model(), path)
    data = graphs.write_samples(folder / "data", np.random.default_rng(1), (3, 8, 8), count=8)
    return path, data


def _table(model, data, options, preprocess=PreprocessConfig(), samples=8):
    return calibrate(model, data, preprocess, CalibrationConfig(num_samples=samples, batch_size=4), options,
                     progress=False)


def _digest(model: onnx.ModelProto) -> str:
    return hashlib.sha256(model.SerializeToString()).hexdigest()


def _convert(table, tmp_path, fmt, model, options):
    path = tmp_path / f"table.{fmt}"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        write_table(table, path, fmt, model, options)
        back, detected = read_table(path, None, model, options)
    assert detected.name == fmt  # detected from the content alone
    return back


# ---- golden files --------------------------------------------------------------------

def test_tensorrt_golden_is_big_endian_float32_of_amax_over_127():
    table, fmt = read_table(GOLDEN / "tensorrt_mnist.cache", options=INT8_SYMMETRIC)
    assert fmt.name == "tensorrt" and table.method == "EntropyCalibration2"
    expected = {"data": 0.007845180109, "conv1": 0.01671504229, "ip2": 0.2276359797, "prob": 0.007875937968}
    for name, value in expected.items():
        entry = table.tensors[name]
        assert entry.qparams.dtype == "int8" and entry.qparams.zero_point == 0
        assert entry.qparams.scale == pytest.approx(value, rel=1e-9)
        assert entry.range[1] == pytest.approx(127 * value, rel=1e-7)
    assert len(table.tensors) == 8
    # uint8 options: the same grid with zero point 128, not a recomputed one; the scale is the
    # file's big-endian float32 "conv1: 3c88edfc" bit for bit
    as_uint8, _ = read_table(GOLDEN / "tensorrt_mnist.cache", options=UINT8)
    conv1 = struct.unpack(">f", bytes.fromhex("3c88edfc"))[0]
    assert as_uint8.tensors["conv1"].qparams == QParams(conv1, 128, "uint8")


def test_tpu_mlir_golden_threshold_or_min_max():
    sym, fmt = read_table(GOLDEN / "tpu_mlir_yolov5s.table", options=INT8_SYMMETRIC)
    assert fmt.name == "tpu-mlir" and len(sym.tensors) == 7
    assert sym.tensors["122_Conv"].qparams == QParams(f32(56.4281803 / 127), 0, "int8")
    # min 0: TPU-MLIR quantizes unsigned, threshold / 255 (here as the same grid in int8)
    assert sym.tensors["images"].qparams == QParams(f32(1.0000080 / 255), -128, "int8")
    asym, _ = read_table(GOLDEN / "tpu_mlir_yolov5s.table", options=UINT8)
    # by hand: scale (7.2770605 + 87.9204330) / 255 = 0.37332350, zero point 87.9204330 / 0.37332350 = 235.5 -> 236
    assert asym.tensors["128_Conv"].qparams == QParams(f32(95.1974935 / 255), 236, "uint8")
    assert asym.tensors["128_Conv"].min == -87.9204330


def test_tpu_mlir_other_sections_are_skipped_with_a_warning():
    with pytest.warns(UserWarning, match="skipped 1 lines"):
        table, _ = read_table(GOLDEN / "tpu_mlir_int4.table", options=INT8_SYMMETRIC)
    assert table.tensors["122_Conv"].qparams.scale == f32(56.4281803 / 127)  # the int8 threshold, not the int4 one


def test_tpu_mlir_op_names_with_type_suffix_map_to_tensors(chain, tmp_path):
    model, _ = chain
    (tmp_path / "t.table").write_text("# op_name    threshold    min    max\nc2_Conv 2.0 -1.5 2.0\nr1 3.0 0.0 3.0\n")
    table, _ = read_table(tmp_path / "t.table", None, model)
    assert set(table.tensors) == {"c2", "r1"}


def test_tengine_golden_zero_points_decide_the_type():
    u8, fmt = read_table(GOLDEN / "tengine_uint8.scale", options=UINT8)
    assert fmt.name == "tengine"
    assert u8.tensors["data"].qparams == QParams(f32(0.007843), 127, "uint8")
    assert u8.tensors["fc"].qparams == QParams(f32(0.101961), 128, "uint8")
    i8, fmt = read_table(GOLDEN / "tengine_int8.scale", options=INT8_SYMMETRIC)
    assert fmt.name == "tengine"
    assert i8.tensors["conv1"].qparams == QParams(f32(0.047244), 0, "int8")


def test_ncnn_golden_maps_layers_to_their_input_tensors(chain):
    model, _ = chain
    table, fmt = read_table(GOLDEN / "ncnn_chain.table", None, model, INT8_SYMMETRIC)
    assert fmt.name == "ncnn"
    assert set(table.tensors) == {"x", "r1", "c2"}  # inputs of conv1, layer1.0.conv1, head
    assert table.tensors["x"].qparams == QParams(f32(1 / 47.340626), 0, "int8")
    assert table.tensors["c2"].qparams == QParams(f32(1 / 84.666664), 0, "int8")


def test_ncnn_needs_the_model(chain):
    with pytest.raises(QtoolError, match="give the model"):
        read_table(GOLDEN / "ncnn_chain.table")


def test_amct_golden_text_record(chain, tmp_path):
    model, _ = chain
    with pytest.warns(UserWarning) as caught:
        table, fmt = read_table(GOLDEN / "amct_record.txt", None, model, QuantizeConfig(activation_dtype="int8"))
    assert fmt.name == "amct"
    assert table.tensors["x"].qparams == QParams(f32(0.0798481479), 1, "int8")
    assert table.tensors["r1"].qparams == QParams(f32(0.00392156886), -128, "int8")
    messages = " ".join(str(w.message) for w in caught)
    assert "not INT8" in messages and "layer1.0.conv1" in messages  # the INT4 record is flagged
    assert "1 of 3 quantized tensors have no entry: c2" in messages  # no record for layer 'head'
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        as_uint8, _ = read_table(GOLDEN / "amct_record.txt", None, model, UINT8)
    assert as_uint8.tensors["x"].qparams == QParams(f32(0.0798481479), 129, "uint8")


def _varint(n: int) -> bytes:
    out = b""
    while True:
        byte, n = n & 0x7F, n >> 7
        out += bytes([byte | (0x80 if n else 0)])
        if not n:
            return out


def _field(number: int, wire: int, payload: bytes) -> bytes:
    return _varint(number << 3 | wire) + payload


def _length_delimited(number: int, payload: bytes) -> bytes:
    return _field(number, 2, _varint(len(payload)) + payload)


def test_amct_binary_record_assembled_by_hand_from_the_wire_format(chain, tmp_path):
    """The golden record's first entry, encoded field by field per the protobuf spec."""
    model, _ = chain
    value = (_field(1, 5, struct.pack("<f", 0.0798481479)) + _field(2, 0, _varint(1))
             + _field(3, 5, struct.pack("<f", 0.00297622895)) + _field(4, 0, _varint(0))
             + _field(9, 0, _varint(1)) + _length_delimited(10, b"INT8"))
    entry = _length_delimited(1, b"conv1") + _length_delimited(2, value)
    (tmp_path / "record.bin").write_bytes(_length_delimited(1, entry))
    with pytest.warns(UserWarning, match="no entry"):
        table, fmt = read_table(tmp_path / "record.bin", None, model, QuantizeConfig(activation_dtype="int8"))
    assert fmt.name == "amct-binary"
    assert table.tensors["x"].qparams == QParams(f32(0.0798481479), 1, "int8")
    # and qtool writes the same bytes for the same record
    record = amct.record_class()()
    item = record.record.add(key="conv1")
    item.value.scale_d, item.value.offset_d, item.value.skip_fusion, item.value.dst_type = 0.0798481479, 1, True, "INT8"
    item.value.scale_w.append(0.00297622895)
    item.value.offset_w.append(0)
    assert record.SerializeToString() == (tmp_path / "record.bin").read_bytes()


def test_amct_proto_in_the_package_defines_the_documented_fields():
    value = amct.record_class()().record.add().value
    fields = value.DESCRIPTOR.fields_by_name
    numbers = {name: fields[name].number for name in ("scale_d", "offset_d", "scale_w", "offset_w", "shift_bit",
                                                       "skip_fusion", "dst_type")}
    assert numbers == {"scale_d": 1, "offset_d": 2, "scale_w": 3, "offset_w": 4, "shift_bit": 5, "skip_fusion": 9,
                       "dst_type": 10}
    value.scale_w.extend([0.5, 0.25])  # repeated: one scale per output channel
    assert list(value.scale_w) == [0.5, 0.25] and value.dst_type == "INT8"  # the documented default


def test_onnxruntime_golden(chain):
    model, _ = chain
    table, fmt = read_table(GOLDEN / "onnxruntime_chain.json", None, model, UINT8)
    assert fmt.name == "onnxruntime" and table.method == "MinMax"
    # by hand: scale 5.25 / 255 = 0.0205882, zero point 2.5 / 0.0205882 = 121.43 -> 121
    assert table.tensors["x"].qparams == QParams(f32(5.25 / 255), 121, "uint8")
    assert table.tensors["r1"].range == (0.0, 3.5)


def test_onnxruntime_reads_what_qtool_writes_and_the_reverse(chain, tmp_path):
    calibrate_module = pytest.importorskip("onnxruntime.quantization.calibrate")
    if not hasattr(calibrate_module, "load_tensors_data"):
        pytest.skip("this onnxruntime has no save/load_tensors_data")
    model, data = chain
    table = _table(model, data, UINT8)
    write_table(table, tmp_path / "qtool.json", "onnxruntime")
    theirs = calibrate_module.load_tensors_data(tmp_path / "qtool.json")
    for name, entry in table.tensors.items():
        assert (float(theirs[name].lowest), float(theirs[name].highest)) == entry.range
    calibrate_module.save_tensors_data(theirs, tmp_path / "ort.json")
    back, fmt = read_table(tmp_path / "ort.json", None, model, UINT8)
    assert fmt.name == "onnxruntime"
    assert {n: e.qparams for n, e in back.tensors.items()} == {n: e.qparams for n, e in table.tensors.items()}


def test_unrecognised_and_forced_formats(tmp_path):
    (tmp_path / "junk.txt").write_text("hello world\n")
    with pytest.raises(QtoolError, match="unrecognised calibration table"):
        read_table(tmp_path / "junk.txt")
    with pytest.raises(QtoolError, match="first line is not TRT"):
        read_table(GOLDEN / "tengine_uint8.scale", "tensorrt")
    with pytest.raises(QtoolError, match="unknown table format"):
        read_table(GOLDEN / "tengine_uint8.scale", "caffe")


# ---- round trips -----------------------------------------------------------------------

@pytest.fixture(scope="module")
def effnet_tables():
    preprocess = load_config(EFFNET_CONFIG).preprocess
    return {options: _table(EFFNET, CALIB_SAMPLES, options, preprocess, samples=4)
            for options in (UINT8, INT8_SYMMETRIC)}


@pytest.mark.parametrize("options, formats", [(UINT8, EXACT_ASYMMETRIC), (INT8_SYMMETRIC, EXACT_SYMMETRIC)],
                         ids=["uint8-asymmetric", "int8-symmetric"])
def test_round_trip_on_efficientnet_is_exact_and_quantizes_identically(effnet_tables, tmp_path, options, formats):
    table = effnet_tables[options]
    reference = _digest(quantize_model(EFFNET, table, options).model)
    for fmt in formats:
        back = _convert(table, tmp_path, fmt, EFFNET, options)
        assert {n: back.tensors[n].qparams for n in table.tensors} == \
               {n: e.qparams for n, e in table.tensors.items()}, fmt
        assert _digest(quantize_model(EFFNET, back, options).model) == reference, fmt


def test_tensorrt_writes_asymmetric_entries_as_amax_over_127(effnet_tables, tmp_path):
    """Every uint8 entry, those with zero point 128 too (a range about as wide on both sides of 0,
    whose scale (max - min)/255 was taken for a symmetric one), is written as amax/127."""
    table = effnet_tables[UINT8]
    assert any(e.qparams.zero_point == 128 for e in table.tensors.values())  # the case that was missed
    with pytest.warns(UserWarning, match=f"{len(table.tensors)} asymmetric entries were written as amax/127"):
        write_table(table, tmp_path / "t.cache", "tensorrt")
    assert _cache_scales(tmp_path / "t.cache") == {name: f32(max(-e.range[0], e.range[1]) / 127)
                                                   for name, e in table.tensors.items()}


def _cache_scales(path: Path) -> dict[str, float]:
    """{tensor: scale} of a TensorRT cache, decoded here from its hex lines."""
    lines = path.read_text().splitlines()[1:]
    return {name: struct.unpack(">f", bytes.fromhex(value.strip()))[0]
            for name, value in (line.rsplit(":", 1) for line in lines)}


def _tensorrt_from_json_and_cache(model: Path, table: Path, folder: Path, *config) -> tuple[bytes, bytes, Path]:
    """`quantize --target tensorrt` from the JSON table and from its converted TensorRT cache: the
    two model files, and the cache."""
    cache = folder / "calib.cache"
    r = run_qtool("table", "convert", table, "--to", "tensorrt", "-o", cache)
    assert r.returncode == 0, r.stderr
    written = []
    for source in (table, cache):
        out = folder / f"{source.name}.int8.onnx"
        r = run_qtool("quantize", model, *config, *RANGES_ONLY, "--target", "tensorrt", "--table", source, "-o", out)
        assert r.returncode == 0, r.stderr
        written.append(out.read_bytes())
    return written[0], written[1], cache


def test_tensorrt_cache_quantizes_efficientnet_as_its_json_table_does(tmp_path):
    """EfficientNet-Lite0 calibrated with its shipped config (target ort-cpu: uint8 entries): the
    model from the converted cache is the model from the JSON table, byte for byte."""
    table = tmp_path / "calib.json"
    r = run_qtool("calibrate", EFFNET, "--data", CALIB_SAMPLES, "--config", EFFNET_CONFIG, "--method", "minmax",
                  "-o", table)
    assert r.returncode == 0, r.stderr
    from_json, from_cache, cache = _tensorrt_from_json_and_cache(EFFNET, table, tmp_path, "--config", EFFNET_CONFIG)
    entries = json.loads(table.read_text())["tensors"]
    assert any(e["zero_point"] == 128 for e in entries.values())
    assert from_json == from_cache
    assert _cache_scales(cache) == {name: f32(max(-e["range"][0], e["range"][1]) / 127) for name, e in entries.items()}


def test_tensorrt_cache_quantizes_a_small_model_as_its_json_table_does(tmp_path):
    """A Conv whose input ranges over [-40, 39.5] (uint8 zero point 128) and whose Relu
    output is one-sided: the cache holds amax/127 for both, and quantizes as the JSON does."""
    rng = np.random.default_rng(0)
    onnx.save(graphs.conv_model(rng, c_in=3, activation="Relu"), tmp_path / "m.onnx")
    data = graphs.write_samples(tmp_path / "data", rng, (3, 12, 12), count=4, scale=5.0)
    first = np.load(data / "s000.npy")
    first[0, 0, 0, :2] = (-40.0, 39.5)  # on the grid ranges are kept on (qtool.calibration.grid)
    np.save(data / "s000.npy", first)
    table = tmp_path / "calib.json"
    r = run_qtool("calibrate", tmp_path / "m.onnx", "--data", data, "--method", "minmax", "-o", table)
    assert r.returncode == 0, r.stderr
    entries = json.loads(table.read_text())["tensors"]
    assert entries["x"]["zero_point"] == 128 and entries["act"]["range"][0] == 0.0
    from_json, from_cache, cache = _tensorrt_from_json_and_cache(tmp_path / "m.onnx", table, tmp_path)
    assert from_json == from_cache
    assert _cache_scales(cache) == {name: f32(max(-e["range"][0], e["range"][1]) / 127) for name, e in entries.items()}


def test_layer_keyed_formats_say_which_efficientnet_tensors_have_no_entry(effnet_tables, tmp_path):
    table = effnet_tables[UINT8]
    with pytest.warns(UserWarning) as caught:
        back = _convert_warn(table, tmp_path, "amct", EFFNET, UINT8)
    missing = [name for name in table.tensors if name not in back.tensors]
    assert len(missing) == 11  # the projection convs' outputs that only feed an Add, the Add outputs, the ReduceMean
    assert any(f"{len(missing)} of {len(table.tensors)} quantized tensors have no entry" in str(w.message)
               for w in caught)
    assert all(back.tensors[n].qparams == table.tensors[n].qparams for n in back.tensors)


def _convert_warn(table, tmp_path, fmt, model, options):
    write_table(table, tmp_path / f"t.{fmt}", fmt, model, options)
    return read_table(tmp_path / f"t.{fmt}", None, model, options)[0]


@pytest.mark.parametrize("fmt, options", [("amct", UINT8), ("amct-binary", UINT8), ("amct", INT8_SYMMETRIC),
                                          ("ncnn", INT8_SYMMETRIC)])
def test_layer_keyed_round_trip_quantizes_identically(chain, tmp_path, fmt, options):
    model, data = chain
    table = _table(model, data, options)
    back = _convert(table, tmp_path, fmt, model, options)
    assert {n: e.qparams for n, e in back.tensors.items()} == {n: e.qparams for n, e in table.tensors.items()}
    assert _digest(quantize_model(model, back, options).model) == _digest(quantize_model(model, table, options).model)


def test_shared_scale_groups_keep_their_converted_scale(tmp_path):
    """A MaxPool's input and output share one scale; a TensorRT cache repeats it per tensor."""
    model = tmp_path / "pool.onnx"
    onnx.save(graphs.conv_model(np.random.default_rng(0), activation="Relu", pool="MaxPool"), model)
    data = graphs.write_samples(tmp_path / "data", np.random.default_rng(1), (8, 12, 12), count=8)
    table = _table(model, data, INT8_SYMMETRIC)
    assert table.tensors["act"].qparams == table.tensors["pool"].qparams
    back = _convert(table, tmp_path, "tensorrt", model, INT8_SYMMETRIC)
    assert _digest(quantize_model(model, back, INT8_SYMMETRIC).model) == \
           _digest(quantize_model(model, table, INT8_SYMMETRIC).model)


def test_every_format_is_detected_from_its_own_output(chain, tmp_path):
    model, data = chain
    table = _table(model, data, INT8_SYMMETRIC)
    for fmt in FORMATS:
        assert _convert(table, tmp_path, fmt, model, INT8_SYMMETRIC).tensors, fmt


def test_tengine_keeps_float32_digits_where_tengine_prints_six_decimals(tmp_path):
    from qtool.table.formats.common import imported_table
    from qtool.table.table import TableEntry

    tiny = QParams(f32(3.2e-7), 3, "uint8")
    table = imported_table({"t": TableEntry(None, None, tiny.range, tiny)}, "minmax", "qtool")
    write_table(table, tmp_path / "t.scale", "tengine")
    # Tengine's own writer prints "%f": 0.000000 here. The file must hold a number that reads back,
    # as plain text, to the same float32.
    numbers = [float(token) for token in (tmp_path / "t.scale").read_text().split()[1:2]]
    assert [f32(n) for n in numbers] == [f32(tiny.scale)]
    assert read_table(tmp_path / "t.scale")[0].tensors["t"].qparams == tiny


# ---- command line ------------------------------------------------------------------------

def test_cli_convert_and_quantize_from_a_foreign_table(chain, tmp_path):
    model, data = chain
    native = tmp_path / "calib.json"
    r = run_qtool("calibrate", model, "--data", data, "--format", "tengine", "-o", tmp_path / "calib.scale")
    assert r.returncode == 0, r.stderr
    assert "(tengine)" in r.stdout
    r = run_qtool("table", "convert", tmp_path / "calib.scale", "-o", native, "--to", "qtool", "--model", model)
    assert r.returncode == 0, r.stderr
    document = json.loads(native.read_text())
    assert document["settings"] == {"imported_from": "tengine"} and document["model"]["file"] == "chain.onnx"
    r = run_qtool("table", "convert", native, "-o", tmp_path / "calib.amct", "--to", "amct")
    assert r.returncode == 2 and r.stderr.startswith("error: ") and "--model" in r.stderr
    for table in (tmp_path / "calib.scale", native):
        r = run_qtool("quantize", model, "--table", table, "-o", tmp_path / f"{table.suffix[1:]}.int8.onnx")
        assert r.returncode == 0, r.stderr
    assert (tmp_path / "scale.int8.onnx").read_bytes() == (tmp_path / "json.int8.onnx").read_bytes()
    r = run_qtool("quantize", model, "--table", native, "--table-format", "tensorrt", "-o", tmp_path / "x.onnx")
    assert r.returncode == 2 and "not a TensorRT calibration cache" in r.stderr
