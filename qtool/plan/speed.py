"""Float for speed: the quantized nodes onnxruntime's CPU kernels run faster in float, from the graph and its shapes.

An int8 node gains per MAC in a dense layer (Conv, Gemm, MatMul) and per weight where each weight is read
once (a GEMV streams 1 byte instead of 4). It pays a fixed cost per integer kernel, and a pass per value for
each Q/DQ where it meets float and for each activation it cannot fuse (a hard-swish's float form: four passes
between a DQ and a Q, where a float Conv fuses it); an integer depthwise Conv gains nothing and pays per
output pixel and tap, padding included; a node with no integer kernel (PRelu) pays its DQ and Q. With these
costs (Costs), the float set of least estimated time is a minimum s-t cut: each node's int8-minus-float cost,
each tensor joining float and int8 a boundary, a MaxPool int8 with its int8 reader and its producer. A float
group must save MIN_SAVING of the model's estimated time; if the cut takes every dense layer, the one that
costs least in int8 stays int8 (the output stays an int8 model).
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass
from typing import Iterable, Mapping, Optional, Sequence

import numpy as np
import onnx

from qtool.graph.index import GraphIndex, attribute, node_label
from qtool.plan.ops import rule_for

FEATURES = ("boundary", "passes", "integer_kernel", "mac", "weight", "tap", "depthwise_mac", "depthwise_float_mac",
            "unit_span", "nchw_pool")


@dataclass(frozen=True)
class Costs:
    """ns per feature at batch 1, 1 thread, for onnxruntime 1.32 CPU (AVX-512 VNNI): least squares over the
    whole-model times of 300 float/int8 mixes of the ten kit models, two runs of benchmarks/speed_rules.py
    --fit (median error 3.7%); `passes` agrees with onnxruntime's profiler (DQ, HardSigmoid, Mul, Q: 0.22-0.43
    ns per value each). Fixed costs per Q/DQ or float op fitted to 0: small kernels' cost is in integer_kernel."""

    boundary: float = 0.85  # per value of a tensor where int8 meets float: a Q or DQ, and NHWC <-> float layout
    passes: float = 0.33  # per value of each pass int8 adds: an activation it cannot fuse, an equalized gate
    integer_kernel: float = 1900.0  # an integer Conv/Gemm/MatMul kernel's fixed cost above its float one
    mac: float = 0.0105  # a dense int8 layer's saving per MAC
    weight: float = 0.20  # a layer's saving per weight read (1 byte instead of 4): a GEMV's bound
    tap: float = 4.7  # an integer depthwise Conv's pointer per output pixel and kernel tap (its indirection buffer)
    depthwise_mac: float = 0.34  # ... and its cost per MAC, every tap computed (padding included)
    depthwise_float_mac: float = 0.41  # a float depthwise Conv's cost per MAC it computes (padding skipped)
    # no kit model has it; measured on single ops (benchmarks/kernel_quirks.py), not fitted:
    unit_span: float = 14.0  # a QLinearAdd/QLinearMul broadcasting a rank-1 scalar over a last axis of 1: per value
    nchw_pool: float = 3.0  # a uint8 MaxPool onnxruntime runs in NCHW, above its float one: per output value and tap

    def ns(self, features: Mapping[str, float]) -> float:
        """The features' cost (the savings' counts are negative)."""
        return sum(getattr(self, name) * count for name, count in features.items())


COSTS = Costs()
MIN_SAVING = 0.02  # a float group must save this share of the model's estimated float time
FLOAT_MAC_NS, NODE_NS = 0.02, 1000.0  # that estimate: per MAC of a Conv/Gemm/MatMul, per node
HARD = ("HardSwish", "HardSigmoid")
FUSED_IN_FLOAT = ("Relu", "Clip", "LeakyRelu", "HardSigmoid", "HardSwish", "Sigmoid", "Tanh")
WEIGHTED = ("Conv", "ConvTranspose", "Gemm", "MatMul")
NO_INTEGER_KERNEL = ("ConvTranspose", "PRelu")  # onnxruntime 1.32 CPU runs them in float between a DQ and a Q
# onnxruntime moves a QuantizeLinear after a MaxPool above it and a DequantizeLinear before it below it: a
# MaxPool is int8 where its reader or its producer is. Its uint8 kernel is fast in NHWC only (NhwcMaxPool), which
# onnxruntime uses where it can carry an integer Conv's NHWC layout through the MaxPool to another integer Conv:
# through elementwise ops (an activation, a SiLU's or a hard-swish's Add and Mul), Concat and MaxPool, not
# through a float node, a PRelu, a pooling to 1x1 and a Reshape. Elsewhere it runs in NCHW, several times its
# float time (Costs.nchw_pool; benchmarks/kernel_quirks.py)
LIFTED = ("MaxPool",)
CARRY_LAYOUT = (*LIFTED, *FUSED_IN_FLOAT, "Add", "Mul", "Concat")
Features = dict  # feature name -> count


