"""The graphs of onnxruntime's quantization op tests (tests/ort_op_graphs.py) through the plain
command and through quantize_static (QDQ, default options, the same 8 calibration samples): the
worst-output SQNR of each on 16 held-out samples, as a Markdown table.

    python benchmarks/ort_op_graphs.py [--graphs a,b]

A figure is the lowest SQNR (dB) over a model's float outputs; a model with integer outputs only
(ArgMax) gets the fraction of equal values instead. `float` means the model has no quantized node
(its SQNR is infinite); `does not run` that quantize_static raised or its model did not run.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def _figure(value) -> str:
    if value is None:
        return "does not run"
    kind, x = value
    if kind == "agreement":
        return f"{100 * x:.1f}% equal"
    return "float" if math.isinf(x) else f"{x:.1f}"


def _verdict(c) -> str:
    if c.exit_code != 0:
        return f"exit {c.exit_code}"
    if c.ours is None:
        return "ours does not run"
    if c.theirs is None:
        return "only ours runs"
    (kind, ours), (_, theirs) = c.ours, c.theirs
    if math.isinf(theirs) and math.isinf(ours):
        return "same (both float)"
    if c.ours_quantized > c.theirs_quantized:
        return "quantizes more layers"
    if math.isinf(ours):
        return "ours keeps it float"
    margin = 1.0 if kind == "sqnr" else 0.01
    return "better" if ours > theirs + margin else ("worse" if ours < theirs - margin else "within 1 dB" if kind == "sqnr"
                                                   else "within 1 point")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--graphs", help="comma-separated graph names (default: all)")
    args = parser.parse_args()
    from tests import ort_op_graphs

    names = args.graphs.split(",") if args.graphs else [name for name, _ in ort_op_graphs.GRAPHS]
    print(f"load average {os.getloadavg()[0]:.1f}", file=sys.stderr)
    print("| graph | qtool (plain command) | quantize_static (QDQ) | int8 weights: qtool / quantize_static | qtool is |")
    print("|---|---|---|---|---|")
    counts: dict[str, int] = {}
    for name in names:
        with tempfile.TemporaryDirectory() as folder:
            c = ort_op_graphs.compare(name, Path(folder))
        verdict = _verdict(c)
        counts[verdict] = counts.get(verdict, 0) + 1
        print(f"| {name} | {_figure(c.ours)} | {_figure(c.theirs)} | {c.ours_quantized} / {c.theirs_quantized} "
              f"| {verdict} |", flush=True)
    print("\n" + ", ".join(f"{k}: {v}" for k, v in sorted(counts.items())), file=sys.stderr)


if __name__ == "__main__":
    main()
