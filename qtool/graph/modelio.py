"""Reading and writing ONNX model files, and what a model says about its inputs."""

from __future__ import annotations

import contextlib
import hashlib
import mmap
import os
import re
import tempfile
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Optional

import numpy as np
import onnx
from google.protobuf import json_format, text_format
from google.protobuf.message import DecodeError, EncodeError
from onnx import external_data_helper

from qtool import atomic

from qtool.graph import external_data
from qtool.graph.index import replace_nodes, topological_order

from qtool import interrupt
from qtool.errors import QtoolError

# Protobuf cannot serialise a message over 2 GiB; above that weights go to external data,
# and sessions, shape inference and the checker get a file instead of bytes. A module
# constant so a test can drive the large-model path without writing 2 GB.
PROTOBUF_LIMIT = 2**31 - 1


@contextlib.contextmanager
def _mapped(path: str | Path) -> Iterator[object]:
    """The file's bytes as a read-only buffer, mapped rather than copied (b"" when empty)."""
    with open(path, "rb") as f:
        if os.fstat(f.fileno()).st_size == 0:
            yield b""
            return
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as data:
            yield data


def sha256_file(path: str | Path) -> str:
    with _mapped(path) as data:
        return hashlib.sha256(data).hexdigest()


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


def _locations(model: onnx.ModelProto) -> set[str]:
    return {e.value for t in external_data.external_tensors(model) for e in t.external_data if e.key == "location"}


def external_files(path: str | Path) -> list[Path]:
    """The existing side files the model at `path` keeps tensors in (each once)."""
    path = Path(path)
    files = [atomic.directory_of(path) / loc for loc in sorted(_locations(_read_proto(path)))]
    return [f for f in files if f.is_file()]


# A job loads its model several times (calibration, each prepared graph): the last file loaded and
# checked is kept, keyed by its bytes, and a copy handed out, instead of parsing, serialising and
# checking it again. Only single-file models up to this size are kept (the copy stays in memory).
_KEPT_BYTES = 512 << 20
_kept: dict[tuple, onnx.ModelProto] = {}


def file_key(path: str | Path, limit: int = _KEPT_BYTES) -> Optional[tuple]:
    """The load cache's key of a model file: its path, size and CRC-32 of its bytes (None: not a
    file, over `limit` bytes, or unreadable). What is made from the file may be kept under it while
    load_model keeps the file (`kept`)."""
    path = Path(path)
    try:
        if not path.is_file() or path.stat().st_size > limit:
            return None
        with _mapped(path) as data:
            return str(path.resolve()), len(data), zlib.crc32(data)
    except OSError:
        return None


def kept(key: Optional[tuple]) -> bool:
    """Whether load_model keeps the file of `key`: a single-file model, the last it loaded."""
    return key is not None and key in _kept


def copy_model(model: onnx.ModelProto) -> onnx.ModelProto:
    copy = onnx.ModelProto()
    copy.CopyFrom(model)
    return copy


def load_model(path: str | Path) -> onnx.ModelProto:
    """Load and check a model; every failure is one line naming the file.

    External data locations are validated before any of them is opened, then read.
    """
    path = Path(path)
    key = file_key(path)
    held = _kept.get(key) if key is not None else None  # one look-up: another thread may clear it
    if held is not None:
        return copy_model(held)
    model = _read_proto(path)
    kept = key is not None and not external_data.external_tensors(model)
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
    if kept:
        _kept.clear()
        _kept[key] = copy_model(model)
    return model


def check_model(model: onnx.ModelProto, full_check: bool = False) -> None:
    """onnx.checker for models of any size (over 2 GiB it needs a file)."""
    data = serialized(model)
    if data is not None:
        onnx.checker.check_model(data, full_check=full_check)
        return
    with on_disk(model) as path:
        onnx.checker.check_model(str(path), full_check=full_check)


def _initializers(graph: onnx.GraphProto) -> Iterator[onnx.TensorProto]:
    """Initializers of a graph and of its subgraphs, at any depth."""
    yield from graph.initializer
    for node in graph.node:
        for attr in node.attribute:
            for sub in ([attr.g] if attr.HasField("g") else []) + list(attr.graphs):
                yield from _initializers(sub)