@dataclass
class Terms:
    """The cost model of one graph, linear in Costs: each quantized node's int8-minus-float features
    (its own, and its boundaries with float nodes that are not quantized), and for each pair of
    quantized nodes joined by a tensor the features of a boundary between them."""

    nodes: dict[str, Features]
    pairs: dict[tuple[str, str], Features]
    ops: dict[str, Optional[str]]  # op type; None where the output's shape is unknown
    macs: dict[str, int]  # dense layers' MACs
    dense: list[str]  # nodes whose integer kernel gains per MAC or per weight
    joined: set[tuple[str, str]]  # pairs joined by a tensor with no range (a Conv's output its Relu absorbs)
    follows: set[tuple[str, str]]  # (a, b): b is int8 wherever a is (a MaxPool and the nodes on either side)

    def features(self, floated: Iterable[str] = ()) -> Features:
        """The int8-minus-float features of the model with `floated` float and the rest int8."""
        out = set(floated)
        total: Features = {}
        for label, feats in self.nodes.items():
            if label not in out:
                _add(total, feats)
        for (a, b), feats in self.pairs.items():
            if (a in out) != (b in out):
                _add(total, feats)
        return total


def float_for_speed(model: onnx.ModelProto, plan, shapes: Mapping[str, Sequence[int]], options=None,
                    costs: Costs = COSTS) -> tuple[list[str], list[str]]:
    """(labels of quantized nodes to keep float, one reason per float group, then one for the dense
    layer kept int8 where every one is estimated faster in float). `plan`: the QuantPlan of
    `model` (its quantized_nodes, dynamic_matmuls); `shapes`: tensor -> static dims for one sample
    (batch 1) of the calibration data (qtool.graph.runtime.tensor_dims); a node without its output's
    shape keeps its plan. `options`: its advanced.hard_activations ("float": the hard-swish's float
    form). Nodes inside If/Loop bodies are left as planned."""
    terms = cost_terms(model, plan, shapes, options)
    if not terms.nodes:
        return [], []
    cut = _Cut(terms, costs)
    for label, op in terms.ops.items():
        if op is None:
            cut.pin(label)
    floated = cut.solve()
    pinned = None
    if terms.dense and all(label in floated for label in terms.dense):  # the model stays an int8 model
        pinned = min(terms.dense, key=lambda label: costs.ns(terms.nodes[label]))
        cut.pin(pinned)
        floated = cut.solve()
    total = FLOAT_MAC_NS * sum(terms.macs.values()) + NODE_NS * len(model.graph.node)
    labels, reasons = [], []
    everything = costs.ns(terms.features())
    for group in _groups(model, GraphIndex(model), floated):
        saving = everything - costs.ns(terms.features(group))
        if saving < MIN_SAVING * total:
            continue
        labels += group
        reasons.append(_reason(group, terms, costs, saving))
    if pinned is not None and all(label in labels for label in terms.dense if label != pinned):
        # the pin decided something only where every other dense layer went float (after MIN_SAVING)
        loss = costs.ns(terms.features(labels)) - costs.ns(terms.features([*labels, pinned]))
        reasons.append(f"'{pinned}' stays int8, the dense layer that costs least in int8, so that the model stays "
                       f"an int8 model: every dense layer is estimated faster in float, this one by "
                       f"{max(loss, 0.0) / 1e3:.0f} us at batch 1")
    return labels, reasons


