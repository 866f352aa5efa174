"""Errors that qtool reports to the user as one line, with an exit code.

Anything raised as a QtoolError is the user's input or machine being wrong (a missing
file, a bad config key, a model we cannot handle, a full disk, too little memory); the CLI
prints its message and exits with its code, without a traceback. Everything else is a bug
in qtool.
"""

from __future__ import annotations

import functools
import re
from typing import Callable

EXIT_OK = 0
EXIT_THRESHOLD = 1  # evaluate: a quality threshold was violated
EXIT_INPUT = 2  # usage or input error
EXIT_BUG = 3  # an internal error: a bug in qtool


class QtoolError(Exception):
    """A problem with the user's input. The message names the file and what is wrong."""

    exit_code = EXIT_INPUT

    def __init__(self, message: str, path: object | None = None):
        self.path = None if path is None else str(path)
        super().__init__(f"{self.path}: {message}" if self.path else message)


class ThresholdError(QtoolError):
    """A quality target was not met (exit code 1)."""

    exit_code = EXIT_THRESHOLD


class RunRefused(QtoolError):
    """onnxruntime refused to run a model on a batch (InvalidArgument, Fail, RuntimeException from a
    session run; qtool.graph.runtime.Session): exit 2, the message naming the model file and what
    onnxruntime refused. Steps that can do without the run (a batch size onnxruntime refuses, a
    candidate the run check rejects) catch it and go on."""

    def __init__(self, message: str, path: object | None = None, reason: str = ""):
        super().__init__(message, path)
        self.reason = reason or message


class LoadRefused(QtoolError):
    """onnxruntime refused to load a model (qtool.graph.runtime.create_session): exit 2 when the model
    is the user's; when it is one qtool derived from a model onnxruntime loads (the prepared graph
    with observers, a candidate), qtool.graph.runtime.job_model makes it an InternalError."""


class MissingRanges(QtoolError):
    """A calibration table lacks ranges the plan needs: exit 2 for a table the user gave; for the
    table the job made itself, an inconsistency of qtool's planning (the API makes it an InternalError)."""


class InternalError(Exception):
    """qtool made something it must not hand out (a quantized model onnxruntime cannot run):
    a bug in qtool, not in the user's input. The CLI exits with EXIT_BUG and writes nothing."""


class OutputError(QtoolError, OSError):
    """An output cannot be written: its directory is missing or read-only, or the disk is full.
    Also an OSError, so code that may skip a write (a cache) still catches it as one."""


class NotEnoughMemory(QtoolError):
    """The machine has too little memory for the job: the user's model or inputs, not a bug."""


# what onnxruntime says when its allocator fails (it raises its own Fail/RuntimeException types)
_ALLOCATION_FAILED = ("Failed to allocate memory", "bad_alloc")


def allocation_failure(exc: BaseException) -> bool:
    """A MemoryError, or onnxruntime failing to allocate a buffer (its own exception, not one of
    qtool's that quotes it)."""
    if isinstance(exc, MemoryError):
        return True
    return type(exc).__module__.startswith("onnxruntime") and any(text in str(exc) for text in _ALLOCATION_FAILED)


def not_enough_memory(exc: BaseException, path: object, doing: str) -> NotEnoughMemory:
    """The one-line error for an allocation failure while `doing` something with the file `path`."""
    text = " ".join(str(exc).split())
    if isinstance(exc, MemoryError):
        detail = text or "MemoryError"
    else:
        size = re.search(r"requested buffer of size (\d+)", text)
        detail = (f"onnxruntime could not allocate {_size(int(size.group(1)))}" if size
                  else "onnxruntime could not allocate memory")
    return NotEnoughMemory(f"not enough memory to {doing} ({detail})", path)


def _size(count: int) -> str:
    for unit, scale in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20)):
        if count >= scale:
            return f"{count / scale:.1f} {unit}"
    return f"{count} bytes"


def reports_memory(doing: str) -> Callable:
    """Decorate a job `func(model, ...)`: an allocation failure becomes NotEnoughMemory naming the model."""
    def decorate(func: Callable) -> Callable:
        @functools.wraps(func)
        def job(model, *args, **kwargs):
            try:
                return func(model, *args, **kwargs)
            except Exception as exc:
                if allocation_failure(exc):
                    raise not_enough_memory(exc, model, doing) from exc
                raise
        return job
    return decorate
