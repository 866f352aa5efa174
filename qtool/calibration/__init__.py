"""Calibration: model + data -> fixed-size, mergeable statistics -> ranges -> calibration table.

One streaming pass of in-graph reductions (observer), histograms keyed by bfloat16,
range methods (min-max, percentile, entropy, mse, aciq), shards and their merge.
Never imported by the back end or the integer package.
"""
