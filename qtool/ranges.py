"""Choosing a quantization range from a tensor's statistics.

A method maps one tensor's streaming summary to the (low, high) interval that the
int8 grid will cover. Values outside are clipped; a narrower range means finer
steps for the values that matter.
"""

from __future__ import annotations

from typing import Callable

from qtool.errors import QtoolError
from qtool.statistics import TensorStats

RangeMethod = Callable[[TensorStats], tuple[float, float]]


def minmax(stats: TensorStats) -> tuple[float, float]:
    """The observed extremes: nothing is clipped, so outliers cost resolution."""
    return stats.min, stats.max


METHODS: dict[str, RangeMethod] = {"minmax": minmax}


def choose_range(stats: TensorStats, method: str) -> tuple[float, float]:
    try:
        chooser = METHODS[method]
    except KeyError:
        raise QtoolError(f"unknown calibration method '{method}'; known: {', '.join(METHODS)}") from None
    if not stats.seen:
        return 0.0, 0.0
    return chooser(stats)
