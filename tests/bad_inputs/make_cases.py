"""Generate the bad-input corpus: broken models, data, configs and tables, and cases.json.

Run from anywhere: `python tests/bad_inputs/make_cases.py`. It rewrites every file it
owns in this folder (deterministically) and the manifest `cases.json`, where each case
is a qtool command line that must exit with code 2 and print one line
`error: <file>: <message>`. In arguments and expected files, `{corpus}` stands for
this folder and `{tmp}` for a fresh temporary folder (outputs go there). A case may
also name a `read_only` folder the test makes read-only before the run (a read-only
file system) and a `fault` it injects (`disk_full`: every fsync fails with ENOSPC).
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import shutil
import zipfile
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

HERE = Path(__file__).resolve().parent
OWNED = ["models", "ext", "data", "configs", "tables", "labels", "secret.bin", "cases.json"]


def _conv_graph(name: str = "tiny") -> onnx.GraphProto:
    rng = np.random.default_rng(0)
    weight = numpy_helper.from_array(rng.normal(0, 0.5, (4, 3, 3, 3)).astype(np.float32), "W")
    bias = numpy_helper.from_array(rng.normal(0, 0.1, (4,)).astype(np.float32), "B")
    nodes = [helper.make_node("Conv", ["x", "W", "B"], ["c"], name="conv", pads=[1, 1, 1, 1]),
             helper.make_node("Relu", ["c"], ["y"], name="relu")]
    return helper.make_graph(nodes, name, [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 3, 8, 8])],
                             [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 4, 8, 8])], [weight, bias])


def _model(graph: onnx.GraphProto, opset: int = 17, ir_version: int = 8) -> onnx.ModelProto:
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)], producer_name="qtool-bad-inputs")
    model.ir_version = ir_version
    return model


def _external(location: str, length: int | None = None) -> onnx.ModelProto:
    """The tiny Conv model with its weight stored externally at `location`."""
    model = _model(_conv_graph())
    weight = model.graph.initializer[0]
    weight.ClearField("raw_data")
    weight.ClearField("float_data")
    weight.data_location = TensorProto.EXTERNAL
    entries = {"location": location, "offset": "0", "length": str(4 * 3 * 3 * 3 * 4 if length is None else length)}
    for key, value in entries.items():
        weight.external_data.add(key=key, value=value)
    return model


def _write(path: str, data: bytes | str) -> None:
    target = HERE / path
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_bytes(data.encode() if isinstance(data, str) else data)


def _save(path: str, model: onnx.ModelProto) -> None:
    _write(path, model.SerializeToString())


def _npy(path: str, array: np.ndarray) -> None:
    target = HERE / path
    target.parent.mkdir(parents=True, exist_ok=True)
    np.save(target, array, allow_pickle=True)


def _table(tensors: dict, sha256: str, **overrides) -> str:
    document = {"format": "qtool-calibration", "version": 1, "model": {"file": "tiny.onnx", "sha256": sha256},
                "method": "minmax", "settings": {}, "num_samples": 1, "tensors": tensors}
    document.update(overrides)
    return json.dumps(document, indent=1) + "\n"


def make_files() -> None:
    for name in OWNED:
        target = HERE / name
        if target.is_dir() and not target.is_symlink():
            shutil.rmtree(target)
        elif target.exists() or target.is_symlink():
            target.unlink()

    tiny = _model(_conv_graph())
    tiny_bytes = tiny.SerializeToString()
    _write("models/tiny.onnx", tiny_bytes)
    _write("models/not_onnx.onnx", "this is a text file, not a model\n")
    _write("models/empty.onnx", b"")
    _write("models/truncated.onnx", tiny_bytes[: len(tiny_bytes) // 2])
    _write("models/random.onnx", np.random.default_rng(1).integers(0, 256, 512, dtype=np.uint8).tobytes())
    (HERE / "models/folder.onnx").mkdir(parents=True)
    _write("models/folder.onnx/.keep", "")

    broken = _model(_conv_graph())
    broken.graph.node[1].input[0] = "undefined_tensor"
    _save("models/fails_checker.onnx", broken)
    empty_graph = _model(_conv_graph())
    del empty_graph.graph.node[:]
    _save("models/no_nodes.onnx", empty_graph)
    _save("models/opset9.onnx", _model(_conv_graph(), opset=9, ir_version=4))
    _save("models/opset12.onnx", _model(_conv_graph(), opset=12, ir_version=7))
    int_graph = helper.make_graph(
        [helper.make_node("Cast", ["ids"], ["f"], to=TensorProto.FLOAT), helper.make_node("Relu", ["f"], ["y"])],
        "int_input", [helper.make_tensor_value_info("ids", TensorProto.INT64, ["N", 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 4])])
    _save("models/int_input.onnx", _model(int_graph))
    nan_model = _model(_conv_graph())
    weights = numpy_helper.to_array(nan_model.graph.initializer[0]).copy()
    weights[0, 0, 0, 0] = np.nan
    weights[1, 0, 0, 0] = np.inf
    nan_model.graph.initializer[0].CopyFrom(numpy_helper.from_array(weights, "W"))
    _save("models/nan_weight.onnx", nan_model)
    two = helper.make_graph([helper.make_node("Add", ["a", "b"], ["y"])], "two_inputs",
                            [helper.make_tensor_value_info("a", TensorProto.FLOAT, ["N", 3, 8, 8]),
                             helper.make_tensor_value_info("b", TensorProto.FLOAT, ["N", 3, 8, 8])],
                            [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 3, 8, 8])])
    _save("models/two_inputs.onnx", _model(two))
    # Inputs too large for any machine: the run check's made-up input (2^50 bytes) and an
    # Expand onnxruntime must allocate 2^48 bytes for
    huge = _conv_graph("huge_input")
    huge.input[0].CopyFrom(helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, 2**23, 2**23]))
    huge.output[0].CopyFrom(helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4, 2**23, 2**23]))
    huge_bytes = _model(huge).SerializeToString()
    _write("models/huge_input.onnx", huge_bytes)
    bomb = _conv_graph("expand_bomb")
    bomb.initializer.append(numpy_helper.from_array(np.array([2**38, 4, 8, 8], np.int64), "big_shape"))
    bomb.node.append(helper.make_node("Expand", ["y", "big_shape"], ["big"], name="expand"))
    bomb.output.append(helper.make_tensor_value_info("big", TensorProto.FLOAT, [2**38, 4, 8, 8]))
    bomb_bytes = _model(bomb).SerializeToString()
    _write("models/expand_bomb.onnx", bomb_bytes)
    dynamic = _conv_graph("dynamic_hw")
    dynamic.input[0].CopyFrom(helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 3, "H", "W"]))
    dynamic.output[0].CopyFrom(helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 4, "H", "W"]))
    _save("models/dynamic_hw.onnx", _model(dynamic))

    # External data (CVE-2024-27318): the weight bytes exist only outside ext/ (secret.bin),
    # reachable through '..', an absolute path or a symlink; plus a missing and a short file.
    weight_bytes = numpy_helper.to_array(tiny.graph.initializer[0]).tobytes()
    _write("secret.bin", weight_bytes)
    _save("ext/dotdot.onnx", _external("../secret.bin"))
    _save("ext/dotdot_nested.onnx", _external("sub/../../secret.bin"))
    _save("ext/absolute.onnx", _external("/etc/passwd"))
    _save("ext/windows_absolute.onnx", _external("C:\\weights\\secret.bin"))
    _save("ext/symlink.onnx", _external("link.bin"))
    os.symlink("../secret.bin", HERE / "ext/link.bin")
    _save("ext/missing.onnx", _external("missing.bin"))
    _write("ext/short.bin", weight_bytes[:100])
    _save("ext/short.onnx", _external("short.bin"))
    _save("ext/empty_location.onnx", _external(""))

    x = np.random.default_rng(2).normal(size=(1, 3, 8, 8)).astype(np.float32)
    _npy("data/ok/x.npy", x)
    _write("data/empty/README.txt", "no samples here\n")
    _write("data/corrupt_images/a.jpg", "not a jpeg\n")
    png = bytes.fromhex("89504e470d0a1a0a") + b"\0" * 40
    _write("data/corrupt_images/b.png", png)
    _write("data/corrupt_images/c.jpg", b"")
    _npy("data/all_nan/x.npy", np.full((1, 3, 8, 8), np.nan, np.float32))
    _npy("data/npy_rank/x.npy", x[0, 0])
    _npy("data/npy_shape/x.npy", np.zeros((1, 3, 9, 9), np.float32))
    _npy("data/npy_dtype/x.npy", x.astype(np.int32))
    _npy("data/npy_strings/x.npy", np.full((1, 3, 8, 8), "a"))
    _write("data/npz_key/x.npz", _npz_bytes(wrong=x))
    _write("data/npz_corrupt/x.npz", b"PK\x03\x04" + b"\0" * 60)
    _write("data/npy_corrupt/x.npy", b"\x93NUMPY garbage header")
    _npy("data/npy_pickle/x.npy", np.array([{"a": 1}], dtype=object))
    _write("data/npy_text/x.npy", "1 2 3\n")
    _write("data/npz_deflate_broken/x.npz", _broken_deflate_npz(x))
    _write("data/image/a.png", _png_bytes())

    _write("configs/unknown_section.yaml", "calibraton:\n  method: minmax\n")
    _write("configs/mistyped_key.yaml", "preprocess:\n  mena: [0, 0, 0]\n")
    _write("configs/wrong_type.yaml", "calibration:\n  batch_size: eight\n")
    _write("configs/bad_value.yaml", "quantization:\n  activation_dtype: int4\n")
    _write("configs/bad_yaml.yaml", "preprocess: [unclosed\n")
    _write("configs/not_mapping.yaml", "- a\n- b\n")
    _write("configs/zero_std.yaml", "preprocess:\n  std: [1, 0, 1]\n")
    _write("configs/upgrade_opset.yaml", "quantization:\n  upgrade_opset: true\n")
    _write("configs/advanced_key_at_top.yaml", "quantization:\n  dynamic_weights: column\n")

    sha = hashlib.sha256(tiny_bytes).hexdigest()
    entry = {"min": 0.0, "max": 1.0, "range": [0.0, 1.0], "dtype": "uint8", "scale": 1 / 255, "zero_point": 0}
    _write("tables/not_json.json", "{not json")
    _write("tables/wrong_format.json", json.dumps({"format": "tensorrt", "version": 1}))
    _write("tables/version2.json", _table({}, sha, version=2))
    _write("tables/missing_tensors.json", _table({"c": entry}, sha))
    _write("tables/zero_scale.json", _table({"x": {**entry, "scale": 0.0}, "c": entry}, sha))
    _write("tables/nan_range.json", _table({"x": {**entry, "range": [float("nan"), 1.0]}, "c": entry}, sha))
    _write("tables/zero_point_300.json", _table({"x": {**entry, "zero_point": 300}, "c": entry}, sha))
    _write("tables/scale_contradicts_range.json",
           _table({"x": entry, "c": {**entry, "min": 0.0, "max": 6.15, "range": [0.0, 6.15], "scale": 100.0}}, sha))
    _write("tables/huge_input.json", _table({"x": entry, "c": entry}, hashlib.sha256(huge_bytes).hexdigest()))
    _write("tables/tengine_zero_point_300.scale", "x 0.003921569 300\nc 0.003921569 0\n")
    _write("tables/expand_bomb.json", _table({"x": entry}, hashlib.sha256(bomb_bytes).hexdigest()))
    _write("tables/no_tensors_key.json", json.dumps({"format": "qtool-calibration", "version": 1,
                                                      "model": {"sha256": sha}}))

    _write("labels/malformed.tsv", "x.npy\tnot-a-number\n")
    _write("labels/empty.tsv", "# nothing\n")


def _png_bytes() -> bytes:
    import cv2

    ok, data = cv2.imencode(".png", np.full((8, 8, 3), 128, np.uint8))
    assert ok
    return data.tobytes()


def _npz_bytes(compress: bool = False, **arrays: np.ndarray) -> bytes:
    """An .npz with fixed timestamps (np.savez stamps the current time: not reproducible)."""
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w") as archive:
        for key, array in arrays.items():
            member = io.BytesIO()
            np.save(member, array)
            info = zipfile.ZipInfo(key + ".npy", date_time=(1980, 1, 1, 0, 0, 0))
            info.compress_type = zipfile.ZIP_DEFLATED if compress else zipfile.ZIP_STORED
            archive.writestr(info, member.getvalue())
    return buffer.getvalue()


def _broken_deflate_npz(x: np.ndarray) -> bytes:
    """A zip whose member's compressed stream is corrupt: the header parses, reading fails."""
    data = bytearray(_npz_bytes(compress=True, x=x))
    start = data.index(b"x.npy") + len(b"x.npy")
    data[start + 2:start + 12] = bytes(range(10))  # overwrite bytes inside the deflate stream
    return bytes(data)


