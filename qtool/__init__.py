"""qtool: post-training int8 quantization of ONNX models.

Data flows one way through the package:

    model + data  ->  statistics  ->  calibration table  ->  quantized model  ->  report
    (dataset,         (observer,       (ranges, qparams,     (plan, ops/,          (evaluate,
     preprocess)       statistics)      table)                rewrite)              metrics, report)
"""

__version__ = "0.1.0"
