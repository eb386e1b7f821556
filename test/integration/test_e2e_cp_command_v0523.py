"""scripts/e2e_cp_logprobs.py on sglang 0.5.23 (interleave CP).

* the exact command of every run (off_a, off_b, on, on_corrupt; bf16 and fp8 KV; with
  --share-gpu and --stable-topk, as the GPU run takes them), built by the script's own
  ``server_command``, goes through 0.5.23's real parser (every option spelled in full, none
  unknown), ``ServerArgs`` and its resolution pipeline and ``check_server_args`` with the
  plugin loaded the way SGLang loads it; the flag-on runs report no configuration problem;
  the flag-off runs are the same command minus the flag. A CPU machine cannot run all of
  0.5.23's resolution: its model step asks the GPU for its compute capability (answered
  "Hopper" here, as test_settings_v0523.py does), and the device is named (``--device
  cuda``; the GPU machine detects it);
* the checks the script runs only on 0.5.23 (the write-path counter under interleave, the
  multi-request prefill batch, its radix hits, the prefill-batch log lines), on
  recorded-looking inputs, passing and failing where they should. These need no sglang.
"""

import types
from pathlib import Path

import pytest

from sglang_cp_shared_kv.releases import installed, v0523
from sglang_cp_shared_kv_testing.support import load_script

INTERLEAVE = "interleave"
ON_V0523 = installed.INSTALLED is v0523.RELEASE
needs_v0523 = pytest.mark.skipif(not ON_V0523, reason=f"needs sglang {v0523.RELEASE.version}")
DTYPES = ("bfloat16", "fp8_e4m3")
RUNS = ("off_a", "off_b", "on", "on_corrupt")


def _args(dtype, tp=2):
    return types.SimpleNamespace(tp=tp, kv_cache_dtype=dtype, share_gpu=True, stable_topk=True, boot_timeout=1)


def _command(e2e, run, dtype, model="MODEL"):
    flag, corrupt, pool = e2e.RUNS[run]
    return e2e.server_command(flag, corrupt, pool, str(model), 31000, _args(dtype), cp_strategy=INTERLEAVE)


def _added_env(env):
    import os

    return {k: v for k, v in env.items() if os.environ.get(k) != v and k != "PYTHONPATH"}


# ------------------------------------------------------------------ the command on 0.5.23's parser
@pytest.fixture
def hopper(monkeypatch, plugin_loaded):
    import torch

    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a, **k: (9, 0))
    # what main() sets for every server (os.environ.setdefault)
    monkeypatch.setenv("SGLANG_DISAGGREGATION_ALL_CP_RANKS_TRANSFER", "1")


@needs_v0523
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("run", RUNS)
def test_each_run_command_parses_resolves_and_passes_the_checks(hopper, tmp_path, monkeypatch, run, dtype):
    import argparse

    from sglang.srt.server_args import ServerArgs, prepare_server_args

    from sglang_cp_shared_kv import sglang_api as sg
    from sglang_cp_shared_kv.settings.config import FLAG_DEST
    from sglang_cp_shared_kv.settings.server_args_v0523 import configuration_problems
    from sglang_cp_shared_kv_testing.server import write_model

    e2e = load_script("e2e_cp_logprobs")
    assert e2e.CP_STRATEGY == INTERLEAVE  # the installed release picks it
    model = write_model(tmp_path / "model", e2e.MODEL)
    cmd, env = _command(e2e, run, dtype, model)
    assert cmd[1:3] == ["-m", "sglang.launch_server"]
    for name, value in _added_env(env).items():  # the server's environment, as far as SGLang reads it here
        monkeypatch.setenv(name, value)
    argv = cmd[3:]
    # every option spelled as 0.5.23's parser (with the plugin's flag) knows it: no abbreviation, none unknown
    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    known = {s for action in parser._actions for s in action.option_strings}
    assert [a for a in argv if a.startswith("--") and a not in known] == []
    server_args = prepare_server_args(argv + ["--device", "cuda"])
    server_args.resolve_once()
    server_args.check_server_args()  # stock checks, and the plugin's when the flag is on: no exception
    flag_on = e2e.RUNS[run][0]
    assert getattr(server_args, FLAG_DEST) is flag_on
    if flag_on:
        assert configuration_problems(server_args) == []
    cfg = sg.resolved_view(server_args)
    graphs = sg.cuda_graph_config
    assert (cfg.enable_prefill_cp, cfg.cp_strategy, cfg.attn_cp_size) == (True, INTERLEAVE, 2)
    assert (cfg.dsa_prefill_backend, cfg.dsa_decode_backend) == ("flashmla_sparse", "flashmla_sparse")
    assert cfg.cuda_graph_config.prefill.backend == graphs.Backend.DISABLED
    assert cfg.cuda_graph_config.decode.backend == graphs.Backend.DISABLED
    assert (graphs.Phase.PREFILL, "backend") in server_args._cuda_graph_config_locked  # chosen: no WARNING
    assert cfg.disable_flashinfer_autotune and cfg.disable_overlap_schedule and cfg.skip_server_warmup
    assert (cfg.kv_cache_dtype, cfg.page_size, cfg.chunked_prefill_size) == (dtype, 64, e2e.CHUNK)
    assert cfg.max_total_tokens == e2e.RUNS[run][2] and cfg.disaggregation_mode == "null"
    assert cfg.sampling_backend == "pytorch" and cfg.disable_custom_all_reduce and cfg.enable_metrics


