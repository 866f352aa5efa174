"""Reading and writing ONNX model files, and what a model says about its inputs."""

from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import numpy as np
import onnx
from google.protobuf import json_format, text_format
from google.protobuf.message import DecodeError

from qtool import atomic
from qtool.errors import QtoolError

# Protobuf cannot serialise a message over 2 GiB; above that weights go to external data.
_PROTOBUF_LIMIT = 2**31 - 1


def sha256_file(path: str | Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def load_model(path: str | Path) -> onnx.ModelProto:
    """Load and check a model; every failure is one line naming the file."""
    path = Path(path)
    if not path.exists():
        raise QtoolError("model file not found", path)
    if not path.is_file():
        raise QtoolError("model path is not a file", path)
    try:
        model = onnx.load(str(path))
    # onnx.load picks a JSON or text parser from the extension (.json, .txt): their errors too
    except (DecodeError, RuntimeError, json_format.ParseError, text_format.ParseError) as exc:
        raise QtoolError(f"not an ONNX model (protobuf parse failed: {str(exc).splitlines()[0] or type(exc).__name__})", path) from None
    except OSError as exc:
        raise QtoolError(f"cannot read model: {exc.strerror or exc}", path) from None
    if not model.graph.node:
        raise QtoolError("not an ONNX model (no graph nodes; wrong or truncated file?)", path)
    try:
        onnx.checker.check_model(model)
    except onnx.checker.ValidationError as exc:
        first = str(exc).strip().splitlines()[0]
        raise QtoolError(f"model fails the ONNX checker: {first}", path) from None
    return model


def save_model(model: onnx.ModelProto, path: str | Path) -> None:
    """Write a model atomically (temporary file in the same directory, then rename)."""
    data = model.SerializeToString() if model.ByteSize() < _PROTOBUF_LIMIT else None
    if data is not None:
        atomic.write_bytes(path, data)
        return
    # Large models: the weights go into one external data file beside the model, named with a
    # relative location. Both files are written in a private temporary directory inside the
    # target directory and renamed into place, data first, so no half-written pair is visible.
    path = Path(path)
    location = path.name + ".data"
    workdir = Path(tempfile.mkdtemp(prefix=f".{path.name}.", dir=path.parent if str(path.parent) else "."))
    try:
        onnx.save_model(model, str(workdir / path.name), save_as_external_data=True,
                        all_tensors_to_one_file=True, location=location, size_threshold=1024)
        os.replace(workdir / location, path.parent / location)
        os.replace(workdir / path.name, path)
    finally:
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
