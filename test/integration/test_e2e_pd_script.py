"""scripts/e2e_pd_gpu.py on CPU: the server commands SGLang's parser accepts, the decode
answer it records (answered, aborted, HTTP error), the verdict (exact, and a negative
control that must show), and the PD corruption switch of scripts/e2e/sitecustomize.py."""

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from sglang_cp_shared_kv.settings.config import FLAG
from sglang_cp_shared_kv_testing.support import load_script

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def pd():
    return load_script("e2e_pd_gpu")


def _args(cp_size, dtype="bfloat16", share_gpu=False):
    return argparse.Namespace(model=Path("/models/tiny"), kv_cache_dtype=dtype, cp_size=cp_size, stock_topk=False,
                              share_gpu=share_gpu, port=32000)


@pytest.mark.parametrize("cp_size,flag_on,dtype", [(2, False, "bfloat16"), (2, True, "fp8_e4m3"), (4, True, "bfloat16"),
                                                   (1, False, "bfloat16"), (1, False, "fp8_e4m3")])
def test_server_commands_parse_with_sglangs_parser(pd, plugin_loaded, cp_size, flag_on, dtype):
    from sglang.srt.server_args import ServerArgs

    parser = argparse.ArgumentParser(exit_on_error=False)
    ServerArgs.add_cli_args(parser)  # with the plugin's hooks applied: it adds the flag
    ports = {"prefill": 1, "decode": 2, "bootstrap": 3}
    prefill, decode = pd.server_commands(_args(cp_size, dtype), pd.RUNS["on" if flag_on else "off"], ports)
    p = parser.parse_args(prefill[prefill.index("sglang.launch_server") + 1:])
    d = parser.parse_args(decode[decode.index("sglang.launch_server") + 1:])
    assert (p.disaggregation_mode, d.disaggregation_mode) == ("prefill", "decode")
    assert p.max_total_tokens == pd.POOL and p.disaggregation_bootstrap_port == 3 and d.base_gpu_id == 0
    assert p.tensor_parallel_size == cp_size and d.tensor_parallel_size == 1
    assert p.enable_nsa_prefill_context_parallel == (cp_size > 1)
    assert (FLAG in prefill) == flag_on and (FLAG in decode) == flag_on  # the flag on both servers
    assert d.max_total_tokens is None and (p.mem_fraction_static, d.mem_fraction_static) == (
        (0.45, 0.85) if cp_size > 1 else (0.3, 0.3))
    assert not p.sleep_on_idle and not d.sleep_on_idle
    # bf16: flashmla_sparse on both. fp8: with CP the prefill runs flashmla_sparse, flag off too
    # (stock fp8's flashmla_kv crashes there); decode keeps SGLang's fp8 default (its
    # flashmla_sparse decode reads the fp8 cache without dequantizing it)
    sparse, unset = ("flashmla_sparse",) * 2, (None, None)
    want_prefill = sparse if dtype == "bfloat16" or cp_size > 1 else unset
    want_decode = sparse if dtype == "bfloat16" else unset
    assert (p.nsa_prefill_backend, p.nsa_decode_backend) == want_prefill
    assert (d.nsa_prefill_backend, d.nsa_decode_backend) == want_decode


