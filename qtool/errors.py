"""Errors that qtool reports to the user as one line, with an exit code.

Anything raised as a QtoolError is the user's input being wrong (a missing file,
a bad config key, a model we cannot handle); the CLI prints its message and exits
with its code, without a traceback. Everything else is a bug in qtool.
"""

from __future__ import annotations

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


class InternalError(Exception):
    """qtool made something it must not hand out (a quantized model onnxruntime cannot run):
    a bug in qtool, not in the user's input. The CLI exits with EXIT_BUG and writes nothing."""
