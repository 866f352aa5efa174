"""One graph's look-ups, and the node helpers every stage shares.

Every pass that walks a graph asks the same questions: which node makes this tensor, which nodes
read it, is it a constant, a graph output, of what type and shape. `GraphIndex` answers them from
one scan; it is a snapshot, so a pass that edits the graph builds a new one afterwards.
"""

from __future__ import annotations

import fnmatch
import functools
import heapq

from typing import Callable, Iterable, Iterator, Optional

import numpy as np
import onnx
from onnx import helper, numpy_helper

DIVISOR_TOLERANCE = 1e-6  # relative: a constant that matches the divisor asked for (GraphIndex.divides)


class GraphIndex:
    """Producer, consumers, initializers, outputs, element types and shapes of one graph.

    `outer`: the index of the graph enclosing this one, when it is an If/Loop/Scan body. A body
    reads the outer scopes' tensors by name (a Conv in a branch often takes its weight from the
    main graph's initializers), so their initializers, types and shapes are seen here too; the
    producers, consumers and outputs stay this graph's own."""

    def __init__(self, model: onnx.ModelProto | onnx.GraphProto, outer: Optional["GraphIndex"] = None):
        graph = model.graph if isinstance(model, onnx.ModelProto) else model
        self.graph = graph
        self.initializers: dict[str, onnx.TensorProto] = {t.name: t for t in graph.initializer}
        self.outputs: set[str] = {o.name for o in graph.output}
        self.producer: dict[str, onnx.NodeProto] = {}
        self.consumers: dict[str, list[onnx.NodeProto]] = {}
        for node in graph.node:
            for out in node.output:
                self.producer[out] = node
            for name in node.input:
                if name:
                    self.consumers.setdefault(name, []).append(node)
        # the types and shapes the graph declares, read now (a snapshot, as the rest) but converted
        # only when first asked for: most passes never ask
        self._values = [*graph.value_info, *graph.input, *graph.output]
        self._inits = list(graph.initializer)
        self._outer = outer
        if outer is not None:
            self.initializers = {**outer.initializers, **self.initializers}

    @functools.cached_property
    def elem_type(self) -> dict[str, int]:
        types = {value.name: value.type.tensor_type.elem_type for value in self._values
                 if value.type.HasField("tensor_type")}
        types.update((init.name, init.data_type) for init in self._inits)
        return {**self._outer.elem_type, **types} if self._outer is not None else types

    @functools.cached_property
    def shapes(self) -> dict[str, tuple[Optional[int], ...]]:
        shapes = {value.name: tuple(d.dim_value if d.HasField("dim_value") else None
                                    for d in value.type.tensor_type.shape.dim)
                  for value in self._values
                  if value.type.HasField("tensor_type") and value.type.tensor_type.HasField("shape")}
        return {**self._outer.shapes, **shapes} if self._outer is not None else shapes

    def derived(self, compute: Callable[["GraphIndex"], object]):
        """compute(self), once per index: what several passes derive from one graph (the index is a
        snapshot, so what is derived from it holds as long as it does). Callers do not change it."""
        cache = self.__dict__.setdefault("_derived", {})
        if compute not in cache:
            cache[compute] = compute(self)
        return cache[compute]

    @functools.cached_property
    def body_readers(self) -> dict[str, list[onnx.NodeProto]]:
        """Name -> the nodes of this graph whose If/Loop/Scan bodies read it (body_reads)."""
        readers: dict[str, list[onnx.NodeProto]] = {}
        for node in self.graph.node:
            for name in body_reads(node):
                readers.setdefault(name, []).append(node)
        return readers

    def is_constant(self, name: str) -> bool:
        return name in self.initializers

    def constant_tensor(self, name: str) -> Optional[onnx.TensorProto]:
        """The tensor holding a constant: an initializer, or a Constant node's value (exporters
        that keep weights in Constant nodes write them so); None for a computed tensor."""
        producer = self.producer.get(name)
        if name in self.initializers or producer is None or producer.op_type != "Constant":
            return self.initializers.get(name)
        return next((a.t for a in producer.attribute if a.name == "value"), None)

    def const(self, name: str) -> Optional[np.ndarray]:
        """The initializer's values, or None for a computed tensor."""
        init = self.initializers.get(name)
        return numpy_helper.to_array(init) if init is not None else None

    def uniform(self, name: str) -> Optional[float]:
        """The value of float constant `name` whose elements are all equal (a broadcast offset or
        divisor); None otherwise."""
        values = self.const(name) if name else None
        if values is None or values.size == 0 or values.dtype.kind != "f" or not np.all(values == values.flat[0]):
            return None
        return float(values.flat[0])

    def divides(self, node: Optional[onnx.NodeProto], tensor: str, divisor: float) -> bool:
        """`node` divides `tensor` by `divisor`: a Div by it, or a Mul by its reciprocal (either
        operand order), to a relative DIVISOR_TOLERANCE."""
        if node is None or node.domain not in ("", "ai.onnx") or len(node.input) != 2:
            return False
        if node.op_type == "Div" and node.input[0] == tensor:
            value = self.uniform(node.input[1])
            return value is not None and abs(value - divisor) <= DIVISOR_TOLERANCE * divisor
        if node.op_type == "Mul" and tensor in node.input:
            value = self.uniform(node.input[1] if node.input[0] == tensor else node.input[0])
            return value is not None and abs(value * divisor - 1.0) <= DIVISOR_TOLERANCE
        return False

    def scalar(self, name: str) -> Optional[float]:
        """The value of a one-element constant; None for a computed tensor or a larger constant."""
        value = self.const(name) if name else None
        return float(value.reshape(-1)[0]) if value is not None and value.size == 1 else None

    def clip_bounds(self, clip: onnx.NodeProto) -> Optional[tuple[Optional[float], Optional[float]]]:
        """A Clip's (min, max): its constant inputs (opset 11 on) or attributes (before), None for a
        bound it does not set; None instead of the pair when a bound is computed."""
        bounds = []
        for index, name in ((1, "min"), (2, "max")):
            if index < len(clip.input) and clip.input[index]:
                value = self.scalar(clip.input[index])
                if value is None:
                    return None
                bounds.append(value)
            else:
                bounds.append(attribute(clip, name))
        return bounds[0], bounds[1]

    def is_float(self, name: str) -> bool:
        # Unknown types (shape inference could not reach them) are assumed float: the
        # rules only ask about inputs that are float for every valid model.
        return self.elem_type.get(name, onnx.TensorProto.FLOAT) == onnx.TensorProto.FLOAT

    def rank(self, name: str) -> int:
        """An initializer's rank; -1 for a computed tensor."""
        init = self.initializers.get(name)
        return len(init.dims) if init is not None else -1

    def only_consumer(self, name: str) -> Optional[onnx.NodeProto]:
        """The single node reading `name`, when it is not also a graph output."""
        users = self.consumers.get(name, [])
        return users[0] if len(users) == 1 and name not in self.outputs else None


