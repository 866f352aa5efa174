"""Pooling and reductions. MaxPool only selects values, so its output keeps the input's
scale and zero point; averaging ops (AveragePool, GlobalAveragePool, ReduceMean) compute
new values and get their own range (a mean's range is narrower than its input's)."""

from qtool.plan.ops.rule import OpRule

RULES = (
    OpRule("MaxPool", output="tie"),
    OpRule("AveragePool"),
    OpRule("GlobalAveragePool"),
    OpRule("ReduceMean", activations=(0,)),
)
