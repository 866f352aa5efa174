"""External tensor data: which side files a model names, and whether qtool may read them.

ONNX keeps large tensors in files beside the model, named by a `location` relative to
the model's directory. A crafted model can name `/etc/shadow`, `../../secret`, or a
symlink that leads out of the directory (the path traversal fixed in onnx as
CVE-2024-27318). qtool checks every location of every tensor (initializers, Constant
attributes, subgraphs, functions) before it reads any of them: relative, without `..`,
resolving inside the model's directory (symlinks followed), an existing regular file,
and the offset/length inside it. Only file metadata is touched until all pass.
"""

from __future__ import annotations

import os
import re
from pathlib import Path, PurePosixPath, PureWindowsPath
from typing import Iterator

import onnx
from onnx import external_data_helper

from qtool.errors import QtoolError

CVE = "CVE-2024-27318"


def _attribute_tensors(node: onnx.NodeProto) -> Iterator[onnx.TensorProto]:
    for attr in node.attribute:
        if attr.HasField("t"):
            yield attr.t
        yield from attr.tensors
        sparse = ([attr.sparse_tensor] if attr.HasField("sparse_tensor") else []) + list(attr.sparse_tensors)
        for s in sparse:
            yield s.values
            yield s.indices
        graphs = ([attr.g] if attr.HasField("g") else []) + list(attr.graphs)
        for graph in graphs:
            yield from _graph_tensors(graph)


def _graph_tensors(graph: onnx.GraphProto) -> Iterator[onnx.TensorProto]:
    yield from graph.initializer
    for s in graph.sparse_initializer:
        yield s.values
        yield s.indices
    for node in graph.node:
        yield from _attribute_tensors(node)


def external_tensors(model: onnx.ModelProto) -> list[onnx.TensorProto]:
    """Every tensor of the model (subgraphs and functions included) whose data lives in a side file."""
    tensors = list(_graph_tensors(model.graph))
    for function in model.functions:
        for node in function.node:
            tensors.extend(_attribute_tensors(node))
    return [t for t in tensors if t.data_location == onnx.TensorProto.EXTERNAL]


def _refuse(tensor: onnx.TensorProto, location: str, why: str, path: Path) -> QtoolError:
    return QtoolError(f"refusing external data of tensor '{tensor.name}': location {location!r} {why}", path)


def _int_entry(info: dict[str, str], key: str, tensor: onnx.TensorProto, path: Path) -> int | None:
    if key not in info:
        return None
    try:
        value = int(info[key])
    except ValueError:
        value = -1
    if value < 0:
        raise QtoolError(f"external data of tensor '{tensor.name}' has an invalid {key} {info[key]!r}", path)
    return value


def check_locations(model: onnx.ModelProto, model_path: str | Path) -> None:
    """Refuse any external data location that is unsafe or broken; reads no tensor data."""
    path = Path(model_path)
    base = path.parent if str(path.parent) else Path(".")
    real_base = os.path.realpath(base)
    for tensor in external_tensors(model):
        info = {entry.key: entry.value for entry in tensor.external_data}
        location = info.get("location", "")
        if not location or "\0" in location:
            raise _refuse(tensor, location, "is empty or not a file name", path)
        windows = PureWindowsPath(location)
        if PurePosixPath(location).is_absolute() or windows.is_absolute() or windows.drive or windows.root:
            raise _refuse(tensor, location, f"is an absolute path ({CVE})", path)
        if ".." in re.split(r"[\\/]", location):
            raise _refuse(tensor, location, f"contains '..' ({CVE})", path)
        target = os.path.realpath(os.path.join(base, location))
        if os.path.commonpath([real_base, target]) != real_base:
            raise _refuse(tensor, location, f"resolves outside the model's directory, through a symlink ({CVE})",
                          path)
        if not os.path.exists(target):
            raise _refuse(tensor, location, "does not exist beside the model", path)
        if not os.path.isfile(target):
            raise _refuse(tensor, location, "is not a regular file", path)
        size = os.path.getsize(target)
        offset = _int_entry(info, "offset", tensor, path) or 0
        length = _int_entry(info, "length", tensor, path)
        end = offset + (length or 0)
        if offset > size or end > size:
            raise QtoolError(f"external data of tensor '{tensor.name}' (offset {offset}, length {length}) lies "
                             f"beyond the end of {location!r} ({size} bytes)", path)


def load_data(model: onnx.ModelProto, model_path: str | Path) -> None:
    """Read every tensor's external data into the model (after check_locations)."""
    path = Path(model_path)
    try:
        external_data_helper.load_external_data_for_model(model, str(path.parent))
    except (OSError, ValueError, onnx.checker.ValidationError) as exc:  # onnx's own checks (it refuses symlinks)
        raise QtoolError(f"cannot read external tensor data: {str(exc).strip().splitlines()[0]}", path) from None