@pytest.mark.parametrize("dtype", DTYPES)
def test_flag_off_runs_are_the_flag_on_command_minus_the_flag(dtype):
    from sglang_cp_shared_kv.settings.config import FLAG_ALIAS

    e2e = load_script("e2e_cp_logprobs")
    commands = {run: _command(e2e, run, dtype) for run in RUNS}
    on_cmd, on_env = commands["on"]
    assert on_cmd.count(FLAG_ALIAS) == 1
    assert commands["off_b"][0] == [a for a in on_cmd if a != FLAG_ALIAS]
    big = commands["off_a"][0]
    at = big.index("--max-total-tokens")
    assert big[at + 1] == str(e2e.BIG_POOL) and big[:at + 1] + [str(e2e.POOL)] + big[at + 2:] == commands["off_b"][0]
    assert commands["on_corrupt"][0] == on_cmd
    off_env = _added_env(commands["off_b"][1])
    assert _added_env(on_env) == {**off_env, "SGLANG_CP_SHARED_KV_TESTING_ALLOW_NON_PD": "1"}
    assert _added_env(commands["on_corrupt"][1]) == {**_added_env(on_env), "CPSKV_E2E_CORRUPT_RANK": "1"}
    assert _added_env(commands["off_a"][1]) == off_env
    assert off_env[e2e.DSA_DENSE_THRESHOLD_ENV] == "0" and off_env["CPSKV_E2E_STABLE_TOPK"] == "1"
    # none of in-seq-split's option names is left
    assert not [a for a in on_cmd if "nsa" in a or a in ("--tp", "--disable-cuda-graph",
                                                           "--disable-piecewise-cuda-graph")]


# ------------------------------------------------------------------ the checks the script runs on 0.5.23
def _e2e_interleave():
    e2e = load_script("e2e_cp_logprobs")
    e2e.CP_STRATEGY = INTERLEAVE  # this module object's global: as on 0.5.23
    return e2e


def _requests(e2e, n):
    return {**e2e.prompts(n), **e2e.batch_prompts()}


def test_the_batch_prompts_fit_one_chunk_and_share_a_cached_prefix():
    e2e = _e2e_interleave()
    batch = e2e.batch_prompts()
    assert list(batch) == [e2e.BATCH_SOURCE, *e2e.BATCH_PROMPTS] and len(e2e.BATCH_PROMPTS) == 4
    source = batch[e2e.BATCH_SOURCE][0]
    assert len(source) > e2e.BATCH_PREFIX and e2e.BATCH_PREFIX % e2e.PAGE == 0
    new_tokens = 0
    for name in e2e.BATCH_PROMPTS:
        ids, start = batch[name]
        if name in e2e.BATCH_RADIX_HITS:
            assert ids[:e2e.BATCH_PREFIX] == source[:e2e.BATCH_PREFIX] and start == e2e.BATCH_PREFIX
            assert ids[e2e.BATCH_PREFIX] != source[e2e.BATCH_PREFIX]
        else:
            assert start == 0 and ids[:8] != source[:8]
        new_tokens += len(ids) - start
    assert len(e2e.BATCH_RADIX_HITS) == 2 and new_tokens == 1051 < e2e.CHUNK  # one chunk: one batch
    assert min(len(ids) for ids, _ in batch.values()) == 1  # a request shorter than any N
    # the prompts of both strategies stay as they are, the batch posted after them
    requests = _requests(e2e, 2)
    assert list(requests)[:len(e2e.prompts(2))] == list(e2e.prompts(2))


