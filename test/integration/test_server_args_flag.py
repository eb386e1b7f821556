"""The flag on the real SGLang argument parser and ServerArgs: every entry path, and inertness."""

import json
import os
import pickle
import subprocess
import sys

import pytest

from sglang_cp_shared_kv.settings.config import FLAG, FLAG_DEST, is_enabled
from sglang_cp_shared_kv_testing.support import shared_kv_kwargs

pytestmark = pytest.mark.usefixtures("plugin_loaded", "pretend_hopper", "all_cp_ranks_env")


def _argv(model, *extra):
    return ["--model-path", model, "--skip-tokenizer-init", "--device", "cuda", "--tp-size", "2",
            "--enable-nsa-prefill-context-parallel", "--nsa-prefill-cp-mode", "in-seq-split",
            "--disaggregation-mode", "prefill", *extra]


def test_launch_server_help_lists_the_flag():
    proc = subprocess.run([sys.executable, "-m", "sglang.launch_server", "--help"],
                          capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert FLAG in proc.stdout


def test_cli_flag_reaches_server_args(tiny_nsa_model):
    from sglang.srt.server_args import prepare_server_args

    on = prepare_server_args(_argv(tiny_nsa_model, FLAG))
    off = prepare_server_args(_argv(tiny_nsa_model))
    assert getattr(on, FLAG_DEST) is True and is_enabled(on)
    assert getattr(off, FLAG_DEST) is False and not is_enabled(off)
    on.check_server_args()  # a valid shared-KV configuration passes SGLang's and our checks


def test_stock_abbreviations_parse_as_without_the_plugin(tiny_nsa_model):
    # SGLang's parser allows abbreviations; "--enable-nsa-prefill" is stock's short form of
    # --enable-nsa-prefill-context-parallel and must not become ambiguous with the flag.
    from sglang.srt.server_args import prepare_server_args

    argv = [a for a in _argv(tiny_nsa_model) if a != "--enable-nsa-prefill-context-parallel"]
    short = prepare_server_args([*argv, "--enable-nsa-prefill"])
    assert short.enable_nsa_prefill_context_parallel and not is_enabled(short)
    own = prepare_server_args([*argv, "--enable-nsa-prefill-context-parallel", "--enable-nsa-prefill-cp-sh"])
    assert is_enabled(own)  # the flag's own abbreviations still work


def test_config_yaml(tiny_nsa_model, tmp_path):
    from sglang.srt.server_args import prepare_server_args

    path = tmp_path / "prefill.yaml"
    path.write_text("enable-nsa-prefill-cp-shared-kv: true\nnsa-prefill-cp-mode: in-seq-split\n")
    server_args = prepare_server_args(["--config", str(path)] + _argv(tiny_nsa_model))
    assert is_enabled(server_args)


def test_engine_style_keyword(tiny_nsa_model):
    # sglang.Engine(**kwargs) builds ServerArgs(**kwargs): the flag is a keyword like any other.
    from sglang.srt.server_args import ServerArgs

    on = ServerArgs(**shared_kv_kwargs(tiny_nsa_model))
    off = ServerArgs(**shared_kv_kwargs(tiny_nsa_model, enable_nsa_prefill_cp_shared_kv=False))
    assert is_enabled(on) and not is_enabled(off)
    stock = ServerArgs(model_path=tiny_nsa_model, skip_tokenizer_init=True, device="cuda")
    assert not is_enabled(stock)


def test_value_survives_pickling_into_scheduler_processes(tiny_nsa_model):
    from sglang.srt.server_args import ServerArgs

    server_args = ServerArgs(**shared_kv_kwargs(tiny_nsa_model))
    assert is_enabled(pickle.loads(pickle.dumps(server_args)))


_DUMP = """
import dataclasses, json, sys, torch
torch.cuda.get_device_capability = lambda *a, **k: (9, 0)
from sglang.srt.plugins import load_plugins
load_plugins()
from sglang.srt.server_args import prepare_server_args
sa = prepare_server_args(sys.argv[1:])
sa.check_server_args()
fields = {f.name: repr(getattr(sa, f.name)) for f in dataclasses.fields(sa)}
print("SERVER_ARGS=" + json.dumps({"fields": fields, "plugin_attr": hasattr(sa, "%s")}))
""" % FLAG_DEST


def test_flag_off_server_args_identical_to_stock(tiny_nsa_model):
    """Same argv, plugin loaded vs. excluded through SGLANG_PLUGINS: identical ServerArgs
    and the same outcome of SGLang's checks."""
    env = {**os.environ, "SGLANG_DISAGGREGATION_ALL_CP_RANKS_TRANSFER": "1"}
    procs = [
        subprocess.Popen([sys.executable, "-c", _DUMP, *_argv(tiny_nsa_model, "--random-seed", "0")], stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True, env={**env, **extra})
        for extra in ({}, {"SGLANG_PLUGINS": "no_such_plugin"})
    ]
    dumps = []
    for proc in procs:
        out, err = proc.communicate(timeout=240)
        assert proc.returncode == 0, err[-2000:]
        line = next(x for x in out.splitlines() if x.startswith("SERVER_ARGS="))
        dumps.append(json.loads(line.split("=", 1)[1]))
    with_plugin, stock = dumps
    assert with_plugin["plugin_attr"] and not stock["plugin_attr"]  # the plugin really was (not) loaded
    assert with_plugin["fields"] == stock["fields"]
