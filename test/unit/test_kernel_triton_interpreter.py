"""The Triton kernels of sgl-kernel/ against their torch references on a CPU, run by
Triton's interpreter in a subprocess (``TRITON_INTERPRET=1`` must be set before Triton
builds the kernels, and must not leak into the other tests)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
CASES = ROOT / "sgl-kernel" / "tests" / "test_interpreted.py"


def test_triton_kernels_match_references_under_the_interpreter():
    pytest.importorskip("triton")
    env = dict(os.environ, TRITON_INTERPRET="1",
               PYTHONPATH=os.pathsep.join([str(ROOT / "sgl-kernel" / "python"), str(ROOT / "python"),
                                           os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:warnings", str(CASES)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-3000:]
    assert " passed" in proc.stdout and "skipped" not in proc.stdout, proc.stdout[-2000:]