PREFILL_LOG = """\
[2026-12-08 10:00:00 TP0] Prefill batch, #new-seq: 1, #new-token: 2048, #cached-token: 0, token usage: 0.12, \
#running-req: 0, #queue-req: 0, #pending-token: 0, cuda graph: False, input throughput (token/s): 100.00
[2026-12-08 10:00:01 TP0] Prefill batch, #new-seq: 4, #new-token: 1051, #cached-token: 2048, token usage: 0.2, \
#running-req: 0, #queue-req: 0, #pending-token: 0, cuda graph: False, input throughput (token/s): 99.00
[2026-12-08 10:00:01 TP1] Prefill batch, #new-seq: 4, #new-token: 1051, #cached-token: 2048, token usage: 0.2, \
#running-req: 0, #queue-req: 0, #pending-token: 0, cuda graph: False, input throughput (token/s): 99.00
"""


def test_prefill_batch_lines_and_both_pool_lines_are_read():
    from sglang_cp_shared_kv_testing.server import prefill_batches, startup_figures

    assert prefill_batches(PREFILL_LOG) == [(1, 2048, 0), (4, 1051, 2048), (4, 1051, 2048)]
    assert prefill_batches("Decode batch, #running-req: 1") == []
    pools = ("[TP0] KV Cache is allocated. dtype: torch.bfloat16, #tokens: 8192, KV size: 0.02 GB\n"  # 0.5.23
             "[TP1] KV Cache is allocated. #tokens: 65536, K size: 0.10 GB, V size: 0.01 GB\n"  # 0.5.12.post1
             "[TP0] KV Cache VA upper bound. dtype: torch.bfloat16, #tokens: 99, KV size: 1 GB\n")
    assert startup_figures(pools)["pool_tokens"] == [8192, 65536]


def test_batch_checks_pass_only_where_the_log_shows_one_batch_of_all_four():
    e2e = _e2e_interleave()
    requests = _requests(e2e, 2)
    total = sum(len(requests[name][0]) for name in e2e.BATCH_PROMPTS)
    assert total == 1051 + 2048
    from sglang_cp_shared_kv_testing.server import prefill_batches

    good = {"prefill_batches": prefill_batches(PREFILL_LOG)}
    checks = e2e.batch_checks({"off_a": good, "on": good}, requests)
    assert len(checks) == 2 and all(checks.values())
    split = {"prefill_batches": [(1, 2048, 0), (1, 200, 1024), (3, 851, 1024)]}  # timing split the batch
    assert e2e.batch_checks({"off_a": good, "on": split}, requests) == {
        "off_a: the 4 batch prompts prefilled in one batch (3099 tokens)": True,
        "on: the 4 batch prompts prefilled in one batch (3099 tokens)": False}
    other = {"prefill_batches": [(4, 1051, 1024)]}  # four requests, but not these tokens
    assert not any(e2e.batch_checks({"on": other}, requests).values())
    assert not any(e2e.batch_checks({"on": {}}, requests).values())  # nothing logged: no pass


def _samples(counts, index="gathered", mla="gathered"):
    return {f'{{cp_rank="{rank}",index="{index}",mla="{mla}"}}': float(c) for rank, c in counts.items()}


