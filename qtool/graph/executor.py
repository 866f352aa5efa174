"""Where the shards of a long job run: local processes (--workers) or a Dask cluster (--dask).

Every heavy verb splits its data into shards whose partial results are fixed-size and merge
exactly, so what runs them only has to be a `concurrent.futures.Executor`: a process pool, Dask's
`Client.get_executor()`, or an API caller's. A task's arguments are small (a model path and its
sha256, sample files, options); each worker loads its own samples and keeps what it built per model
hash (`worker_cache`), and what the coordinator built itself goes to each worker once (`shared`), so
nothing the size of the dataset goes through the scheduler. Dask is optional and imported only for
--dask; it re-runs the tasks of a dead worker, and a task failing on bad input fails the job
(QtoolError pickles by its message). Usage: docs/scale-out.md.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import hashlib
import os
import pickle
import tempfile
from collections import OrderedDict
from dataclasses import dataclass, replace
from typing import Callable, Iterator, Optional, Sequence, TypeVar

from qtool.errors import QtoolError
from qtool.graph.modelio import sha256_file
from qtool.progress import bar as progress_bar

INSTALL_HINT = '--dask needs Dask: pip install "qtool[dask]" (or: pip install "dask[distributed]")'
# shards per worker: few, since each costs a task's round trip and a pass's first, unsaturated batches;
# more than one, so a dead worker's share is small and the progress bar moves
TASKS_PER_WORKER = 2
CACHE_ENTRIES = 4  # models (and their sessions) a worker keeps

Job = TypeVar("Job")
Result = TypeVar("Result")


@dataclass(frozen=True)
class Engine:
    """An executor and how to split work for it."""

    executor: concurrent.futures.Executor
    width: int  # tasks that run at once
    threads: int  # onnxruntime intra-op threads of each task's sessions (0: one per core)
    name: str  # for messages: "2 local processes", "Dask tcp://host:8786"
    client: Optional[object] = None  # Dask's Client, for `shared`


def parse_dask(text: str) -> tuple[Optional[str], int]:
    """--dask: 'local' or 'local:N' -> (None, N); a scheduler address -> (address, 0)."""
    text = text.strip()
    if text == "local" or text.startswith("local:"):
        count = text[len("local:"):] if ":" in text else str(os.cpu_count() or 1)
        if not count.isdigit() or int(count) < 1:
            raise QtoolError(f"--dask local:N needs a worker count N >= 1, got '{text}'")
        return None, int(count)
    if not text:
        raise QtoolError("--dask needs a scheduler address (tcp://host:8786) or local[:N]")
    return text, 0


def as_engine(executor: concurrent.futures.Executor) -> Engine:
    """A caller's executor: Dask's (its cluster's thread count) or any other (its max_workers, else the cores)."""
    client = getattr(executor, "_client", None)
    if client is not None and hasattr(client, "nthreads"):
        width = sum(client.nthreads().values()) or 1
        return Engine(executor, width, 1, f"Dask {client.scheduler.address}", client)
    width = getattr(executor, "_max_workers", None) or os.cpu_count() or 1
    return Engine(executor, width, max(1, (os.cpu_count() or 1) // width), type(executor).__name__)


@contextlib.contextmanager
def _without_env(name: str) -> Iterator[None]:
    """`name` out of this process's environment for the block, back as it was after."""
    saved = os.environ.pop(name, None)
    try:
        yield
    finally:
        if saved is not None:
            os.environ[name] = saved


@contextlib.contextmanager
def open_engine(dask: Optional[str] = None, workers: int = 1) -> Iterator[Optional[Engine]]:
    """The engine of --dask (a LocalCluster of single-threaded worker processes, or a running
    scheduler) or of --workers N > 1 (a local process pool); None: run in this process."""
    if dask:
        address, count = parse_dask(dask)
        try:
            from distributed import Client, LocalCluster
        except ImportError:
            raise QtoolError(INSTALL_HINT) from None
        with contextlib.ExitStack() as stack:
            if address is None:
                import logging

                import dask

                # Dask starts its workers with MALLOC_TRIM_THRESHOLD_=65536, which also turns off glibc's
                # adaptive mmap threshold: every batch-sized array is then mmapped and unmapped, and a worker
                # spent 40% more time per sample than the same code in a plain process (measured: 2.8 s of
                # system time in a 7 s calibration of 1,024 images; 0.9 s without it).
                stack.enter_context(dask.config.set({"distributed.nanny.pre-spawn-environ.MALLOC_TRIM_THRESHOLD_":
                                                     None}))
                # A LocalCluster's nannies run in this process and set the variable here before spawning
                # (an earlier cluster of this process left it behind): workers inherit this environment.
                stack.enter_context(_without_env("MALLOC_TRIM_THRESHOLD_"))
                # on 127.0.0.1 and without a dashboard: nothing of the cluster is reachable from another machine
                cluster = stack.enter_context(LocalCluster(n_workers=count, threads_per_worker=1, processes=True,
                                                           host="127.0.0.1", dashboard_address=None,
                                                           silence_logs=logging.ERROR))
                client = stack.enter_context(Client(cluster))
            else:
                try:
                    client = stack.enter_context(Client(address, timeout="30s"))
                except (OSError, TimeoutError) as exc:
                    raise QtoolError(f"cannot reach the Dask scheduler at {address}: {exc}") from None
            yield replace(as_engine(client.get_executor()), name=f"Dask {address or f'local:{count}'}")
        return
    if workers > 1:
        import multiprocessing  # here: a process pool's, not every job's import

        context = multiprocessing.get_context("spawn")  # no fork of a process that may hold onnxruntime threads
        with concurrent.futures.ProcessPoolExecutor(workers, mp_context=context) as pool:
            yield Engine(pool, workers, max(1, (os.cpu_count() or 1) // workers), f"{workers} local processes")
        return
    yield None


def run_in_order(engine: Engine, task: Callable[..., Result], jobs: Sequence[Job], desc: str,
                 progress: bool = True, common: object = None) -> Iterator[Result]:
    """Submit every job, then yield the results in job order as soon as each is in (one progress
    bar over the shards as they complete); the first failure cancels the rest and is raised.
    `common`: a handle from `shared`, passed to every task after its job (task(job, common))."""
    extra = () if common is None else (common,)
    futures = [engine.executor.submit(task, job, *extra) for job in jobs]
    done: dict[int, Result] = {}
    index = {future: i for i, future in enumerate(futures)}
    following = 0
    try:
        with progress_bar(desc, "shard", len(jobs), progress) as bar:
            for future in concurrent.futures.as_completed(futures):
                done[index[future]] = future.result()
                bar.update()
                while following in done:
                    yield done.pop(following)
                    following += 1
    finally:
        for future in futures:
            future.cancel()


@dataclass(frozen=True)
class SharedFile:
    """What `shared` wrote for a non-Dask executor's workers: a pickle file and its sha256."""

    path: str
    sha256: str


@contextlib.contextmanager
def shared(engine: Engine, value: object) -> Iterator[object]:
    """A handle that sends `value` (a model the coordinator built, evaluation batches) to each
    worker once, not with every task: on Dask it is scattered to every worker (a task given the
    handle receives the value itself); on other executors (process pools on this machine) it is
    a temporary pickle file each worker reads once. Tasks get the value with `resolve`."""
    if engine.client is not None:
        (future,) = engine.client.scatter([value], broadcast=True, hash=False)  # a list: one value, not split
        try:
            yield future
        finally:
            future.release()
        return
    data = pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)
    with tempfile.TemporaryDirectory(prefix="qtool-shared-") as folder:
        path = os.path.join(folder, "value.pickle")
        with open(path, "wb") as file:
            file.write(data)
        yield SharedFile(path, hashlib.sha256(data).hexdigest())


def resolve(handle: object) -> object:
    """On a worker: the value behind a `shared` handle (read once per worker from a SharedFile)."""
    if isinstance(handle, SharedFile):
        def load() -> object:
            with open(handle.path, "rb") as file:
                return pickle.load(file)
        return worker_cache(("shared", handle.sha256), load)
    return handle


_CACHE: "OrderedDict[tuple, object]" = OrderedDict()


def worker_cache(key: tuple, build: Callable[[], Result]) -> Result:
    """What a worker process built for `key` (a model's sha256 and options), built once and
    kept for its next shards; the least recently used of CACHE_ENTRIES goes first."""
    if key in _CACHE:
        _CACHE.move_to_end(key)
        return _CACHE[key]  # type: ignore[return-value]
    value = build()
    _CACHE[key] = value
    while len(_CACHE) > CACHE_ENTRIES:
        _CACHE.popitem(last=False)
    return value


_CHECKED: set[tuple[str, str]] = set()


def model_cache(path: str, sha256: str, key: tuple, build: Callable[[], Result]) -> Result:
    """worker_cache for what is built from the model file at `path`, checked once per worker
    to be the coordinator's model (a cluster's workers read their own copy of the file)."""
    def checked() -> Result:
        if (path, sha256) not in _CHECKED:
            if sha256_file(path) != sha256:
                raise QtoolError("the model file a worker reads differs from the coordinator's (sha256)", path)
            _CHECKED.add((path, sha256))
        return build()

    return worker_cache((sha256, *key), checked)
