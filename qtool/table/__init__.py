"""The calibration table: quantization parameters, the table document and other toolchains' formats.

qparams is pure maths (range -> scale/zero point); resolve turns ranges into the final
parameters a plan needs (shared and fixed scales); formats reads and writes TensorRT,
Tengine, TPU-MLIR, ncnn, AMCT and onnxruntime tables.
"""
