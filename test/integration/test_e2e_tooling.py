"""The e2e tooling (scripts/e2e): inert by default, and it really re-initialises dummy weights
and corrupts only the named rank's view (it runs only where two GPUs are lent)."""

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

CHECK = """
import torch, sglang.srt.model_loader.weight_utils as wu
m = torch.nn.Module(); m.input_layernorm = torch.nn.LayerNorm(8); m.proj = torch.nn.Linear(512, 256)
wu.initialize_dummy_weights(m)
print("NORM", float(m.input_layernorm.weight.mean()), "STD", float(m.proj.weight.std()))
import sglang_cp_shared_kv.forward.materialize as mat
print("WRAPPED", mat.materialize_mla.__name__ == "materialize_mla" and mat.materialize_mla.__module__ != mat.__name__)
"""


def _run(extra_env):
    env = {**os.environ, **extra_env,
           "PYTHONPATH": os.pathsep.join([str(ROOT / "scripts" / "e2e"), str(ROOT / "python")])}
    out = subprocess.run([sys.executable, "-c", CHECK], capture_output=True, text=True, env=env, timeout=180)
    assert out.returncode == 0, out.stderr[-2000:]
    words = " ".join(line for line in out.stdout.splitlines() if line.startswith(("NORM", "WRAPPED"))).split()
    return dict(zip(words[::2], words[1::2]))


def test_e2e_sitecustomize():
    stock = _run({})
    assert abs(float(stock["NORM"])) < 1e-2 and float(stock["STD"]) < 1e-2 and stock["WRAPPED"] == "False"
    e2e = _run({"CPSKV_E2E": "1", "CPSKV_E2E_CORRUPT_RANK": "1"})
    assert float(e2e["NORM"]) == 1.0 and 0.015 < float(e2e["STD"]) < 0.025 and e2e["WRAPPED"] == "True"
