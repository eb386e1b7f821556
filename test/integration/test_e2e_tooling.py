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


FAKE_SGL_KERNEL = {  # the shape of sgl_kernel's package: __init__ binds the names from .top_k
    "__init__.py": "from sgl_kernel.top_k import fast_topk_transform_fused, fast_topk_transform_ragged_fused, "
                   "fast_topk_v2\n",
    "top_k.py": "def fast_topk_v2(*a, **k): return 'stock'\n"
                "def fast_topk_transform_fused(*a, **k): return 'stock'\n"
                "def fast_topk_transform_ragged_fused(*a, **k): return 'stock'\n",
}
CHECK_TOPK = """
import sgl_kernel
from sglang_cp_shared_kv.testing.stable_topk import STAND_INS
print("REPLACED", sum(getattr(sgl_kernel, name) is fn for name, fn in STAND_INS.items()))
"""


def test_stable_topk_switch_replaces_the_kernels_sglang_imports(tmp_path):
    package = tmp_path / "sgl_kernel"
    package.mkdir()
    for name, text in FAKE_SGL_KERNEL.items():
        (package / name).write_text(text)
    path = os.pathsep.join([str(ROOT / "scripts" / "e2e"), str(ROOT / "python"), str(tmp_path)])

    def replaced(extra_env):
        env = {**os.environ, **extra_env, "PYTHONPATH": path}
        out = subprocess.run([sys.executable, "-c", CHECK_TOPK], capture_output=True, text=True, env=env, timeout=180)
        assert out.returncode == 0, out.stderr[-2000:]
        return out.stdout

    assert "REPLACED 0" in replaced({})
    assert "REPLACED 0" in replaced({"CPSKV_E2E": "1"})
    on = replaced({"CPSKV_E2E": "1", "CPSKV_E2E_STABLE_TOPK": "1"})
    assert "REPLACED 3" in on and "[cpskv-e2e] deterministic NSA top-k" in on


def test_e2e_verdict_demands_bit_equality_with_the_stable_topk():
    from sglang_cp_shared_kv.testing.support import load_script

    e2e = load_script("e2e_cp2_logprobs")
    same = {"near_max": 0.0, "far_max": 0.0, "far_mean": 0.0}
    noisy = {"near_max": 0.0, "far_max": 0.03, "far_mean": 0.004}
    slightly = {"near_max": 0.0, "far_max": 1e-6, "far_mean": 1e-7}
    corrupt = {"near_max": 0.2, "far_max": 0.3, "far_mean": 0.1}
    exact = e2e.verdict({"spread": same, "on": same, "corrupt": corrupt}, True, True)
    assert all(exact.values()) and set(exact) == {"repeat_bit_identical", "on_bit_identical", "control_detected"}
    assert not e2e.verdict({"spread": same, "on": slightly, "corrupt": corrupt}, True, True)["on_bit_identical"]
    assert not e2e.verdict({"spread": noisy, "on": same}, False, True)["repeat_bit_identical"]
    # the stock top-k: the far positions only within the flag-off spread
    loose = e2e.verdict({"spread": noisy, "on": slightly, "corrupt": corrupt}, True, False)
    assert all(loose.values()) and "far_within_spread" in loose
    # one GPU, no CP: only the flag-off repeat
    assert e2e.verdict({"spread": same}, True, True) == {"repeat_bit_identical": True}


def test_an_installed_mooncake_engine_that_does_not_import_fails_instead_of_skipping(monkeypatch):
    """The Mooncake tests skip only where no engine is installed: one that is installed but
    broken (a missing libibverbs, say) must fail them, or CI would pass without running them."""
    import importlib
    import importlib.metadata

    import pytest

    from sglang_cp_shared_kv.testing import support

    real_import = importlib.import_module

    def broken(name, *args, **kwargs):
        if name == "mooncake.engine":
            raise ImportError("libibverbs.so.1: cannot open shared object file")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(importlib.metadata, "version", lambda name: "0.3.14")
    monkeypatch.setattr(importlib, "import_module", broken)
    with pytest.raises(pytest.fail.Exception, match="installed but mooncake.engine does not import"):
        support.mooncake_engine_or_skip()

    def not_installed(name):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "version", not_installed)
    with pytest.raises(pytest.skip.Exception, match="needs one of mooncake-transfer-engine-non-cuda"):
        support.mooncake_engine_or_skip()
