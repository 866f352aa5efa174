"""Where the weights form of bias correction helps and where it hurts, sample by sample: the fp32
model with only its weights rounded to int8 (per output channel, as qtool writes them; activations
stay float), without and with the form's bias shift, against fp32 on each calibration sample.

    python benchmarks/bias_correction_samples.py MODEL [--kit ../shared/bench] [--groups 4]

The shift is the one qtool computes ((W - W_q) . m, m the channel means a qtool calibration keeps
for it, each Conv tap weighted by its share of positions off the padding), for every Conv and Gemm
with a bias, in the main graph and in If/Loop bodies alike. Samples are grouped by the energy of
their first input (mean square), quietest first; per group: the first output's squared error
against fp32 summed over its samples, without and with the shift. A sample whose input is near
zero has no weight-rounding error at all, and gets the shift as an error of its own.
"""

from __future__ import annotations

import argparse
import copy
import sys
import tempfile
from pathlib import Path

import numpy as np
import onnx
from onnx import numpy_helper

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from models import _samples  # noqa: E402
import qtool.api as api  # noqa: E402
from qtool.config import PreprocessConfig  # noqa: E402
from qtool.graph.index import attribute, scoped_initializers, scoped_nodes  # noqa: E402
from qtool.graph.runtime import create_session  # noqa: E402
from qtool.quantization.bias_correction import weight_shift  # noqa: E402
from qtool.table import qparams as qp  # noqa: E402


def rounded(model: onnx.ModelProto, means: dict, sizes: dict, shifted: bool) -> onnx.ModelProto:
    """`model` with the weights of each Conv/Gemm with a bias whose input has channel means rounded
    to int8 per output channel, and with `shifted` their biases moved by the weights form."""
    out = copy.deepcopy(model)
    inits = scoped_initializers(out.graph)
    for node in scoped_nodes(out.graph):
        if (node.op_type not in ("Conv", "Gemm") or len(node.input) < 3 or node.input[0] not in means
                or node.input[1] not in inits or node.input[2] not in inits):
            continue
        weight = numpy_helper.to_array(inits[node.input[1]])
        axis = 0 if node.op_type == "Conv" or attribute(node, "transB", 0) else 1
        scales = qp.weight_scales(weight, axis, qp.WEIGHT_QMAX)
        shape = [1] * weight.ndim
        shape[axis] = -1
        dequantized = (qp.quantize_weight(weight, scales, axis, qp.WEIGHT_QMAX).astype(np.float64)
                       * scales.astype(np.float64).reshape(shape))
        inits[node.input[1]].CopyFrom(numpy_helper.from_array(dequantized.astype(np.float32), node.input[1]))
        shift = weight_shift(node, weight, dequantized, np.asarray(means[node.input[0]], np.float64),
                             tuple(sizes.get(node.input[0], ())))
        if shifted and shift is not None:
            bias = numpy_helper.to_array(inits[node.input[2]])
            inits[node.input[2]].CopyFrom(numpy_helper.from_array((bias + shift).astype(np.float32), node.input[2]))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model")
    parser.add_argument("--kit", type=Path, default=ROOT.parent / "shared" / "bench")
    parser.add_argument("--groups", type=int, default=4)
    args = parser.parse_args()
    path = args.kit / "models" / f"{args.model}.onnx"
    calib = args.kit / "inputs" / args.model / "calib"
    table = api.calibrate(str(path), str(calib), config={"quantization": {"bias_correction": "weights"}},
                          progress=False)
    model = onnx.load(str(path))
    feeds = _samples(calib, path, PreprocessConfig())
    first = model.graph.input[0].name
    energy = np.array([float(np.mean(np.square(f[first].astype(np.float64)))) for f in feeds])
    outputs = {}
    with tempfile.TemporaryDirectory() as tmp:
        for label, m in (("fp32", model), ("rounded", rounded(model, table.channel_means, table.spatial_sizes, False)),
                         ("shifted", rounded(model, table.channel_means, table.spatial_sizes, True))):
            file = Path(tmp) / f"{label}.onnx"
            onnx.save(m, file)
            session = create_session(str(file), 1, label)
            name = session.get_outputs()[0].name
            outputs[label] = [np.asarray(session.run([name], f)[0], np.float64) for f in feeds]
    order = np.argsort(energy, kind="stable")
    print(f"| {args.model}: samples by input energy | energy (mean square) | output squared error, weights "
          f"rounded | with the weights form's shift |")
    print("|---|---|---|---|")
    for group in np.array_split(order, args.groups):
        errors = {label: sum(float(np.sum((outputs[label][i] - outputs["fp32"][i]) ** 2)) for i in group)
                  for label in ("rounded", "shifted")}
        print(f"| {len(group)} samples | {energy[group].min():.2e} - {energy[group].max():.2e} "
              f"| {errors['rounded']:.3g} | {errors['shifted']:.3g} |")


if __name__ == "__main__":
    main()
