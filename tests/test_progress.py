"""Progress bars: drawn where stderr is a terminal (tests/test_atomic_writes.py watches one drawn on
a pseudo-terminal), and nothing of them where it is not: no bar text and no tqdm import, whose
version lookup every job run from a pipeline would otherwise pay."""

from __future__ import annotations

import os
import re
import subprocess
import sys

from tests.conftest import CALIB_SAMPLES, EFFNET, ROOT

from qtool import progress


def _importtime(args: list[str], tmp_path) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.run([sys.executable, "-X", "importtime", *args], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=600)


def test_a_command_whose_stderr_is_a_pipe_draws_no_bar_and_imports_no_tqdm(tmp_path):
    done = _importtime(["-m", "qtool", "calibrate", str(EFFNET), "--data", str(CALIB_SAMPLES), "-o",
                        str(tmp_path / "t.json")], tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]
    assert (tmp_path / "t.json").is_file()
    imported = re.findall(r"^import time:\s+\d+ \|\s+\d+ \| +(\S+)$", done.stderr, re.M)
    assert "onnxruntime" in imported  # the import log is there: the job ran its stages
    assert not [m for m in imported if m == "tqdm" or m.startswith("tqdm.")]
    assert "calibrating" not in done.stderr


def test_an_api_job_asked_for_progress_without_a_terminal_imports_no_tqdm(tmp_path):
    script = (f"import sys, qtool\nqtool.calibrate({str(EFFNET)!r}, {str(CALIB_SAMPLES)!r}, progress=True)\n"
              "print(sorted(m for m in sys.modules if m.split('.')[0] == 'tqdm'))\n")
    done = _importtime(["-c", script], tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip().splitlines()[-1] == "[]"


def test_a_silent_bar_takes_a_bars_calls_and_a_line_still_reaches_stderr(capsys):
    assert not progress.drawn()  # pytest's captured stderr is no terminal
    with progress.bar("calibrating", "sample", 3) as bar:
        bar.update(2)
    progress.write("warning: kept")
    assert capsys.readouterr().err == "warning: kept\n"