def cost_terms(model: onnx.ModelProto, plan, shapes: Mapping[str, Sequence[int]], options=None) -> Terms:
    """The cost model of `model`'s quantized main-graph nodes (float_for_speed's arguments)."""
    index = GraphIndex(model)
    quantized = set(plan.quantized_nodes)
    dynamic = set(getattr(plan, "dynamic_matmuls", ()))
    float_form = options is not None and options.advanced.hard_activations == "float"
    ranged = set(plan.activations)
    terms = Terms({}, {}, {}, {}, [], set(), set())
    for node in model.graph.node:
        label = node_label(node)
        if label not in quantized:
            continue
        feats, macs, dense = _own(node, index, shapes, float_form, label in dynamic)
        terms.nodes[label] = feats
        terms.ops[label] = node.op_type if node.output and node.output[0] in shapes else None
        if dense:
            terms.macs[label] = macs
            terms.dense.append(label)

    def boundary(name: str) -> Features:
        return {"boundary": float(_values(shapes.get(name)))}

    for node in model.graph.node:
        label = node_label(node)
        if label not in terms.nodes or label in dynamic:
            continue  # a dynamic MatMul reads and writes float: its quantization is its own cost
        for name in node.input:
            if not name or index.is_constant(name):
                continue
            producer = index.producer.get(name)
            source = node_label(producer) if producer is not None else None
            if source in terms.nodes and source not in dynamic:
                key = (source, label) if source < label else (label, source)
                terms.pairs[key] = terms.pairs.get(key, {})
                _add(terms.pairs[key], boundary(name))
                if name not in ranged:  # no Q/DQ can go there: the two go together
                    terms.joined.add(key)
                if producer.op_type in LIFTED or node.op_type in LIFTED:  # the reader's int8 makes its producer's
                    terms.follows.add((label, source))
                if node.op_type in LIFTED:  # and the producer's makes the MaxPool's
                    terms.follows.add((source, label))
            else:  # a graph input or a float node's output: a QuantizeLinear when this node is int8
                _add(terms.nodes[label], boundary(name))
        for name in node.output:
            readers = index.consumers.get(name, [])
            if name in index.outputs or any(node_label(r) not in terms.nodes or node_label(r) in dynamic
                                            for r in readers):
                _add(terms.nodes[label], boundary(name))  # a DequantizeLinear for the float readers
    return terms


def _add(total: Features, feats: Features, sign: float = 1.0) -> None:
    for name, count in feats.items():
        total[name] = total.get(name, 0.0) + sign * count


def _values(dims: Optional[Sequence[int]]) -> int:
    if dims is None or any(not isinstance(d, int) or d < 0 for d in dims):
        return 0
    return int(np.prod(dims, dtype=np.int64))


