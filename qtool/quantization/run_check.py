"""The written model runs: one onnxruntime inference of the int8 model before quantize reports success.

onnxruntime rewrites a QDQ model before it runs it (QDQ fusion, the NHWC layout transformer of its
8-bit kernels), and a rewritten form can fail although the fp32 graph runs (found so far: a cubic
Resize scaling down between int8 Convs; docs/guarantees.md). The user would meet such a failure
only at the first inference, so quantize runs it once itself: on the first calibration sample (a
batch of one: what a deployment runs, and a fraction of a batch's time), or inputs made up from the
input specs. The model must load and run, give fp32's output shapes, and finite outputs wherever
the prepared fp32 graph's are finite on the same input. When it fails,
`locate` looks for one node whose float form makes the model pass.
"""

from __future__ import annotations

import re
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Callable, Iterator, Optional, Sequence

import numpy as np
import onnx

from qtool.errors import QtoolError, allocation_failure
from qtool.graph.modelio import InputSpec
from qtool.graph.runtime import create_session, ort_message

_NODE_NAME = re.compile(r"Name:'([^']*)'")


@dataclass(frozen=True)
class RunFailure:
    """Why the model did not pass: one line, and the node onnxruntime named (runtime errors name it)."""

    reason: str
    node: Optional[str] = None


@dataclass(frozen=True)
class Reference:
    """The input the check runs and fp32's outputs on it (None: fp32 does not run on it either,
    so only loading the int8 model is checked)."""

    feeds: dict[str, np.ndarray]
    names: tuple[str, ...]
    outputs: Optional[tuple[np.ndarray, ...]]
    skipped: Optional[str] = None  # why the outputs are not checked

    @property
    def runs(self) -> Optional[dict[str, np.ndarray]]:
        """The feeds where fp32 runs on them, else None (no inputs the model runs on)."""
        return self.feeds if self.outputs is not None else None


@dataclass
class Kept:
    """The last model that passed inside `keeping()`, and its session (onnxruntime, `threads`
    intra-op threads: those the caller runs it on)."""

    model: Optional[onnx.ModelProto] = None
    session: object = None
    threads: int = 1
    as_written: bool = False  # sessions with their Q/DQ computed as written (qtool.graph.runtime)

    def take(self, model: onnx.ModelProto):
        """The session of `model` if it is the kept one (by identity: the proto check ran), else None;
        the slot is emptied either way."""
        session = self.session if self.model is model else None
        self.model = self.session = None
        return session


_KEEPING: ContextVar[Optional[Kept]] = ContextVar("qtool_run_check_keeping", default=None)


@contextmanager
def keeping(threads: int = 1, as_written: bool = False) -> Iterator[Kept]:
    """Within it, `check` keeps the session of the last model that passes, for a caller that runs
    that same model next (a measured choice scores the candidate it has just built: one session
    fewer per candidate); its run checks run on `threads` intra-op threads and `as_written`, as that
    caller's runs do. Outside it nothing is kept, so no session outlives its check."""
    kept = Kept(threads=threads, as_written=as_written)
    token = _KEEPING.set(kept)
    try:
        yield kept
    finally:
        _KEEPING.reset(token)


def made_up_feeds(specs: Sequence[InputSpec], size: int = 1) -> dict[str, np.ndarray]:
    """One batch from the input specs alone (quantize with a table and no data): batch 1, `size`
    for the other dims the specs leave open (an image's height and width)."""
    rng = np.random.default_rng(0)
    feeds = {}
    for spec in specs:
        shape = tuple((1 if i == 0 else size) if d is None else d for i, d in enumerate(spec.shape))
        if np.issubdtype(spec.dtype, np.floating):
            feeds[spec.name] = rng.normal(0.0, 1.0, shape).astype(spec.dtype)
        else:
            feeds[spec.name] = np.zeros(shape, spec.dtype)
    return feeds


def ort_reason(exc: BaseException) -> str:
    """onnxruntime's message as one line, without its status prefixes and C++ source locations."""
    return ort_message(exc)


