"""Conv and ConvTranspose: int8 weights per output channel, int32 bias.

The output-channel axis differs: Conv weights are (C_out, C_in/group, k...), so axis 0;
ConvTranspose weights are (C_in, C_out/group, k...), so axis 1 (onnxruntime's own
quantizer got this wrong for years).
"""

from qtool.plan.ops.rule import OpRule

RULES = (
    OpRule("Conv", activations=(0,), weight=1, weight_axis=lambda node, rank: 0, bias=2,
           absorbs_activation=True),
    OpRule("ConvTranspose", activations=(0,), weight=1, weight_axis=lambda node, rank: 1, bias=2,
           absorbs_activation=True),
)
