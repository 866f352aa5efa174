"""bias_correction auto: what the target says, measured where it says so.

On onnxruntime CPU (and the targets without a rule) `auto` is off. The weights form's shift is
the rounding error at the calibration inputs' mean: a sample whose input is far from it (a quiet
audio chunk, whose rounded weights err by almost nothing) gets the shift as an error of its own,
and measured per model on the calibration samples the choice keeps it where held-out samples
lose (their channel means differ from those few dozen); the fast form moves the few positions
that matter on a detector's per-position outputs and costs a pass of each model
(benchmarks/README.md). On OpenVINO (Target.bias_correction "measured") the weights form
is a candidate like the range methods: the model without and with it are scored as OpenVINO
computes them, and it is kept when it is MARGIN_DB closer to fp32, both always measured (an
all-int8 model above KEEP may still gain). It reads the table's channel means, which calibration
keeps for it; without data, with a table without them, or with no layer to correct (no candidate
is built then), `auto` is off.
"""

from __future__ import annotations

from typing import Optional

from qtool.choices.decision import Decision
from qtool.choices.measure import MARGIN_DB, Scoring, figures
from qtool.config import QuantizeConfig, with_options
from qtool.table.table import CalibrationTable
from qtool.targets import measures_bias_correction, target_of

OPTION = "quantization.bias_correction"


def choose_bias_correction(table: CalibrationTable, options: QuantizeConfig, scoring: Optional[Scoring]
                           ) -> tuple[QuantizeConfig, Optional[Decision]]:
    """(options with `auto` settled to off or weights, the decision); unchanged and no decision
    when they name a form already. `scoring`: the job's (None: no data to measure on)."""
    if options.bias_correction != "auto":
        return options, None
    off = with_options(options, bias_correction="off")
    target = target_of(options)
    if not measures_bias_correction(options):
        return off, Decision(OPTION, "off", f"auto: off on target {target.name}")
    if scoring is None:
        return off, Decision(OPTION, "off", "auto: no calibration data to measure the weights form on")
    if table.channel_means is None:
        return off, Decision(OPTION, "off", "auto: the table holds no channel means (a table of another format)")
    if not table.channel_means:
        return off, Decision(OPTION, "off", "auto: no layer with a bias whose input calibration observed")
    weights = with_options(options, bias_correction="weights")
    without, with_weights = scoring.measured([(table, off), (table, weights)])
    kept = with_weights["cosine_db"] >= without["cosine_db"] + MARGIN_DB
    return (weights if kept else off), Decision(
        OPTION, "weights" if kept else "off",
        f"auto on target {target.name}: the weights form must be {MARGIN_DB} dB closer to fp32",
        (("off", figures(without)), ("weights", figures(with_weights))), scoring.count)
