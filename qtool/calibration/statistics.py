"""Streaming activation statistics: fixed-size summaries reduced batch by batch.

Nothing here keeps an activation after the batch that produced it, so memory does not grow with
the number of calibration samples, and summaries of disjoint shards merge into the summary of
their union (sharded and multi-process calibration rely on it). A summary holds the exact extremes
of every value seen, the sums of per-batch extremes (for the averaged min-max), and, where the
range method needs a distribution, a histogram (qtool.calibration.histogram) of the bounded strided
sample the observer takes of each batch (qtool.calibration.observer). The histogram is held as its
filled keys and their counts: a tensor's values fill a few thousand of the 65,536 keys, and the
dense int64 arrays (512 KB a tensor, hundreds of tensors) would be most of a calibration's peak
memory; `hist` expands one tensor's when a range method reads it (docs/design/histogram.md).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Optional

import numpy as np

from qtool.calibration import histogram

_FLUSH = 1 << 18  # pending histogram keys are counted once this many are buffered


@dataclass
class TensorStats:
    min: float = math.inf
    max: float = -math.inf
    count: int = 0  # finite values seen
    nonfinite: int = 0  # NaN/Inf values seen and excluded
    batches: int = 0
    batch_min_sum: float = 0.0  # sums of each batch's extremes: the averaged min-max method
    batch_max_sum: float = 0.0
    sample_limit: int = field(default=1 << 14, compare=False)  # values per batch that feed the histogram
    # the histogram's nonzero keys (uint16, ascending) and their counts; both None when no method needs one
    hist_keys: Optional[np.ndarray] = field(default=None, repr=False, compare=False)
    hist_counts: Optional[np.ndarray] = field(default=None, repr=False, compare=False)
    _pending: list = field(default_factory=list, repr=False, compare=False)
    _pending_size: int = field(default=0, repr=False, compare=False)

    @classmethod
    def with_histogram(cls, hist: Optional[np.ndarray] = None, **fields) -> "TensorStats":
        """Statistics that keep a histogram, starting from the dense counts `hist` (or none)."""
        stats = cls(hist_keys=np.zeros(0, np.uint16), hist_counts=np.zeros(0, np.int64), **fields)
        if hist is not None:
            stats._set_dense(np.asarray(hist, dtype=np.int64))
        return stats

    @property
    def hist(self) -> Optional[np.ndarray]:
        """The dense histogram (histogram.NUM_KEYS int64 counts), or None when none is kept."""
        self.flush()
        if self.hist_keys is None:
            return None
        dense = np.zeros(histogram.NUM_KEYS, dtype=np.int64)
        dense[self.hist_keys] = self.hist_counts
        return dense

    def _set_dense(self, dense: np.ndarray) -> None:
        keys = np.flatnonzero(dense)
        self.hist_keys, self.hist_counts = keys.astype(np.uint16), dense[keys]

    def update(self, array: np.ndarray) -> None:
        """Reduce a whole array (inputs, and the fallback path for batches holding NaN/Inf)."""
        # np.min/np.max propagate NaN and Inf: a finite result proves every value was
        # finite, so the common case costs two reductions and no mask.
        if array.size == 0:
            return
        lo, hi = float(np.min(array)), float(np.max(array))
        if not (math.isfinite(lo) and math.isfinite(hi)):
            finite = np.isfinite(array)
            self.nonfinite += int(array.size - np.count_nonzero(finite))
            array = array[finite]
            if array.size == 0:
                self.batches += 1
                return
            lo, hi = float(array.min()), float(array.max())
        self.add_extremes(lo, hi, int(array.size))
        if self.hist_keys is not None:
            flat = array.reshape(-1)
            s = flat.size // self.sample_limit
            step = s - s % 2 + 1  # the observer's in-graph formula: an odd stride
            self.add_sample(flat[::step])

    def add_extremes(self, lo: float, hi: float, size: int) -> None:
        """A batch's exact extremes over `size` finite values (computed inside the graph)."""
        self.min = min(self.min, lo)
        self.max = max(self.max, hi)
        self.count += size
        self.batches += 1
        self.batch_min_sum += lo
        self.batch_max_sum += hi

    def add_sample(self, values: np.ndarray) -> None:
        if self.hist_keys is None or values.size == 0:
            return
        self._pending.append(histogram.keys(values))
        self._pending_size += values.size
        if self._pending_size >= _FLUSH:
            self.flush()

    def flush(self) -> None:
        """Count buffered keys (one bincount for many small batches is much cheaper)."""
        if self._pending:
            dense = histogram.count(np.concatenate(self._pending))
            dense[self.hist_keys] += self.hist_counts
            self._set_dense(dense)
            self._pending.clear()
            self._pending_size = 0

    def merge(self, other: "TensorStats") -> "TensorStats":
        self.flush()
        other.flush()
        if (self.hist_keys is None) != (other.hist_keys is None):
            raise ValueError("cannot merge statistics with and without a histogram")
        fields = dict(min=min(self.min, other.min), max=max(self.max, other.max), count=self.count + other.count,
                      nonfinite=self.nonfinite + other.nonfinite, batches=self.batches + other.batches,
                      batch_min_sum=self.batch_min_sum + other.batch_min_sum,
                      batch_max_sum=self.batch_max_sum + other.batch_max_sum, sample_limit=self.sample_limit)
        if self.hist_keys is None:
            return TensorStats(**fields)
        hist = self.hist
        hist[other.hist_keys] += other.hist_counts
        return TensorStats.with_histogram(hist, **fields)

    def __getstate__(self) -> dict:
        """Pickled (a shard's result coming back from a worker) with its pending keys counted: the
        histogram is already (key, count) pairs, so a result of ~60 tensors is a few MB, not 30."""
        self.flush()
        return dict(self.__dict__)

    @property
    def seen(self) -> bool:
        return self.count > 0

    @property
    def sampled(self) -> int:
        """Values in the histogram."""
        self.flush()
        return 0 if self.hist_keys is None else int(self.hist_counts.sum())


SAMPLE_LIMIT = 1 << 14  # default values per tensor and batch that feed the histogram
