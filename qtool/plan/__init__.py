"""Middle end, the watershed: above it a prepared graph and options, below it a QuantPlan.

The plan says which weights, biases and activations get quantized, which tensors share
parameters and which outputs have fixed ranges; per-op knowledge lives in the declarative
rule registry of `qtool.plan.ops`. Calibration and the back end both consume the plan.
"""
