"""Streaming activation statistics: fixed-size summaries reduced batch by batch.

Nothing here keeps an activation after the batch that produced it, so memory does
not grow with the number of calibration samples. Summaries of disjoint shards merge
into the summary of their union (min of mins, max of maxes, sums of counts), which
is what sharded and multi-process calibration rely on.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np


@dataclass
class TensorStats:
    min: float = math.inf
    max: float = -math.inf
    count: int = 0  # finite values seen
    nonfinite: int = 0  # NaN/Inf values seen and excluded
    batches: int = 0

    def update(self, array: np.ndarray) -> None:
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
        self.min = min(self.min, lo)
        self.max = max(self.max, hi)
        self.count += int(array.size)
        self.batches += 1

    def merge(self, other: "TensorStats") -> "TensorStats":
        return TensorStats(min(self.min, other.min), max(self.max, other.max), self.count + other.count,
                           self.nonfinite + other.nonfinite, self.batches + other.batches)

    @property
    def seen(self) -> bool:
        return self.count > 0
