"""The graphs of onnxruntime's quantization op tests (rebuilt in tests/ort_op_graphs.py) through the
plain command: it exits 0, its model runs, has int8 weights where quantize_static has, and is within
1 dB of quantize_static's worst-output SQNR (1 point of agreement for integer outputs) wherever
quantize_static's model runs and we quantize no more layers with weights than it does. benchmarks/ort_op_graphs.py writes the figures as a table."""

from __future__ import annotations

import pytest

from tests import ort_op_graphs

SQNR_MARGIN_DB = 1.0
AGREEMENT_MARGIN = 0.01


@pytest.mark.parametrize("name", [name for name, _ in ort_op_graphs.GRAPHS])
def test_an_onnxruntime_op_test_graph_quantizes_as_well_as_quantize_static(tmp_path, name):
    c = ort_op_graphs.compare(name, tmp_path)
    assert c.exit_code == 0, c.output
    assert c.ours is not None, f"our model does not run: {c.ours_error}"
    if c.theirs is None:
        return  # quantize_static fails: nothing to compare with
    # where quantize_static stores int8 weights, so can we (a speed rule, where there is one, switched off)
    assert c.ours_quantized > 0 or c.theirs_quantized == 0, c.output
    if c.ours_quantized > c.theirs_quantized:
        return  # we quantize layers it keeps float (an LSTM, an Attention's projections): not like for like
    (kind, ours), (_, theirs) = c.ours, c.theirs
    margin = SQNR_MARGIN_DB if kind == "sqnr" else AGREEMENT_MARGIN
    assert ours >= theirs - margin, f"{kind}: ours {ours:.4g}, quantize_static {theirs:.4g}"
