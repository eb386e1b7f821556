"""Repository-level checks that CI must enforce."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def copy_checker() -> Path:
    shared = ROOT.parent / "shared" / "tools" / "check_sglang_copy.py"
    return shared if shared.is_file() else ROOT / "tools" / "check_sglang_copy.py"


def test_no_code_copied_from_sglang():
    proc = subprocess.run([sys.executable, str(copy_checker()), str(ROOT)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_pure_modules_import_no_sglang():
    """The layout, geometry, planner and the transfer arithmetic run where SGLang and torch
    are absent (and import fast)."""
    code = ("import sys; import sglang_cp_shared_kv.cp_shared_kv_layout, sglang_cp_shared_kv.pool.planner, "
            "sglang_cp_shared_kv.__main__, sglang_cp_shared_kv.transfer.pages, "
            "sglang_cp_shared_kv.transfer.failure_cause; "
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('sglang', 'torch')))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          env={"PYTHONPATH": str(ROOT / "python"), "PATH": "/usr/bin:/bin"})
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[]"