@pytest.mark.parametrize("cp_size", [2, 8])
def test_share_gpu_servers_fix_every_pool_and_take_their_own_ports(pd, plugin_loaded, cp_size):
    """--share-gpu: both servers' pools fixed (decode's at BIG_POOL where the run names none),
    the shared memory fraction, idle schedulers asleep; every run on ports of its own."""
    from sglang.srt.server_args import ServerArgs

    from sglang_cp_shared_kv_testing import shared_gpu

    parser = argparse.ArgumentParser(exit_on_error=False)
    ServerArgs.add_cli_args(parser)
    args = _args(cp_size, share_gpu=True)
    used = set()
    for name, run in pd.RUNS.items():
        ports = pd.run_ports(args, name)
        assert not used & set(ports.values())
        used |= set(ports.values())
        prefill, decode = pd.server_commands(args, run, ports)
        p = parser.parse_args(prefill[prefill.index("sglang.launch_server") + 1:])
        d = parser.parse_args(decode[decode.index("sglang.launch_server") + 1:])
        assert p.mem_fraction_static == d.mem_fraction_static == shared_gpu.MEM_FRACTION_STATIC
        assert p.sleep_on_idle and d.sleep_on_idle and p.disable_custom_all_reduce
        assert p.max_total_tokens == run.prefill_pool
        assert d.max_total_tokens == (run.decode_pool or pd.BIG_POOL)
        assert (p.port, d.port, p.disaggregation_bootstrap_port, p.nccl_port, d.nccl_port) == (
            ports["prefill"], ports["decode"], ports["bootstrap"], ports["prefill_nccl"], ports["decode_nccl"])
        env = pd.run_env(args, run)
        assert {k: env[k] for k in shared_gpu.ENV} == shared_gpu.ENV
        assert ("CPSKV_E2E_STALL_WRITE_RANK" in env) == (name == "on_abort")


def test_only_runs_with_the_flag_or_off_all_ranks_have_every_cp_rank_send(pd, monkeypatch):
    """The flag-off baseline is stock's default transfer (CP rank 0 sends every page), even
    where the caller's environment sets the variable: stock's every-rank split loses a
    radix hit's pages (docs/transfer.md, SGLang limitation 5), which made the first real PD
    run compare the flag against a wrong reference."""
    monkeypatch.setenv("SGLANG_DISAGGREGATION_ALL_CP_RANKS_TRANSFER", "1")
    args = _args(2, share_gpu=True)
    every_rank = {name for name, run in pd.RUNS.items()
                  if pd.run_env(args, run).get("SGLANG_DISAGGREGATION_ALL_CP_RANKS_TRANSFER") == "1"}
    assert every_rank == {name for name, run in pd.RUNS.items() if run.flag_on or run.decode_flag} | {"off_all_ranks"}
    assert {"off", "off_b", "off_big", "off_small_decode"}.isdisjoint(every_rank)


def test_the_over_pool_prompt_exceeds_one_rank_and_fits_two(pd):
    prompts = pd.prompts()
    assert pd.POOL < len(prompts["over_pool"]) < 2 * pd.POOL <= pd.BIG_POOL
    chunked, radix = prompts["chunked"], prompts["radix_hit"]
    assert len(chunked) > 3 * pd.CHUNK and radix[:2 * pd.CHUNK] == chunked[:2 * pd.CHUNK]
    assert len(prompts["chunked"]) + pd.NEW_TOKENS <= pd.MODEL["max_position_embeddings"]


def test_decode_answers_are_recorded_as_answered_aborted_or_failed(pd):
    ok = pd.summarize_decode({"status": "ok", "elapsed_s": 0.2, "response": {
        "output_ids": [5, 6], "meta_info": {"finish_reason": {"type": "length"},
                                            "output_token_logprobs": [[-1.5, 5, None], [-0.25, 6, None]]}}})
    assert ok["status"] == "ok" and ok["ids"] == [5, 6] and ok["logprobs"] == [-1.5, -0.25]
    aborted = pd.summarize_decode({"status": "ok", "elapsed_s": 0.1, "response": {
        "output_ids": [], "meta_info": {"finish_reason": {"type": "abort", "message": "cause: prefill CP rank 1"}}}})
    assert aborted["status"] == "aborted" and "prefill CP rank 1" in aborted["error"]
    failed = pd.summarize_decode({"status": "http_error", "code": 500, "error": "boom", "elapsed_s": 1.0})
    assert failed == {"status": "http_error", "error": "boom", "elapsed_s": 1.0}
    assert not pd.same_answer(aborted, aborted) and pd.same_answer(ok, dict(ok))


