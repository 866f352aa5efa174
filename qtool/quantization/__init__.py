"""Back end: fp32 graph + plan + table -> int8 QDQ model.

Rewrite to QuantizeLinear/DequantizeLinear, int8 per-channel weights and int32 biases,
adaptive rounding and bias correction, the passes a target names (onnxruntime's own
rewrites: ort_cpu/), float fallback of single layers, checks of the written model. Never
imports calibration or evaluation.
"""
