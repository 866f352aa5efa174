"""Each output on its own scale: the tail of a head that int8 moves far from fp32 stays float.

A many-headed model (landmarks beside a presence flag and world coordinates, boxes beside
masks) is one trunk feeding small heads whose outputs live on very different scales; one
coarse head can be far from fp32 while the worst-output figure of the others looks fine. The
all-int8 candidate is measured per output, by its SQNR over the samples (a one-value flag has no
per-sample cosine). An output below LAGGING_DB (a cosine of about 0.99) lags; the nodes that feed
only lagging outputs (the heads' own tails, never a node another output reads) are kept float
when that gains MARGIN_DB on the lagging outputs, unless the tails hold more than MAX_SHARE of
the quantized nodes (then the trunk, not the head, is what moves them: the decision says so).
"""

from __future__ import annotations

from typing import Optional

import onnx

from qtool.choices.decision import Decision
from qtool.choices.measure import MARGIN_DB, Scoring
from qtool.config import Config, QuantizeConfig, with_options
from qtool.graph.index import GraphIndex, node_label
from qtool.table.table import CalibrationTable

OPTION = "quantization.advanced.float_nodes"
LAGGING_DB = 17.0  # an output's SQNR below it lags: 1 - cosine of about 0.5 * 10^(-17/10) = 0.01
MAX_SHARE = 0.25  # the tails kept float hold at most this share of the quantized nodes


def head_tails(model: onnx.ModelProto, lagging: set[str]) -> list[onnx.NodeProto]:
    """The nodes every output of which feeds only `lagging` graph outputs (through nodes of the
    same kind), in graph order: the tails that no other output shares."""
    index = GraphIndex(model)
    tail: set[str] = set()  # node labels
    for node in reversed(model.graph.node):  # readers come later in a sorted graph
        used = [name for name in node.output if name and (name in index.outputs or index.consumers.get(name))]
        if used and all((name not in index.outputs or name in lagging)
                        and all(node_label(r) in tail for r in index.consumers.get(name, ())) for name in used):
            tail.add(node_label(node))
    return [node for node in model.graph.node if node_label(node) in tail]


def _by_output(figures: dict) -> dict[str, float]:
    return {name: round(float(f["sqnr_db"]), 2) for name, f in figures.get("outputs", {}).items()}


def choose_head_tails(model: onnx.ModelProto, table: CalibrationTable, cfg: Config, scoring: Optional[Scoring]
                      ) -> tuple[QuantizeConfig, Optional[Decision]]:
    """(cfg.quantization with the lagging heads' tails in `advanced.float_nodes`, the decision);
    `model`: the fp32 model; no decision for a model with one output, or without data to measure
    on (`scoring` None).
    Each lagging output's own tail changes that output alone, so one candidate with every such
    tail float measures each tail's gain exactly; the tails that gain MARGIN_DB stay float."""
    options = cfg.quantization
    if scoring is None or options.advanced.head_tails == "off" or len(model.graph.output) < 2:
        return options, None
    graph = scoring.build(table, options)
    if graph.source is None:
        return options, None
    per_output = _by_output(scoring(graph.model))
    lagging = sorted(name for name, db in per_output.items() if db < LAGGING_DB)
    if not lagging:
        return options, None
    quantized = set(graph.plan.quantized_nodes)
    own = {name: [node_label(n) for n in head_tails(graph.source, {name}) if node_label(n) in quantized]
           for name in lagging}
    measured = [("int8", {"sqnr_db": per_output})]
    rule = f"output(s) {', '.join(lagging)} below {LAGGING_DB} dB"
    tails = [label for name in lagging for label in own[name]]
    if not tails:
        return options, Decision(OPTION, (), f"{rule} share every quantized node with the other outputs",
                                 tuple(measured), scoring.count)
    if len(tails) > MAX_SHARE * len(quantized):
        return options, Decision(OPTION, (), f"{rule}: their own tails hold {len(tails)} of {len(quantized)} "
                                 f"quantized nodes, more than {MAX_SHARE:.0%}", tuple(measured), scoring.count)
    candidate = with_options(options, float_nodes=tuple(dict.fromkeys([*options.advanced.float_nodes, *tails])))
    kept = _by_output(scoring(scoring.build(table, candidate).model))
    measured.append(("own tails float", {"sqnr_db": kept}))
    gained = [name for name in lagging if own[name] and kept[name] >= per_output[name] + MARGIN_DB]
    chosen = tuple(label for name in gained for label in own[name])
    final = {name: kept[name] if name in gained else per_output[name] for name in lagging}
    rest = [f"{name} ({final[name]:.1f} dB)" for name in lagging if final[name] < LAGGING_DB]
    why = (f"{rule}; the own tails of {', '.join(gained) or 'none'} float gain at least {MARGIN_DB} dB"
           + (f"; still below: {', '.join(rest)}, moved by the nodes they share with other outputs" if rest else ""))
    floats = with_options(options, float_nodes=tuple(dict.fromkeys([*options.advanced.float_nodes, *chosen])))
    return (floats if chosen else options), Decision(OPTION, chosen, why, tuple(measured), scoring.count)
