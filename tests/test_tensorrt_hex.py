"""TensorRT calibration caches hold each scale as the hex of its float32 bits, written without
leading zeros (`%x` of the bits as an unsigned integer): a scale below 2^-95 has fewer than 8 hex
digits. A short form is the low digits of the number, so it reads as the number it is ("800000" is
0x00800000), never as the high digits ("80000000" would be -0.0)."""

from __future__ import annotations

import struct

import pytest

from qtool.config import QuantizeConfig
from qtool.table.formats import read_table, write_table
from qtool.table.qparams import QParams

INT8_SYMMETRIC = QuantizeConfig(activation_dtype="int8", symmetric_activations=True)
# tensor -> the hex TensorRT writes: two full forms, then short ones (tiny scales of tensors that
# hardly vary), down to the smallest float32 of all
CACHE = {"data": "3c008912", "conv1": "3c88edfc", "smallest_normal": "800000", "tiny": "3c23d70",
         "tinier": "f800000", "subnormal": "1"}


def _bits_to_float(text: str) -> float:
    """The spec: the hex is the unsigned integer whose big-endian bytes are the float32."""
    return struct.unpack(">f", struct.pack(">I", int(text, 16)))[0]


def _cache(tmp_path):
    path = tmp_path / "short.cache"
    path.write_text("TRT-8601-EntropyCalibration2\n" + "".join(f"{k}: {v}\n" for k, v in CACHE.items()))
    return path


def test_short_hex_forms_read_as_the_number_they_are(tmp_path):
    table, fmt = read_table(_cache(tmp_path), options=INT8_SYMMETRIC)
    assert fmt.name == "tensorrt" and set(table.tensors) == set(CACHE)
    assert _bits_to_float("800000") == 2.0 ** -126 and _bits_to_float("1") == 2.0 ** -149  # the spec's own check
    for name, text in CACHE.items():
        scale = _bits_to_float(text)
        assert table.tensors[name].qparams == QParams(scale, 0, "int8"), name
        assert table.tensors[name].range == pytest.approx((-127 * scale, 127 * scale), rel=1e-6)


def test_short_hex_forms_round_trip_bit_for_bit(tmp_path):
    table, _ = read_table(_cache(tmp_path), options=INT8_SYMMETRIC)
    written = tmp_path / "again.cache"
    write_table(table, written, "tensorrt", options=INT8_SYMMETRIC)
    lines = dict(line.split(": ") for line in written.read_text().splitlines()[1:])
    # written with all 8 digits: the same number with its leading zeros
    assert lines == {name: f"{int(text, 16):08x}" for name, text in CACHE.items()}
    back, fmt = read_table(written, options=INT8_SYMMETRIC)
    assert fmt.name == "tensorrt"
    assert {n: e.qparams for n, e in back.tensors.items()} == {n: e.qparams for n, e in table.tensors.items()}
