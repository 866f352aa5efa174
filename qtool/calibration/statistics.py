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
Where bias correction's weights form will read it (qtool.quantization.bias_correction), the input
of a layer with a bias also keeps its per-channel mean (each sample weighs the same): summed as
integers of 2^-24, so shards merge to the same bits as one pass.
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
    # per-channel means (axis 1) of each sample, summed in units of 2^-24 (integers: any merge order
    # gives the same sums); None when the tensor's channel means are not kept
    channel_sums: Optional[np.ndarray] = field(default=None, repr=False, compare=False)
    channel_samples: int = 0
    # the sums over those samples of the tensor's spatial sizes (the axes after the channels): which
    # of a Conv's taps fall on padding (qtool.quantization.bias_correction.weight_shift)
    spatial_sums: Optional[np.ndarray] = field(default=None, repr=False, compare=False)
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
        keys, self.hist_counts = histogram.sparse(dense)
        self.hist_keys = keys.astype(np.uint16)

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

    def add_channel_means(self, means: np.ndarray, spatial: tuple[int, ...] = ()) -> None:
        """One batch's per-sample channel means ([samples, channels]) and the tensor's spatial size
        in that batch; a batch with a non-finite mean is left out (its NaN/Inf are excluded from the
        extremes too)."""
        means = np.asarray(means, np.float64)
        if means.ndim < 2 or means.size == 0 or not np.all(np.isfinite(means)):
            return
        means = means.reshape(means.shape[0], -1)
        sizes = np.asarray(spatial, np.int64) * means.shape[0]
        units = np.rint(np.clip(means, -_MEAN_LIMIT, _MEAN_LIMIT) * _MEAN_UNIT).astype(np.int64).sum(axis=0)
        if self.channel_sums is None:
            self.channel_sums, self.spatial_sums = units, sizes
        else:
            self.channel_sums, self.spatial_sums = self.channel_sums + units, self.spatial_sums + sizes
        self.channel_samples += means.shape[0]

    @property
    def channel_mean(self) -> Optional[np.ndarray]:
        """The mean over samples of each channel's mean, or None when none was kept."""
        if self.channel_sums is None or not self.channel_samples:
            return None
        return self.channel_sums / _MEAN_UNIT / self.channel_samples

    @property
    def spatial_mean(self) -> Optional[np.ndarray]:
        """The tensor's mean spatial size over the samples of channel_mean (empty for [N, C])."""
        if self.spatial_sums is None or not self.channel_samples:
            return None
        return self.spatial_sums / self.channel_samples

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
        kept = [t for t in (self, other) if t.channel_sums is not None]  # a shard without samples has none
        if kept:
            fields.update(channel_sums=sum(t.channel_sums for t in kept), spatial_sums=sum(t.spatial_sums for t in kept),
                          channel_samples=sum(t.channel_samples for t in kept))
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


_MEAN_UNIT = float(2**24)  # channel means are summed as integers of 2^-24
_MEAN_LIMIT = float(2**20)  # clipped to +-2^20 first: no int64 sum overflows below 2^19 samples

SAMPLE_LIMIT = 1 << 14  # default values per tensor and batch that feed the histogram