def _external_copy(model: onnx.ModelProto, data_path: Path,
                   location: str = "") -> tuple[onnx.ModelProto, Optional[str]]:
    """A copy of `model` whose initializers of 1 kB or more live in `data_path` (written and fsynced),
    referenced as `location`, and the sha256 of that file (None when no tensor went there)."""
    copy = onnx.ModelProto()
    copy.CopyFrom(model)  # the caller's model keeps its tensors
    digest, offset = hashlib.sha256(), 0
    with open(data_path, "wb") as f:
        for tensor in _initializers(copy.graph):
            if not tensor.HasField("raw_data") or len(tensor.raw_data) < 1024:
                continue
            raw = tensor.raw_data
            f.write(raw)
            digest.update(raw)
            external_data_helper.set_external_data(tensor, location, offset, len(raw))
            tensor.ClearField("raw_data")
            offset += len(raw)
        f.flush()
        os.fsync(f.fileno())
    return copy, digest.hexdigest() if offset else None


def _set_location(model: onnx.ModelProto, location: str) -> None:
    for tensor in _initializers(model.graph):
        for entry in tensor.external_data:
            if entry.key == "location":
                entry.value = location


def _write_synced(path: Path, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


@contextlib.contextmanager
def on_disk(model: onnx.ModelProto) -> Iterator[Path]:
    """A temporary file copy of `model` (external data beside it), for APIs that need a path."""
    with tempfile.TemporaryDirectory(prefix="qtool-") as tmp:
        path = Path(tmp) / "model.onnx"
        proto, _ = _external_copy(model, path.with_suffix(".data"), "model.data")
        _write_synced(path, proto.SerializeToString())
        yield path


def data_file_name(path: str | Path, digest: str) -> str:
    """The external data file of model `path` whose content has sha256 `digest`."""
    return f"{Path(path).name}.{digest[:16]}.data"


def _data_files(path: Path) -> set[str]:
    """The data files qtool wrote for output `path` (`<name>.<16 hex digits>.data`)."""
    ours = re.compile(re.escape(path.name) + r"\.[0-9a-f]{16}\.data")
    return {e.name for e in os.scandir(atomic.directory_of(path)) if ours.fullmatch(e.name)
            and e.is_file(follow_symlinks=False)}


def _legacy_data_file(path: Path) -> Optional[str]:
    """`<name>.data` when the model now at `path` reads it (the name older versions wrote)."""
    legacy = path.name + ".data"
    if not (atomic.directory_of(path) / legacy).is_file() or not path.is_file():
        return None
    try:
        old = onnx.load(str(path), load_external_data=False)
    except Exception:  # an unreadable old model: its data file is left alone
        return None
    return legacy if legacy in _locations(old) else None


@atomic.reports_write_errors
def save_model(model: onnx.ModelProto, path: str | Path, external: bool = False) -> None:
    """Write a model atomically: a reader sees the old model with its old weights or the new model
    with its new weights, whenever the run is killed.

    With `external`, or when the model is too large for one protobuf, the tensors go to one
    data file `<name>.<sha256[:16]>.data` beside the model, named by its content, so it never
    overwrites the data the old model reads. It is renamed into place first; the model's own
    rename is the one commit point. Data files of this output that the new model does not name
    are removed afterwards, and temporaries of killed runs before.
    """
    path = Path(path)
    directory = atomic.directory_of(path)
    atomic.remove_stale(path)
    data = None if external else serialized(model)
    with contextlib.ExitStack() as stack:
        model_tmp = stack.enter_context(atomic.temporary(path))
        data_tmp, location = None, None
        if data is None:
            data_tmp = stack.enter_context(atomic.temporary(path))
            proto, digest = _external_copy(model, data_tmp)
            if digest is None:  # no tensor large enough: the model alone (the empty temporary goes)
                data_tmp = None
            else:
                location = data_file_name(path, digest)
                _set_location(proto, location)
            data = proto.SerializeToString()
        _write_synced(model_tmp, data)
        # one writer at a time commits into the directory, so the data files removed below are
        # no concurrent writer's uncommitted ones; signals wait until the pair is consistent
        with atomic.directory_lock(directory), interrupt.deferred():
            legacy = _legacy_data_file(path)
            if data_tmp is not None:
                os.replace(data_tmp, directory / location)
                atomic.sync_directory(directory)  # the data's name is on disk before the model's
            os.replace(model_tmp, path)
            interrupt.committed(path)
            atomic.sync_directory(directory)
            for name in (_data_files(path) | {legacy}) - {location, None}:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(directory / name)


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
