"""Embedding tables stored int8, settled from the graph (quantization option `advanced.embeddings:
auto`, the default): the planner's per-table rule (qtool.plan.planner: tables only row Gathers read,
of EMBEDDING_AUTO_BYTES or more, on a target with Target.int8_embeddings) read on the prepared
graph, and written as `embeddings: int8` with the tables by name in `embedding_tables` (on a target
without int8 embeddings, `float`), so the settled config replays the choice instead of making it."""

from __future__ import annotations

from qtool.choices.decision import Decision
from qtool.config import EMBEDDING_AUTO_BYTES, QuantizeConfig
from qtool.plan.planner import QuantPlan
from qtool.targets import target_of

RULE = "tables read by row Gathers only, of {} bytes or more, int8 per row"


def choose_embeddings(plan: QuantPlan, options: QuantizeConfig) -> list[Decision]:
    """The decisions settling `embeddings: auto` for the prepared graph's `plan` (its embeddings: the
    tables auto takes); none when `embeddings` is not auto."""
    if options.advanced.embeddings != "auto":
        return []
    if not target_of(options).int8_embeddings:
        return [Decision("quantization.advanced.embeddings", "float",
                         f"{target_of(options).runtime}: int8 Gather tables not measured there")]
    return [Decision("quantization.advanced.embeddings", "int8", "the tables in embedding_tables"),
            Decision("quantization.advanced.embedding_tables", tuple(sorted(plan.embeddings)),
                     RULE.format(EMBEDDING_AUTO_BYTES))]
