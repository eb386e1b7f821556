"""scripts/soak_pd.py on CPU: its load (deterministic from a seed), its clients (aborts and
walk-aways the servers see), its checks and its report, run against a stand-in PD pair whose
pages, radix cache, ranks and answers are known -- a stand-in that leaks a page, hangs a
request or answers from KV a killed rank never sent must fail the check made for it; the
server commands SGLang's parser takes; and the idle pool audit
(``sglang_cp_shared_kv.observability.idle_pool_audit_v0512``) on SGLang's own idle-check mixin, allocator and
radix cache."""

from __future__ import annotations

import argparse
import collections
import json
import math
import select
import socket
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from sglang_cp_shared_kv.settings.config import FLAG, FLAG_DEST
from sglang_cp_shared_kv_testing.support import free_port, load_script

PAGE = 64


@pytest.fixture(scope="module")
def soak():
    return load_script("soak_pd")


# ----------------------------------------------------------------------------- the load
def _shape(soak, cp_size=4, pool=1024):
    args = argparse.Namespace(cp_size=cp_size, pool=pool, abort_window=3.0)
    return soak.shape_of(args)


def test_the_plan_is_the_seeds_and_covers_every_kind_and_action(soak):
    from sglang_cp_shared_kv_testing.pd_load import SPLIT_MULTIPLE, kind_ranges, plan_load

    shape = _shape(soak)
    plan = plan_load(7, 200, shape)
    assert plan == plan_load(7, 200, shape) and plan != plan_load(8, 200, shape)
    assert [r.index for r in plan] == list(range(200))
    assert {r.kind for r in plan} == {"fresh", "prefix", "long", "decode_over", "decode_window"}
    assert {r.action for r in plan} == {"none", "abort", "abandon"}
    assert all(r.tokens % SPLIT_MULTIPLE == 0 and 16 <= r.tokens <= shape.prefill_limit for r in plan)
    ranges = kind_ranges(shape)
    for r in plan:
        if r.kind != "prefix":
            assert ranges[r.kind][0] <= r.tokens <= ranges[r.kind][1], r
        else:
            assert r.tokens <= shape.decode_limit
    # several times one rank's pool, under the logical pool; decode holds the long ones only
    assert max(r.tokens for r in plan if r.kind == "long") > 2.5 * shape.pool
    assert shape.decode_limit < min(r.tokens for r in plan if r.kind == "decode_window") <= shape.decode_pool
    assert shape.decode_pool < min(r.tokens for r in plan if r.kind == "decode_over")
    # stock decode holds the window case for good: it comes in the load's last tenth
    assert min(r.index for r in plan if r.kind == "decode_window") >= 180
    assert all(r.action == "none" for r in plan if r.kind.startswith("decode_"))
    assert all(0 < r.action_after_s <= 3.0 for r in plan if r.action != "none")


def test_prefix_prompts_share_their_prefix_and_nothing_else_does(soak):
    from sglang_cp_shared_kv_testing.pd_load import plan_load, prefix_ids

    shape = _shape(soak)
    plan = plan_load(7, 200, shape)
    by_prefix = collections.defaultdict(list)
    for r in plan:
        if r.kind == "prefix":
            by_prefix[r.prefix].append(r)
    assert len(by_prefix) == 4
    for k, reqs in by_prefix.items():
        head = prefix_ids(7, shape, k)
        assert len(head) % PAGE == 0 and len(head) == shape.prefix_tokens(k)
        for r in reqs[:3]:
            ids = r.ids(7, shape)
            assert len(ids) == r.tokens and ids[:len(head)] == head
    fresh = [r for r in plan if r.kind == "fresh"][:2]
    assert fresh[0].ids(7, shape)[:16] != fresh[1].ids(7, shape)[:16]


def test_request_ids_are_no_prefix_of_one_another():
    from sglang_cp_shared_kv_testing.pd_load import rid_of

    rids = [rid_of("soak-on", i) for i in range(1200)] + [rid_of("soak-on-seq", i) for i in range(20)]
    assert not [a for a in rids for b in rids if a != b and b.startswith(a)]  # SGLang aborts by prefix


def test_latency_summary():
    from sglang_cp_shared_kv_testing.pd_load import latency_summary

    assert latency_summary([]) == {"count": 0}
    s = latency_summary([float(x) for x in range(1, 101)])
    assert (s["count"], s["p50_s"], s["p90_s"], s["p99_s"], s["max_s"], s["mean_s"]) == (100, 50.0, 90.0, 99.0,
                                                                                         100.0, 50.5)


# ------------------------------------------------------------------ the servers it starts
def _args(soak, cp_size=4, dtype="bfloat16", share_gpu=True, **extra):
    extra.setdefault("hicache_ratio", None)
    return argparse.Namespace(model=Path("/models/tiny"), kv_cache_dtype=dtype, cp_size=cp_size, stock_topk=False,
                              share_gpu=share_gpu, port=33000, pool=soak.POOL, decode_max_running_requests=None,
                              **extra)


@pytest.mark.parametrize("phase,dtype,hicache_ratio", [("on", "bfloat16", None), ("off", "fp8_e4m3", None),
                                                       ("fault", "bfloat16", None), ("on", "fp8_e4m3", 2.0),
                                                       ("off", "bfloat16", 2.0)])