def _runs(pd, corrupt_differs=True, on_gap=0.0, guard_waits=False):
    def answer(value):
        return {"decode": {"status": "ok", "ids": [1, 2], "logprobs": [value, -1.0]},
                "prefill": {"status": "ok", "cached_tokens": pd.RADIX_PREFIX}}

    def refused(message, elapsed=0.1):
        return {"decode": {"status": "http_error", "error": message, "elapsed_s": elapsed},
                "prefill": {"status": "error"}}

    base = {name: answer(-0.5) for name in pd.prompts()}
    runs = {name: {"prompts": dict(base)} for name in pd.runs_for(2) if not pd.RUNS[name].small_decode}
    runs["off"]["prompts"]["over_pool"] = {"decode": {"status": "ok", "ids": [0, 0], "logprobs": [0.0, 0.0]}}
    runs["on"] = {"prompts": {name: answer(-0.5 + on_gap) for name in base}}
    runs["on"]["prompts"]["over_logical"] = refused("...; cause: prefill CP rank 1 of 2: rejected room 7")
    runs["on_corrupt"] = {"prompts": {name: answer(-0.7 if corrupt_differs else -0.5 + on_gap) for name in base}}
    window = refused(f"Request r: {FLAG}: this decode server can never hold the request",
                     elapsed=pd.HANG_PROBE_S if guard_waits else 0.2)
    for name in ("off_small_decode", "guarded_small_decode", "on_small_decode"):
        runs[name] = {"prompts": {"decode_over": refused("exceeds the maximum number of tokens"),
                                  "decode_window": window, "short_behind": answer(-0.5)}}
    runs["off_small_decode"]["prompts"]["decode_window"] = {"decode": {"status": "error", "error": "timed out",
                                                                       "elapsed_s": pd.HANG_PROBE_S}}
    runs["on"]["pages_sent"] = {"0": {"kv": 60, "state": 60}, "1": {"kv": 58, "state": 58}}  # JSON keys
    runs["on_abort"] = {"startup": {"prefill": {"stalled_write_processes": 1}}, "prompts": {"chunked_aborted": {
        **refused(f"...; cause: prefill CP rank 1 of 2: room 7 ends unsent: {pd.ABORT_CAUSE} before sending all",
                  elapsed=3.5),
        "abort": {"forwards_before_abort": 8, "forwards_expected": 8, "last_chunk_handed_over": True,
                  "abort_at_s": 3.0}}}}
    return runs


def test_verdict_is_exact_and_needs_the_control_to_show(pd):
    checks = pd.verdict(_runs(pd))
    assert all(checks.values()) and "on=off_big:over_pool" in checks and "on=off:over_pool" not in checks
    assert len([c for c in checks if c.startswith("on_corrupt detected")]) == len(pd.prompts())
    assert not pd.verdict(_runs(pd, on_gap=1e-7))["on=off:short"]  # one ulp-sized gap fails
    assert not pd.verdict(_runs(pd, corrupt_differs=False))["on_corrupt detected:chunked"]
    assert checks["on fails over_logical on decode at once"]
    one_gpu = {name: run for name, run in _runs(pd).items() if name in pd.runs_for(1)}
    assert set(pd.verdict(one_gpu, cp_size=1)) == {
        "off_b=off:short", "off_b=off:chunked", *(f"off_b=off:{p}" for p in pd.CACHED_PROMPTS),
        "off_big answers over_pool",
        "off_big answers over_logical", "guarded_small_decode refuses decode_over at once",
        "guarded_small_decode refuses decode_window at once", "guarded_small_decode answers short_behind",
        "guarded_small_decode:short_behind=off:short",
        f"off: radix_hit found its {pd.RADIX_PREFIX} tokens in the prefill's cache"}


