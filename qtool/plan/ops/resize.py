"""Resize: nearest only selects values; linear and cubic interpolate between neighbours.
The LiteRT spec ties RESIZE_NEAREST_NEIGHBOR and RESIZE_BILINEAR output to the input's
scale and zero point; a linear interpolation never leaves the input's range, so the tie
clips nothing. (Cubic can overshoot slightly: the shared range is the union of the input's
and output's observed ranges, so the overshoot seen in calibration is covered.)
roi, scales and sizes are constants or int64: only X (input 0) is an activation."""

from qtool.plan.ops.rule import OpRule

RULES = (OpRule("Resize", activations=(0,), output="tie"),)
