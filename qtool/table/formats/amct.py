"""Huawei AMCT's quantization record (ScaleOffsetRecord), text and binary protobuf.

    record { key: "conv1" value { scale_d: 0.0798481 offset_d: 1 scale_w: 0.0029762 offset_w: 0 } }

The message is defined in amct.proto beside this file; its classes are built at run time from
that text with the protobuf runtime onnx depends on (a small parser of the proto2 subset it uses),
so neither protoc nor generated code is needed. Records are keyed by layer (the ONNX node name),
scale_d/offset_d quantizing the layer's input: qtool maps them to tensors through the model and
says which quantized tensors no record covers. Float fields are float32 in both encodings, so a
round trip is exact; uint8 entries are written as the same grid in int8 (offset = zero point - 128).
"""

from __future__ import annotations

import functools
import re
import string
import warnings
from pathlib import Path

from google.protobuf import descriptor_pb2, descriptor_pool, message_factory, text_format
from google.protobuf.message import DecodeError

from qtool.errors import QtoolError
from qtool.table.formats.base import FormatContext, TableFormat
from qtool.table.formats.common import entry_from_qparams, to_dtype
from qtool.table.formats.model_view import LayerEntries, shown, warn_uncovered
from qtool.table.qparams import QParams
from qtool.table.table import CalibrationTable

PROTO_FILE = Path(__file__).with_name("amct.proto")
_PACKAGE = "qtool_amct"
_FDP = descriptor_pb2.FieldDescriptorProto
_SCALARS = {"float": _FDP.TYPE_FLOAT, "double": _FDP.TYPE_DOUBLE, "int32": _FDP.TYPE_INT32,
            "int64": _FDP.TYPE_INT64, "uint32": _FDP.TYPE_UINT32, "bool": _FDP.TYPE_BOOL,
            "string": _FDP.TYPE_STRING}
_LABELS = {"optional": _FDP.LABEL_OPTIONAL, "repeated": _FDP.LABEL_REPEATED, "required": _FDP.LABEL_REQUIRED}
_MESSAGE = re.compile(r"message\s+(\w+)\s*\{([^{}]*)\}")
_FIELD = re.compile(r"(optional|repeated|required)\s+(\w+)\s+(\w+)\s*=\s*(\d+)\s*(?:\[\s*default\s*=\s*([^\]]+?)\s*\])?\s*;")


def file_descriptor(proto_text: str, name: str = "amct.proto") -> descriptor_pb2.FileDescriptorProto:
    """Parse the proto2 subset amct.proto uses: flat messages of scalar or message fields."""
    text = re.sub(r"//[^\n]*", "", proto_text)
    fdp = descriptor_pb2.FileDescriptorProto(name=name, package=_PACKAGE, syntax="proto2")
    for message_name, body in _MESSAGE.findall(text):
        message = fdp.message_type.add(name=message_name)
        for label, type_name, field_name, number, default in _FIELD.findall(body):
            field = message.field.add(name=field_name, number=int(number), label=_LABELS[label])
            if type_name in _SCALARS:
                field.type = _SCALARS[type_name]
            else:
                field.type, field.type_name = _FDP.TYPE_MESSAGE, f".{_PACKAGE}.{type_name}"
            if default:
                field.default_value = default.strip("'\"")
    return fdp


@functools.lru_cache(maxsize=1)
def record_class():
    pool = descriptor_pool.DescriptorPool()
    pool.Add(file_descriptor(PROTO_FILE.read_text(encoding="utf-8")))
    return message_factory.GetMessageClass(pool.FindMessageTypeByName(f"{_PACKAGE}.ScaleOffsetRecord"))


_TEXT_BYTES = set(string.printable.encode()) | set(range(0x80, 0x100))


def _looks_binary(data: bytes) -> bool:
    return any(b not in _TEXT_BYTES for b in data[:4096])


def _parse_text(data: bytes):
    record = record_class()()
    text_format.Parse(data.decode("utf-8-sig"), record, allow_unknown_field=True)
    return record


def _parse_binary(data: bytes):
    record = record_class()()
    record.ParseFromString(data)
    return record


def _valid(record) -> bool:
    return len(record.record) > 0 and all(r.key and r.value.HasField("scale_d") for r in record.record)


def _detect_text(data: bytes) -> bool:
    if _looks_binary(data) or not re.search(rb"^\s*record\s*\{", data[:4096], re.MULTILINE):
        return False
    try:
        return _valid(_parse_text(data))
    except (text_format.ParseError, UnicodeDecodeError):
        return False


def _detect_binary(data: bytes) -> bool:
    if not _looks_binary(data):
        return False
    try:
        return _valid(_parse_binary(data))
    except DecodeError:
        return False


def _entries(record, ctx: FormatContext) -> CalibrationTable:
    entries = LayerEntries(ctx.require_model("AMCT"), "AMCT", ctx.path)
    other_types = []
    for item in record.record:
        value = item.value
        if value.dst_type.upper() != "INT8" or value.act_type.upper() != "INT8":
            other_types.append(item.key)
        try:
            entries.add(item.key, entry_from_qparams(QParams(value.scale_d, value.offset_d, "int8"), ctx.options))
        except ValueError as exc:
            raise QtoolError(f"record '{item.key}': {exc}", ctx.path) from None
    if other_types:
        warnings.warn(f"{ctx.path}: {len(other_types)} records are not INT8 (dst_type/act_type); their scale and "
                      f"offset were taken as an int8 grid: {shown(other_types)}", stacklevel=4)
    return entries.table()


def _read_text(data: bytes, ctx: FormatContext) -> CalibrationTable:
    try:
        return _entries(_parse_text(data), ctx)
    except (text_format.ParseError, UnicodeDecodeError) as exc:
        raise QtoolError(f"not an AMCT text record: {exc}", ctx.path) from None


def _read_binary(data: bytes, ctx: FormatContext) -> CalibrationTable:
    try:
        record = _parse_binary(data)
    except DecodeError as exc:
        raise QtoolError(f"not an AMCT binary record: {exc}", ctx.path) from None
    return _entries(record, ctx)


def build_record(table: CalibrationTable, ctx: FormatContext):
    view = ctx.require_model("AMCT")
    record = record_class()()
    for layer in view.layers:
        entry = table.tensors.get(layer.input)
        if entry is None:
            continue
        params = to_dtype(entry.qparams, "int8")
        item = record.record.add(key=layer.name)
        item.value.scale_d = params.scale
        item.value.offset_d = params.zero_point
        scales = view.weight_scales(layer)
        item.value.scale_w.extend(float(s) for s in scales)
        item.value.offset_w.extend([0] * len(scales))
        item.value.dst_type = "INT8"
    warn_uncovered(view, {layer.input for layer in view.layers}, "AMCT", ctx.path)
    return record


def _write_text(table: CalibrationTable, ctx: FormatContext) -> bytes:
    return text_format.MessageToString(build_record(table, ctx)).encode("utf-8")


def _write_binary(table: CalibrationTable, ctx: FormatContext) -> bytes:
    return build_record(table, ctx).SerializeToString()


FORMATS = (
    TableFormat("amct", "Huawei AMCT record, protobuf text (per layer)", _detect_text, _read_text, _write_text,
                by_layer=True),
    TableFormat("amct-binary", "Huawei AMCT record, binary protobuf (per layer)", _detect_binary, _read_binary,
                _write_binary, by_layer=True),
)