def _own(node: onnx.NodeProto, index: GraphIndex, shapes: Mapping[str, Sequence[int]], float_form: bool,
         dynamic: bool) -> tuple[Features, int, bool]:
    """(the node's own int8-minus-float features, its dense MACs, whether it is a dense layer)."""
    op = node.op_type
    out = float(_values(shapes.get(node.output[0]))) if node.output else 0.0
    rule = rule_for(op, node.domain)
    one_pass = {"passes": out}
    producer = index.producer.get(node.input[0]) if node.input and node.input[0] else None
    fused = (producer is not None and producer.op_type in WEIGHTED and op in FUSED_IN_FLOAT
             and len(index.consumers.get(node.input[0], [])) == 1)  # float runs it inside the layer
    if op in NO_INTEGER_KERNEL:  # a DequantizeLinear before it and a QuantizeLinear after it, no gain
        return {"boundary": out + float(_values(shapes.get(node.input[0])))}, 0, False
    if op in WEIGHTED:
        weight = index.initializers.get(node.input[1]) if len(node.input) > 1 else None
        weights = float(np.prod(weight.dims, dtype=np.int64)) if weight is not None else 0.0
        if (op == "Conv" and weight is not None and len(weight.dims) > 2 and weight.dims[1] == 1
                and (attribute(node, "group", 1) > 1 or weight.dims[0] == 1)):  # one input, one output: depthwise too
            if any(k != 1 for k in weight.dims[2:]):
                taps = float(np.prod(weight.dims[2:], dtype=np.int64))
                nominal = float(layer_macs(node, shapes, weight))
                return {"tap": out / weight.dims[0] * taps, "depthwise_mac": nominal,
                        "depthwise_float_mac": -_computed_macs(node, shapes, weight, nominal)}, 0, False
            if _fused_gate(node, index):  # float fuses the whole hard-swish into the Conv before it
                return one_pass, 0, False
            return {}, 0, False  # a per-channel affine (an equalized chain's tail): one pass either way
        macs = layer_macs(node, shapes, weight)
        feats = {"integer_kernel": 1.0, "mac": -float(macs), "weight": -weights}
        if dynamic:  # DynamicQuantizeLinear over its input first
            _add(feats, {"boundary": float(_values(shapes.get(node.input[0])))})
        return feats, macs, True
    if rule is not None and rule.kernel:  # weight-only (DynamicQuantizeLSTM): reads its weights as int8
        weights = sum(float(np.prod(index.initializers[node.input[i]].dims, dtype=np.int64))
                      for i in rule.kernel_weights if i < len(node.input) and node.input[i] in index.initializers)
        return {"integer_kernel": 1.0, "weight": -weights}, 0, True
    if op in HARD:  # DQ, HardSigmoid, Mul, Q | QLinearAdd (and QLinearMul), where float fuses it or runs one op
        passes = 4.0 if float_form else (2.0 if op == "HardSwish" else 1.0)
        feats = {"passes": passes * out}
        if not fused:
            _add(feats, one_pass, -1.0)
        return feats, 0, False
    if op in LIFTED and not (_from_conv(node.input[0], index) and _to_conv(node.output[0], index)):
        taps = float(np.prod(attribute(node, "kernel_shape", None) or [1], dtype=np.int64))
        return {"nchw_pool": out * taps}, 0, False
    if rule is not None and rule.fusable_activation:
        return {}, 0, False  # Relu/Clip: fused into the integer kernel (or its requantization) too
    if fused:  # Sigmoid/Tanh/LeakyRelu: a QLinear kernel where float fuses
        return one_pass, 0, False
    if op == "Mul" and any(index.producer[name].op_type == "Conv" and _fused_gate(index.producer[name], index)
                           for name in node.input if name in index.producer):
        return one_pass, 0, False  # an equalized HardSwish's product: float fuses it
    if op in ("Add", "Mul") and _unit_span(node, index, shapes):
        return {"unit_span": out}, 0, False
    return {}, 0, False  # elementwise or movement: an integer kernel as fast as the float one


def _unit_span(node: onnx.NodeProto, index: GraphIndex, shapes: Mapping[str, Sequence[int]]) -> bool:
    """A rank-1 one-value input against a tensor whose last axis is 1: onnxruntime's broadcast then steps
    one value at a time (float 9 ns a value, its QLinear kernels 23 ns; with the scalar as [1, 1, 1, 1]
    both take 0.3-0.8 ns)."""
    dims = [list(shapes[name]) if name in shapes else
            (list(index.initializers[name].dims) if name in index.initializers else None) for name in node.input]
    if len(dims) != 2 or any(d is None for d in dims):
        return False
    small, large = sorted(dims, key=len)
    return len(small) == 1 and small[0] == 1 and len(large) > 1 and large[-1] == 1


def _from_conv(name: str, index: GraphIndex) -> bool:
    """Whether the tensor `name` comes from Convs through CARRY_LAYOUT ops only (constants aside)."""
    known: dict[str, bool] = {}
    stack = [name]
    while stack:  # depth first without recursion: a residual trunk can be hundreds of nodes deep
        top = stack[-1]
        producer = index.producer.get(top)
        if producer is None:
            known[top] = False
        elif producer.op_type == "Conv":
            known[top] = True
        else:
            sources = [i for i in producer.input if i and not index.is_constant(i)] \
                if producer.op_type in CARRY_LAYOUT else []
            waiting = [s for s in sources if s not in known]
            if waiting:
                stack.extend(waiting)
                continue
            known[top] = bool(sources) and all(known[s] for s in sources)
        stack.pop()
    return known[name]


def _to_conv(name: str, index: GraphIndex) -> bool:
    """Whether a reader of the tensor `name` leads to a Conv through CARRY_LAYOUT ops."""
    seen, queue = {name}, deque([name])
    while queue:
        for reader in index.consumers.get(queue.popleft(), []):
            if reader.op_type == "Conv":
                return True
            if reader.op_type in CARRY_LAYOUT and reader.output[0] not in seen:
                seen.add(reader.output[0])
                queue.append(reader.output[0])
    return False


