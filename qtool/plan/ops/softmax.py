"""Softmax: output in [0, 1), fixed at scale 1/256 (zero point -128 int8, 0 uint8) per
the LiteRT int8 spec, so no calibration range is needed for it."""

from qtool.plan.ops.rule import OpRule


def _softmax_params(dtype: str) -> tuple[float, int]:
    return 1.0 / 256.0, (-128 if dtype == "int8" else 0)


RULES = (OpRule("Softmax", output="fixed", fixed=_softmax_params),)
