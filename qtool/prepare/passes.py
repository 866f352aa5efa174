"""Runtime-specific passes on the prepared fp32 graph, run before planning when a target names
them (Target.prepare_passes). Each rewrites in place, computes what the graph computed, and
returns whether it changed the graph (the caller then infers shapes again).
"""

from __future__ import annotations

from typing import Callable

import onnx

from qtool.prepare.embed_layer_norm import write_out_embed_layer_norms
from qtool.prepare.residual_gate import gated_residuals


def embed_layer_norm(model: onnx.ModelProto, options) -> bool:
    """onnxruntime's fused EmbedLayerNormalization written out, so that its tables can go int8 per row
    like any other: only when embeddings may be int8."""
    return options.advanced.embeddings != "float" and write_out_embed_layer_norms(model) > 0


def residual_gate(model: onnx.ModelProto, options) -> bool:
    """x + x * g written x * (1 + g): one reader of x, into which OpenVINO fuses its dequantization."""
    return gated_residuals(model) > 0


PASSES: dict[str, Callable[[onnx.ModelProto, object], bool]] = {"embed_layer_norm": embed_layer_norm,
                                                                 "residual_gate": residual_gate}