def test_the_radix_hit_must_find_its_prefix_in_the_prefills_cache(pd):
    runs = _runs(pd)
    check = f"on: radix_hit found its {pd.RADIX_PREFIX} tokens in the prefill's cache"
    assert pd.verdict(runs)[check]
    runs["on"]["prompts"]["radix_hit"] = {**runs["on"]["prompts"]["radix_hit"], "prefill": {"status": "ok",
                                                                                           "cached_tokens": 0}}
    assert not pd.verdict(runs)[check]
    prompts = pd.prompts()
    assert prompts["radix_hit"][:pd.RADIX_PREFIX] == prompts["chunked"][:pd.RADIX_PREFIX]
    assert list(prompts).index("radix_hit") == list(prompts).index("chunked") + 1  # posted right after it


def test_every_cp_rank_must_have_sent_pages(pd):
    runs = _runs(pd)
    check = "on: every CP rank sent KV and index pages"
    assert pd.verdict(runs)[check]
    runs["on"]["pages_sent"]["1"]["state"] = 0  # rank 1 sent no index page
    assert not pd.verdict(runs)[check]
    del runs["on"]["pages_sent"]["1"]  # rank 1 sent nothing at all
    assert not pd.verdict(runs)[check]
    assert pd.pages_sent_by_rank({'{cp_rank="1",kind="kv"}': 4.0, '{cp_rank="0",kind="state"}': 2.0,
                                  '{cp_rank="0",kind="kv"}': 3.0}) == {0: {"state": 2, "kv": 3}, 1: {"kv": 4}}


def test_an_abort_mid_transfer_must_fail_on_decode_at_once_naming_the_abort(pd):
    """on_abort: decode's failure must come within AT_ONCE_S of the abort (stock decode waits
    for its waiting timeout), name the prefill's abort, and the abort must have come after
    every chunk ran while a write was held (else it was not mid-transfer)."""
    check = "on_abort fails on decode at once, naming the abort"
    assert pd.verdict(_runs(pd))[check]
    for change in (
        lambda e, s: e["decode"].update(elapsed_s=e["abort"]["abort_at_s"] + pd.AT_ONCE_S),  # too late
        lambda e, s: e["decode"].update(error="...; cause: prefill CP rank 1 of 2: rejected room 7"),  # not the abort
        lambda e, s: e.update(decode={"status": "ok", "ids": [1], "logprobs": [-1.0], "elapsed_s": 3.1}),  # answered
        lambda e, s: e["abort"].update(forwards_before_abort=7),  # aborted before the last chunk ran
        # computed, not yet in SGLang's transfer queue: 0.5.12.post1 never honours that abort
        lambda e, s: e["abort"].update(last_chunk_handed_over=False),
        lambda e, s: e["abort"].pop("last_chunk_handed_over"),  # a record of the script before it waited
        lambda e, s: s.update(stalled_write_processes=0),  # no write held: maybe not mid-transfer
    ):
        runs = _runs(pd)
        change(runs["on_abort"]["prompts"]["chunked_aborted"], runs["on_abort"]["startup"]["prefill"])
        assert not pd.verdict(runs)[check]


def test_the_small_decode_verdict_needs_a_refusal_at_once_that_names_the_flag(pd):
    """A decode that answers, waits (the stock hang) or refuses without the flag's message
    fails the guarded runs' checks; the stock run is recorded, never judged."""
    assert all(v for k, v in pd.verdict(_runs(pd)).items() if "small_decode" in k)
    assert not any(k.startswith("off_small_decode") for k in pd.verdict(_runs(pd)))
    waited = pd.verdict(_runs(pd, guard_waits=True))
    assert not waited["guarded_small_decode refuses decode_window at once"]
    runs = _runs(pd)
    runs["on_small_decode"]["prompts"]["decode_window"]["decode"]["error"] = "exceeds the maximum number of tokens"
    assert not pd.verdict(runs)["on_small_decode refuses decode_window at once"]
    runs["guarded_small_decode"]["prompts"]["short_behind"] = {"decode": {"status": "error", "elapsed_s": 45}}
    assert not pd.verdict(runs)["guarded_small_decode answers short_behind"]


