"""qtool: post-training int8 quantization of ONNX models.

Data flows one way through the package:

    model + data  ->  statistics  ->  calibration table  ->  quantized model  ->  report
    (dataset,         (observer,       (ranges, qparams,     (plan, ops/,          (evaluate,
     preprocess)       statistics)      table)                rewrite)              metrics, report)

The public face (qtool.calibrate, qtool.quantize, qtool.evaluate: docs/api.md) is imported on
first use (PEP 562), so `import qtool` and `qtool --help` do not load onnx, onnxruntime or numpy.
"""

from __future__ import annotations

import importlib

__version__ = "0.1.0"

_PUBLIC = {
    "calibrate": "qtool.api",
    "quantize": "qtool.api",
    "search": "qtool.api",
    "evaluate": "qtool.api",
    "QuantizeResult": "qtool.api",
    "MixedPrecisionSearch": "qtool.api",
    "SearchOutcome": "qtool.api",
    "load_config": "qtool.config",
    "Config": "qtool.config",
    "PreprocessConfig": "qtool.config",
    "CalibrationConfig": "qtool.config",
    "QuantizeConfig": "qtool.config",
    "AdvancedConfig": "qtool.config",
    "EvaluateConfig": "qtool.config",
    "CalibrationTable": "qtool.table.table",
    "EvaluationReport": "qtool.evaluation.report",
    "QtoolError": "qtool.errors",
    "ThresholdError": "qtool.errors",
    "OutputError": "qtool.errors",
    "NotEnoughMemory": "qtool.errors",
}

__all__ = ["__version__", *_PUBLIC]


def __getattr__(name: str):
    module = _PUBLIC.get(name)
    if module is None:
        raise AttributeError(f"module 'qtool' has no attribute '{name}'")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_PUBLIC))