def _run(model: onnx.ModelProto, feeds: dict[str, np.ndarray], label: str, load_only: bool = False):
    """(outputs, None, session) or (None, RunFailure, None)."""
    kept = _KEEPING.get()
    try:
        # a batch_pass: a measured choice scores its candidate on this session next (keeping())
        session = create_session(model, threads=kept.threads if kept is not None else 1, label=label,
                                 log_level=4, batch_pass=True, as_written=kept is not None and kept.as_written)
    except QtoolError as exc:
        return None, RunFailure(f"onnxruntime cannot load it: {ort_reason(exc)}"), None
    if load_only:
        return (), None, session
    try:
        return tuple(session.run(None, feeds)), None, session
    except Exception as exc:  # onnxruntime raises its own Fail/InvalidArgument types
        if allocation_failure(exc):
            raise  # too little memory is no failure of the model: the job reports it
        named = _NODE_NAME.search(str(exc))
        return None, RunFailure(f"onnxruntime fails running it: {ort_reason(exc)}",
                                named.group(1) if named else None), None


def reference(fp32: onnx.ModelProto, feeds: dict[str, np.ndarray], source: str) -> Reference:
    """fp32's outputs on `feeds` (`source` says where they come from, for the note when fp32 fails)."""
    names = tuple(o.name for o in fp32.graph.output)
    outputs, failure, _ = _run(fp32, feeds, "fp32 model")
    if failure is None:
        return Reference(feeds, names, outputs)
    return Reference(feeds, names, None, f"the fp32 model does not run on {source} ({failure.reason})")


def check(model: onnx.ModelProto, ref: Reference) -> Optional[RunFailure]:
    """None when `model` passes (see the module doc), else why not."""
    kept = _KEEPING.get()
    if kept is not None:
        kept.take(None)  # a model that fails keeps nothing
    outputs, failure, session = _run(model, ref.feeds, "int8 model", load_only=ref.outputs is None)
    if failure is not None or ref.outputs is None:
        return failure
    for name, got, want in zip(ref.names, outputs, ref.outputs):
        got, want = np.asarray(got), np.asarray(want)
        if got.shape != want.shape:
            return RunFailure(f"output '{name}' has shape {list(got.shape)}, fp32's is {list(want.shape)}")
        if np.issubdtype(want.dtype, np.floating) and np.all(np.isfinite(want)):
            bad = int(got.size - np.count_nonzero(np.isfinite(got)))
            if bad:
                return RunFailure(f"output '{name}' has {bad} NaN/Inf value(s) where fp32's are finite")
    if kept is not None:
        kept.model, kept.session = model, session
    return None


def locate(failure: RunFailure, candidates: Sequence[tuple[str, str]],
           passes: Callable[[frozenset[str]], bool]) -> Optional[str]:
    """One node of `candidates` ((label, op type) of the quantized nodes, in graph order) whose
    float form makes the model pass; `passes(labels)` quantizes with `labels` float and checks.

    First the node onnxruntime named, then the nodes of an op type its message names, then all:
    a group is halved while one half in float passes, so a node is found in about log2(n) runs.
    None when no single node is enough."""
    labels = [label for label, _ in candidates]
    if failure.node in labels and passes(frozenset([failure.node])):
        return failure.node
    words = set(re.findall(r"\w+", failure.reason))
    suspects = [label for label, op in candidates if op in words]
    for group in (suspects, labels):
        if group and passes(frozenset(group)):
            found = _halve(group, passes)
            if found is not None:
                return found
    return None


def _halve(group: list[str], passes: Callable[[frozenset[str]], bool]) -> Optional[str]:
    """A single node of `group` (which passes in float as a whole) that passes alone."""
    while len(group) > 1:
        first, second = group[:len(group) // 2], group[len(group) // 2:]
        if passes(frozenset(first)):
            group = first
        elif passes(frozenset(second)):
            group = second
        else:
            return None  # the failure needs nodes of both halves in float
    return group[0]