def _fused_gate(conv: onnx.NodeProto, index: GraphIndex) -> bool:
    """A per-channel 1x1 Conv -> Clip(0, 1) -> Mul by the Conv's input: the gate that activation
    equalization writes for a HardSwish/HardSigmoid op, which a float Conv runs fused (a gate with a
    Clip(0, 6) comes from a hard-swish written out in Add, Clip, Mul, Div: float runs that in passes too)."""
    clip = index.only_consumer(conv.output[0]) if conv.output else None
    if clip is None or clip.op_type != "Clip" or index.clip_bounds(clip) != (0.0, 1.0):
        return False
    product = index.only_consumer(clip.output[0])
    return product is not None and product.op_type == "Mul" and conv.input[0] in product.input


def layer_macs(node: onnx.NodeProto, shapes: Mapping[str, Sequence[int]], weight: Optional[onnx.TensorProto]) -> int:
    """A weighted layer's MACs for one sample (0 where the shapes leave them open)."""
    out = shapes.get(node.output[0])
    if node.op_type == "Conv" and weight is not None:
        return _values(out) * int(np.prod(weight.dims[1:], dtype=np.int64))
    if node.op_type == "ConvTranspose" and weight is not None:
        return _values(shapes.get(node.input[0])) * int(np.prod(weight.dims[1:], dtype=np.int64))
    a = shapes.get(node.input[0])
    if not a or not out:
        return 0
    k = a[0] if node.op_type == "Gemm" and attribute(node, "transA", 0) else a[-1]
    return _values(out) * int(k) if isinstance(k, int) else 0


def _computed_macs(node: onnx.NodeProto, shapes: Mapping[str, Sequence[int]], weight: onnx.TensorProto,
                   nominal: float) -> float:
    """The MACs of a Conv whose taps read the input, not its padding (`nominal` where the shapes or
    attributes leave that open)."""
    x, y = shapes.get(node.input[0]), shapes.get(node.output[0])
    spatial = len(weight.dims) - 2
    if not x or not y or len(x) != spatial + 2 or len(y) != spatial + 2 or attribute(node, "auto_pad", "NOTSET") \
            not in ("NOTSET", b"NOTSET"):
        return nominal
    strides = attribute(node, "strides", None) or [1] * spatial
    dilations = attribute(node, "dilations", None) or [1] * spatial
    pads = attribute(node, "pads", None) or [0] * (2 * spatial)
    share = 1.0
    for a in range(spatial):
        k = weight.dims[2 + a]
        inside = sum(1 for o in range(y[2 + a]) for t in range(k)
                     if 0 <= o * strides[a] - pads[a] + t * dilations[a] < x[2 + a])
        share *= inside / (k * y[2 + a]) if y[2 + a] else 1.0
    return nominal * share


def _groups(model: onnx.ModelProto, index: GraphIndex, chosen: set[str]) -> list[list[str]]:
    """The chosen labels in connected groups (joined by a tensor), each in graph order."""
    order = [node_label(n) for n in model.graph.node if node_label(n) in chosen]
    by_label = {node_label(n): n for n in model.graph.node}
    seen: set[str] = set()
    groups = []
    for start in order:
        if start in seen:
            continue
        seen.add(start)
        members, queue = {start}, deque([start])
        while queue:
            node = by_label[queue.popleft()]
            near = [index.producer[name] for name in node.input if name in index.producer]
            near += [r for name in node.output for r in index.consumers.get(name, [])]
            for other in near:
                label = node_label(other)
                if label in chosen and label not in seen:
                    seen.add(label)
                    members.add(label)
                    queue.append(label)
        groups.append([label for label in order if label in members])
    return groups