# Each case: qtool arguments, the file the error line must name, a piece of its message.
M = "{corpus}/models"
D = "{corpus}/data"
OUT = "{tmp}/out.onnx"


def _q(model: str, *extra: str) -> list[str]:
    return ["quantize", model, "--data", f"{D}/ok", *extra, "-o", OUT]


RO = "{tmp}/ro"  # made read-only by the test (the `read_only` of these cases)
READ_ONLY = f"output directory {RO} is on a read-only file system"


CASES = [
    # models
    ("model_missing", _q(f"{M}/does_not_exist.onnx"), f"{M}/does_not_exist.onnx", "model file not found"),
    ("model_is_directory", _q(f"{M}/folder.onnx"), f"{M}/folder.onnx", "model path is not a file"),
    ("model_text_file", _q(f"{M}/not_onnx.onnx"), f"{M}/not_onnx.onnx", "not an ONNX model"),
    ("model_empty_file", _q(f"{M}/empty.onnx"), f"{M}/empty.onnx", "not an ONNX model"),
    ("model_truncated", _q(f"{M}/truncated.onnx"), f"{M}/truncated.onnx", "not an ONNX model"),
    ("model_random_bytes", _q(f"{M}/random.onnx"), f"{M}/random.onnx", "not an ONNX model"),
    ("model_fails_checker", _q(f"{M}/fails_checker.onnx"), f"{M}/fails_checker.onnx", "fails the ONNX checker"),
    ("model_no_nodes", _q(f"{M}/no_nodes.onnx"), f"{M}/no_nodes.onnx", "no graph nodes"),
    ("opset_9_keep_opset", _q(f"{M}/opset9.onnx", "--keep-opset"), f"{M}/opset9.onnx",
     "opset 9 is too old (QuantizeLinear/DequantizeLinear need >= 10) and keep_opset (--keep-opset) forbids "
     "converting it"),
    ("nothing_to_quantize", ["calibrate", f"{M}/int_input.onnx", "--data", f"{D}/ok", "-o", "{tmp}/t.json"],
     f"{M}/int_input.onnx", "nothing to quantize: the model has no float input and no float tensor reaches an op "
     "qtool quantizes (inputs: ids int64)"),
    ("nan_in_weight", _q(f"{M}/nan_weight.onnx"), f"{M}/nan_weight.onnx", "constant 'W' contains 2 NaN/Inf"),
    ("evaluate_int8_model_broken", ["evaluate", f"{M}/tiny.onnx", f"{M}/truncated.onnx", "--data", f"{D}/ok"],
     f"{M}/truncated.onnx", "not an ONNX model"),
    ("evaluate_inputs_differ", ["evaluate", f"{M}/tiny.onnx", f"{M}/two_inputs.onnx", "--data", f"{D}/ok"],
     f"{M}/two_inputs.onnx", "inputs differ"),
    # external data
    ("external_dotdot", _q("{corpus}/ext/dotdot.onnx"), "{corpus}/ext/dotdot.onnx",
     "location '../secret.bin' contains '..' (CVE-2024-27318)"),
    ("external_dotdot_nested", _q("{corpus}/ext/dotdot_nested.onnx"), "{corpus}/ext/dotdot_nested.onnx",
     "contains '..'"),
    ("external_absolute", _q("{corpus}/ext/absolute.onnx"), "{corpus}/ext/absolute.onnx", "is an absolute path"),
    ("external_windows_absolute", _q("{corpus}/ext/windows_absolute.onnx"), "{corpus}/ext/windows_absolute.onnx",
     "is an absolute path"),
    ("external_symlink_outside", _q("{corpus}/ext/symlink.onnx"), "{corpus}/ext/symlink.onnx",
     "resolves outside the model's directory"),
    ("external_missing", _q("{corpus}/ext/missing.onnx"), "{corpus}/ext/missing.onnx", "does not exist"),
    ("external_too_short", _q("{corpus}/ext/short.onnx"), "{corpus}/ext/short.onnx", "beyond the end of"),
    ("external_empty_location", _q("{corpus}/ext/empty_location.onnx"), "{corpus}/ext/empty_location.onnx",
     "is empty"),
    # data
    ("data_missing", ["quantize", f"{M}/tiny.onnx", "--data", f"{D}/nowhere", "-o", OUT], f"{D}/nowhere",
     "data path not found"),
    ("data_no_samples", ["quantize", f"{M}/tiny.onnx", "--data", f"{D}/empty", "-o", OUT], f"{D}/empty",
     "no samples found"),
    ("data_all_images_corrupt", ["quantize", f"{M}/tiny.onnx", "--data", f"{D}/corrupt_images", "-o", OUT],
     f"{D}/corrupt_images", "no readable samples"),
    ("npy_wrong_rank", ["quantize", f"{M}/tiny.onnx", "--data", f"{D}/npy_rank", "-o", OUT], f"{D}/npy_rank/x.npy",
     "has shape [8, 8], the model expects rank 4 [?, 3, 8, 8]"),
    ("npy_wrong_shape", ["quantize", f"{M}/tiny.onnx", "--data", f"{D}/npy_shape", "-o", OUT],
     f"{D}/npy_shape/x.npy", "has shape [1, 3, 9, 9], the model expects [?, 3, 8, 8]"),
    ("npy_wrong_dtype", ["quantize", f"{M}/tiny.onnx", "--data", f"{D}/npy_dtype", "-o", OUT],
     f"{D}/npy_dtype/x.npy", "has dtype int32, the model expects float32"),
    ("npy_strings", ["quantize", f"{M}/tiny.onnx", "--data", f"{D}/npy_strings", "-o", OUT],
     f"{D}/npy_strings/x.npy", "has dtype <U1, the model expects float32"),
    ("npz_wrong_key", ["quantize", f"{M}/tiny.onnx", "--data", f"{D}/npz_key", "-o", OUT], f"{D}/npz_key/x.npz",
     "no array for model input 'x' (file has: wrong)"),
    ("npz_corrupt", ["quantize", f"{M}/tiny.onnx", "--data", f"{D}/npz_corrupt", "-o", OUT],
     f"{D}/npz_corrupt/x.npz", "cannot read tensor file"),
    ("npz_broken_deflate", ["quantize", f"{M}/tiny.onnx", "--data", f"{D}/npz_deflate_broken", "-o", OUT],
     f"{D}/npz_deflate_broken/x.npz", "cannot read tensor file"),
    ("npy_corrupt", ["quantize", f"{M}/tiny.onnx", "--data", f"{D}/npy_corrupt", "-o", OUT],
     f"{D}/npy_corrupt/x.npy", "cannot read tensor file"),
    ("npy_pickled_objects", ["quantize", f"{M}/tiny.onnx", "--data", f"{D}/npy_pickle", "-o", OUT],
     f"{D}/npy_pickle/x.npy", "cannot read tensor file: not a valid .npy/.npz file of numeric arrays (it holds "
     "Python objects)"),
    ("npy_text", ["quantize", f"{M}/tiny.onnx", "--data", f"{D}/npy_text", "-o", OUT],
     f"{D}/npy_text/x.npy", "cannot read tensor file: not a valid .npy/.npz file of numeric arrays"),
    ("images_for_two_inputs", ["quantize", f"{M}/two_inputs.onnx", "--data", f"{D}/image", "-o", OUT],
     f"{D}/image", "an image folder can only feed a single-input model"),
    ("images_for_dynamic_size_without_config", ["quantize", f"{M}/dynamic_hw.onnx", "--data", f"{D}/image", "-o",
                                                OUT],
     f"{D}/image", "has a dynamic image size; set preprocess.size in the config"),
    ("npy_for_two_inputs", ["quantize", f"{M}/two_inputs.onnx", "--data", f"{D}/ok", "-o", OUT], f"{D}/ok/x.npy",
     "a .npy file feeds a single-input model"),
    # configs
    ("config_missing", _q(f"{M}/tiny.onnx", "--config", "{corpus}/configs/nope.yaml"),
     "{corpus}/configs/nope.yaml", "cannot read config"),
    ("config_unknown_section", _q(f"{M}/tiny.onnx", "--config", "{corpus}/configs/unknown_section.yaml"),
     "{corpus}/configs/unknown_section.yaml", "unknown key 'calibraton' (did you mean 'calibration'?); allowed:"),
    ("config_mistyped_key", _q(f"{M}/tiny.onnx", "--config", "{corpus}/configs/mistyped_key.yaml"),
     "{corpus}/configs/mistyped_key.yaml", "unknown key 'preprocess.mena' (did you mean 'mean'?)"),
    ("config_upgrade_opset", _q(f"{M}/tiny.onnx", "--config", "{corpus}/configs/upgrade_opset.yaml"),
     "{corpus}/configs/upgrade_opset.yaml", "unknown key 'quantization.upgrade_opset'"),
    ("config_advanced_key_at_top", _q(f"{M}/tiny.onnx", "--config", "{corpus}/configs/advanced_key_at_top.yaml"),
     "{corpus}/configs/advanced_key_at_top.yaml",
     "unknown key 'quantization.dynamic_weights' (did you mean 'advanced.dynamic_weights'?)"),
    ("config_wrong_type", _q(f"{M}/tiny.onnx", "--config", "{corpus}/configs/wrong_type.yaml"),
     "{corpus}/configs/wrong_type.yaml", "calibration.batch_size must be an integer"),
    ("config_bad_value", _q(f"{M}/tiny.onnx", "--config", "{corpus}/configs/bad_value.yaml"),
     "{corpus}/configs/bad_value.yaml", "activation_dtype must be one of uint8, int8"),
    ("config_bad_yaml", _q(f"{M}/tiny.onnx", "--config", "{corpus}/configs/bad_yaml.yaml"),
     "{corpus}/configs/bad_yaml.yaml", "not valid YAML"),
    ("config_not_mapping", _q(f"{M}/tiny.onnx", "--config", "{corpus}/configs/not_mapping.yaml"),
     "{corpus}/configs/not_mapping.yaml", "config must be a mapping"),
    ("config_zero_std", _q(f"{M}/tiny.onnx", "--config", "{corpus}/configs/zero_std.yaml"),
     "{corpus}/configs/zero_std.yaml", "std must not contain 0"),
    # calibration tables
    ("table_missing", ["quantize", f"{M}/tiny.onnx", "--table", "{corpus}/tables/nope.json", "-o", OUT],
     "{corpus}/tables/nope.json", "cannot read calibration table"),
    ("table_not_json", ["quantize", f"{M}/tiny.onnx", "--table", "{corpus}/tables/not_json.json", "-o", OUT],
     "{corpus}/tables/not_json.json", "unrecognised calibration table; known formats: qtool"),
    ("table_wrong_format", ["quantize", f"{M}/tiny.onnx", "--table", "{corpus}/tables/wrong_format.json", "-o", OUT],
     "{corpus}/tables/wrong_format.json", "unrecognised calibration table"),
    ("table_forced_qtool_not_json", ["quantize", f"{M}/tiny.onnx", "--table", "{corpus}/tables/not_json.json",
                                     "--table-format", "qtool", "-o", OUT],
     "{corpus}/tables/not_json.json", "invalid JSON"),
    ("table_version_2", ["quantize", f"{M}/tiny.onnx", "--table", "{corpus}/tables/version2.json", "-o", OUT],
     "{corpus}/tables/version2.json", "unsupported calibration table version 2"),
    ("table_missing_tensors", ["quantize", f"{M}/tiny.onnx", "--table", "{corpus}/tables/missing_tensors.json",
                               "-o", OUT],
     "{corpus}/tables/missing_tensors.json", "has no entry for 1 tensor(s) the model needs: x (calibrate this model "
     "again, or pass --allow-missing"),
    ("table_zero_scale", ["quantize", f"{M}/tiny.onnx", "--table", "{corpus}/tables/zero_scale.json", "-o", OUT],
     "{corpus}/tables/zero_scale.json", "malformed calibration table"),
    ("table_no_tensors_key", ["quantize", f"{M}/tiny.onnx", "--table", "{corpus}/tables/no_tensors_key.json",
                              "-o", OUT],
     "{corpus}/tables/no_tensors_key.json", "malformed calibration table"),
    # outputs
    ("output_is_model", ["quantize", f"{M}/tiny.onnx", "--data", f"{D}/ok", "-o", f"{M}/tiny.onnx"], f"{M}/tiny.onnx",
     "output path is the same as an input file"),
    ("output_is_table", ["quantize", f"{M}/tiny.onnx", "--table", "{corpus}/tables/missing_tensors.json", "-o",
                         "{corpus}/tables/missing_tensors.json"],
     "{corpus}/tables/missing_tensors.json", "output path is the same as an input file"),
    ("output_dir_missing", ["quantize", f"{M}/tiny.onnx", "--data", f"{D}/ok", "-o", "{tmp}/no/such/dir/out.onnx"],
     "{tmp}/no/such/dir/out.onnx", "output directory {tmp}/no/such/dir does not exist"),
    ("output_is_directory", ["quantize", f"{M}/tiny.onnx", "--data", f"{D}/ok", "-o", "{tmp}"], "{tmp}",
     "output path is a directory"),
    ("save_table_is_output", _q(f"{M}/tiny.onnx", "--save-table", OUT), OUT, "same as an input file"),
    ("calibrate_output_is_model", ["calibrate", f"{M}/tiny.onnx", "--data", f"{D}/ok", "-o", f"{M}/tiny.onnx"],
     f"{M}/tiny.onnx", "output path is the same as an input file"),
    ("output_dir_read_only", _q(f"{M}/tiny.onnx")[:-1] + [f"{RO}/out.onnx"], f"{RO}/out.onnx", READ_ONLY,
     {"read_only": RO}),
    ("save_table_dir_read_only", _q(f"{M}/tiny.onnx", "--save-table", f"{RO}/t.json"), f"{RO}/t.json", READ_ONLY,
     {"read_only": RO}),
    ("calibrate_dir_read_only", ["calibrate", f"{M}/tiny.onnx", "--data", f"{D}/ok", "-o", f"{RO}/t.json"],
     f"{RO}/t.json", READ_ONLY, {"read_only": RO}),
    ("calibrate_shard_dir_read_only", ["calibrate", f"{M}/tiny.onnx", "--data", f"{D}/ok", "--shard", "0/1", "-o",
                                       f"{RO}/s.npz"], f"{RO}/s.npz", READ_ONLY, {"read_only": RO}),
    ("evaluate_reports_dir_read_only", ["evaluate", f"{M}/tiny.onnx", f"{M}/tiny.onnx", "--data", f"{D}/ok",
                                        "--json", "{tmp}/report.json", "--junit", f"{RO}/junit.xml"],
     f"{RO}/junit.xml", READ_ONLY, {"read_only": RO}),
    ("evaluate_html_dir_read_only", ["evaluate", f"{M}/tiny.onnx", f"{M}/tiny.onnx", "--data", f"{D}/ok",
                                     "--html", f"{RO}/report.html"], f"{RO}/report.html", READ_ONLY,
     {"read_only": RO}),
    ("table_convert_dir_read_only", ["table", "convert", "{corpus}/tables/missing_tensors.json", "--to", "tensorrt",
                                     "-o", f"{RO}/t.cache"], f"{RO}/t.cache", READ_ONLY, {"read_only": RO}),
    ("export_params_dir_read_only", ["export-params", f"{M}/tiny.onnx", "-o", f"{RO}/p.json"], f"{RO}/p.json",
     READ_ONLY, {"read_only": RO}),
    ("verify_int_json_dir_read_only", ["verify-int", f"{M}/tiny.onnx", "--data", f"{D}/ok", "--json",
                                       f"{RO}/v.json"], f"{RO}/v.json", READ_ONLY, {"read_only": RO}),
    ("disk_full_model", _q(f"{M}/tiny.onnx"), OUT, "cannot write it: No space left on device",
     {"fault": "disk_full"}),
    ("disk_full_table", ["calibrate", f"{M}/tiny.onnx", "--data", f"{D}/ok", "-o", "{tmp}/t.json"], "{tmp}/t.json",
     "cannot write it: No space left on device", {"fault": "disk_full"}),
    ("evaluate_json_dir_missing", ["evaluate", f"{M}/tiny.onnx", f"{M}/tiny.onnx", "--data", f"{D}/ok", "--json",
                                   "{tmp}/missing/report.json"],
     "{tmp}/missing/report.json", "does not exist"),
    # the machine's memory
    ("memory_made_up_input", ["quantize", f"{M}/huge_input.onnx", "--table", "{corpus}/tables/huge_input.json",
                              "-o", OUT],
     f"{M}/huge_input.onnx", "not enough memory to quantize it (Unable to allocate"),
    ("memory_onnxruntime", _q(f"{M}/expand_bomb.onnx"), f"{M}/expand_bomb.onnx",
     "not enough memory to quantize it (onnxruntime could not allocate 256.0 TiB)"),
    ("memory_onnxruntime_run_check", ["quantize", f"{M}/expand_bomb.onnx", "--table",
                                      "{corpus}/tables/expand_bomb.json", "-o", OUT], f"{M}/expand_bomb.onnx",
     "not enough memory to quantize it (onnxruntime could not allocate 256.0 TiB)"),
    # unusable values in a table, or in the calibration data
    ("table_nan_range", ["quantize", f"{M}/tiny.onnx", "--table", "{corpus}/tables/nan_range.json", "-o", OUT],
     "{corpus}/tables/nan_range.json", "unusable calibration table: tensor 'x' has a NaN/Inf value in its range"),
    ("table_zero_point_out_of_range", ["quantize", f"{M}/tiny.onnx", "--table", "{corpus}/tables/zero_point_300.json",
                                       "-o", OUT],
     "{corpus}/tables/zero_point_300.json", "tensor 'x' has zero point 300, outside uint8's [0, 255]"),
    ("table_scale_contradicts_range", ["quantize", f"{M}/tiny.onnx", "--table",
                                       "{corpus}/tables/scale_contradicts_range.json", "-o", OUT],
     "{corpus}/tables/scale_contradicts_range.json",
     "tensor 'c' has scale 100 and zero point 0, which contradict its range [0, 6.15]"),
    ("table_tengine_zero_point_out_of_range", ["quantize", f"{M}/tiny.onnx", "--table",
                                               "{corpus}/tables/tengine_zero_point_300.scale", "-o", OUT],
     "{corpus}/tables/tengine_zero_point_300.scale", "tensor 'x' has zero point 300, outside uint8's [0, 255]"),
    ("table_convert_nan_range", ["table", "convert", "{corpus}/tables/nan_range.json", "--to", "tensorrt", "-o",
                                 "{tmp}/t.cache"],
     "{corpus}/tables/nan_range.json", "tensor 'x' has a NaN/Inf value in its range"),
    ("data_all_nan", ["quantize", f"{M}/tiny.onnx", "--data", f"{D}/all_nan", "-o", OUT], f"{D}/all_nan",
     "no finite value of tensor 'x' in the calibration data (every value NaN/Inf)"),
    ("calibrate_data_all_nan", ["calibrate", f"{M}/tiny.onnx", "--data", f"{D}/all_nan", "--method", "minmax", "-o",
                                "{tmp}/t.json"], f"{D}/all_nan", "no finite value of tensor 'x'"),
    # labels
    ("labels_malformed", ["evaluate", f"{M}/tiny.onnx", f"{M}/tiny.onnx", "--data", f"{D}/ok", "--labels",
                          "{corpus}/labels/malformed.tsv"],
     "{corpus}/labels/malformed.tsv", "line 1: expected 'filename<TAB>class_index'"),
    ("labels_empty", ["evaluate", f"{M}/tiny.onnx", f"{M}/tiny.onnx", "--data", f"{D}/ok", "--labels",
                      "{corpus}/labels/empty.tsv"],
     "{corpus}/labels/empty.tsv", "no labels in file"),
]


def main() -> None:
    make_files()
    manifest = [{"name": name, "args": args, "file": file, "message": message, **(extra[0] if extra else {})}
                for name, args, file, message, *extra in CASES]
    names = [case["name"] for case in manifest]
    assert len(names) == len(set(names)), "duplicate case names"
    (HERE / "cases.json").write_text(json.dumps(manifest, indent=1) + "\n", encoding="utf-8")
    print(f"wrote {len(manifest)} cases to {HERE / 'cases.json'}")


if __name__ == "__main__":
    main()
