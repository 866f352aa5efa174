"""Calibration and evaluation data: image folders, folders of .npy/.npz tensors, and samples in memory.

A folder source is a sorted list of files (sorted so runs are deterministic); each file
is one sample, loaded lazily so memory does not grow with the number of samples (but for the
few a job reads twice, which keeping_samples() holds).
A memory source is whatever the caller iterates: any iterable of {input name: array}
dicts, one sample each (a list, a generator, an NNCF Dataset), or a callable that
returns a fresh such iterable for every pass over the data (what onnxruntime's
CalibrationDataReader or a torch DataLoader give their users).
`batches()` groups consecutive samples of either source into model batches when the
model allows it.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import contextvars
import copy
import os
import threading
import warnings
import zipfile
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable, Iterator, Mapping, Optional, Union

import numpy as np

from qtool.config import CalibrationConfig, PreprocessConfig
from qtool.errors import QtoolError
from qtool.graph.modelio import InputSpec
from qtool.data.preprocess import preprocess_image, read_image

IMAGE_SUFFIXES = (".jpg", ".jpeg", ".png", ".bmp")
TENSOR_SUFFIXES = (".npy", ".npz")

Feeds = Mapping[str, np.ndarray]
# what qtool takes as data: a folder (or one file), an iterable of feed dicts, or a callable returning one
DataLike = Union[str, os.PathLike, Iterable[Feeds], Callable[[], Iterable[Feeds]]]


@dataclass
class Sample:
    key: str  # path relative to the data root, POSIX separators: what labels refer to
    feeds: dict[str, np.ndarray]  # input name -> array with a leading batch dimension of 1


@dataclass
class Batch:
    keys: list[str]
    feeds: dict[str, np.ndarray]

    def __len__(self) -> int:
        return len(self.keys)

    def parts(self, size: int) -> list["Batch"]:
        """This batch cut into batches of at most `size` samples (batches() stacks several samples
        along every feed's first axis); whole where a feed's first axis is not one row a sample."""
        if len(self) <= size or any(np.ndim(a) == 0 or len(a) != len(self) for a in self.feeds.values()):
            return [self]
        return [Batch(self.keys[lo:lo + size], {name: array[lo:lo + size] for name, array in self.feeds.items()})
                for lo in range(0, len(self), size)]


class DataSource:
    """Lazily loaded samples of one folder, either all images or all tensors."""

    def __init__(self, root: Path, files: list[Path], kind: str, specs: list[InputSpec],
                 preprocess: PreprocessConfig):
        self.root = root
        self.files = files
        self.kind = kind
        self.specs = specs
        self.preprocess = preprocess
        self.skipped: list[str] = []
        if kind == "images":
            self._image_input, self._size = _image_input(specs, preprocess, root)

    def __len__(self) -> int:
        return len(self.files)

    def key(self, path: Path) -> str:
        return path.relative_to(self.root).as_posix() if path != self.root else path.name

    def load(self, path: Path) -> Optional[Sample]:
        """One sample; None (and a record in `skipped`) for an image that cannot be decoded. Inside
        keeping_samples(), a kept file's sample is decoded once."""
        kept = _KEPT.get()
        if kept is None or path not in kept.files:
            return self._decode(path)
        key = (self.root, path, self.kind, self.preprocess, tuple(self.specs))
        sample = kept.samples.get(key)
        if sample is None:
            sample = self._decode(path)
            kept.keep(key, sample)
        return sample

    def _decode(self, path: Path) -> Optional[Sample]:
        if self.kind == "images":
            image = read_image(path)
            if image is None:
                self.skipped.append(self.key(path))
                return None
            tensor = preprocess_image(image, self.preprocess, self._size)
            return Sample(self.key(path), {self._image_input.name: tensor})
        return Sample(self.key(path), _load_tensors(path, self.specs))


class _Kept:
    """The samples keeping_samples() keeps: those of `files`, up to `budget` input values in all."""

    def __init__(self, files: Iterable[Path], budget: int):
        self.files, self.budget = set(files), budget
        self.samples: dict[tuple, Sample] = {}
        self._lock = threading.Lock()

    def keep(self, key: tuple, sample: Optional[Sample]) -> None:
        """Keep `sample` (of one of `files`) while the budget has room for it."""
        if sample is None:
            return
        size = sum(int(np.size(array)) for array in sample.feeds.values())
        with self._lock:
            if key not in self.samples and size <= self.budget:
                for array in sample.feeds.values():
                    array.setflags(write=False)  # handed out again: no reader may change it
                self.samples[key] = sample
                self.budget -= size


_KEPT: contextvars.ContextVar[Optional[_Kept]] = contextvars.ContextVar("qtool_kept_samples", default=None)


@contextlib.contextmanager
def keeping_samples(files: Iterable[Path], budget: int) -> Iterator[None]:
    """Within it, the samples of `files` (a folder's) are decoded once, up to `budget` input values:
    a job that reads some samples twice (calibration, then the choices' scored samples) holds those
    few in memory rather than decoding them again. The same arrays either way."""
    token = _KEPT.set(_Kept(files, budget))
    try:
        yield
    finally:
        _KEPT.reset(token)


def open_data(data: DataLike, specs: list[InputSpec], preprocess: PreprocessConfig) -> DataSource | MemorySource:
    """The samples of `data` checked against the model's inputs: a folder or file path
    (searched recursively), or samples in memory (a MemorySource, checked as they are read)."""
    if isinstance(data, (DataSource, MemorySource)):  # a shard sent to a worker (split_shard)
        return data
    if not isinstance(data, (str, os.PathLike)):
        return MemorySource(data, specs)
    root = Path(data)
    if not root.exists():
        raise QtoolError("data path not found", root)
    if root.is_file():
        files, root_dir = [root], root.parent
    else:
        files = sorted((p for p in root.rglob("*") if p.is_file()), key=lambda p: p.relative_to(root).as_posix())
        root_dir = root
    tensors = [p for p in files if p.suffix.lower() in TENSOR_SUFFIXES]
    images = [p for p in files if p.suffix.lower() in IMAGE_SUFFIXES]
    if tensors:
        source = DataSource(root_dir, tensors, "tensors", specs, preprocess)
    elif images:
        source = DataSource(root_dir, images, "images", specs, preprocess)
    else:
        raise QtoolError(f"no samples found: expected images ({', '.join(IMAGE_SUFFIXES)}) "
                         f"or tensors ({', '.join(TENSOR_SUFFIXES)})", root)
    return source


class MemorySource:
    """Samples the caller holds: feed dicts ({input name: array}, one sample each, with or
    without the leading batch dimension of 1), already preprocessed; keys are their positions.

    An iterable is iterated once per pass over the data; a callable is called once per pass.
    Arrays are checked as they are read, with the same rules as tensor files.
    """

    root = None  # no folder: labels (which name files) and --shard K/N (a separate command) need one
    start = 0  # the position of the first sample in the caller's data (a shard's slice starts later)

    def __init__(self, data: Iterable[Feeds] | Callable[[], Iterable[Feeds]], specs: list[InputSpec]):
        if isinstance(data, Mapping):
            raise QtoolError("data is one dict; pass a list of dicts (one per sample), or a callable returning one")
        if not callable(data) and not isinstance(data, Iterable):
            raise QtoolError(f"data must be a folder path, an iterable of {{input name: array}} dicts or a "
                             f"callable returning one, not {type(data).__name__}")
        self.data = data
        self.specs = specs
        self._batched = model_batch_size(specs, 2) > 1  # dicts must then hold one sample, not a batch

    def size(self) -> Optional[int]:
        """Number of samples when the data knows it without being read (a list does, a generator not)."""
        try:
            return len(self.data)  # type: ignore[arg-type]
        except TypeError:
            return None

    def samples(self, limit: Optional[int] = None) -> Iterator[Sample]:
        items = self.data() if callable(self.data) else self.data
        if isinstance(items, Mapping) or not isinstance(items, Iterable):
            raise QtoolError(f"the data callable returned {type(items).__name__}, not an iterable of "
                             "{input name: array} dicts")
        produced = 0
        for index, item in enumerate(items, self.start):
            if limit is not None and produced >= limit:
                break
            yield Sample(str(index), self._feeds(item, index))
            produced += 1
        if produced == 0:
            raise QtoolError("no samples in the in-memory data (a generator can be read only once: pass a list, "
                             "or a callable that returns a new iterable on each call)")

    def shippable(self) -> bool:
        """Whether the data can be cut into index ranges for workers: a sequence (a list of dicts),
        not a generator or a callable, which can only be read through in one process."""
        return (not callable(self.data) and hasattr(type(self.data), "__getitem__")
                and hasattr(type(self.data), "__len__"))

    def _feeds(self, item: object, index: int) -> dict[str, np.ndarray]:
        where = f"in-memory sample {index}"
        if not isinstance(item, Mapping):
            raise QtoolError(f"expected a dict of input name -> numpy array, got {type(item).__name__}", where)
        names = [s.name for s in self.specs]
        unknown = [str(k) for k in item if k not in names]
        if unknown:
            raise QtoolError(f"'{unknown[0]}' is not an input of the model (inputs: {', '.join(names)})", where)
        feeds = {}
        for spec in self.specs:
            if spec.name not in item:
                raise QtoolError(f"no array for model input '{spec.name}' (dict has: {', '.join(map(str, item))})",
                                 where)
            array = np.asarray(item[spec.name])
            if self._batched and array.ndim == len(spec.shape) and array.shape[0] != 1:
                raise QtoolError(f"array '{spec.name}' has shape {list(array.shape)}: one sample per dict "
                                 "(leading dimension 1 or none); qtool batches the samples itself", where)
            feeds[spec.name] = _fit_to_spec(array, spec, where)
        return feeds


def folder_only(data: object, what: str) -> None:
    """Refuse `what` (--shard K/N: one command of several) for data that is not a folder: it splits files."""
    if not isinstance(data, (str, os.PathLike, DataSource)):
        raise QtoolError(f"{what} needs the data as a folder (it splits the files); in-memory data is read "
                         "in one process")


def check_shippable(source: DataSource | MemorySource, what: str) -> None:
    """Refuse `what` (workers: --workers, --dask, executor=) for in-memory data that cannot be cut into
    index ranges."""
    if isinstance(source, MemorySource) and not source.shippable():
        raise QtoolError(f"{what} needs the data as a folder or a sequence (e.g. a list of {{input name: array}} "
                         "dicts), which it cuts into index ranges; a generator or a callable is read in one process")


def _image_input(specs: list[InputSpec], cfg: PreprocessConfig, root: Path) -> tuple[InputSpec, tuple[int, int]]:
    """The one 4-D float input an image feeds, and the image size it expects."""
    if len(specs) != 1:
        names = ", ".join(s.name for s in specs)
        raise QtoolError(f"the model has {len(specs)} inputs ({names}); an image folder can only feed a "
                         "single-input model: give a folder of .npz files keyed by input name", root)
    spec = specs[0]
    if len(spec.shape) != 4 or spec.dtype.kind != "f":
        raise QtoolError(f"model input '{spec.name}' has shape {list(spec.shape)} and type {spec.dtype}; "
                         "images need a 4-D float input: give .npy/.npz tensors instead", root)
    if cfg.size is not None:
        return spec, tuple(cfg.size)
    h, w = (spec.shape[2], spec.shape[3]) if cfg.layout == "NCHW" else (spec.shape[1], spec.shape[2])
    if h is None or w is None:
        raise QtoolError(f"model input '{spec.name}' has a dynamic image size; set preprocess.size in the config",
                         root)
    return spec, (h, w)


# np.load parses each .npy header with ast.literal_eval, and CPython 3.11's AST constructor
# is not safe from two threads at once: loader threads parsing together fail at random with
# "SystemError: AST constructor recursion depth mismatch" (seen on 3.11.7, cpython
# gh-106905; found by the fuzz test). Tensor files are therefore read one at a time.
_NPY_LOCK = threading.Lock()


def _read_arrays(path: Path) -> "np.ndarray | dict[str, np.ndarray]":
    """One .npy array or the arrays of an .npz, whatever the file's suffix claims."""
    try:
        with _NPY_LOCK:
            loaded = np.load(path, allow_pickle=False)
            if isinstance(loaded, np.lib.npyio.NpzFile):
                with loaded:
                    return {k: loaded[k] for k in loaded.files}
            return loaded
    except OSError as exc:
        raise QtoolError(f"cannot read tensor file: {exc.strerror or str(exc).splitlines()[0] or type(exc).__name__}",
                         path) from None
    except (ValueError, EOFError, zipfile.BadZipFile, zlib.error) as exc:
        raise QtoolError(f"cannot read tensor file: {_not_numeric(exc)}", path) from None


def _not_numeric(exc: BaseException) -> str:
    """What is wrong with a file np.load refused, without numpy's advice to unpickle it: qtool
    reads numeric arrays only, and unpickling an untrusted file runs its code."""
    detail = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
    if "object arrays" in detail.lower():
        detail = "it holds Python objects"
    elif "pickle" in detail.lower():  # numpy's guess for any file without the .npy or zip signature
        detail = ""
    return "not a valid .npy/.npz file of numeric arrays" + (f" ({detail})" if detail else "")


def _load_tensors(path: Path, specs: list[InputSpec]) -> dict[str, np.ndarray]:
    arrays = _read_arrays(path)
    if isinstance(arrays, np.ndarray):
        if len(specs) != 1:
            raise QtoolError(f"a .npy file feeds a single-input model, but the model has {len(specs)} inputs "
                             f"({', '.join(s.name for s in specs)}): use .npz keyed by input name", path)
        arrays = {specs[0].name: arrays}
    feeds = {}
    for spec in specs:
        if spec.name not in arrays:
            raise QtoolError(f"no array for model input '{spec.name}' (file has: {', '.join(arrays) or 'nothing'})",
                             path)
        feeds[spec.name] = _fit_to_spec(arrays[spec.name], spec, path)
    return feeds


def _fit_to_spec(array: np.ndarray, spec: InputSpec, path: Path | str) -> np.ndarray:
    """Add a missing batch dimension and check dtype and static dimensions.

    Integer and bool arrays (token ids, masks, lengths) must have the model's dtype: converting
    them could wrap or truncate values silently. Float arrays are cast (float64 -> float32)."""
    if array.ndim == len(spec.shape) - 1:
        array = array[None]
    if array.ndim != len(spec.shape):
        raise QtoolError(f"array '{spec.name}' has shape {list(array.shape)}, the model expects rank "
                         f"{len(spec.shape)} {_shape_text(spec.shape)}", path)
    for got, want in zip(array.shape, spec.shape):
        if want is not None and got != want:
            raise QtoolError(f"array '{spec.name}' has shape {list(array.shape)}, the model expects "
                             f"{_shape_text(spec.shape)}", path)
    if array.dtype != spec.dtype:
        if array.dtype.kind == spec.dtype.kind == "f":
            array = array.astype(spec.dtype)
        else:
            raise QtoolError(f"array '{spec.name}' has dtype {array.dtype}, the model expects {spec.dtype} "
                             "(only float arrays are converted, to the model's float type)", path)
    return array


def _shape_text(shape: tuple) -> str:
    return "[" + ", ".join("?" if d is None else str(d) for d in shape) + "]"


def model_batch_size(specs: list[InputSpec], requested: int) -> int:
    """Samples per batch: `requested` only if every input has a dynamic leading (batch) dimension.

    A model fixed at batch 1, or one with an input whose batch is not the first axis
    (recurrent state, scalars), is fed one sample at a time.
    """
    if all(len(s.shape) > 0 and s.shape[0] is None for s in specs):
        return requested
    return 1


def iter_samples(source: DataSource | MemorySource, limit: Optional[int] = None) -> Iterator[Sample]:
    """Decode samples in a small thread pool (OpenCV releases the GIL) while the caller works."""
    if isinstance(source, MemorySource):
        yield from source.samples(limit)
        return
    files = source.files
    wanted = len(files) if limit is None else min(limit, len(files))
    with concurrent.futures.ThreadPoolExecutor(max_workers=2) as pool:
        pending: list = []
        position = 0
        produced = 0
        try:
            while produced < wanted:
                while position < len(files) and len(pending) < min(16, wanted - produced):
                    # in the caller's context: its keeping_samples()
                    pending.append(pool.submit(contextvars.copy_context().run, source.load, files[position]))
                    position += 1
                if not pending:
                    break
                sample = pending.pop(0).result()
                if sample is not None:
                    produced += 1
                    yield sample
        finally:  # interrupted or stopped early: do not decode the rest of the queue first
            for future in pending:
                future.cancel()
    if source.skipped:
        warnings.warn(f"{source.root}: skipped {len(source.skipped)} unreadable image file(s), "
                      f"e.g. {min(source.skipped)}", stacklevel=2)
    if produced == 0:
        raise QtoolError("no readable samples (every file failed to decode)", source.root)


def batches(source: DataSource | MemorySource, batch_size: int, limit: Optional[int] = None) -> Iterator[Batch]:
    """Group consecutive samples of equal shapes into batches of at most `batch_size`."""
    size = model_batch_size(source.specs, batch_size)
    group: list[Sample] = []

    def flush() -> Batch:
        feeds = {name: np.concatenate([s.feeds[name] for s in group]) if len(group) > 1 else group[0].feeds[name]
                 for name in group[0].feeds}
        return Batch([s.key for s in group], feeds)

    for sample in iter_samples(source, limit):
        if group and _shapes(group[0]) != _shapes(sample):
            yield flush()
            group = []
        group.append(sample)
        if len(group) == size:  # full: given before the next sample is read
            yield flush()
            group = []
    if group:
        yield flush()


def _shapes(sample: Sample) -> tuple:
    return tuple((k, v.shape) for k, v in sample.feeds.items())


def count_samples(source: DataSource | MemorySource, limit: Optional[int]) -> Optional[int]:
    """Samples a pass will read; None when in-memory data does not know its length."""
    size = source.size() if isinstance(source, MemorySource) else len(source)
    return size if limit is None or size is None else min(limit, size)


def batch_span(total_batches: int, k: int, n: int) -> tuple[int, int]:
    return total_batches * k // n, total_batches * (k + 1) // n


def select_shard(source: DataSource, calib: CalibrationConfig, k: int, n: int) -> Optional[int]:
    """Restrict `source` to shard k/n; returns the sample limit."""
    if (k, n) == (0, 1):
        return calib.num_samples
    source.files = source.files[slice(*_span(source, calib.batch_size, calib.num_samples, k, n, (0, 1)))]
    return None


def split_shard(source: DataSource | MemorySource, batch_size: int, limit: Optional[int], k: int, n: int,
                parts: int) -> list[DataSource | MemorySource]:
    """Shard k/n of the first `limit` samples of `source` as up to `parts` sources of whole
    consecutive batches (at most one per batch): what a worker is sent. For a folder, the sample
    files (it loads them itself); for a sequence in memory (check_shippable), its slice."""
    count = _count(source, limit)
    a, b = batch_span(-(-count // model_batch_size(source.specs, batch_size)), k, n)
    parts = max(1, min(parts, b - a))
    return [_restricted(source, *_span(source, batch_size, limit, k, n, (j, parts))) for j in range(parts)]


def first_samples(source: DataSource | MemorySource, keys: list[str]) -> DataSource | MemorySource:
    """`source` restricted to the samples of `keys`, its first readable samples (the first batch, the
    per-layer subset), for a worker to read again."""
    if isinstance(source, MemorySource):
        return _restricted(source, 0, len(keys))
    wanted, found = set(keys), []
    for path in source.files:
        if len(found) == len(wanted):
            break
        if source.key(path) in wanted:
            found.append(path)
    return with_files(source, found)


def with_files(source: DataSource, files: list[Path]) -> DataSource:
    """`source` restricted to `files` (sample references for a worker)."""
    subset = copy.copy(source)
    subset.files, subset.skipped = files, []
    return subset


def _restricted(source: DataSource | MemorySource, lo: int, hi: int) -> DataSource | MemorySource:
    """Samples lo..hi-1 of `source`: its files, or a copy of that slice of the caller's sequence."""
    if isinstance(source, DataSource):
        return with_files(source, source.files[lo:hi])
    subset = copy.copy(source)
    subset.data = [source.data[i] for i in range(lo, hi)]
    subset.start = source.start + lo
    return subset


def spread_samples(source: DataSource | MemorySource, limit: Optional[int], count: int) -> DataSource | MemorySource:
    """`count` samples spread evenly over the first `limit` of `source` (positions i * total // count),
    so that a folder sorted by where its samples came from is measured on all of it; `source` as it
    is when it has no more, or when its length is unknown until read (a generator: its first ones)."""
    if isinstance(source, MemorySource) and not source.shippable():
        return source
    total = _count(source, limit)
    if total <= count:
        return source
    picks = [i * total // count for i in range(count)]
    if isinstance(source, DataSource):
        return with_files(source, [source.files[i] for i in picks])
    subset = copy.copy(source)
    subset.data = [source.data[i] for i in picks]
    return subset


def _count(source: DataSource | MemorySource, limit: Optional[int]) -> int:
    count = len(source.files) if isinstance(source, DataSource) else len(source.data)
    return min(limit, count) if limit else count


def _span(source: DataSource | MemorySource, batch_size: int, limit: Optional[int], k: int, n: int,
          sub: tuple[int, int]) -> tuple[int, int]:
    """The sample positions [lo, hi) of part sub = (j, m) of shard k/n: whole batches."""
    count = _count(source, limit)
    size = model_batch_size(source.specs, batch_size)
    total = -(-count // size)
    a, b = batch_span(total, k, n)
    j, m = sub
    a, b = a + (b - a) * j // m, a + (b - a) * (j + 1) // m
    if a == b:
        raise QtoolError(f"shard {k}/{n} is empty: {count} samples make only {total} batches", source.root)
    return a * size, min(b * size, count)