def default_opset(model: onnx.ModelProto) -> int:
    """The model's ai.onnx opset version (0 when it imports none)."""
    for entry in model.opset_import:
        if entry.domain in ("", "ai.onnx"):
            return entry.version
    return 0


def matches(name: str, patterns: Iterable[str]) -> bool:
    """Whether a node or tensor `name` is one of `patterns`, names or glob patterns as options give them."""
    return any(name == pattern or fnmatch.fnmatchcase(name, pattern) for pattern in patterns)


def node_label(node: onnx.NodeProto) -> str:
    """How reports and options name a node: its name, or its first output when it has none."""
    return node.name or node.output[0]


def attribute(node: onnx.NodeProto, name: str, default=None):
    for attr in node.attribute:
        if attr.name == name:
            return helper.get_attribute_value(attr)
    return default


def set_attribute(node: onnx.NodeProto, name: str, value) -> None:
    """Set one attribute in place (its position kept), or add it at the end."""
    made = helper.make_attribute(name, value)
    for attr in node.attribute:
        if attr.name == name:
            attr.CopyFrom(made)
            return
    node.attribute.append(made)


def replace_nodes(graph: onnx.GraphProto, nodes: Iterable[onnx.NodeProto],
                  initializers: Iterable[onnx.TensorProto] = ()) -> None:
    """A rewrite's result, in place: `graph`'s node list becomes `nodes` (in that order) and
    `initializers` are added to its constants."""
    nodes = list(nodes)  # may be built from graph.node itself
    if len(nodes) != len(graph.node) or any(new is not old for new, old in zip(nodes, graph.node)):
        del graph.node[:]  # (the same nodes in the same order are left as they are: extend copies each)
        graph.node.extend(nodes)
    graph.initializer.extend(initializers)


