"""Progress bars on stderr: drawn where someone watches, and free where no one does.

A bar is drawn when the caller asks for progress and stderr is a terminal (tqdm's own rule for
`disable=None`). Elsewhere (CI, a pipe, a log file) the bar draws nothing and tqdm is not imported
at all, so a job run from a pipeline pays nothing for a bar it never shows (tqdm's import also
looks up its own version in the installed packages' metadata).
"""

from __future__ import annotations

import sys
import threading

_thread_lock = False  # thread_lock() was called: the bars get a thread lock when tqdm is first imported


class _Silent:
    """A bar that draws nothing: the calls a tqdm bar takes here, doing nothing."""

    def __enter__(self) -> "_Silent":
        return self

    def __exit__(self, *exc) -> None:
        return None

    def update(self, n: int = 1) -> None:
        return None


def drawn(progress: bool = True) -> bool:
    """Whether a bar asked for with `progress` is drawn: stderr is a terminal."""
    isatty = getattr(sys.stderr, "isatty", None)
    return bool(progress) and isatty is not None and isatty()


def bar(desc: str, unit: str, total: int | None = None, progress: bool = True):
    """A progress bar of `total` `unit`s (None: unknown), removed when done; a silent one where
    it would not be drawn (drawn)."""
    if not drawn(progress):
        return _Silent()
    return _tqdm()(total=total, desc=desc, unit=unit, leave=False)


def write(line: str) -> None:
    """`line` on stderr, on a line of its own below a bar being drawn."""
    if "tqdm" in sys.modules:
        _tqdm().write(line, file=sys.stderr)
    else:
        print(line, file=sys.stderr)


def thread_lock() -> None:
    """The bars of this process are drawn by its threads only: they get a thread lock, not the
    multiprocessing lock tqdm makes at the first bar (6 ms and a semaphore). The command line's
    choice; an API caller's process may draw its own bars across processes."""
    global _thread_lock
    _thread_lock = True
    if "tqdm" in sys.modules:
        _lock(sys.modules["tqdm"].tqdm)


def _tqdm():
    from tqdm import tqdm

    if _thread_lock:
        _lock(tqdm)
    return tqdm


def _lock(tqdm) -> None:
    if not hasattr(tqdm, "_lock"):
        tqdm.set_lock(threading.RLock())
