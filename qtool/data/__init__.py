"""Data: calibration and evaluation samples as batches of {input name: array}.

Image folders through the preprocessing config, .npy/.npz folders keyed by input name,
labels for classification. Above it: the ground package; below it: batches.
"""
