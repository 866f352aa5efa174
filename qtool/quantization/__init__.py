"""Back end: fp32 graph + plan + table -> int8 QDQ model.

Rewrite to QuantizeLinear/DequantizeLinear, int8 per-channel weights and int32 biases,
adaptive rounding and bias correction, onnxruntime-specific stem rewrites, float
fallback of single layers, checks of the written model. Never imports calibration or
evaluation.
"""