def _reason(group: list[str], terms: Terms, costs: Costs, saving: float) -> str:
    """What the group's int8 form would cost, by cause, against what its layers would save."""
    counts: dict[str, int] = {}
    for label in group:
        op = terms.ops[label] or "?"
        counts[op] = counts.get(op, 0) + 1
    types = ", ".join(f"{n} {op}" for op, n in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0])))
    change = terms.features()
    _add(change, terms.features(group), -1.0)  # what int8 has and float does not
    part = {name: getattr(costs, name) * change.get(name, 0.0) / 1e3 for name in FEATURES}
    causes = [(part["boundary"] + part["passes"], "Q/DQ and unfused activations"),
              (part["tap"] + part["depthwise_mac"] + part["depthwise_float_mac"], "depthwise Convs"),
              (part["integer_kernel"], "integer kernels' fixed cost"),
              (part["unit_span"], "broadcasts stepping value by value"),
              (part["nchw_pool"], "uint8 MaxPools in NCHW")]
    costs_text = ", ".join(f"{us:.0f} us {what}" for us, what in causes if us >= 0.5)
    saved = -(part["mac"] + part["weight"])
    span = f"'{group[0]}'" + (f" to '{group[-1]}'" if len(group) > 1 else "")
    saved = saved if saved > 0.5 else 0.0
    return (f"{len(group)} nodes ({types}), {span}: estimated {saving / 1e3:.0f} us faster in float at batch 1; "
            f"int8 adds {costs_text or 'little'} and saves {saved:.0f} us of MACs and weight reads")


class _Cut:
    """Minimum s-t cut over the quantized nodes: source side int8, sink side float (Dinic's max flow)."""

    def __init__(self, terms: Terms, costs: Costs):
        self.labels = list(terms.nodes)
        self.id = {label: i + 2 for i, label in enumerate(self.labels)}  # 0 source, 1 sink
        self.unary = {label: costs.ns(feats) for label, feats in terms.nodes.items()}
        self.pairs = {key: costs.ns(feats) for key, feats in terms.pairs.items()}
        self.follows = terms.follows
        for key in terms.joined:
            self.pairs[key] = math.inf

    def pin(self, label: str) -> None:
        """Keep `label` int8 whatever it costs."""
        self.unary[label] = -math.inf

    def solve(self) -> set[str]:
        """The float labels: the nodes that reach the sink in the residual graph (ties stay int8)."""
        graph: list[list[list]] = [[] for _ in range(len(self.labels) + 2)]

        def edge(u: int, v: int, cap: float, back: float = 0.0) -> None:
            forward, reverse = [v, cap, None], [u, back, None]
            forward[2], reverse[2] = reverse, forward
            graph[u].append(forward)
            graph[v].append(reverse)

        for label, cost in self.unary.items():
            if cost > 0:
                edge(self.id[label], 1, cost)  # paid when int8
            elif cost < 0:
                edge(0, self.id[label], -cost)  # paid when float (inf: never float)
        for (a, b), cost in self.pairs.items():
            if cost > 0:
                edge(self.id[a], self.id[b], cost, cost)
        for a, b in self.follows:  # cut when a is int8 and b float: never
            edge(self.id[a], self.id[b], math.inf)
        _max_flow(graph, 0, 1)
        reach = {1}
        queue = deque([1])
        while queue:
            v = queue.popleft()
            for u, _, back in graph[v]:  # back: the edge u -> v, with its residual capacity
                if u not in reach and back[1] > 1e-9:
                    reach.add(u)
                    queue.append(u)
        return {label for label in self.labels if self.id[label] in reach}


def _max_flow(graph: list[list[list]], s: int, t: int) -> float:
    """Dinic's algorithm on adjacency lists of [head, residual capacity, reverse edge]."""
    flow = 0.0
    while True:
        level = [-1] * len(graph)
        level[s] = 0
        queue = deque([s])
        while queue:
            u = queue.popleft()
            for v, cap, _ in graph[u]:
                if cap > 1e-9 and level[v] < 0:
                    level[v] = level[u] + 1
                    queue.append(v)
        if level[t] < 0:
            return flow
        pointer = [0] * len(graph)
        while True:  # a blocking flow: paths along the levels, depth first without recursion
            path: list[list] = []
            u = s
            while u != t:
                edges = graph[u]
                while pointer[u] < len(edges) and not (edges[pointer[u]][1] > 1e-9
                                                       and level[edges[pointer[u]][0]] == level[u] + 1):
                    pointer[u] += 1
                if pointer[u] == len(edges):  # a dead end: retreat
                    if not path:
                        break
                    level[u] = -1
                    u = path.pop()[2][0]
                    continue
                e = edges[pointer[u]]
                path.append(e)
                u = e[0]
            if u != t:
                break
            sent = min(e[1] for e in path)
            for e in path:
                e[1] -= sent
                e[2][1] += sent
            flow += sent
