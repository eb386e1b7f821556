"""scripts/e2e_cp_logprobs.py on sglang 0.5.12.post1 (in-seq-split CP): the command line and
environment of each run's server, byte for byte what the script built before it learned
0.5.23's options (the literals below were printed by that code, 2026-12-07), built through
``server_command`` without starting a server, and ``launch`` starting exactly that.
Needs no sglang: the strategy is passed, the script's ``shared_gpu`` arguments are read from
that module (they are its owner's, and are pinned by its own tests)."""

import types

import pytest

from sglang_cp_shared_kv_testing import shared_gpu
from sglang_cp_shared_kv_testing.support import load_script

IN_SEQ_SPLIT = "in-seq-split"
SHARED = object()  # where shared_gpu.server_args() go

HEAD = ["-m", "sglang.launch_server", "--model-path", "MODEL", "--load-format", "dummy", "--skip-tokenizer-init",
        "--trust-remote-code"]
TAIL = ["--random-seed", "0", "--port", "31000", "--nccl-port", "31005"]
NSA_BACKENDS = ["--nsa-prefill-backend", "flashmla_sparse", "--nsa-decode-backend", "flashmla_sparse"]
IN_SEQ_CP = ["--enable-nsa-prefill-context-parallel", "--nsa-prefill-cp-mode", "in-seq-split",
             "--disable-custom-all-reduce"]


def _middle(dtype):
    return ["--kv-cache-dtype", dtype, "--chunked-prefill-size", "2048", "--disable-piecewise-cuda-graph",
            "--sampling-backend", "pytorch", "--skip-server-warmup", "--disable-overlap-schedule"]


#: (tp, kv dtype, share gpu, stable top-k, run): (argv after the interpreter, env added)
EXPECTED = {
    (2, "bfloat16", True, True, "on_corrupt"): (
        HEAD + ["--tp", "2", "--page-size", "64", "--mem-fraction-static", "0.8", "--max-total-tokens", "8192",
                "--disable-cuda-graph"] + TAIL + _middle("bfloat16") + NSA_BACKENDS + IN_SEQ_CP
        + [SHARED, "--enable-nsa-prefill-cp-shared-kv", "--enable-metrics", "--x"],
        {"CPSKV_E2E": "1", "SGLANG_NSA_PREFILL_DENSE_ATTN_KV_LEN_THRESHOLD": "0", "CPSKV_E2E_STABLE_TOPK": "1",
         "SGLANG_CP_SHARED_KV_TESTING_ALLOW_NON_PD": "1", "CPSKV_E2E_CORRUPT_RANK": "1", "E": "1"}),
    (2, "fp8_e4m3", False, False, "off_a"): (
        HEAD + ["--tp", "2", "--page-size", "64", "--mem-fraction-static", "0.5", "--max-total-tokens", "65536",
                "--disable-cuda-graph"] + TAIL + _middle("fp8_e4m3") + NSA_BACKENDS + IN_SEQ_CP + ["--x"],
        {"CPSKV_E2E": "1", "SGLANG_NSA_PREFILL_DENSE_ATTN_KV_LEN_THRESHOLD": "0", "E": "1"}),
    (1, "fp8_e4m3", False, True, "off_b"): (
        HEAD + ["--tp", "1", "--page-size", "64", "--mem-fraction-static", "0.5", "--max-total-tokens", "8192",
                "--disable-cuda-graph"] + TAIL + _middle("fp8_e4m3") + ["--x"],
        {"CPSKV_E2E": "1", "SGLANG_NSA_PREFILL_DENSE_ATTN_KV_LEN_THRESHOLD": "0", "CPSKV_E2E_STABLE_TOPK": "1",
         "E": "1"}),
    (4, "bfloat16", True, False, "on"): (
        HEAD + ["--tp", "4", "--page-size", "64", "--mem-fraction-static", "0.8", "--max-total-tokens", "8192",
                "--disable-cuda-graph"] + TAIL + _middle("bfloat16") + NSA_BACKENDS + IN_SEQ_CP
        + [SHARED, "--enable-nsa-prefill-cp-shared-kv", "--enable-metrics", "--x"],
        {"CPSKV_E2E": "1", "SGLANG_NSA_PREFILL_DENSE_ATTN_KV_LEN_THRESHOLD": "0",
         "SGLANG_CP_SHARED_KV_TESTING_ALLOW_NON_PD": "1", "E": "1"}),
}


def _expected(key):
    argv, env = EXPECTED[key]
    share = key[2]
    flat = [a for item in argv for a in (shared_gpu.server_args() if item is SHARED else [item])]
    return flat, {**env, **(shared_gpu.env() if share else {})}


def _added_env(env):
    import os

    return {k: v for k, v in env.items() if os.environ.get(k) != v and k != "PYTHONPATH"}


@pytest.mark.parametrize("key", list(EXPECTED), ids=lambda k: "-".join(map(str, k)))
def test_the_in_seq_split_command_is_unchanged(key, monkeypatch):
    e2e = load_script("e2e_cp_logprobs")
    tp, dtype, share, stable, run = key
    args = types.SimpleNamespace(tp=tp, kv_cache_dtype=dtype, share_gpu=share, stable_topk=stable, boot_timeout=1)
    flag, corrupt, pool = e2e.RUNS[run]
    cmd, env = e2e.server_command(flag, corrupt, pool, "MODEL", 31000, args, ["--x"], {"E": "1"},
                                  cp_strategy=IN_SEQ_SPLIT)
    want_argv, want_env = _expected(key)
    assert cmd[1:] == want_argv
    assert _added_env(env) == want_env
    # launch starts exactly what server_command builds (the strategy the installed release's)
    if e2e.CP_STRATEGY == IN_SEQ_SPLIT:
        started = {}
        monkeypatch.setattr(e2e, "start_server", lambda name, c, e, port, log, t: started.update(cmd=c, env=e))
        e2e.launch(run, flag, corrupt, pool, "MODEL", 31000, args, "LOG", ["--x"], {"E": "1"})
        assert started == {"cmd": cmd, "env": env}
