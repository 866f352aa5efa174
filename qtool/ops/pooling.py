"""Pooling. MaxPool only selects values, so its output keeps the input's scale and
zero point; average pooling computes new values and gets its own range."""

from qtool.ops import OpRule, register

register(
    OpRule("MaxPool", output="tie"),
    OpRule("AveragePool"),
    OpRule("GlobalAveragePool"),
)