def test_the_over_logical_check_follows_the_cp_size(pd):
    """At N = 2 the prefill refuses over_logical (decode must fail it); from N = 3 the ranks
    hold it and decode must answer it like off_big."""
    prompts = pd.prompts()
    assert 2 * pd.POOL < len(prompts["over_logical"]) <= 3 * pd.POOL
    assert len(prompts["over_logical"]) + pd.NEW_TOKENS <= pd.MODEL["max_position_embeddings"]
    runs = _runs(pd)
    runs["on"]["prompts"]["over_logical"] = runs["off_big"]["prompts"]["over_logical"]
    four = pd.verdict(runs, cp_size=4)
    assert four["on=off_big:over_logical"] and "on fails over_logical on decode at once" not in four
    assert not pd.verdict(runs, cp_size=2)["on fails over_logical on decode at once"]  # it answered


def test_the_small_decode_prompts_fit_the_prefill_but_not_the_decode(pd):
    probe = pd.small_decode_prompts()
    assert list(probe) == ["decode_over", "decode_window", "short_behind"]  # the order they are posted
    assert pd.DECODE_POOL < len(probe["decode_over"]) <= 2 * pd.POOL <= pd.BIG_POOL
    window = len(probe["decode_window"])
    assert window < pd.DECODE_POOL < window + pd.DEFAULT_RESERVED_DECODE_TOKENS  # under decode's pool, over its bound
    assert pd.SMALL_DECODE_BOOTSTRAP_TIMEOUT_S < pd.HANG_PROBE_S


SWAP_CHECK = """
import numpy as np
from types import SimpleNamespace
from sglang_cp_shared_kv.cp_shared_kv_layout import CpSharedKVLayout
from sglang_cp_shared_kv.transfer.prefill import PrefillShardTransfer
for rank in (0, 1):
    me = SimpleNamespace(layout=CpSharedKVLayout(cp_size=2, cp_rank=rank, page_size=64))
    physical, positions = PrefillShardTransfer.owned_pages(me, np.arange(1, 9), slice(0, 8))
    print("RANK", rank, list(physical), list(positions))
"""


def test_pd_corruption_switch_sends_one_page_twice_on_the_named_rank_only():
    def run(extra):
        env = {**os.environ, **extra, "PYTHONPATH": os.pathsep.join([str(ROOT / "scripts" / "e2e"),
                                                                     str(ROOT / "python")])}
        out = subprocess.run([sys.executable, "-c", SWAP_CHECK], capture_output=True, text=True, env=env,
                             timeout=180)
        assert out.returncode == 0, out.stderr[-2000:]
        return [line for line in out.stdout.splitlines() if line.startswith("RANK")]

    stock = run({})
    corrupt = run({"CPSKV_E2E": "1", "CPSKV_E2E_CORRUPT_SEND_RANK": "1"})
    assert corrupt[0] == stock[0]  # rank 0 untouched
    stock_pages, corrupt_pages = stock[1].split("]")[0], corrupt[1].split("]")[0]
    # its first page goes to the second page's place too: one page's keys lost (a swap would
    # only reorder keys, which attention and the top-k cannot see)
    assert stock_pages.startswith("RANK 1 [np.int32(1), np.int32(2),")
    assert corrupt_pages.startswith("RANK 1 [np.int32(1), np.int32(1),")
    assert stock[1].split("]")[1] == corrupt[1].split("]")[1]  # the same positions


