"""bias_correction auto, from the graph: off for a model with per-position outputs.

The correction moves each channel's bias by that channel's mean shift over every position of every
sample. In a model whose outputs are one vector per sample (a classifier: [N, C]) the positions
are averaged away before the output, so that mean is what reaches it. Where each output position
counts on its own (a detector's anchors, a segmenter's pixels, a recogniser's time steps) the mean
is dominated by the background positions, and applying it everywhere moves the few positions
that matter: on the kit the YOLOv8 detector keeps half its boxes and the DB text detector loses
text-pixel IoU (benchmarks/README.md). Elsewhere `auto` runs the step whenever there is data
(qtool.choices.built records what ran).
"""

from __future__ import annotations

from typing import Optional

import onnx

from qtool.choices.decision import Decision
from qtool.config import QuantizeConfig
from qtool.graph.shapes import inferred_shapes


def choose_bias_correction(model: onnx.ModelProto, options: QuantizeConfig) -> Optional[Decision]:
    """Decision('quantization.bias_correction', 'off') for `auto` on a model with an output of rank
    other than 2 (or of unknown rank); None (left to the build) otherwise."""
    if options.bias_correction != "auto":
        return None
    names = [o.name for o in model.graph.output]
    shapes = inferred_shapes(model, names)
    dense = [name for name in names if len(shapes.get(name) or []) != 2]
    if not dense:
        return None
    return Decision("quantization.bias_correction", "off",
                    f"auto: off for a model with per-position outputs ({', '.join(dense[:3])}"
                    f"{' ...' if len(dense) > 3 else ''}): a channel's mean shift over all positions is not "
                    "the shift at the positions that matter")
