"""Reading and writing ONNX model files, and what a model says about its inputs."""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Optional

import numpy as np
import onnx
from google.protobuf import json_format, text_format
from google.protobuf.message import DecodeError, EncodeError

from qtool import atomic

from qtool.graph import external_data
from qtool.graph.index import replace_nodes, topological_order

from qtool import interrupt
from qtool.errors import QtoolError

# Protobuf cannot serialise a message over 2 GiB; above that weights go to external data,
# and sessions, shape inference and the checker get a file instead of bytes. A module
# constant so a test can drive the large-model path without writing 2 GB.
PROTOBUF_LIMIT = 2**31 - 1


def sha256_file(path: str | Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def serialized(model: onnx.ModelProto) -> Optional[bytes]:
    """The model's bytes, or None when it does not fit in one protobuf (over PROTOBUF_LIMIT).

    Serialising once is cheaper than asking ByteSize() first and serialising after: over
    2 GiB protobuf refuses (ValueError, or its EncodeError), which means the same."""
    try:
        data = model.SerializeToString()
    except (ValueError, EncodeError):
        return None
    return data if len(data) < PROTOBUF_LIMIT else None


def _read_proto(path: Path) -> onnx.ModelProto:
    """The model file alone, external tensor data not read (so its locations can be checked first)."""
    if not path.exists():
        raise QtoolError("model file not found", path)
    if not path.is_file():
        raise QtoolError("model path is not a file", path)
    try:
        model = onnx.load(str(path), load_external_data=False)
    # onnx.load picks a JSON or text parser from the extension (.json, .txt): their errors too
    except (DecodeError, RuntimeError, ValueError, json_format.ParseError, text_format.ParseError) as exc:
        raise QtoolError(f"not an ONNX model (protobuf parse failed: {str(exc).splitlines()[0] or type(exc).__name__})", path) from None
    except OSError as exc:
        raise QtoolError(f"cannot read model: {exc.strerror or exc}", path) from None
    if not model.graph.node:
        raise QtoolError("not an ONNX model (no graph nodes; wrong or truncated file?)", path)
    return model


def has_external_data(path: str | Path) -> bool:
    """Whether the model file keeps tensors in side files (its output should, too)."""
    return bool(external_data.external_tensors(_read_proto(Path(path))))


def load_model(path: str | Path) -> onnx.ModelProto:
    """Load and check a model; every failure is one line naming the file.

    External data locations are validated before any of them is opened, then read.
    """
    path = Path(path)
    model = _read_proto(path)
    external_data.check_locations(model, path)
    external_data.load_data(model, path)
    order = topological_order(model.graph)
    if order is not None and order != sorted(order):  # onnxruntime sorts the nodes itself; the checker wants them sorted
        replace_nodes(model.graph, [model.graph.node[k] for k in order])
    try:
        # over 2 GiB the file (its data is external) is checked in place rather than copied
        data = serialized(model)
        onnx.checker.check_model(data if data is not None else str(path))
    except onnx.checker.ValidationError as exc:
        first = str(exc).strip().splitlines()[0]
        raise QtoolError(f"model fails the ONNX checker: {first}", path) from None
    return model


def check_model(model: onnx.ModelProto, full_check: bool = False) -> None:
    """onnx.checker for models of any size (over 2 GiB it needs a file)."""
    data = serialized(model)
    if data is not None:
        onnx.checker.check_model(data, full_check=full_check)
        return
    with on_disk(model) as path:
        onnx.checker.check_model(str(path), full_check=full_check)


def _save_external(model: onnx.ModelProto, path: Path) -> None:
    """Model + one external data file `<name>.data` beside it (relative location); fsynced."""
    copy = onnx.ModelProto()
    copy.CopyFrom(model)  # onnx moves tensors out of the proto it saves: keep the caller's intact
    location = path.name + ".data"
    onnx.save_model(copy, str(path), save_as_external_data=True, all_tensors_to_one_file=True,
                    location=location, size_threshold=1024)
    for written in (path, path.parent / location):
        if written.exists():
            with open(written, "rb+") as f:
                os.fsync(f.fileno())


@contextlib.contextmanager
def on_disk(model: onnx.ModelProto) -> Iterator[Path]:
    """A temporary file copy of `model` (external data beside it), for APIs that need a path."""
    with tempfile.TemporaryDirectory(prefix="qtool-") as tmp:
        path = Path(tmp) / "model.onnx"
        _save_external(model, path)
        yield path


@atomic.reports_write_errors
def save_model(model: onnx.ModelProto, path: str | Path, external: bool = False) -> None:
    """Write a model atomically (temporary file in the same directory, then rename).

    With `external`, or when the model is too large for one protobuf, the tensors go
    to one external data file `<name>.data` beside the model, with a relative location.
    """
    data = None if external else serialized(model)
    if data is not None:
        atomic.write_bytes(path, data)
        return
    # Both files are written in a private temporary directory inside the target directory
    # and renamed into place, data first; signals are held off between the two renames
    # so an interrupted run never leaves a new model with old data or the reverse.
    path = Path(path)
    location = path.name + ".data"
    workdir = None
    try:
        with interrupt.deferred():  # no signal between creating the directory and knowing its name
            workdir = Path(tempfile.mkdtemp(prefix=f".{path.name}.", dir=path.parent if str(path.parent) else "."))
        _save_external(model, workdir / path.name)
        with interrupt.deferred():
            if (workdir / location).exists():
                os.replace(workdir / location, path.parent / location)
            os.replace(workdir / path.name, path)
            interrupt.committed(path)
    finally:
        if workdir is not None:
            with interrupt.deferred():  # a signal now would leave half the directory behind
                shutil.rmtree(workdir, ignore_errors=True)


@dataclass(frozen=True)
class InputSpec:
    """One graph input the user must feed."""

    name: str
    dtype: np.dtype
    shape: tuple[Optional[int], ...]  # None for a dynamic dimension

    @property
    def batch_dynamic(self) -> bool:
        return len(self.shape) > 0 and self.shape[0] is None

    @property
    def fixed_batch(self) -> Optional[int]:
        return self.shape[0] if self.shape else None


def input_specs(model: onnx.ModelProto) -> list[InputSpec]:
    initializers = {t.name for t in model.graph.initializer}
    specs = []
    for value in model.graph.input:
        if value.name in initializers:  # old exporters list weights as inputs too
            continue
        tensor_type = value.type.tensor_type
        # dim_value <= 0 (-1 in some exporters) means dynamic, like a dim_param
        dims = tuple(d.dim_value if d.HasField("dim_value") and d.dim_value > 0 else None
                     for d in tensor_type.shape.dim)
        dtype = onnx.helper.tensor_dtype_to_np_dtype(tensor_type.elem_type)
        specs.append(InputSpec(value.name, np.dtype(dtype), dims))
    return specs


def output_names(model: onnx.ModelProto) -> list[str]:
    return [o.name for o in model.graph.output]