def tensor_bytes(tensor: onnx.TensorProto) -> int:
    """The tensor's data size from its dims and type: ByteSize() walks the message, 0.2 ms a
    tensor, and the graph passes ask it of every initializer."""
    if tensor.data_type == onnx.TensorProto.STRING:  # variable-length items
        return tensor.ByteSize()
    try:
        itemsize = helper.tensor_dtype_to_np_dtype(tensor.data_type).itemsize
    except (KeyError, TypeError, ValueError):
        return tensor.ByteSize()
    count = 1
    for dim in tensor.dims:
        count *= dim
    return count * itemsize


def keep_initializers(graph: onnx.GraphProto, kept: Callable[[onnx.TensorProto], bool]) -> None:
    """In place: `graph` keeps the initializers for which `kept` is true, in their order. Each
    other one is deleted where it stands: emptying the list and extending it again would copy every
    kept tensor's bytes (0.1 s per pass over a 90 MB transformer)."""
    for i in reversed([i for i, t in enumerate(graph.initializer) if not kept(t)]):
        del graph.initializer[i]


def rename_reads(nodes: Iterable[onnx.NodeProto], renamed: dict[str, str]) -> None:
    """In place: each input of `nodes` named in `renamed` reads the name it maps to instead."""
    for node in nodes:
        for k, name in enumerate(node.input):
            if name in renamed:
                node.input[k] = renamed[name]


def topological_order(graph: onnx.GraphProto) -> Optional[list[int]]:
    """The positions of `graph`'s nodes in an order where each comes after the nodes whose outputs
    it reads (its bodies' reads included), keeping the given order wherever it already holds; None
    when no such order exists (a cycle, or a name made twice)."""
    maker: dict[str, int] = {}
    for k, node in enumerate(graph.node):
        for name in node.output:
            if name and maker.setdefault(name, k) != k:
                return None
    users: list[list[int]] = [[] for _ in graph.node]
    waiting = []
    for k, node in enumerate(graph.node):
        makers = {maker[name] for name in names_read(node) if name in maker} - {k}
        for j in makers:
            users[j].append(k)
        waiting.append(len(makers))
    ready = [k for k, count in enumerate(waiting) if count == 0]
    heapq.heapify(ready)
    order = []
    while ready:
        k = heapq.heappop(ready)
        order.append(k)
        for user in users[k]:
            waiting[user] -= 1
            if not waiting[user]:
                heapq.heappush(ready, user)
    return order if len(order) == len(graph.node) else None


def bodies(node: onnx.NodeProto) -> list[tuple[str, onnx.GraphProto]]:
    """A node's subgraphs by attribute name: If's then_branch and else_branch, Loop's and Scan's body."""
    found = []
    for attr in node.attribute:
        if attr.type == _GRAPH:
            found.append((attr.name, attr.g))
        elif attr.type == _GRAPHS:
            found += [(attr.name, graph) for graph in attr.graphs]
    return found


_GRAPH, _GRAPHS = onnx.AttributeProto.GRAPH, onnx.AttributeProto.GRAPHS


def scoped_nodes(graph: onnx.GraphProto) -> Iterator[onnx.NodeProto]:
    """Every node of `graph` and of its nodes' bodies, at any depth (a node before its bodies' nodes)."""
    for node in graph.node:
        yield node
        for _, body in bodies(node):
            yield from scoped_nodes(body)


def made_in(graph: onnx.GraphProto) -> list[str]:
    """The tensors a graph makes, in order: its inputs (a Loop's or Scan's body has some) and its
    nodes' outputs; what it reads from enclosing graphs is not among them."""
    return [*(i.name for i in graph.input), *(o for node in graph.node for o in node.output if o)]


def scoped_initializers(graph: onnx.GraphProto) -> dict[str, onnx.TensorProto]:
    """The initializers of `graph` and of its bodies at any depth (names are unique over a model)."""
    return {t.name: t for g in [graph, *(body for node in scoped_nodes(graph) for _, body in bodies(node))]
            for t in g.initializer}


def body_reads(node: onnx.NodeProto) -> set[str]:
    """Names read inside a node's If/Loop/Scan bodies (outer-scope references among them)."""
    names: set[str] = set()
    if not node.attribute:  # most nodes: no attribute, so no body
        return names
    for _, graph in bodies(node):
        for inner in graph.node:
            names |= names_read(inner)
    return names


def names_read(node: onnx.NodeProto) -> set[str]:
    """Names a node reads, its bodies included."""
    return set(node.input) | body_reads(node)
