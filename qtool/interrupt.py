"""Signals become exceptions, so an interrupted run unwinds through the atomic writers' cleanup.

Python turns SIGINT into KeyboardInterrupt, but SIGTERM (what CI runners, `timeout`
and container shutdowns send) kills the process outright, leaving temporary files
behind. While a command runs, both signals raise instead; the `with` blocks of
qtool.atomic then delete their temporary files. A short critical section (renaming
a model and its external data file into place as a pair) can hold the signal off
until it has finished.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
from typing import Iterator, Optional

EXIT_SIGINT = 130  # 128 + signal number, as shells report it
EXIT_SIGTERM = 143


class Terminated(BaseException):
    """SIGTERM arrived. A BaseException, like KeyboardInterrupt, so `except Exception` does not swallow it."""


_critical = 0
_pending: Optional[int] = None
_committed: set[str] = set()  # outputs renamed into place whole by the running command


def _raise_for(signum: int) -> None:
    if signum == signal.SIGINT:
        raise KeyboardInterrupt
    raise Terminated


def _handler(signum, frame) -> None:
    global _pending
    if _critical:
        _pending = signum
        return
    _raise_for(signum)


@contextlib.contextmanager
def signals_raise() -> Iterator[None]:
    """While active, SIGINT raises KeyboardInterrupt and SIGTERM raises Terminated (main thread only)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    _committed.clear()
    previous = {sig: signal.signal(sig, _handler) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


@contextlib.contextmanager
def deferred() -> Iterator[None]:
    """Hold SIGINT/SIGTERM (as handled by signals_raise) until the block has finished."""
    global _critical, _pending
    _critical += 1
    try:
        yield
    finally:
        _critical -= 1
        if not _critical and _pending is not None:
            signum, _pending = _pending, None
            _raise_for(signum)


def committed(path: str | os.PathLike) -> None:
    """`path` is now in place whole (called in the deferred block of its rename)."""
    _committed.add(os.path.abspath(path))


def was_committed(path: str | os.PathLike) -> bool:
    """Whether `path` was renamed into place whole since the command started: an interrupt after
    that loses nothing, so the command has succeeded."""
    return os.path.abspath(path) in _committed
