"""NNCF's default post-training quantization of an ONNX model, for benchmarks/openvino.py and
benchmarks/quantize_time.py.

    /path/to/nncf-venv/bin/python benchmarks/openvino_nncf.py MODEL CALIB_FOLDER OUT

Runs in NNCF's own virtual environment (NNCF is no dependency of qtool): `nncf.quantize` on the
ONNX model with its defaults (`model_type=TRANSFORMER` for a graph with LayerNormalization, as
NNCF's docs recommend for transformers), calibrated on the .npy/.npz samples of CALIB_FOLDER (one sample a
file, batch 1). A model below opset 13 is converted to opset 13 first (NNCF's ONNX backend needs
13). Prints one JSON line: the seconds `nncf.quantize` took and NNCF's version.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

# this file's folder comes first on sys.path when run as a script, and benchmarks/openvino.py would
# then be the `openvino` package that NNCF imports
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]

import numpy as np
import onnx


def samples(folder: Path, names: list[str]) -> list[dict]:
    found = []
    for path in sorted(folder.iterdir()):
        if path.suffix == ".npz":
            with np.load(path) as archive:
                found.append({name: archive[name] for name in names if name in archive})
        elif path.suffix == ".npy":
            found.append({names[0]: np.load(path)})
    return found


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("model", type=Path)
    parser.add_argument("calib", type=Path)
    parser.add_argument("out", type=Path)
    args = parser.parse_args()
    import nncf  # only in NNCF's own virtual environment

    model = onnx.load(str(args.model))
    opset = next(o.version for o in model.opset_import if o.domain in ("", "ai.onnx"))
    if opset < 13:
        from onnx import version_converter

        model = version_converter.convert_version(model, 13)
    initializers = {t.name for t in model.graph.initializer}
    names = [i.name for i in model.graph.input if i.name not in initializers]
    data = samples(args.calib, names)
    start = time.perf_counter()
    transformer = any(n.op_type == "LayerNormalization" for n in model.graph.node)
    options = {"model_type": nncf.ModelType.TRANSFORMER} if transformer else {}
    quantized = nncf.quantize(model, nncf.Dataset(data), **options)
    seconds = time.perf_counter() - start
    onnx.save(quantized, str(args.out))
    print(json.dumps({"seconds": seconds, "nncf": nncf.__version__, "opset": max(opset, 13)}))


if __name__ == "__main__":
    main()
