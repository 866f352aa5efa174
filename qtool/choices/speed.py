"""Float for speed, settled from the graph (quantization option `advanced.speed_rule: auto`, the
default on a target that names a rule, Target.speed_rule): the quantized nodes that the rule of the
target's runtime (RULES) says run no faster in int8, on the shapes of the run check's input, the
first calibration sample (batch 1). An int8 model no faster than fp32 is what that runtime's user
quantizes to avoid; a rule is a model of the runtime's kernels, so nothing is timed and the same
graph and shapes give the same nodes on any machine. The nodes go to `advanced.float_nodes` in the
settled config, which replays them.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable, Iterable, Optional

from qtool.choices.decision import Decision
from qtool.config import Config, QuantizeConfig
from qtool.data.dataset import Batch
from qtool.plan.speed import float_for_speed
from qtool.plan.speed_openvino import small_convs_float
from qtool.quantization.quantize import SharedGraphs, ranges_only
from qtool.table.table import CalibrationTable, smoothed_options
from qtool.targets import target_of

OPTION = "quantization.advanced.float_nodes"
# Target.speed_rule -> (the rule: (model, plan, shapes, options) -> (float labels, reasons), what the decision says)
RULES = {
    "onnxruntime_cpu": (float_for_speed, "speed rule: faster in float by onnxruntime CPU's kernel costs on the "
                                         "graph's shapes (batch 1; nothing timed)"),
    "openvino_cpu": (small_convs_float, "speed rule: convolutions OpenVINO CPU runs no faster in int8, by their "
                                        "MACs on the graph's shapes (batch 1; nothing timed)"),
}


def speed_rule(options: QuantizeConfig) -> Optional[str]:
    """The name of the speed rule `options` run (RULES): their target's, unless `speed_rule` is off."""
    return target_of(options).speed_rule if options.advanced.speed_rule != "off" else None


def choose_float_for_speed(model_path: str | Path, table: CalibrationTable, cfg: Config,
                           calib_data: Optional[Callable[[int], Iterable[Batch]]],
                           shared: SharedGraphs) -> Optional[Decision]:
    """The decision on the nodes kept float for speed; None when `speed_rule` is off."""
    options = cfg.quantization
    if options.advanced.speed_rule == "off":
        return None
    name = speed_rule(options)
    if name is None:
        return Decision("quantization.advanced.speed_rule", "off", f"no speed rule for {target_of(options).runtime}")
    rule, text = RULES[name]
    smoothed = smoothed_options(ranges_only(options), table)
    graph = shared.graph(model_path, table, smoothed)
    # the graph's dims on the run check's input: the first calibration sample (the shapes are read
    # at batch 1), else inputs made up from the input specs that the model runs on
    dims = shared.dims(model_path, graph.model, calib_data)
    if dims is None:
        return Decision(OPTION, (), "speed rule: no inputs the model runs on, so no shapes")
    labels, reasons = rule(graph.model, graph.plan, dims, options)
    return Decision(OPTION, tuple(labels), text, details=tuple(reasons))