def test_server_commands_parse_with_sglangs_parser(soak, plugin_loaded, phase, dtype, hicache_ratio):
    from sglang.srt.server_args import ServerArgs

    from sglang_cp_shared_kv_testing import shared_gpu

    parser = argparse.ArgumentParser(exit_on_error=False)
    ServerArgs.add_cli_args(parser)  # with the plugin's hooks applied: it adds the flag
    args = _args(soak, dtype=dtype, hicache_ratio=hicache_ratio)
    ports = soak.phase_ports(args, phase)
    prefill, decode = soak.server_commands(args, phase, ports)
    p = parser.parse_args(prefill[prefill.index("sglang.launch_server") + 1:])
    d = parser.parse_args(decode[decode.index("sglang.launch_server") + 1:])
    # --hicache-ratio: the prefill's host tier (write-through: a prefix is backed up as it is cached)
    assert p.enable_hierarchical_cache == bool(hicache_ratio) and not d.enable_hierarchical_cache
    if hicache_ratio:
        assert p.hicache_ratio == hicache_ratio and p.hicache_write_policy == "write_through"
    assert (p.disaggregation_mode, d.disaggregation_mode) == ("prefill", "decode")
    assert p.max_total_tokens == soak.POOL and d.max_total_tokens == soak.decode_pool_for(4, soak.POOL) == 3584
    assert p.chunked_prefill_size == soak.CHUNK and p.tensor_parallel_size == 4 and d.tensor_parallel_size == 1
    assert p.enable_metrics and d.enable_metrics  # the idle pool audit is read from /metrics
    flag_on = phase != "off"
    assert (FLAG in prefill) == flag_on and (FLAG in decode) == flag_on
    assert p.mem_fraction_static == d.mem_fraction_static == shared_gpu.MEM_FRACTION_STATIC
    assert (p.port, d.port, p.disaggregation_bootstrap_port) == (ports["prefill"], ports["decode"], ports["bootstrap"])
    env = soak.phase_env(args, phase)
    assert env["SGLANG_ENABLE_STRICT_MEM_CHECK_DURING_IDLE"] == "0"  # a leak is logged and measured, not fatal
    assert env["SGLANG_DISAGGREGATION_WAITING_TIMEOUT"] == str(
        soak.FAULT_WAITING_TIMEOUT_S if phase == "fault" else soak.WAITING_TIMEOUT_S)
    assert (env.get("SGLANG_DISAGGREGATION_ALL_CP_RANKS_TRANSFER") == "1") == flag_on
    assert env["CPSKV_E2E_STABLE_TOPK"] == "1" and env["CPSKV_E2E_SHARE_GPU"] == "1"


def test_phases_take_ports_of_their_own(soak):
    args = _args(soak)
    used = set()
    for name in soak.PHASES:
        ports = set(soak.phase_ports(args, name).values())
        assert len(ports) == 5 and not used & ports
        used |= ports


def test_the_soak_refuses_bad_arguments(tmp_path):
    script = Path(__file__).resolve().parents[2] / "scripts" / "soak_pd.py"
    for argv, message in ((["--cp-size", "1"], "choose one of (2, 4, 8)"), (["--cp-size", "3"], "choose one of"),
                          (["--phases", "on,bogus"], "phases ['bogus']"),
                          (["--kill-rank", "4"], "a CP rank of 4"),
                          (["--hicache-ratio", "1"], "more than 1")):
        proc = subprocess.run([sys.executable, str(script), *argv, "--workdir", str(tmp_path)], capture_output=True,
                              text=True, timeout=180)
        assert proc.returncode == 2 and message in proc.stderr, proc.stderr[-500:]