def test_a_failed_run_is_reported_and_the_others_still_run(pd, tmp_path, monkeypatch):
    answer = {"decode": {"status": "ok", "ids": [1], "logprobs": [-0.5]}, "prefill": {"status": "ok"}}
    started = []

    def run_servers(name, args, work, room_base):
        started.append(name)
        if name == "on":
            raise RuntimeError("on prefill: server exited with 1; see on.log")
        return {"prompts": {p: answer for p in pd.prompts()}, "startup": {}, "stable_topk_problems": []}

    monkeypatch.setattr(pd, "run_servers", run_servers)
    (tmp_path / "work").mkdir()
    (tmp_path / "work" / "on.cp2.bfloat16.json").write_text("{}")  # a stale run of an earlier call
    monkeypatch.setattr(sys, "argv", ["e2e_pd_gpu.py", "--runs", "on,off_b", "--workdir", str(tmp_path / "work"),
                                      "--logdir", str(tmp_path / "logs"), "--out", str(tmp_path / "pd.json")])
    assert pd.main() == 1
    report = json.loads((tmp_path / "pd.json").read_text())
    assert started == ["on", "off_b"]  # off_b still ran
    assert report["failed_runs"] == {"on": "RuntimeError: on prefill: server exited with 1; see on.log"}
    assert report["runs"] == ["off_b"] and not report["pass"]
    assert not (tmp_path / "work" / "on.cp2.bfloat16.json").exists()
    assert (tmp_path / "logs").is_dir()


def test_a_run_whose_ranks_did_not_all_take_the_stable_topk_fails_its_check(pd):
    from sglang_cp_shared_kv_testing.server import stable_topk_problem

    assert stable_topk_problem({"stable_topk_processes": 3}, "on prefill", Path("p.log"), 2) is None
    problem = stable_topk_problem({"stable_topk_processes": 1}, "on prefill", Path("p.log"), 2)
    assert "1 server process(es) reported it, fewer than its 2 TP rank(s)" in problem


def test_the_abort_probe_waits_for_the_last_chunk_handed_over_on_the_ranks_whose_writes_run(pd, monkeypatch):
    """The on_abort probe aborts only once every chunk is computed AND the ranks whose writes
    run have sent the request's index pages (SGLang hands them over with the last chunk, right
    after it queues the request for transfer): an earlier abort lands where 0.5.12.post1 never
    honours it. The held rank's own index pages do not count."""
    metric = pd.PAGES_SENT_METRIC
    expected = -(-len(pd.prompts()["chunked"]) // pd.CHUNK) * 2  # forwards of the chunked prompt on 2 ranks
    samples = {"forwards": 0, "state": {0: 0, 1: 0}}

    def prometheus(port, name):
        if name == metric:
            return {f'{{cp_rank="{r}",kind="{kind}"}}': float(n if kind == "state" else 99)
                    for r, n in samples["state"].items() for kind in ("kv", "state")}
        return {'{cp_rank="0"}': float(samples["forwards"])}

    posted, polls = [], []

    def tick(_seconds):  # each poll of the probe: the server moves on
        polls.append(1)
        if len(polls) == 3:
            samples["forwards"] = expected  # every chunk computed on both ranks
        if len(polls) == 4:
            samples["state"][1] = 7  # the held rank's pages count for nothing
        if len(polls) == 6:
            samples["state"][0] = 5  # rank 0 handed its last chunk over

    def generate(ports, ids, room, timeout, rid, meanwhile):
        meanwhile(pd.time.monotonic())
        return {"decode": {"status": "aborted"}}

    import time
    from types import SimpleNamespace

    monkeypatch.setattr(pd, "prometheus_samples", prometheus)
    monkeypatch.setattr(pd, "time", SimpleNamespace(sleep=tick, monotonic=time.monotonic))  # this script's only
    monkeypatch.setattr(pd, "post", lambda port, path, body: posted.append((path, len(polls))))
    monkeypatch.setattr(pd, "generate_pd", generate)
    entry = pd.probe_abort({"prefill": 1, "decode": 2}, room=7, cp_size=2)
    assert posted == [("/abort_request", 6)]  # not at the forward count (poll 3), not for rank 1 (poll 4)
    record = entry["abort"]
    assert record["forwards_before_abort"] == record["forwards_expected"] == expected
    assert record["last_chunk_handed_over"] is True
