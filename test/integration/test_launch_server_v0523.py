"""``python -m sglang.launch_server ... --enable-prefill-cp-shared-kv`` on sglang 0.5.23 on this
CPU machine, as far as SGLang lets a CPU machine go: the installed plugin makes the flag
known to 0.5.23's own parser, and startup then stops exactly where it stops with the flag
off -- in 0.5.23's ``handle_model_specific_adjustments`` resolution step, which reads the
GPU's compute capability for DeepSeek-V3.2's DSA defaults, before any of the plugin's
resolution steps (``handle_context_parallelism`` and after) and its ``check_server_args``.
Without the plugin (``SGLANG_PLUGINS`` naming another) the flag is an unknown argument.
The plugin's own checks on 0.5.23, with the GPU's answer stood in for:
test_settings_v0523.py. Runs only where sglang 0.5.23 is installed."""

import os
import subprocess
import sys

import pytest

from sglang_cp_shared_kv.releases import installed, v0523

if installed.INSTALLED is not v0523.RELEASE:
    pytest.skip(f"needs sglang {v0523.RELEASE.version}", allow_module_level=True)

STOPS_AT = "in handle_model_specific_adjustments"
NO_GPU = "Found no NVIDIA driver on your system"


def _launch(model_dir, *flag, plugins=None):
    env = dict(os.environ, SGLANG_DISAGGREGATION_ALL_CP_RANKS_TRANSFER="1", CUDA_VISIBLE_DEVICES="")
    env.pop("SGLANG_PLUGINS", None)
    if plugins is not None:
        env["SGLANG_PLUGINS"] = plugins
    argv = [sys.executable, "-m", "sglang.launch_server", "--model-path", model_dir, "--load-format", "dummy",
            "--skip-tokenizer-init", "--device", "cuda", "--tp", "2", "--enable-prefill-cp", "--cp-strategy",
            "interleave", "--disaggregation-mode", "prefill", "--disaggregation-transfer-backend", "mooncake", *flag]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode != 0
    return proc.stderr


def test_the_flag_starts_as_far_as_stock_does_on_a_cpu_machine(tiny_nsa_model):
    """(0.5.23's spelling of the flag; both spellings reach the record: test_settings_v0523.py)"""
    with_flag, stock = _launch(tiny_nsa_model, "--enable-prefill-cp-shared-kv"), _launch(tiny_nsa_model)
    for stderr in (with_flag, stock):
        assert STOPS_AT in stderr and NO_GPU in stderr, stderr[-3000:]
    assert "unrecognized arguments" not in with_flag and "cp_shared_kv" not in with_flag.split(STOPS_AT)[-1]


def test_without_the_plugin_the_flag_is_unknown(tiny_nsa_model):
    stderr = _launch(tiny_nsa_model, "--enable-prefill-cp-shared-kv", plugins="no_such_plugin")
    assert "unrecognized arguments: --enable-prefill-cp-shared-kv" in stderr, stderr[-3000:]
