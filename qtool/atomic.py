"""Atomic output files: write to a temporary file beside the target, then rename.

A reader (or a CI job that is killed halfway) therefore sees either the old file or
the complete new one, never a half-written one. os.replace is atomic on POSIX when
source and target are on the same file system, which is why the temporary file is
created in the target's own directory rather than in /tmp.
"""

from __future__ import annotations

import contextlib
import functools
import os
import tempfile
from pathlib import Path
from typing import Callable, Iterator

from qtool import interrupt
from qtool.errors import OutputError, QtoolError


# mkstemp creates files readable by their owner only; outputs get the usual permissions
# (0o666 minus the umask), read once at import while the process is single-threaded.
_UMASK = os.umask(0o022)
os.umask(_UMASK)
_FILE_MODE = 0o666 & ~_UMASK


def check_output_path(path: str | os.PathLike, *inputs: str | os.PathLike) -> Path:
    """Refuse output paths whose directory is missing or not writable, or that would overwrite an
    input: checked before the work, which would otherwise be lost at the end."""
    out = Path(path)
    parent = out.parent if str(out.parent) else Path(".")
    if not parent.is_dir():
        raise OutputError(f"output directory {parent} does not exist", out)
    if not os.access(parent, os.W_OK | os.X_OK):  # also false for root on a read-only file system
        read_only = hasattr(os, "statvfs") and os.statvfs(parent).f_flag & os.ST_RDONLY
        why = "on a read-only file system" if read_only else "not writable"
        raise OutputError(f"output directory {parent} is {why}", out)
    if out.is_dir():
        raise QtoolError("output path is a directory", out)
    for src in inputs:
        if src is not None and out.resolve() == Path(src).resolve():
            raise QtoolError("output path is the same as an input file; choose another name", out)
    return out


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike) -> Iterator[Path]:
    """Yield a temporary path in the target's directory; rename it onto `path` on success."""
    target = Path(path)
    directory = target.parent if str(target.parent) else Path(".")
    tmp_path = None
    try:
        # A signal between creating the file and knowing its name would orphan it: hold it off.
        with interrupt.deferred():
            fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=directory)
            os.fchmod(fd, _FILE_MODE)
            os.close(fd)
            tmp_path = Path(tmp)
        yield tmp_path
        with interrupt.deferred():  # renamed and recorded as one step: an interrupt comes before or after both
            os.replace(tmp_path, target)
            interrupt.committed(target)
    except BaseException as exc:
        if tmp_path is not None:
            with interrupt.deferred(), contextlib.suppress(FileNotFoundError):  # a second signal waits
                tmp_path.unlink()
        if isinstance(exc, OSError) and not isinstance(exc, QtoolError):
            raise write_error(exc, target) from exc
        raise


def write_error(exc: OSError, path: str | os.PathLike) -> OutputError:
    """A failed write (disk full, read-only, I/O error) as the user's one-line error naming the output."""
    return OutputError(f"cannot write it: {exc.strerror or exc}", path)


def reports_write_errors(writer: Callable) -> Callable:
    """Decorate `writer(obj, path, ...)`: an OSError while it writes becomes an OutputError naming `path`."""
    @functools.wraps(writer)
    def write(obj, path, *args, **kwargs):
        try:
            return writer(obj, path, *args, **kwargs)
        except OSError as exc:
            if isinstance(exc, QtoolError):
                raise
            raise write_error(exc, path) from exc
    return write


def write_bytes(path: str | os.PathLike, data: bytes) -> None:
    with atomic_path(path) as tmp:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())


def write_text(path: str | os.PathLike, text: str) -> None:
    write_bytes(path, text.encode("utf-8"))