def test_interleave_write_paths_demand_every_forward_on_every_rank_gathered():
    e2e = _e2e_interleave()
    for n in (2, 4):
        requests = _requests(e2e, n)
        answered = {prompt: [-1.0] for prompt in requests}
        run = {"logprobs": answered}
        # 1.5k 1, 3k 2, radix 1, 6k 3, over_rank_pool, 1500 1, 1501 1, 4109 3, mid-page 1, 4097 3, 5003 3,
        # BATCH_SOURCE 1, the batch 1
        over = -(-e2e.over_rank_pool_tokens(n) // e2e.CHUNK)
        assert e2e.chunks_answered(run, requests) == 1 + 2 + 1 + 3 + over + 1 + 1 + 3 + 1 + 3 + 3 + 1 + 1
        need = e2e.chunks_answered(run, requests)
        assert e2e.interleave_write_path_problem(_samples(dict.fromkeys(range(n), need)), n, need) is None
        assert "fewer than" in e2e.interleave_write_path_problem(_samples(dict.fromkeys(range(n), need - 1)), n, need)
        uneven = dict.fromkeys(range(n), need)
        uneven[n - 1] += 1
        assert "different numbers" in e2e.interleave_write_path_problem(_samples(uneven), n, need)
        missing = dict.fromkeys(range(n - 1), need)
        assert "expected 0.." in e2e.interleave_write_path_problem(_samples(missing), n, need)
        local = {**_samples(dict.fromkeys(range(n), need)), **_samples({0: 1}, index="local", mla="local")}
        assert "index=local" in e2e.interleave_write_path_problem(local, n, need)
        assert e2e.interleave_write_path_problem({}, n, need) is not None  # no counter: no pass
        # through capacity_checks, as main() calls it
        refused = {"refused": "HTTP 400: Input length (12288 tokens) exceeds the maximum allowed length"}
        runs = {"off_a": {"logprobs": answered}, "off_b": {"logprobs": {**answered, "over_rank_pool": refused}},
                "on": {"logprobs": answered, "write_paths": _samples(dict.fromkeys(range(n), need)),
                       "startup": {"shared": [(e2e.POOL, n * e2e.POOL)]}}}
        checks = e2e.capacity_checks(runs, n, INTERLEAVE, requests)
        assert len(checks) == 5 and all(checks.values()), checks
        assert "on: every CP rank ran every forward through the shared pool (gathered)" in checks
        runs["on"]["write_paths"] = _samples(dict.fromkeys(range(n), 1))
        assert not all(e2e.capacity_checks(runs, n, INTERLEAVE, requests).values())


def test_interleave_radix_checks_include_the_batch_hits():
    e2e = _e2e_interleave()
    hits = {**e2e.RADIX_HITS, **e2e.BATCH_RADIX_HITS}
    assert len(e2e.radix_checks({"on": {"cached_tokens": hits}})) == 4
    assert all(e2e.radix_checks({"on": {"cached_tokens": hits}}).values())
    short = {**hits, "batch_shares_prefix_b": 0}
    assert not e2e.radix_checks({"on": {"cached_tokens": short}})["on: batch_shares_prefix_b found its 1024 tokens cached"]
    assert len(e2e.radix_checks({"on": {"cached_tokens": hits}}, cp_strategy="in-seq-split")) == 2


def test_the_batch_is_one_request_after_its_source_with_no_flush_between(tmp_path, monkeypatch):
    e2e = _e2e_interleave()
    events = []
    monkeypatch.setattr(e2e, "launch", lambda *a, **k: "PROC")
    monkeypatch.setattr(e2e, "stop", lambda proc: events.append("stop"))
    monkeypatch.setattr(e2e, "flush_cache", lambda port: events.append("flush"))
    monkeypatch.setattr(e2e, "logprobs", lambda port, ids, start: (events.append(("one", len(ids))) or [-1.0], start))
    monkeypatch.setattr(e2e, "prometheus_samples", lambda port, name: {})
    posted = []

    def post(port, path, body, timeout=600):
        posted.append(body)
        return [{"meta_info": {"input_token_logprobs": [[-0.5, 7, None]] * len(ids), "cached_tokens": start,
                               "finish_reason": {"type": "length"}}}
                for ids, start in zip(body["input_ids"], body["logprob_start_len"])]

    monkeypatch.setattr(e2e, "post", post)
    log = tmp_path / "on.log"
    log.write_text(PREFILL_LOG)
    requests = _requests(e2e, 2)
    args = types.SimpleNamespace(port=31000, stable_topk=False, share_gpu=False, tp=2)
    run = e2e.one_run("on", "MODEL", requests, args, log)
    batch = requests
    assert len(posted) == 1 and posted[0]["input_ids"] == [batch[n][0] for n in e2e.BATCH_PROMPTS]
    assert posted[0]["logprob_start_len"] == [batch[n][1] for n in e2e.BATCH_PROMPTS]
    source = ("one", len(batch[e2e.BATCH_SOURCE][0]))
    assert events[events.index(source) - 1] == "flush" and events[events.index(source) + 1:] == ["stop"]
    assert all(isinstance(run["logprobs"][n], list) for n in requests)
    assert run["cached_tokens"]["batch_shares_prefix_a"] == e2e.BATCH_PREFIX
    assert run["prefill_batches"] == [(1, 2048, 0), (4, 1051, 2048), (4, 1051, 2048)]


def test_a_batch_member_the_server_aborts_is_recorded_as_refused(monkeypatch):
    e2e = _e2e_interleave()
    outs = [{"meta_info": {"input_token_logprobs": [[-0.5, 3, None]], "cached_tokens": 0, "finish_reason": None}},
            {"meta_info": {"finish_reason": {"type": "abort", "message": "too long"}, "cached_tokens": 0}}]
    monkeypatch.setattr(e2e, "post", lambda *a, **k: outs)
    got = e2e.logprobs_of_batch(31000, {"a": ([5], 0), "b": ([6, 7], 0)})
    assert got == {"a": ([-0.5], 0), "b": ({"refused": "too long"}, 0)}


def test_the_script_names_no_release():
    text = Path(load_script("e2e_cp_logprobs").__file__).read_text()
    assert "installed.INSTALLED" in text and "def server_command" in text


@needs_v0523
def test_without_the_testing_variable_the_flag_still_refuses_a_server_without_pd(hopper, tmp_path, monkeypatch):
    """The flag-on runs need SGLANG_CP_SHARED_KV_TESTING_ALLOW_NON_PD=1 (no decode server):
    without it the same command is refused, naming --disaggregation-mode."""
    from sglang.srt.server_args import prepare_server_args

    from sglang_cp_shared_kv.settings.server_args_v0523 import configuration_problems
    from sglang_cp_shared_kv_testing.server import write_model

    e2e = load_script("e2e_cp_logprobs")
    cmd, env = _command(e2e, "on", "bfloat16", write_model(tmp_path / "model", e2e.MODEL))
    assert env["SGLANG_CP_SHARED_KV_TESTING_ALLOW_NON_PD"] == "1"
    monkeypatch.delenv("SGLANG_CP_SHARED_KV_TESTING_ALLOW_NON_PD", raising=False)
    server_args = prepare_server_args(cmd[3:] + ["--device", "cuda"])
    server_args.resolve_once()
    assert [p.split(":")[0] for p in configuration_problems(server_args)] == ["--disaggregation-mode null"]


def test_a_switch_that_found_nothing_to_patch_spoils_the_exact_comparison():
    """sitecustomize imports on when a release lacks a patch's target, saying so: a run with such a
    line cannot be compared exactly, however many processes announced the deterministic top-k."""
    from sglang_cp_shared_kv_testing.server import NOT_PATCHED_LINE, stable_topk_problem, startup_figures

    log = ("[cpskv-e2e] deterministic NSA top-k (pid 1)\n[cpskv-e2e] deterministic NSA top-k (pid 2)\n"
           f"{NOT_PATCHED_LINE} sglang.kernels.ops.attention.dsv4.topk: AttributeError('x') (pid 2)\n")
    figures = startup_figures(log)
    assert figures["not_patched"] == ["sglang.kernels.ops.attention.dsv4.topk"]
    problem = stable_topk_problem(figures, "on", Path("on.log"), 2)
    assert problem and "sglang.kernels.ops.attention.dsv4.topk" in problem
    clean = startup_figures(log.rsplit("\n", 2)[0])
    assert clean["not_patched"] == [] and stable_topk_problem(clean, "on", Path("on.log"), 2) is None
