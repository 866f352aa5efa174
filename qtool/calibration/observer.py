"""Running calibration data through the fp32 graph and summarising the tensors the plan needs.

Fetching every observed activation as a session output costs more than the inference itself
(copies, no buffer reuse, a reorder out of onnxruntime's NCHWc layout per tensor), so the observer
adds a few reduction nodes per tensor to a copy of the model (max, min, count, and a strided
sample where a histogram is needed) and onnxruntime's kernels reduce in the same pass. Python
folds each batch's scalars and bounded samples into fixed-size summaries
(qtool.calibration.statistics). A batch with non-finite extremes is re-run with those tensors
whole, so their NaN/Inf are counted and excluded exactly; a saturated Clip output stops being
reduced (qtool.calibration.saturation). Where bias correction's weights form will read them, the
input of a layer with a bias also gets its per-sample channel means (GlobalAveragePool). The
nodes, and why: docs/design/observer.md.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Callable, Collection, Iterable, NamedTuple, Optional

import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper

from qtool.calibration import saturation
from qtool.data.dataset import Batch
from qtool.graph.edit import with_body_outputs, with_outputs
from qtool.graph.index import bodies, made_in, scoped_nodes
from qtool.graph.runtime import SharedWeights, create_session
from qtool.graph.shapes import elem_types, inferred_shapes, samples_within
from qtool.calibration.statistics import SAMPLE_LIMIT, TensorStats

_PREFIX = "qtool_observe"

# A run of the fp32 graph raises the process's peak memory by about the sum of its activations
# (onnxruntime's working memory for a batch): a 224x224 CNN with 29 MB of activations per sample
# peaked 236 MB higher calibrating at batch 8 than at batch 1, in the same time. So a calibration
# run takes at most as many samples as keep that sum under RUN_BYTES (docs/design/observer.md).
RUN_BYTES = 128 * 2**20


def run_batch(model: onnx.ModelProto, requested: int) -> int:
    """Samples per calibration run of `model` for batches of `requested`: fewer where the float
    tensors the graph computes hold more than RUN_BYTES (qtool.graph.shapes.samples_within)."""
    return samples_within(model, requested, RUN_BYTES)


def pool_stride(height: int, width: int) -> int:
    """Row/column stride of the grid sample of a non-negative 4-D tensor: 4 from 28x28 maps up,
    2 from 8x8, else 1 (every position), so even small maps give many values per channel."""
    side = min(height, width)
    return 4 if side >= 28 else 2 if side >= 8 else 1


def nonnegative(model: onnx.ModelProto) -> set[str]:
    """Tensors that cannot hold a negative value: outputs of Relu, and of Clip with a constant min >= 0."""
    constants = {t.name: t for t in model.graph.initializer}
    for node in model.graph.node:
        if node.op_type == "Constant" and node.attribute and node.attribute[0].name == "value":
            constants[node.output[0]] = node.attribute[0].t
    found = set()
    for node in model.graph.node:
        if node.op_type == "Relu":
            found.add(node.output[0])
        elif node.op_type == "Clip":
            lo = None
            if len(node.input) > 1 and node.input[1] in constants:
                lo = float(numpy_helper.to_array(constants[node.input[1]]))
            for attr in node.attribute:  # opset < 11
                if attr.name == "min":
                    lo = attr.f
            if lo is not None and lo >= 0.0:
                found.add(node.output[0])
    return found


def with_reductions(model: onnx.ModelProto, names: list[str], sampled: Collection[str],
                    sample_limit: int, shapes: Optional[dict[str, list]] = None, known: Collection[str] = ()
                    ) -> tuple[onnx.ModelProto, dict[str, tuple]]:
    """A copy of `model` that outputs, per tensor, (min, max, size, sample, spatial, per_size) as described above.

    min is "" for a provably non-negative 4-D tensor (its low end is 0), size is "" when the
    count comes from the channel maxima times `spatial` (static H x W), sample is "" when no
    histogram is needed. `known`: sampled tensors whose extremes are known already (saturated,
    see qtool.calibration.saturation): only their sample and count are computed, min and max are ""; the
    count is int(size) * spatial // per_size (per_size: the positions of the pooled grid
    sample, whose size is then the one computed; 0 when size is the tensor's own)."""
    reduced = onnx.ModelProto()
    reduced.CopyFrom(model)
    graph = reduced.graph
    types = elem_types(model)
    if shapes is None:  # inference is slow: callers may pass it
        shapes = inferred_shapes(model, [*names, *known])
    floor_zero = nonnegative(model)
    flat, limit, two, one = (f"{_PREFIX}_flat", f"{_PREFIX}_limit", f"{_PREFIX}_two", f"{_PREFIX}_one")
    graph.initializer.extend([numpy_helper.from_array(np.array([-1], np.int64), flat),
                              numpy_helper.from_array(np.array(sample_limit, np.int64), limit),
                              numpy_helper.from_array(np.array(2, np.int64), two),
                              numpy_helper.from_array(np.array([1], np.int64), one),
                              numpy_helper.from_array(np.array([0], np.int64), f"{_PREFIX}_zero"),
                              numpy_helper.from_array(np.array([np.iinfo(np.int64).max], np.int64),
                                                      f"{_PREFIX}_end")])
    outputs: dict[str, tuple] = {}
    for i, name in enumerate([*names, *known]):
        p = f"{_PREFIX}_{i}"
        extremes = i < len(names)  # False: a saturated tensor, sampled only
        elem = types.get(name, TensorProto.FLOAT) or TensorProto.FLOAT
        dims = shapes.get(name)
        image_like = dims is not None and len(dims) == 4 and elem == TensorProto.FLOAT
        spatial = dims[2] * dims[3] if image_like and dims[2] and dims[3] else 0
        nodes, outs = [], []
        skip_min = image_like and name in floor_zero
        # a non-negative 4-D tensor is sampled from a grid of rows and columns (MaxPool with a
        # 1x1 window, on the NCHWc layout): only 1/4 or 1/16 of it is reordered and sliced
        pooled_sample = skip_min and bool(spatial) and name in sampled
        need_flat = (not skip_min or not spatial) if extremes else not pooled_sample
        if need_flat:
            nodes.append(helper.make_node("Reshape", [name, flat], [f"{p}_flat"], name=f"{p}_reshape"))
        sample_source = f"{p}_flat"
        per_size = 0
        if pooled_sample:
            stride = pool_stride(dims[2], dims[3])
            nodes += [helper.make_node("MaxPool", [name], [f"{p}_sub"], kernel_shape=[1, 1], strides=[stride, stride],
                                       name=f"{p}_subsample"),
                      helper.make_node("Reshape", [f"{p}_sub", flat], [f"{p}_subflat"], name=f"{p}_subreshape"),
                      helper.make_node("Size", [f"{p}_subflat"], [f"{p}_subsize"], name=f"{p}_subsize")]
            sample_source = f"{p}_subflat"
            per_size = ((dims[2] - 1) // stride + 1) * ((dims[3] - 1) // stride + 1)  # the grid's positions
        max_name = ""
        if extremes and image_like:
            # GlobalMaxPool runs on onnxruntime's blocked NCHWc layout: no reorder to NCHW
            nodes.append(helper.make_node("GlobalMaxPool", [name], [f"{p}_max"], name=f"{p}_gmp"))
            outs.append(helper.make_tensor_value_info(f"{p}_max", elem, None))
            max_name = f"{p}_max"
        elif extremes:
            nodes.append(helper.make_node("ReduceMax", [f"{p}_flat"], [f"{p}_max"], keepdims=0, name=f"{p}_max"))
            outs.append(helper.make_tensor_value_info(f"{p}_max", elem, []))
            max_name = f"{p}_max"
        min_name = ""
        if extremes and not skip_min:
            nodes.append(helper.make_node("ReduceMin", [f"{p}_flat"], [f"{p}_min"], keepdims=0, name=f"{p}_min"))
            outs.append(helper.make_tensor_value_info(f"{p}_min", elem, []))
            min_name = f"{p}_min"
        size_name = ""
        if need_flat:
            nodes.append(helper.make_node("Size", [f"{p}_flat"], [f"{p}_size"], name=f"{p}_size"))
            outs.append(helper.make_tensor_value_info(f"{p}_size", TensorProto.INT64, []))
            size_name = f"{p}_size"
        elif not extremes:  # the count from the grid sample's size: no channel maxima to count from
            outs.append(helper.make_tensor_value_info(f"{p}_subsize", TensorProto.INT64, []))
            size_name = f"{p}_subsize"
        sample_name = ""
        if name in sampled:
            counted = f"{p}_subsize" if pooled_sample else f"{p}_size"
            nodes += [helper.make_node("Div", [counted, limit], [f"{p}_s"], name=f"{p}_div"),
                      helper.make_node("Mod", [f"{p}_s", two], [f"{p}_odd"], name=f"{p}_mod"),
                      helper.make_node("Sub", [f"{p}_s", f"{p}_odd"], [f"{p}_even"], name=f"{p}_sub"),
                      helper.make_node("Add", [f"{p}_even", one], [f"{p}_step"], name=f"{p}_step"),
                      helper.make_node("Slice", [sample_source, f"{_PREFIX}_zero", f"{_PREFIX}_end",
                                                 f"{_PREFIX}_zero", f"{p}_step"], [f"{p}_sample"],
                                       name=f"{p}_slice")]
            outs.append(helper.make_tensor_value_info(f"{p}_sample", elem, [None]))
            sample_name = f"{p}_sample"
        graph.node.extend(nodes)
        graph.output.extend(outs)
        outputs[name] = (min_name, max_name, size_name, sample_name, spatial, 0 if extremes else per_size)
    return reduced, outputs


class ChannelMeans(NamedTuple):
    """Where one tensor's per-sample channel means come from in an observing session's outputs."""

    output: str  # the means, [N, C, 1...]
    shape: str  # the output of its shape where its spatial dims are dynamic, else ""
    static: tuple[int, ...]  # its spatial size where shape inference knows it, else ()


def with_channel_means(reduced: onnx.ModelProto, ranks: dict[str, int],
                       shapes: Optional[dict[str, list]] = None) -> dict[str, ChannelMeans]:
    """Adds to `reduced` (in place) an output of each tensor's per-sample channel means, [N, C, 1...]
    (GlobalAveragePool, on onnxruntime's blocked layout), the tensor itself for rank 2 ([N, C]);
    `ranks`: tensor -> its rank; `shapes`: the dims shape inference gives. Its spatial size comes
    from those dims where they are all known, else from an output of its shape (a Shape node makes
    onnxruntime reorder the tensor out of the blocked layout: a copy of it per run). Returns tensor
    -> its ChannelMeans."""
    types = elem_types(reduced)
    shapes = shapes or {}
    means = {}
    for i, name in enumerate(sorted(ranks)):
        if ranks[name] < 2 or types.get(name, TensorProto.FLOAT) != TensorProto.FLOAT:
            continue
        out, shape, static = f"{_PREFIX}_mean{i}", "", ()
        op = "GlobalAveragePool" if ranks[name] > 2 else "Identity"
        reduced.graph.node.append(helper.make_node(op, [name], [out], name=out))
        reduced.graph.output.append(helper.make_tensor_value_info(out, TensorProto.FLOAT, None))
        dims = shapes.get(name) or []
        if ranks[name] > 2 and len(dims) == ranks[name] and all(isinstance(d, int) and d > 0 for d in dims[2:]):
            static = tuple(dims[2:])
        elif ranks[name] > 2:
            shape = f"{_PREFIX}_shape{i}"
            reduced.graph.node.append(helper.make_node("Shape", [name], [shape], name=shape))
            reduced.graph.output.append(helper.make_tensor_value_info(shape, TensorProto.INT64, [ranks[name]]))
        means[name] = ChannelMeans(out, shape, static)
    return means


def observe(model: onnx.ModelProto, tensors: list[str], batches: Iterable[Batch],
            histogram_for: Collection[str] = (), threads: int = 0,
            on_batch: Optional[Callable[[Batch], None]] = None,
            sample_limit: int = SAMPLE_LIMIT, saturate: Collection[str] = (),
            means_for: Optional[dict[str, int]] = None) -> dict[str, TensorStats]:
    """One pass over `batches`; returns a summary per tensor (with a histogram for `histogram_for`).

    `saturate`: tensors whose table entry needs only their overall extremes, plus their
    histogram for those in `histogram_for` (any method but the averaged min-max:
    qtool.calibration.saturation.saturable). Those bounded by construction stop having their extremes
    reduced once they reach their bounds; the ones with a histogram keep being sampled
    (qtool.calibration.saturation). `means_for`: tensor -> rank of the tensors whose per-sample
    channel means (axis 1) are kept too (TensorStats.channel_mean), whether saturated or not."""
    return Observer(model, tensors, histogram_for, threads, sample_limit, saturate, means_for).run(batches, on_batch)


class Observer:
    """The observing sessions of one model and one set of observed tensors, kept for several passes.

    A worker that collects several shards of one model (qtool.calibration.shards) keeps one
    Observer: each pass starts from fresh statistics and the full observing session and
    saturates exactly as a pass of its own would (so its statistics depend on its batches
    only, whatever ran before on that worker), but every session is built once: the one
    without the saturated tensors, which each pass reaches after its first batches, is the
    same session the previous pass built."""

    KEPT_SESSIONS = 4

    def __init__(self, model: onnx.ModelProto, tensors: list[str], histogram_for: Collection[str] = (),
                 threads: int = 0, sample_limit: int = SAMPLE_LIMIT, saturate: Collection[str] = (),
                 means_for: Optional[dict[str, int]] = None):
        # tensors inside If/Loop/Scan bodies are observed through the graph outputs that carry them out
        self.in_loops = _made_in_loops(model, tensors)
        model, self.routes = with_body_outputs(model, tensors)
        self.model, self.tensors, self.threads, self.sample_limit = model, tensors, threads, sample_limit
        self.histogram_for = {self.routes.get(t, t) for t in histogram_for}
        inputs = {i.name for i in model.graph.input}
        self.fetched = [self.routes.get(t, t) for t in tensors if t not in inputs]
        self.from_feeds = [t for t in tensors if t in inputs]  # graph inputs are read from the feeds
        self.shapes = inferred_shapes(model, self.fetched)
        # channel means of main-graph tensors only (a body's tensor leaves it stacked over iterations)
        observed = set(tensors)
        wanted = {t: rank for t, rank in (means_for or {}).items() if t in observed}
        self.means_for = {t: rank for t, rank in wanted.items() if t not in self.routes and t not in inputs}
        self.means_from_feeds = sorted(t for t in wanted if t in inputs)
        self.bounded = {t: b for t, b in saturation.bounds(model).items()
                        if t in saturate and t in self.fetched
                        and (t not in self.histogram_for or saturation.static(self.shapes.get(t)))}
        self.weight = {t: int(np.prod([d or 1 for d in self.shapes.get(t, [])[1:]], dtype=np.int64))
                       for t in self.fetched}
        self.weights = SharedWeights(model)  # the observing sessions are variants of one model: its weights held once
        self._sessions: OrderedDict[tuple, tuple] = OrderedDict()
        self._fallback = None

    def batch_size(self, requested: int) -> int:
        """Samples per observing run: 1 when a Loop body makes an observed tensor (the values of
        all its iterations leave the loop together, so a run holds them for every sample of the
        batch: hundreds of MB per sample for a decoder looping 500 times); else at most run_batch's."""
        return 1 if self.in_loops else run_batch(self.model, requested)

    def _session(self, active: list[str], known: list[str]):
        """The session observing `active` (and sampling `known`), built once; the least recently used
        of KEPT_SESSIONS goes first (passes over other data may saturate other tensors)."""
        key = (tuple(active), tuple(known))
        if key in self._sessions:
            self._sessions.move_to_end(key)
        else:
            self._sessions[key] = _observing_session(self.weights, active, self.histogram_for, self.sample_limit,
                                                     self.threads, self.shapes, known, self.means_for)
            while len(self._sessions) > self.KEPT_SESSIONS:
                self._sessions.popitem(last=False)
        return self._sessions[key]

    def run(self, batches: Iterable[Batch], on_batch: Optional[Callable[[Batch], None]] = None
            ) -> dict[str, TensorStats]:
        """One pass over `batches`, from fresh statistics (see observe)."""
        bounded = self.bounded
        active = list(self.fetched)  # extremes reduced (and sampled when in histogram_for)
        known: list[str] = []  # saturated histogram tensors: sampled and counted only
        session, outputs, names, means = self._session(active, known)
        rebuilds = 0
        stats = {t: TensorStats.with_histogram() if t in self.histogram_for else TensorStats()
                 for t in [*self.fetched, *self.from_feeds]}
        for s in stats.values():
            s.sample_limit = self.sample_limit  # the same stride for graph inputs, sampled in numpy
        for batch in batches:
            values = dict(zip(names, session.run(names, batch.feeds))) if names else {}
            bad = []
            for name in active:
                min_name, max_name, size_name, sample_name, spatial, _ = outputs[name]
                maxima = values[max_name]
                size = int(values[size_name]) if size_name else maxima.size * spatial
                if size == 0:
                    continue
                hi = float(np.max(maxima))
                # a non-negative tensor's range starts at 0 whatever its minimum (see the module doc)
                lo = float(values[min_name]) if min_name else min(0.0, hi)
                if not (np.isfinite(lo) and np.isfinite(hi)):
                    bad.append(name)
                    continue
                stats[name].add_extremes(lo, hi, size)
                if sample_name:
                    stats[name].add_sample(values[sample_name])
            for name in known:  # its extremes are its bounds, reached already: only the count and sample grow
                _, _, size_name, sample_name, spatial, per_size = outputs[name]
                size = int(values[size_name])
                size = size // per_size * spatial if per_size else size
                if size == 0:
                    continue
                stats[name].add_extremes(*bounded[name], size)
                stats[name].add_sample(values[sample_name])
            if bad:  # rare: NaN/Inf in this batch; count and exclude them exactly from the full tensors
                self._fallback = self._fallback or create_session(with_outputs(self.model, self.fetched),
                                                                  self.threads, "the fp32 model's tensors")
                for name, array in zip(bad, self._fallback.run(bad, batch.feeds)):
                    stats[name].update(array)
            for name in self.from_feeds:
                stats[name].update(batch.feeds[name])
            for name, m in means.items():
                stats[name].add_channel_means(values[m.output], tuple(values[m.shape][2:]) if m.shape else m.static)
            for name in self.means_from_feeds:
                array = np.asarray(batch.feeds[name])
                if array.ndim >= 2 and array.dtype == np.float32:
                    stats[name].add_channel_means(array.reshape(*array.shape[:2], -1).mean(axis=2, dtype=np.float64),
                                                  array.shape[2:])
            del values
            done = [t for t in active if t in bounded and stats[t].seen
                    and saturation.saturated(stats[t].min, stats[t].max, bounded[t])]
            if done and saturation.worth_rebuilding(sum(self.weight[t] for t in done),
                                                    sum(self.weight[t] for t in active), rebuilds):
                active = [t for t in active if t not in done]
                known += [t for t in done if t in self.histogram_for]
                session, outputs, names, means = self._session(active, known)
                rebuilds += 1
            if on_batch:
                on_batch(batch)
        for s in stats.values():
            s.flush()
        return {t: stats[self.routes.get(t, t)] for t in self.tensors}


def _made_in_loops(model: onnx.ModelProto, tensors: Collection[str]) -> bool:
    """Whether a Loop body, or a body nested in one, makes one of `tensors`."""
    wanted = set(tensors)
    loops = [body for node in scoped_nodes(model.graph) if node.op_type == "Loop" for _, body in bodies(node)]
    inside = [*loops, *(inner for body in loops for node in scoped_nodes(body) for _, inner in bodies(node))]
    return any(t in wanted for body in inside for t in made_in(body))


def _observing_session(weights: SharedWeights, names: list[str], histogram_for: Collection[str],
                       sample_limit: int, threads: int, shapes: Optional[dict[str, list]] = None,
                       known: Collection[str] = (), means_for: Optional[dict[str, int]] = None):
    """(session, per-tensor output names, the session outputs to fetch, tensor -> its channel means'
    output); no session when nothing is left to observe (every observed tensor saturated, none sampled
    and no channel means kept: the model need not run at all)."""
    if not names and not known and not means_for:
        return None, {}, [], {}
    reduced, outputs = with_reductions(weights.light, names, set(histogram_for), sample_limit, shapes, known)
    means = with_channel_means(reduced, means_for or {}, shapes)
    # priority order: each tensor's reductions run soon after it is made (with the default order
    # nudenet's observing session held 1.3 GB at batch 8, with this one 0.6 GB; same statistics)
    return (create_session(reduced, threads, "the fp32 model with calibration observers", weights=weights,
                           order=ort.ExecutionOrder.PRIORITY_BASED, batch_pass=True), outputs,
            [*(o for t in [*names, *known] for o in outputs[t][:4] if o),
             *(o for m in means.values() for o in (m.output, m.shape) if o)],
            means)
