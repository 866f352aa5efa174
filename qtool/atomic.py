"""Atomic output files: write to a temporary file beside the target, then rename.

A reader (or a CI job that is killed halfway) therefore sees either the old file or
the complete new one, never a half-written one. os.replace is atomic on POSIX when
source and target are on the same file system, which is why the temporary file is
created in the target's own directory rather than in /tmp.

A temporary is `.<name>.XXXXXXXX.tmp`, flock-ed by its writer while it lives: a run
killed outright (SIGKILL, OOM) leaves it unlocked, and the next run that writes the
same output removes it, while a live concurrent writer's temporaries stay locked.
"""

from __future__ import annotations

import contextlib
import functools
import os
import re
import shutil
import tempfile
from pathlib import Path
from typing import Callable, Iterator, Optional

from qtool import interrupt
from qtool.errors import OutputError, QtoolError

try:
    import fcntl
except ImportError:  # no flock (Windows): temporaries are still removed on failure, stale ones are kept
    fcntl = None


# mkstemp creates files readable by their owner only; outputs get the usual permissions
# (0o666 minus the umask), read once at import while the process is single-threaded.
_UMASK = os.umask(0o022)
os.umask(_UMASK)
_FILE_MODE = 0o666 & ~_UMASK
_RANDOM = "[a-z0-9_]{8}"  # tempfile's random part


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


def directory_of(path: str | os.PathLike) -> Path:
    parent = Path(path).parent
    return parent if str(parent) else Path(".")


def _same_file(fd: int, path: str | os.PathLike) -> bool:
    try:
        st = os.stat(path, follow_symlinks=False)
    except FileNotFoundError:
        return False
    own = os.fstat(fd)
    return (st.st_dev, st.st_ino) == (own.st_dev, own.st_ino)


def remove_stale(path: str | os.PathLike) -> None:
    """Remove temporaries that killed runs writing `path` left behind: unlocked `.<name>.XXXXXXXX.tmp`
    files (and the `.<name>.XXXXXXXX` directories older versions used). Locked ones belong to live writers."""
    if fcntl is None:
        return
    target = Path(path)
    temporary = re.compile(re.escape(f".{target.name}.") + _RANDOM + r"(\.tmp)?")
    try:
        entries = list(os.scandir(directory_of(target)))
    except OSError:
        return
    for entry in entries:
        match = temporary.fullmatch(entry.name)
        if match is None or entry.is_symlink() or (match.group(1) is None) != entry.is_dir(follow_symlinks=False):
            continue
        try:
            fd = os.open(entry.path, os.O_RDONLY | os.O_NOFOLLOW)
        except OSError:  # gone already, or not ours to read
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            if _same_file(fd, entry.path):
                with interrupt.deferred():
                    if entry.is_dir(follow_symlinks=False):
                        shutil.rmtree(entry.path, ignore_errors=True)
                    else:
                        os.unlink(entry.path)
        except OSError:  # locked: a live writer's
            pass
        finally:
            os.close(fd)


@contextlib.contextmanager
def temporary(path: str | os.PathLike) -> Iterator[Path]:
    """A new empty file beside `path` with the usual permissions, locked while it lives; removed on
    exit unless it was renamed away."""
    target = Path(path)
    fd: Optional[int] = None
    tmp_path: Optional[Path] = None
    try:
        # A signal between creating the file and knowing its name would orphan it: hold it off.
        with interrupt.deferred():
            while True:
                fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=directory_of(target))
                tmp_path = Path(tmp)
                if fcntl is None:
                    break
                fcntl.flock(fd, fcntl.LOCK_EX)
                if _same_file(fd, tmp_path):
                    break
                os.close(fd)  # another run's remove_stale took it before the lock: make another
                fd = tmp_path = None
            os.fchmod(fd, _FILE_MODE)
        yield tmp_path
    finally:
        with interrupt.deferred():  # a second signal waits
            if tmp_path is not None and _same_file(fd, tmp_path):
                with contextlib.suppress(FileNotFoundError):
                    tmp_path.unlink()
            if fd is not None:
                os.close(fd)


@contextlib.contextmanager
def directory_lock(directory: str | os.PathLike) -> Iterator[None]:
    """Hold an exclusive flock on `directory`: writers committing into it go one at a time."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        fd = None
    try:
        if fd is not None and fcntl is not None:
            with contextlib.suppress(OSError):  # a file system without locks: go on unlocked
                fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        if fd is not None:
            os.close(fd)


def sync_directory(directory: str | os.PathLike) -> None:
    """fsync a directory, so the renames done in it reach the disk in the order they were made."""
    with contextlib.suppress(OSError):
        fd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike) -> Iterator[Path]:
    """Yield a temporary path in the target's directory; rename it onto `path` on success. A failed
    write (disk full, I/O error) is the user's OutputError naming `path`."""
    try:
        remove_stale(path)
        with temporary(path) as tmp_path:
            yield tmp_path
            with interrupt.deferred():  # renamed and recorded as one step: an interrupt comes before or after both
                os.replace(tmp_path, path)
                interrupt.committed(Path(path))
    except OSError as exc:
        if isinstance(exc, QtoolError):
            raise
        raise write_error(exc, path) from exc


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