def test_scheduler_processes_are_found_by_their_title(soak):
    """The fault phase kills a CP rank by the title SGLang gives its scheduler process."""
    group = _rank_processes(3)
    try:
        pids = _wait_for_ranks(soak, group.pid, 3)
        assert sorted(pids) == [0, 1, 2]
        killer = soak.RankKiller(group.pid, rank=1, after=2)
        killer(1)
        assert killer.record == {}  # not yet
        killer(2)
        assert killer.record["pid"] == pids[1] and killer.record["requests_ended"] == 2
        deadline = time.monotonic() + 10
        while 1 in soak.scheduler_pids(group.pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert sorted(soak.scheduler_pids(group.pid)) == [0, 2]
        killer(3)  # once only
        assert killer.record["requests_ended"] == 2
    finally:
        from sglang_cp_shared_kv_testing.server import stop

        stop(group, grace_s=2)


def _rank_processes(cp_size):
    """A process group holding one stand-in scheduler process per rank, titled as SGLang's."""
    body = " ".join(f"(exec -a sglang::scheduler_ATTN_CP{r}_TP{r} sleep 600) &" for r in range(cp_size))
    return subprocess.Popen(["bash", "-c", f"{body} wait"], start_new_session=True)


def _wait_for_ranks(soak, group, count):
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        pids = soak.scheduler_pids(group)
        if len(pids) == count:
            return pids
        time.sleep(0.05)
    raise AssertionError(f"stand-in ranks not up: {soak.scheduler_pids(group)}")


# --------------------------------------------------------------------------- the idle audit
def _scheduler(cp_size=4, rank=1, pages_per_rank=8, flag=True, decode=False):
    """SGLang's idle-check mixin over a real shared-KV (or stock) allocator and radix cache."""
    from sglang.srt.managers.scheduler_runtime_checker_mixin import SchedulerRuntimeCheckerMixin
    from sglang.srt.mem_cache.allocator import PagedTokenToKVPoolAllocator
    from sglang.srt.mem_cache.cache_init_params import CacheInitParams
    from sglang.srt.mem_cache.memory_pool import ReqToTokenPool
    from sglang.srt.mem_cache.radix_cache import RadixCache

    from sglang_cp_shared_kv.pool.allocator import CpSharedPagedTokenToKVPoolAllocator
    from sglang_cp_shared_kv.cp_shared_kv_layout import CpSharedKVLayout

    class Scheduler(SchedulerRuntimeCheckerMixin):
        is_hybrid_swa = is_hybrid_ssm = enable_hisparse = False
        last_batch = running_batch = None
        idle = True

        def is_fully_idle(self):
            return self.idle

    if decode:
        allocator = PagedTokenToKVPoolAllocator(pages_per_rank * PAGE, PAGE, torch.bfloat16, "cpu", None, True)
    else:
        layout = CpSharedKVLayout(PAGE, cp_size, rank)
        kvcache = SimpleNamespace(cp_layout=layout, physical_size=pages_per_rank * PAGE)
        allocator = CpSharedPagedTokenToKVPoolAllocator(pages_per_rank * PAGE * cp_size, PAGE, torch.bfloat16, "cpu",
                                                        kvcache, True)
    requests = ReqToTokenPool(4, 4096, "cpu", False)
    s = Scheduler()
    s.token_to_kv_pool_allocator, s.req_to_token_pool = allocator, requests
    s.tree_cache = RadixCache(CacheInitParams(disable=False, req_to_token_pool=requests,
                                              token_to_kv_pool_allocator=allocator, page_size=PAGE))
    s.max_total_num_tokens = allocator.size
    s.server_args = SimpleNamespace(**{FLAG_DEST: flag, "disaggregation_mode": "decode" if decode else "prefill"})
    s.enable_metrics, s.forward_ct, s.tp_rank = True, 0, 0
    return s


def _cache(s, pages, start=0):
    from sglang.srt.mem_cache.base_prefix_cache import InsertParams
    from sglang.srt.mem_cache.radix_cache import RadixKey

    locs = s.token_to_kv_pool_allocator.alloc(pages * PAGE)
    s.tree_cache.insert(InsertParams(key=RadixKey(list(range(start, start + pages * PAGE))), value=locs))
    return locs


def _check(s):
    """SGLang's own idle check, with the audit hook after it (as the plugin registers it)."""
    from sglang_cp_shared_kv.observability import idle_pool_audit_v0512 as idle_pool_audit

    result = s._check_all_pools(s.get_pool_stats())
    return idle_pool_audit.audit_idle_pools(result, s, s.get_pool_stats())


def _published(rank):
    import prometheus_client

    from sglang_cp_shared_kv.observability.idle_pool_audit_v0512 import AUDIT_METRIC, FIELDS

    return {f: prometheus_client.REGISTRY.get_sample_value(AUDIT_METRIC, {"rank": str(rank), "field": f})
            for f in FIELDS}


def test_the_idle_audit_finds_the_page_sglangs_check_counts_and_names_its_rank():
    from sglang_cp_shared_kv.observability import idle_pool_audit_v0512 as idle_pool_audit

    s = _scheduler(cp_size=4, rank=1)
    _cache(s, 5)
    has_leak, _ = _check(s)
    whole = _published(1)
    assert not has_leak and not idle_pool_audit.leak_found(whole)
    assert (whole["pages"], whole["free_pages"], whole["cached_pages"], whole["leaked_pages"]) == (32, 27, 5, 0)
    assert (whole["rank_pages"], whole["rank_free_pages"] + whole["rank_cached_pages"]) == (8, 8)
    assert whole["total_tokens"] == 32 * PAGE and whole["evictable_tokens"] == 5 * PAGE
    assert whole["audits"] == 1 and whole["checked_at_unix_s"] > time.time() - 60
    lost = s.token_to_kv_pool_allocator.alloc(PAGE)  # allocated, then forgotten: neither free nor cached
    s.forward_ct += 1
    has_leak, _ = _check(s)
    leaked = _published(1)
    assert has_leak  # SGLang's own count sees it ...
    assert leaked["sglang_leak"] == 1 and leaked["accounted_minus_total_tokens"] == -PAGE
    assert leaked["leaked_pages"] == 1 and leaked["leak_audits"] == 1  # ... the audit names the page's owner:
    owner = (int(lost[0]) // PAGE - 1) % 4
    assert leaked["rank_leaked_pages"] == (owner == 1)
    assert idle_pool_audit.leak_found(leaked)


def test_a_node_evicted_to_host_memory_holds_no_device_page():
    """HiCache keeps a node whose KV it evicted to host memory with no device value (as
    ``HiRadixCache._evict_backuped`` leaves it): the audit walks past it, its pages free."""
    from sglang_cp_shared_kv.observability import idle_pool_audit_v0512 as idle_pool_audit

    s = _scheduler(cp_size=6, rank=5, pages_per_rank=4)  # (rank 5: published by no other test)
    _cache(s, 2)
    _cache(s, 3, start=10_000)
    node = next(n for n in s.tree_cache.root_node.children.values() if len(n.value) == 3 * PAGE)
    # what HiRadixCache does on a device eviction of a backed-up node
    s.token_to_kv_pool_allocator.free(node.value)
    s.tree_cache.evictable_size_ -= len(node.value)
    node.value = None
    has_leak, _ = _check(s)
    record = _published(5)
    assert not has_leak and not idle_pool_audit.leak_found(record)
    assert (record["pages"], record["cached_pages"], record["free_pages"], record["leaked_pages"]) == (24, 2, 22, 0)


def test_a_double_free_a_count_can_hide_is_caught_page_by_page():
    """A page freed twice balances a page leaked elsewhere in SGLang's count; the page
    listing catches both."""
    from sglang_cp_shared_kv.observability import idle_pool_audit_v0512 as idle_pool_audit

    s = _scheduler()
    cached = _cache(s, 3)
    allocator = s.token_to_kv_pool_allocator
    allocator.alloc(PAGE)  # leaked
    allocator.free(cached[:PAGE])  # still cached, and now free too
    has_leak, _ = _check(s)
    record = _published(1)
    assert not has_leak  # the count balances
    assert record["leaked_pages"] == 1 and record["double_listed_pages"] == 1
    assert idle_pool_audit.leak_found(record)


def test_decode_is_audited_as_one_rank_with_its_preallocation_slots():
    from sglang_cp_shared_kv.observability import idle_pool_audit_v0512 as idle_pool_audit

    s = _scheduler(decode=True, pages_per_rank=16)
    s.req_to_token_pool.pre_alloc_size = 0  # SGLang's decode pool keeps extra slots; the stand-in none
    _check(s)
    record = _published(0)
    assert record["cp_size"] == 1 and record["rank_pages"] == record["pages"] == 16
    assert record["free_pages"] == 16 and not idle_pool_audit.leak_found(record)


def test_the_audit_runs_only_idle_with_the_flag_and_metrics_and_refreshes():
    from sglang_cp_shared_kv.observability import idle_pool_audit_v0512 as idle_pool_audit

    s = _scheduler(rank=2)
    s.idle = False  # SGLang's watchdog calls the check mid-batch too
    _check(s)
    assert _published(2)["audits"] is None
    s.idle = True
    _check(s)
    _check(s)  # nothing changed, within REFRESH_S: not again
    assert _published(2)["audits"] == 1
    s.forward_ct += 1
    _check(s)
    assert _published(2)["audits"] == 2
    stock = _scheduler(rank=3, flag=False)
    _check(stock)
    no_metrics = _scheduler(rank=3)
    no_metrics.enable_metrics = False
    _check(no_metrics)
    assert _published(3)["audits"] is None
    # a failing audit never disturbs SGLang's check, and stays off
    broken = _scheduler(rank=3)
    broken.tree_cache = None
    result = (False, ["msg"])
    assert idle_pool_audit.audit_idle_pools(result, broken) is result
    assert broken.__dict__["_cp_shared_kv_idle_pool_audit"].audits == -1


HOOKED = """
import sys
sys.path.insert(0, sys.argv[1])
from sglang.srt.plugins.hook_registry import HookRegistry
from sglang_cp_shared_kv.observability import idle_pool_audit_v0512 as idle_pool_audit
from sglang_cp_shared_kv.hook_check import HookSpec, missing_hooks, register_hooks
import test_soak_pd_script as t
spec = HookSpec("sglang.srt.managers.scheduler_runtime_checker_mixin.SchedulerRuntimeCheckerMixin._check_all_pools",
                idle_pool_audit.audit_idle_pools, "after")
register_hooks([spec])
HookRegistry.apply_hooks()
s = t._scheduler(rank=2)
t._cache(s, 2)
print("MISSING", missing_hooks([spec]), "CHECK", s._check_all_pools(s.get_pool_stats())[0])
print("PUBLISHED", t._published(2)["cached_pages"], t._published(2)["audits"])
"""


def test_registered_as_the_plugin_would_the_audit_runs_after_sglangs_own_check():
    """The HookSpec the plugin's table takes (AFTER SchedulerRuntimeCheckerMixin._check_all_pools),
    applied by SGLang's HookRegistry: in place (the startup check finds it) and publishing
    when SGLang's own check runs. In a fresh interpreter: registration is process-wide."""
    out = subprocess.run([sys.executable, "-c", HOOKED, str(Path(__file__).parent)], capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    lines = [line for line in out.stdout.splitlines() if line.startswith(("MISSING", "PUBLISHED"))]
    assert lines == ["MISSING [] CHECK False", "PUBLISHED 2.0 1.0"], out.stdout[-2000:]


# ----------------------------------------------------------------- the stand-in PD pair
class FakePD:
    """A PD pair in this process, answering as the soak reads SGLang: the prefill takes a
    prompt once decode registered its room (else it fails it after BOOTSTRAP_S), finds its
    page-aligned prefix in a radix cache (LRU pages, evicted when the logical pool runs
    short), holds its other pages while it waits its turn and "computes" (one prompt at a
    time, a time per token), caches its full
    pages and frees the rest; an abort (``/abort_request`` or the client walking away) frees
    them and tells decode the cause. Decode refuses what it can never hold (the flag's
    guard), preallocates, waits for the room (WAITING_S), answers 8 tokens and logprobs that
    depend on the prompt only. Both publish the idle pool audit when nothing runs, and the
    prefill its pages sent per rank. Stand-in scheduler processes (one per rank, titled as
    SGLang's) can be killed: the prefill then never finishes a room again.

    Faults on purpose: ``leak_at`` (the first request finishing at or after that index keeps
    one page, neither free nor cached), ``hang_at`` (decode never answers that request),
    ``answer_unsent`` (after a rank died, decode answers rooms whose KV never came, wrongly)."""

    BOOTSTRAP_S, WAITING_S, S_PER_TOKEN, POLL_S = 4.0, 3.0, 4e-5, 0.002

    def __init__(self, tmp_path: Path, name: str, *, cp_size, pool, decode_pool, flag_on, share_gpu=True,
                 leak_at=None, hang_at=None, answer_unsent=False, vocab=8192):
        self.cp_size, self.flag_on, self.vocab = cp_size, flag_on, vocab
        self.leak_at, self.hang_at, self.answer_unsent = leak_at, hang_at, answer_unsent
        self.decode_pool = decode_pool
        self.prefill_limit = (cp_size if flag_on else 1) * pool - 2 * PAGE
        self.cv = threading.Condition()
        self.rooms, self.aborted, self.busy = {}, set(), 0
        self.p_pages = cp_size * pool // PAGE
        self.p_free, self.cache, self.protected = list(range(1, self.p_pages + 1)), collections.OrderedDict(), {}
        self.d_pages = decode_pool // PAGE
        self.d_free = list(range(1, self.d_pages + 1))
        self.sent = {r: {"kv": 0, "state": 0} for r in range(cp_size)}
        self.audits, self.leaked, self.disconnects, self.rank_dead, self.closed = {}, False, 0, False, False
        self.leak_logged, self.computing = False, False  # NOTE: one prompt at a time, as a CP prefill runs them
        self.queues = {}
        self.logs = {side: tmp_path / f"{name}.{side}.log" for side in ("prefill", "decode")}
        for side, ranks in (("prefill", cp_size), ("decode", 1)):
            lines = [f"[cpskv-e2e] deterministic NSA top-k (pid {r})" for r in range(ranks)]
            lines += [f"[cpskv-e2e] shared GPU: tp rank {r} (gpu {r}) on cuda:0" for r in range(ranks if share_gpu else 0)]
            self.logs[side].write_text("\n".join(lines) + "\n")
        self.ranks = _rank_processes(cp_size)
        self.decode_proc = subprocess.Popen(["sleep", "600"], start_new_session=True)
        self.servers = {side: self._server(side) for side in ("prefill", "decode")}
        self.ports = {"prefill": self.servers["prefill"].server_address[1],
                      "decode": self.servers["decode"].server_address[1], "bootstrap": free_port()}
        self.watcher = threading.Thread(target=self._watch, daemon=True)
        self.watcher.start()

    # -- the pools
    def _audit(self, who, free, held_pages, pages, cp_size, rank):
        """What the plugin's idle pool audit publishes for one rank (``who``: p or d)."""
        from sglang_cp_shared_kv.observability.idle_pool_audit_v0512 import leak_found, page_accounting

        record = page_accounting(torch.tensor(free, dtype=torch.int64), torch.tensor(held_pages, dtype=torch.int64)
                                 * PAGE, PAGE, pages, cp_size, rank)
        total, available, evictable = pages * PAGE, len(free) * PAGE, len(held_pages) * PAGE
        record.update(total_tokens=total, available_tokens=available, evictable_tokens=evictable, protected_tokens=0,
                      session_held_tokens=0, sglang_leak=int(available + evictable != total),
                      accounted_minus_total_tokens=available + evictable - total, req_slots_free=8,
                      req_slots_session_held=0, req_slots_total=8, cp_size=cp_size)
        last = self.audits.get((who, rank), {"audits": 0, "leak_audits": 0})
        record.update(audits=last["audits"] + 1, leak_audits=last["leak_audits"] + int(leak_found(record)),
                      checked_at_unix_s=time.time())
        self.audits[(who, rank)] = record
        return record

    def _watch(self):
        """Audit the pools whenever nothing runs; notice a stand-in rank process that died."""
        from sglang_cp_shared_kv_testing.server import live_group_members

        all_up = False
        while not self.closed:
            with self.cv:
                if self.busy == 0:
                    records = [self._audit("p", self.p_free, list(self.cache.values()), self.p_pages, self.cp_size, r)
                               for r in range(self.cp_size)]
                    if records[0]["leaked_pages"] and not self.leak_logged:
                        with open(self.logs["prefill"], "a") as f:  # what SGLang's own idle check logs
                            f.write(f"pool memory leak detected! [full] total={records[0]['total_tokens']}\n")
                        self.leak_logged = True
                    self._audit("d", self.d_free, [], self.d_pages, 1, 0)
            members = len(live_group_members(self.ranks.pid))  # bash and one process per rank
            all_up = all_up or members == self.cp_size + 1
            if all_up and members < self.cp_size + 1:
                self.rank_dead = True
            time.sleep(0.05)

    def _take(self, free, count, evict):
        """``count`` pages from ``free`` (evicting LRU cache pages when ``evict``), first come
        first served as SGLang's queues admit (a long prompt is not starved by short ones);
        None once the pair is closed or the caller's client walked away (``give_up()``)."""
        ticket = object()
        queue = self.queues.setdefault(id(free), collections.deque())
        queue.append(ticket)
        try:
            while True:
                if queue[0] is ticket:
                    while evict and len(free) < count:
                        victim = next((k for k in self.cache if k not in self.protected), None)
                        if victim is None:
                            break
                        free.append(self.cache.pop(victim))
                    if len(free) >= count:
                        taken = free[:count]
                        del free[:count]
                        return taken
                if self.closed:
                    return None
                self.cv.wait(0.05)
        finally:
            queue.remove(ticket)
            self.cv.notify_all()

    # -- the HTTP side
    def _server(self, side):
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def _send(self, code, body, ctype="application/json"):
                data = body if isinstance(body, bytes) else json.dumps(body).encode()
                self.send_response(code)
                self.send_header("Content-Type", ctype)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def gone(self):
                """The client closed its connection (what SGLang's HTTP server aborts on)."""
                if not select.select([self.connection], [], [], 0)[0]:
                    return False
                try:
                    return self.connection.recv(1, socket.MSG_PEEK) == b""
                except OSError:
                    return True

            def do_GET(self):
                if self.path == "/health":
                    return self._send(200, b"", "text/plain")
                with fake.cv:
                    lines = []
                    for (who, rank), record in sorted(fake.audits.items()):
                        if (who == "p") == (side == "prefill") and fake.flag_on:
                            lines += [f'sglang:cp_shared_kv_idle_pool_audit{{rank="{rank}",field="{f}"}} {v}'
                                      for f, v in record.items()]
                    if side == "prefill" and fake.flag_on:
                        lines += [f'sglang:cp_shared_kv_transfer_pages_total{{cp_rank="{r}",kind="{k}"}} {n}'
                                  for r, kinds in fake.sent.items() for k, n in kinds.items()]
                self._send(200, "\n".join(lines).encode(), "text/plain")

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])) or b"null")
                if self.path == "/abort_request":
                    with fake.cv:
                        fake.aborted.add(body["rid"])
                        fake.cv.notify_all()
                    return self._send(200, {})
                if self.path == "/flush_cache":
                    with fake.cv:
                        if fake.busy:
                            return self._send(400, b"Cache not flushed because there are pending requests",
                                              "text/plain")
                        fake.p_free += list(fake.cache.values())
                        fake.cache.clear()
                    return self._send(200, b"Cache flushed.", "text/plain")
                with fake.cv:
                    fake.busy += 1
                try:
                    code, answer = (fake.prefill if side == "prefill" else fake.decode)(self, body)
                    if code is not None:
                        self._send(code, answer)
                finally:
                    with fake.cv:
                        fake.busy -= 1
                        fake.cv.notify_all()

        server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        server.daemon_threads = True
        threading.Thread(target=server.serve_forever, daemon=True).start()
        return server

    def _room(self, room):
        return self.rooms.setdefault(room, {"registered": False, "state": None, "cause": None})

    @staticmethod
    def _finish(message):
        return {"meta_info": {"finish_reason": {"type": "abort", "message": message}}}

    def prefill(self, handler, body):
        ids, rid, room = body["input_ids"], body.get("rid", ""), body["bootstrap_room"]
        if len(ids) > self.prefill_limit:
            with self.cv:  # NOTE: stock sends decode a one-token stand-in, which decode answers from
                self._room(room)["state"] = "unsent"  # KV that never came (docs/troubleshooting.md)
                self.cv.notify_all()
            return 400, {"error": {"message": f"Input length ({len(ids)} tokens) exceeds the maximum allowed length"}}
        index = int(rid.rsplit("-", 1)[1]) if rid.rsplit("-", 1)[-1].isdigit() else -1
        with self.cv:
            state = self._room(room)
            deadline = time.monotonic() + self.BOOTSTRAP_S
            while not state["registered"] and time.monotonic() < deadline and rid not in self.aborted:
                self.cv.wait(0.01)
            if not state["registered"] or rid in self.aborted:
                state.update(state="failed", cause=f"cause: prefill CP rank 0 of {self.cp_size}: room {room} ends "
                                                   "unsent: the prefill aborted the request before it ran")
                self.cv.notify_all()
                return 200, self._finish("bootstrap timeout" if rid not in self.aborted else "aborted")
            cached = []
            while len(cached) < (len(ids) - 1) // PAGE and tuple(ids[:PAGE * (len(cached) + 1)]) in self.cache:
                key = tuple(ids[:PAGE * (len(cached) + 1)])
                self.cache.move_to_end(key)
                cached.append(key)
            for key in cached:
                self.protected[key] = self.protected.get(key, 0) + 1
            pages = self._take(self.p_free, -(-len(ids) // PAGE) - len(cached), evict=True)
            ran = False
            while self.computing and rid not in self.aborted and not handler.gone() and not self.closed:
                self.cv.wait(self.POLL_S)  # its turn
            if not (rid in self.aborted or handler.gone() or self.closed):
                self.computing = ran = True
        outcome = None if ran else "aborted"
        end = time.monotonic() + self.S_PER_TOKEN * (len(ids) - PAGE * len(cached))
        while outcome is None:  # "computing"
            with self.cv:
                if rid in self.aborted or handler.gone():
                    outcome = "aborted"
                elif self.rank_dead:
                    outcome = None  # NOTE: a prefill that lost a rank never finishes the room
                elif time.monotonic() >= end:
                    outcome = "done"
                if outcome is None:
                    if handler.gone() or self.closed:
                        outcome = "aborted"
                    else:
                        self.cv.wait(self.POLL_S)
        with self.cv:
            self.computing = self.computing and not ran
            for key in cached:
                self.protected[key] -= 1
                if not self.protected[key]:
                    del self.protected[key]
            if outcome == "aborted":
                self.disconnects += handler.gone()
                self.p_free += pages
                when = "before sending all of its KV" if ran else "before it ran"
                state.update(state="failed", cause=f"cause: prefill CP rank 1 of {self.cp_size}: room {room} ends "
                                                   f"unsent: the prefill aborted the request {when}")
                self.cv.notify_all()
                return (200, self._finish("Abort in waiting queue")) if not handler.gone() else (None, None)
            full = len(ids) // PAGE - len(cached)
            for i in range(full):
                key = tuple(ids[:PAGE * (len(cached) + i + 1)])
                if key in self.cache:
                    self.p_free.append(pages[i])
                else:
                    self.cache[key] = pages[i]
            rest = pages[full:]
            if self.leak_at is not None and index >= self.leak_at and not self.leaked and rest:
                self.leaked = True
                rest = rest[1:]  # kept by no one
            self.p_free += rest
            for p in range(len(cached), -(-len(ids) // PAGE)):
                self.sent[p % self.cp_size]["kv"] += 1
                self.sent[p % self.cp_size]["state"] += 1
            state["state"] = "done"
            self.cv.notify_all()
        return 200, {"meta_info": {"cached_tokens": PAGE * len(cached), "finish_reason": {"type": "length"}}}

    def _answer(self, ids, wrong=False):
        seed = sum(ids) + 7 * len(ids) + (13 if wrong else 0)
        out = [(seed * (k + 3)) % self.vocab for k in range(8)]
        logprobs = [-((seed + k) % 997) / 100.0 for k in range(8)]
        return {"output_ids": out, "meta_info": {"output_token_logprobs": [[lp, t, None] for lp, t in zip(logprobs, out)],
                                                 "finish_reason": {"type": "length"}}}

    def decode(self, handler, body):
        ids, rid, room = body["input_ids"], body.get("rid", ""), body["bootstrap_room"]
        index = int(rid.rsplit("-", 1)[1]) if rid.rsplit("-", 1)[-1].isdigit() else -1
        if self.flag_on and len(ids) + 512 > self.decode_pool:
            return 400, {"error": {"message": f"Request {rid}: {FLAG}: this decode server can never hold the request"}}
        if len(ids) > self.decode_pool:
            return 400, {"error": {"message": "exceeds the maximum number of tokens"}}
        with self.cv:
            if len(ids) + 512 > self.decode_pool or index == self.hang_at:  # stock's window case; the hang on purpose
                while not handler.gone() and not self.closed:
                    self.cv.wait(0.02)
                return None, None
            pages = self._take(self.d_free, -(-(len(ids) + 8) // PAGE), evict=False)
            state = self._room(room)
            state["registered"] = True
            self.cv.notify_all()
            deadline = time.monotonic() + self.WAITING_S
            while state["state"] is None and time.monotonic() < deadline and not handler.gone():
                if self.rank_dead and self.answer_unsent:
                    break
                self.cv.wait(0.01)
            self.d_free += pages
            if handler.gone():
                return None, None
            if state["state"] == "done":
                return 200, self._answer(ids)
            if state["state"] == "unsent" or state["state"] is None and self.rank_dead and self.answer_unsent:
                return 200, self._answer(ids, wrong=True)  # answered from KV that never came
            cause = state["cause"] or f"Request {room} timed out after {self.WAITING_S}s in KVPoll.WaitingForInput"
            return 200, self._finish(f"Failed to get kvcache from prefill instance, it might be dead; {cause}")

    def pair(self, soak):
        fake = self

        class FakePair(soak.Pair):
            def stop(self):
                fake.closed = True
                with fake.cv:
                    fake.cv.notify_all()
                for server in fake.servers.values():
                    server.shutdown()
                    server.server_close()
                super().stop()

        return FakePair(self.ports, {"prefill": self.ranks, "decode": self.decode_proc}, self.logs)


def _soak_with(monkeypatch, soak, tmp_path, argv, work=None, **faults):
    """Run the soak's main against FakePD pairs (``faults`` for the named phases:
    ``{phase: {leak_at: ...}}``; ``work``: the work folder, default under ``tmp_path``); its
    report and the stand-ins."""
    fakes = {}

    def launch_pair(name, args, ports, commands, env, logs):
        fake = FakePD(tmp_path, name, cp_size=args.cp_size, pool=args.pool,
                      decode_pool=soak.decode_pool_for(args.cp_size, args.pool), flag_on=soak.PHASES[name].flag_on,
                      **faults.get(name, {}))
        # NOTE: the soak reads the logs it named
        for side in ("prefill", "decode"):
            logs[side].write_text(fake.logs[side].read_text())
            fake.logs[side] = logs[side]
        fakes[name] = fake
        return fake.pair(soak)

    monkeypatch.setattr(soak, "launch_pair", launch_pair)
    monkeypatch.setattr(soak, "SETTLE_S", 0.3)
    monkeypatch.setattr(soak, "IDLE_WAIT_S", 15)
    monkeypatch.setattr(soak, "FAULT_BOUND_S", 8)
    monkeypatch.setattr(soak, "FAULT_PREFILL_GRACE_S", 0.3)
    monkeypatch.setattr(soak, "STOCK_PATIENCE_S", 3)
    out = tmp_path / "soak.json"
    monkeypatch.setattr(sys, "argv", ["soak_pd.py", "--workdir", str(work or tmp_path / "work"), "--out", str(out),
                                      "--share-gpu", "--cp-size", "4", "--abort-window", "0.3", "--bound", "8",
                                      "--load-deadline", "120", *argv])
    status = soak.main()
    report = json.loads(out.read_text())
    assert status == (0 if report["pass"] else 1)
    return report, fakes


@pytest.fixture(scope="module")
def clean_run(tmp_path_factory):
    """One soak of on and off (200 requests, 8 clients) against stand-ins that do it right."""
    soak = load_script("soak_pd")
    tmp = tmp_path_factory.mktemp("soak")
    with pytest.MonkeyPatch.context() as mp:
        return (*_soak_with(mp, soak, tmp, ["--phases", "on,off", "--parallel", "2"]), soak, tmp / "work")


def test_a_clean_pair_passes_every_check_with_its_figures(clean_run):
    report, fakes, _, _ = clean_run
    failed = {k: v for k, v in report["checks"].items() if not v["pass"]}
    assert report["pass"] and not failed, json.dumps(failed, indent=1)[:3000]
    checks = report["checks"]
    load = checks["on: load"]
    assert load["requests"] == 200 and load["clients"] == 8 and load["not_posted"] == 0
    bound = checks["on: every request ended within the bound"]
    assert bound["decode_latency"]["count"] > 150 and bound["decode_latency"]["max_s"] <= 8
    assert set(bound["statuses"]["decode"]) >= {"ok", "http_error", "aborted", "abandoned"}
    radix = checks["on: the radix cache hit and evicted"]
    assert radix["hits"] > 0 and radix["evicted_misses"] > 0
    leak = checks["on: no page leaked on any prefill rank or on decode"]
    assert sorted(leak["audits"]["prefill"]) == ["0", "1", "2", "3"] and list(leak["audits"]["decode"]) == ["0"]
    assert all(r["rank_leaked_pages"] == 0 and r["rank_free_pages"] + r["rank_cached_pages"] == r["rank_pages"]
               for r in leak["audits"]["prefill"].values())
    assert checks["on: fresh prompts one at a time = under load, bit for bit"]["compared"] == 12
    assert checks["on one at a time = off one at a time (prompts stock serves)"]["compared"] > 0
    aborts = checks["on: aborted requests failed naming the abort or were answered right"]["landed"]
    assert sum(aborts.values()) == report["plan"]["actions"]["abort"]
    assert fakes["on"].disconnects > 0  # the walk-aways reached the server as closed connections
    # stock: recorded, never judged; its window case waited out the clients' patience
    assert report["stock"] and not any(k.startswith("off:") for k in report["checks"])
    assert not report["stock"]["off: decode refused at once what it can never hold"]["pass"]


def test_the_report_says_where_each_request_went_and_keeps_the_runs(clean_run, tmp_path):
    report, fakes, soak, _ = clean_run
    assert report["phases"] == ["off", "on"] and report["failed_phases"] == {}
    assert report["plan"]["requests"] == 200 and set(report["load_wall_s"]) == {"on", "off"}
    assert "correctness run" in report["note"]


def test_a_leaked_page_fails_the_leak_check(soak, monkeypatch, tmp_path):
    report, fakes = _soak_with(monkeypatch, soak, tmp_path, ["--phases", "on", "--sequential", "3"],
                               on={"leak_at": 5})
    assert fakes["on"].leaked
    leak = report["checks"]["on: no page leaked on any prefill rank or on decode"]
    assert not leak["pass"] and not report["pass"]
    assert any("leaked_pages" in p for p in leak["problems"])
    assert leak["sglang_leak_lines"]["prefill"] == 1  # SGLang's own idle check's line, counted too
    owners = [r for r in leak["audits"]["prefill"].values() if r["rank_leaked_pages"]]
    assert len(owners) == 1  # one rank holds the lost page
    # the load itself was fine: the other checks pass
    others = [k for k, v in report["checks"].items() if not v["pass"]]
    assert others == ["on: no page leaked on any prefill rank or on decode"], others


def test_a_hung_request_fails_the_bound_check(soak, monkeypatch, tmp_path):
    report, fakes = _soak_with(monkeypatch, soak, tmp_path, ["--phases", "on", "--sequential", "3", "--bound", "3"],
                               on={"hang_at": 4})
    bound = report["checks"]["on: every request ended within the bound"]
    assert not bound["pass"] and not report["pass"]
    assert [p["index"] for p in bound["problems"] if p["side"] == "decode"] == [4]
    assert bound["problems"][0]["status"] == "error" and "no answer within 3" in bound["problems"][0]["error"]


def _fault_soak(soak, monkeypatch, tmp_path, clean_run, **fault):
    """The fault phase in a copy of the clean run's work folder: its on phase is the
    reference (a later device call's resume, as SOAK_SEED gives it)."""
    import shutil

    work = tmp_path / "work"
    shutil.copytree(clean_run[3], work)
    return _soak_with(monkeypatch, soak, tmp_path, ["--phases", "fault", "--fault-requests", "40", "--kill-after",
                                                    "12"], work=work, fault=fault)


def test_a_killed_rank_fails_its_requests_on_decode_within_the_bound(soak, monkeypatch, tmp_path, clean_run):
    report, fakes = _fault_soak(soak, monkeypatch, tmp_path, clean_run)
    checks = report["checks"]
    for name in ("fault: a prefill CP rank killed mid-load", "fault: every request ended within the bound",
                 "fault: no answer from missing KV", "fault: no page leaked on decode", "fault: decode alive after"):
        assert checks[name]["pass"], (name, checks[name])
    kill = checks["fault: a prefill CP rank killed mid-load"]
    assert kill["kill"]["rank"] == 1 and kill["in_flight"] > 0 and kill["posted_after"] > 0
    statuses = checks["fault: every request ended within the bound"]["statuses"]
    assert statuses["decode"].get("aborted", 0) > 0 and statuses["prefill"].get("given_up", 0) > 0
    assert checks["fault: no answer from missing KV"]["compared"] > 0
    assert report["phases"] == ["fault", "off", "on"] and report["pass"]  # the earlier call's phases count


def test_an_answer_from_kv_a_dead_rank_never_sent_fails_the_fault_check(soak, monkeypatch, tmp_path, clean_run):
    report, fakes = _fault_soak(soak, monkeypatch, tmp_path, clean_run, answer_unsent=True)
    check = report["checks"]["fault: no answer from missing KV"]
    assert not check["pass"] and check["problems"] and not report["pass"]
    assert all(p["first_difference"] == 0 for p in check["problems"])


def test_verdict_parts_fail_on_what_they_are_for(soak):
    """The checks on hand-made records: an abort answered differently from its one-at-a-time
    answer, a failure without a message, ranks that disagree, a rank sending nothing."""
    ok = {"status": "ok", "ids": [1, 2], "logprobs": [-0.5, -1.0], "elapsed_s": 0.1}
    other = {**ok, "logprobs": [-0.5, -1.0 + 1e-7]}

    def request(index, kind="fresh", action="none", decode=ok, prefill=None):
        return {"index": index, "kind": kind, "tokens": 64, "action": action, "prefix": None, "posted_at_s": 0.0,
                "decode": decode, "prefill": prefill or {"status": "ok", "elapsed_s": 0.1}}

    record = {"flag_on": True, "bound_s": 10, "load": {"requests": [
        request(0, action="abort"), request(1, decode={"status": "http_error", "error": "", "elapsed_s": 0.1})]},
        "one_at_a_time": [{"index": 0, "kind": "fresh", "tokens": 64, "decode": other}]}
    aborts = soak.aborts_end_right(record)
    assert not aborts["pass"] and aborts["landed"] == {"answered, != one at a time": 1}
    assert soak.first_difference(other, ok) == 1
    bound = soak.ended_within_bound(record)
    assert not bound["pass"] and bound["problems"][0]["index"] == 1  # a failure must say why
    audit = {f: 0 for f in ("sglang_leak", "accounted_minus_total_tokens", "leaked_pages", "double_listed_pages",
                            "out_of_range_pages", "req_slots_session_held", "leak_audits", "rank_leaked_pages")}
    audit.update(req_slots_free=8, req_slots_total=8, rank_pages=4, rank_free_pages=3, rank_cached_pages=1,
                 available_tokens=100, evictable_tokens=64, free_pages=3, cached_pages=1, checked_at_unix_s=1)
    leak = soak.no_leaked_page({"idle_audit": {"audits": {"prefill": {0: audit, 1: {**audit, "free_pages": 2}},
                                                          "decode": {0: audit}}, "missing": []}, "leak_lines": {}},
                               {"prefill": 2, "decode": 1})
    assert not leak["pass"] and "disagree" in leak["problems"][0]
    assert soak.no_leaked_page({"idle_audit": {"audits": {"prefill": {0: audit, 1: audit}, "decode": {0: audit}},
                                               "missing": []}, "leak_lines": {}}, {"prefill": 2, "decode": 1})["pass"]
    assert not soak.no_leaked_page({}, {"decode": 1})["pass"]  # no audit read: no pass
    assert not soak.every_rank_sent({"pages_sent": {"0": {"kv": 3, "state": 1}, "1": {"kv": 3, "state": 0}}}, 2)["pass"]
    assert not soak.no_answer_from_missing_kv({"load": {"requests": []}}, None)["pass"]


def test_with_hicache_a_host_hit_stands_for_an_eviction_and_every_rank_must_use_the_host_tier(soak):
    """--hicache-ratio: a prefix evicted from the device comes back from host memory (a hit with
    host tokens), which the radix check counts as the eviction it is; the host-tier check wants
    every CP rank to have backed pages up and loaded pages back (Prometheus, read from JSON)."""
    shape_args = argparse.Namespace(cp_size=2, pool=soak.POOL, abort_window=3.0, hicache_ratio=2.0)
    prefix = soak.shape_of(shape_args).prefix_tokens(0)

    def prefix_request(index, cached, host=0, at=0.0):
        details = {"device": cached - host, "host": host} if host else None
        return {"index": index, "kind": "prefix", "prefix": 0, "action": "none", "posted_at_s": at,
                "prefill": {"status": "ok", "elapsed_s": 0.1, "cached_tokens": cached,
                            "cached_tokens_details": details}}

    requests = [prefix_request(0, 0), prefix_request(1, prefix, at=1.0), prefix_request(2, prefix, host=prefix, at=2.0)]
    radix = soak.radix_hits_and_evictions({"load": {"requests": requests}}, shape_args)
    assert radix["pass"] and (radix["hits"], radix["host_hits"], radix["evicted_misses"]) == (2, 1, 0)
    without_host_tier = argparse.Namespace(**{**vars(shape_args), "hicache_ratio": None})
    assert not soak.radix_hits_and_evictions({"load": {"requests": requests}}, without_host_tier)["pass"]
    assert not soak.radix_hits_and_evictions({"load": {"requests": requests[:2]}}, shape_args)["pass"]
    used = {"0": {"backed_up": 5, "loaded_back": 2}, "1": {"backed_up": 4, "loaded_back": 2}}
    assert soak.every_rank_used_the_host_tier({"hicache_pages": used}, 2)["pass"]
    short = soak.every_rank_used_the_host_tier({"hicache_pages": {**used, "1": {"backed_up": 4}}}, 2)
    assert not short["pass"] and short["ranks_short"] == [1]
    assert not soak.every_rank_used_the_host_tier({}, 2)["pass"]  # nothing read: no pass


def test_e2e_pd_gpu_keeps_its_names_after_the_move(soak):
    """scripts/e2e_pd_gpu.py and this script share sglang_cp_shared_kv_testing/pd_servers.py: the same objects."""
    from sglang_cp_shared_kv_testing import pd_servers

    pd = load_script("e2e_pd_gpu")
    assert pd.Run is pd_servers.PdRun is soak.PdRun
    assert pd.generate_pd is pd_servers.generate_pd is soak.generate_pd
    assert pd.same_answer is soak.same_answer and pd.ABORT_CAUSE == soak.ABORT_CAUSE
    assert math.isclose(pd.AT_ONCE_S, soak.AT_ONCE_S)
