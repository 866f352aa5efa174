"""The same bytes on another CPU: one qtool command run natively and under valgrind, sha256 of each output.

    python benchmarks/same_bytes.py -- quantize MODEL --data DIR -o OUT.onnx [qtool options]
    python benchmarks/same_bytes.py -- calibrate MODEL --data DIR -o OUT.json [...]

valgrind (`--tool=none`) runs the program on a virtual CPU without AVX-512 (nor VNNI, AMX): on an
AVX-512 machine, onnxruntime, numpy's BLAS and OpenCV then pick the kernels an AVX2 CPU runs. It
does not change /proc/cpuinfo, which qtool reads to decide whether onnxruntime's int8 products
need its exact mode (qtool.graph.runtime.exact_int8_products); the child under valgrind is told
what an AVX2 CPU's /proc/cpuinfo would say (no avx512_vnni/avx_vnni). Expect a slowdown of 25 to 400
times under valgrind (minutes for a job of a second). Prints both digests and whether
they match; exit 1 where they differ.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

_CHILD = """
import sys
import qtool.graph.runtime as runtime
flags = runtime.cpu_flags
if {hide_vnni}:
    runtime.cpu_flags = lambda *a, **k: (flags(*a, **k) or set()) - {{"avx512_vnni", "avx_vnni"}}
from qtool.cli import entry
sys.argv = ["qtool", *sys.argv[1:]]
entry()
"""


def _run(args: list[str], out: Path, valgrind: bool) -> tuple[str, float]:
    code = _CHILD.format(hide_vnni=valgrind)
    command = [sys.executable, "-c", code, *args[:-1], str(out)]
    if valgrind:
        command = ["valgrind", "--tool=none", "-q", *command]
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    start = time.perf_counter()
    done = subprocess.run(command, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        sys.exit(f"{'valgrind' if valgrind else 'native'} run failed ({done.returncode}): {done.stderr.strip()[-400:]}")
    return hashlib.sha256(out.read_bytes()).hexdigest(), time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("qtool_args", nargs=argparse.REMAINDER, help="a qtool command whose last argument is its output")
    args = [a for a in parser.parse_args().qtool_args if a != "--"]
    if len(args) < 2:
        parser.error("give a qtool command after --, its output file last")
    if shutil.which("valgrind") is None:
        sys.exit("valgrind is not installed")
    out = Path(args[-1])
    results = {}
    for valgrind in (False, True):
        target = out.with_name(f"{out.stem}.{'valgrind' if valgrind else 'native'}{out.suffix}")
        results[valgrind] = _run(args, target, valgrind)
        print(f"{'valgrind (AVX2, no VNNI)' if valgrind else 'native'}: sha256 {results[valgrind][0]} "
              f"({results[valgrind][1]:.1f} s) -> {target}", flush=True)
    same = results[False][0] == results[True][0]
    print("same bytes" if same else "different bytes")
    sys.exit(0 if same else 1)


if __name__ == "__main__":
    main()
