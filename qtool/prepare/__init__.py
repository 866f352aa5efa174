"""Front end: an fp32 graph in, the canonical fp32 graph every later stage sees out.

Opset and input checks, shape inference, BatchNormalization folding, cross-layer
equalization. Outputs are numerically the same model (equalization within float error).
"""
