"""Evaluation: fp32 vs int8 on data -> figures, verdicts, reports; the searches built on them.

Task metrics (classification, detection, generic fidelity), per-layer error, sensitivity,
MAC counts, thresholds for CI, JSON/JUnit/HTML reports, and the mixed-precision search.
"""
