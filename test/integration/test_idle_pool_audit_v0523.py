"""The idle pool audit on SGLang 0.5.23 (``observability/idle_pool_audit_v0523.py``), hooked
as the plugin's table hooks it (``plugin_loaded``: AROUND ``Scheduler.on_idle``, AFTER
``SchedulerInvariantChecker._check_all_pools``) and run by 0.5.23's real ``Scheduler.on_idle``
over its real invariant checker, pool-stats observer, ``UnifiedRadixCache`` (its default Rust
tree core, and the Python one) and request pool, with the plugin's real
``CpSharedInterleavedPagesAllocator`` (logical pages of an interleave CP rank) or, for decode,
0.5.23's stock paged allocator. The scheduler around them is a stand-in for what ``on_idle``
touches besides the pools (health checks, load publishing, sleeping). Runs only where sglang
0.5.23 is installed (``.venv-0.5.23``); 0.5.12.post1's: test_soak_pd_script.py."""

from __future__ import annotations

import time
from array import array
from types import SimpleNamespace
from unittest.mock import MagicMock

import pytest
import torch

from sglang_cp_shared_kv.releases import installed, v0523

if installed.INSTALLED is not v0523.RELEASE:
    pytest.skip(f"needs sglang {v0523.RELEASE.version}", allow_module_level=True)

from sglang_cp_shared_kv.observability import idle_pool_audit_v0523 as idle_pool_audit  # noqa: E402
from sglang_cp_shared_kv.observability.idle_pool_audit import (AUDIT_METRIC, FIELDS, STATE_ATTR,  # noqa: E402
                                                               leak_found)
from sglang_cp_shared_kv.settings.config import FLAG  # noqa: E402
from sglang_cp_shared_kv_testing.cpu_kv_configurator import CpuDsaRank, interleave_prefill_server_args  # noqa: E402

pytestmark = pytest.mark.usefixtures("plugin_loaded", "pretend_hopper", "all_cp_ranks_env")
PAGE = 64


@pytest.fixture
def lenient(monkeypatch):
    """SGLang's idle check warns on a leak instead of raising (its default raises: the server stops)."""
    monkeypatch.setenv("SGLANG_ENABLE_STRICT_MEM_CHECK_DURING_IDLE", "false")


def _published(rank):
    import prometheus_client

    return {f: prometheus_client.REGISTRY.get_sample_value(AUDIT_METRIC, {"rank": str(rank), "field": f})
            for f in FIELDS}


class Server:
    """One scheduler process of a flag-on 0.5.23 server: its runtime context (``get_parallel()``,
    ``get_observability()``) and a stand-in ``Scheduler`` holding SGLang's real pools and checks."""

    def __init__(self, model, *, cp_size=4, rank=1, pages_per_rank=8, flag=True, metrics=True, decode=False,
                 tree_core=None):
        from sglang.srt.disaggregation.utils import DisaggregationMode
        from sglang.srt.managers.scheduler_components.invariant_checker import SchedulerInvariantChecker
        from sglang.srt.managers.scheduler_components.pool_stats_observer import SchedulerPoolStatsObserver
        from sglang.srt.mem_cache.allocator import PagedTokenToKVPoolAllocator
        from sglang.srt.mem_cache.cache_init_params import CacheInitParams
        from sglang.srt.mem_cache.memory_pool import ReqToTokenPool
        from sglang.srt.mem_cache.unified_cache.components import ComponentType
        from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache

        from sglang_cp_shared_kv.cp_shared_kv_layout import CpSharedKVLayout
        from sglang_cp_shared_kv.pool.allocator import CpSharedInterleavedPagesAllocator

        extra = ((FLAG,) if flag else ()) + (("--enable-metrics",) if metrics else ())
        self.rank = CpuDsaRank(interleave_prefill_server_args(model, *extra, tp=cp_size), available_bytes=0,
                               tp_rank=rank)
        if decode:
            allocator = PagedTokenToKVPoolAllocator(pages_per_rank * PAGE, PAGE, torch.bfloat16, "cpu", None, True)
        else:
            kvcache = SimpleNamespace(cp_layout=CpSharedKVLayout(PAGE, cp_size, rank),
                                      physical_size=pages_per_rank * PAGE)
            allocator = CpSharedInterleavedPagesAllocator(pages_per_rank * PAGE * cp_size, PAGE, torch.bfloat16,
                                                          "cpu", kvcache, True)
        requests = ReqToTokenPool(4, 4096, "cpu", False)
        cache = UnifiedRadixCache(CacheInitParams(disable=False, req_to_token_pool=requests,
                                                  token_to_kv_pool_allocator=allocator, page_size=PAGE,
                                                  tree_components=(ComponentType.FULL,), tree_core_backend=tree_core))
        mode = DisaggregationMode.DECODE if decode else DisaggregationMode.PREFILL
        observer = SchedulerPoolStatsObserver(
            tree_cache=cache, token_to_kv_pool_allocator=allocator, req_to_token_pool=requests,
            session_controller=None, hisparse_coordinator=None, is_hybrid_swa=False, is_hybrid_ssm=False,
            enable_hisparse=False, full_tokens_per_layer=None, swa_tokens_per_layer=None,
            max_total_num_tokens=allocator.size)
        checker = SchedulerInvariantChecker(
            is_hybrid_swa=False, is_hybrid_ssm=False, disaggregation_mode=mode, page_size=PAGE,
            full_tokens_per_layer=None, swa_tokens_per_layer=None, max_total_num_tokens=allocator.size,
            tree_cache=cache, token_to_kv_pool_allocator=allocator, req_to_token_pool=requests,
            pool_stats_observer=observer, get_last_batch=lambda: None, get_running_batch=lambda: None,
            scheduler_stage_metrics=MagicMock())
        self.scheduler = StandInScheduler(
            server_args=self.rank.server_args, disaggregation_mode=mode, token_to_kv_pool_allocator=allocator,
            tree_cache=cache, req_to_token_pool=requests, pool_stats_observer=observer, invariant_checker=checker)
        if decode:
            self.scheduler.disagg_decode_transfer_queue = MagicMock(
                has_pending_deferred_releases=MagicMock(return_value=False))

    @property
    def allocator(self):
        return self.scheduler.token_to_kv_pool_allocator

    def cache(self, pages, start=0):
        """``pages`` fresh pages, inserted in the radix cache (unlocked: evictable)."""
        from sglang.srt.mem_cache.base_prefix_cache import InsertParams
        from sglang.srt.mem_cache.radix_cache import RadixKey

        locs = self.allocator.alloc(pages * PAGE)
        self.scheduler.tree_cache.insert(InsertParams(key=RadixKey(array("q", range(start, start + pages * PAGE))),
                                                      value=locs))
        return locs

    def on_idle(self):
        """SGLang's ``Scheduler.on_idle`` (hooked as the plugin hooks it)."""
        from sglang.srt.managers.scheduler import Scheduler

        with self.rank.active():
            Scheduler.on_idle(self.scheduler)

    def watchdog_check(self):
        """What SGLang's watchdog does mid-batch: the same check, outside ``on_idle``."""
        with self.rank.active():
            checker = self.scheduler.invariant_checker
            return checker._check_all_pools(self.scheduler.pool_stats_observer.get_pool_stats())


class StandInScheduler:
    """What ``Scheduler.on_idle`` reads of its scheduler: the pools and checks given, idle
    unless told, the rest (health checks, load publishing, sleeping) answered by mocks."""

    is_hybrid_swa = is_hybrid_ssm = enable_hisparse = enable_unified_memory = False
    enable_hicache_storage = enable_lmcache = False
    _last_stall_publish_ts = 0.0

    def __init__(self, **pools):
        self.__dict__.update(pools)
        self.idle, self.forward_ct = True, 0
        self.scheduler_stage_metrics = MagicMock()

    def is_fully_idle(self, *args, **kwargs):
        return self.idle

    def __getattr__(self, name):  # only what is not set above
        if name.startswith("__"):
            raise AttributeError(name)
        value = MagicMock(name=name)
        setattr(self, name, value)
        return value


def test_hooked_where_0523_checks_an_idle_pool(plugin_loaded):
    """Both hooks in the 0.5.23 table and in place (what startup verifies); the targets are
    where SGLang checks: on_idle calls the checker's _check_all_pools, which the watchdog calls too."""
    import inspect

    from sglang.srt.managers.scheduler import Scheduler
    from sglang.srt.managers.scheduler_components import invariant_checker

    from sglang_cp_shared_kv import plugin
    from sglang_cp_shared_kv.hook_check import missing_hooks

    specs = [s for s in plugin.hooks_for(v0523.RELEASE) if s.hook.__module__ == idle_pool_audit.__name__]
    assert [(s.target.rsplit(".", 2)[-2:], s.hook_type) for s in specs] == [
        (["Scheduler", "on_idle"], "around"), (["SchedulerInvariantChecker", "_check_all_pools"], "after")]
    assert set(specs) <= set(plugin_loaded) and missing_hooks(specs) == []
    assert "self.invariant_checker._check_all_pools(" in inspect.getsource(inspect.unwrap(Scheduler.on_idle))
    assert "scheduler.invariant_checker._check_all_pools(" in inspect.getsource(
        invariant_checker.create_scheduler_watchdog)


@pytest.mark.parametrize("tree_core", [None, "python"])  # 0.5.23's default (Rust) tree core, and the Python one
def test_a_clean_idle_pool_audits_no_leak_and_a_dropped_page_is_counted_on_its_rank(tiny_nsa_model, lenient,
                                                                                    tree_core):
    rank = 1 if tree_core is None else 2  # (a rank per case: the gauges are the process's)
    server = Server(tiny_nsa_model, cp_size=4, rank=rank, tree_core=tree_core)
    server.cache(5)
    server.on_idle()
    clean = _published(rank)
    assert clean["sglang_leak"] == 0 and not leak_found(clean)  # SGLang's count and the pages agree: nothing lost
    assert (clean["pages"], clean["free_pages"], clean["cached_pages"], clean["leaked_pages"]) == (32, 27, 5, 0)
    assert (clean["rank_pages"], clean["rank_free_pages"] + clean["rank_cached_pages"]) == (8, 8)
    assert clean["total_tokens"] == 32 * PAGE and clean["evictable_tokens"] == 5 * PAGE and clean["cp_size"] == 4
    assert clean["req_slots_free"] == clean["req_slots_total"] == 4
    assert clean["audits"] == 1 and clean["checked_at_unix_s"] > time.time() - 60

    # a page allocated, then dropped: neither free nor cached
    lost = server.allocator.alloc(PAGE)
    server.scheduler.forward_ct += 1
    server.on_idle()
    leaked = _published(rank)
    assert leaked["sglang_leak"] == 1 and leaked["accounted_minus_total_tokens"] == -PAGE  # SGLang's count sees it
    assert leaked["leaked_pages"] == 1 and leaked["leak_audits"] == 1 and leak_found(leaked)
    owner = (int(lost[0]) // PAGE - 1) % 4  # ... and the audit names the rank storing the page
    assert leaked["rank_leaked_pages"] == (owner == rank)
    # the control: the page handed back, the next audit is clean again
    server.allocator.free(lost)
    server.scheduler.forward_ct += 1
    server.on_idle()
    again = _published(rank)
    assert again["audits"] == 3 and again["leaked_pages"] == 0 and not leak_found(again)
    assert again["free_pages"] == 27  # (the freed page waits in 0.5.23's staged_pages: counted as free)


def test_the_dropped_page_is_counted_on_the_rank_that_stores_it(tiny_nsa_model, lenient):
    """Every rank of the group allocates alike; only the owner of the dropped page counts it as its own."""
    owners, lost_pages = [], []
    for rank in range(3):
        server = Server(tiny_nsa_model, cp_size=3, rank=rank, pages_per_rank=4)
        server.cache(2)
        lost = server.allocator.alloc(PAGE)
        server.on_idle()
        record = _published(rank)
        assert record["leaked_pages"] == 1 and record["cp_size"] == 3 and record["rank_pages"] == 4
        owners.append(record["rank_leaked_pages"])
        lost_pages.append(int(lost[0]) // PAGE)
    assert len(set(lost_pages)) == 1  # the same logical page on every rank ...
    owner = (lost_pages[0] - 1) % 3
    assert owners == [int(r == owner) for r in range(3)]  # ... counted by its owner only


def test_a_double_free_a_count_can_hide_is_caught_page_by_page(tiny_nsa_model, lenient):
    """A page freed while the radix cache still holds it balances a page leaked elsewhere in
    SGLang's count; the page listing catches both. The control: the free alone is caught too."""
    server = Server(tiny_nsa_model, cp_size=4, rank=3)
    cached = server.cache(3)
    server.allocator.alloc(PAGE)  # leaked
    server.allocator.free(cached[:PAGE])  # still cached, and now free too
    server.on_idle()
    record = _published(3)
    assert record["sglang_leak"] == 0 and record["accounted_minus_total_tokens"] == 0  # the count balances
    assert record["leaked_pages"] == 1 and record["double_listed_pages"] == 1
    assert leak_found(record)

    control = Server(tiny_nsa_model, cp_size=8, rank=7, pages_per_rank=2)
    cached = control.cache(2)
    control.on_idle()
    assert _published(7)["double_listed_pages"] == 0
    control.allocator.free(cached[:PAGE])
    control.scheduler.forward_ct += 1
    control.on_idle()
    record = _published(7)
    assert record["double_listed_pages"] == 1 and record["sglang_leak"] == 1 and record["leaked_pages"] == 0


def test_decode_is_audited_as_one_rank_with_its_preallocation_slots(tiny_nsa_model, lenient):
    server = Server(tiny_nsa_model, decode=True, pages_per_rank=16, rank=0)
    server.scheduler.req_to_token_pool.pre_alloc_size = 2  # as 0.5.23's decode pool keeps headroom ...
    server.scheduler.req_to_token_pool.free_slots += [4, 5]  # ... whose slots are free
    server.on_idle()
    record = _published(0)
    assert record["cp_size"] == 1 and record["rank_pages"] == record["pages"] == 16
    assert record["free_pages"] == 16 and record["req_slots_total"] == 6 and not leak_found(record)


def test_the_audit_runs_only_in_on_idle_with_the_flag_and_metrics_and_refreshes(tiny_nsa_model):
    server = Server(tiny_nsa_model, cp_size=6, rank=5, pages_per_rank=4)
    server.cache(2)
    assert server.watchdog_check()[0] is False  # SGLang's watchdog calls the check mid-batch: not audited
    server.scheduler.idle = False  # on_idle returns before its check when the scheduler is not fully idle
    server.on_idle()
    assert _published(5)["audits"] is None
    server.scheduler.idle = True
    server.on_idle()
    server.on_idle()  # nothing changed, within REFRESH_S: not again
    assert _published(5)["audits"] == 1 and _published(5)["cached_pages"] == 2
    server.scheduler.forward_ct += 1
    server.on_idle()
    assert _published(5)["audits"] == 2
    server.watchdog_check()
    assert _published(5)["audits"] == 2

    for off in (dict(flag=False), dict(metrics=False)):
        other = Server(tiny_nsa_model, cp_size=6, rank=4, pages_per_rank=4, **off)
        other.on_idle()
        assert _published(4)["audits"] is None and STATE_ATTR not in other.scheduler.__dict__


def test_a_failing_audit_never_disturbs_sglangs_check_and_stays_off(tiny_nsa_model):
    server = Server(tiny_nsa_model, cp_size=5, rank=4, pages_per_rank=4)
    result = (False, ["msg"])
    broken = SimpleNamespace(token_to_kv_pool_allocator=None, tree_cache=None)  # no allocator to read
    token = idle_pool_audit._IDLE_SCHEDULER.set(server.scheduler)
    try:
        server.scheduler.invariant_checker, checker = broken, broken
        assert idle_pool_audit.audit_idle_pools(result, checker, SimpleNamespace()) is result
    finally:
        idle_pool_audit._IDLE_SCHEDULER.reset(token)
    assert server.scheduler.__dict__[STATE_ATTR].audits == -1


def test_with_sglangs_strict_check_the_leak_is_published_before_the_server_stops(tiny_nsa_model, monkeypatch):
    """SGLang's default: an idle leak raises in on_idle (the scheduler dies); the audit runs
    right after the count, before SGLang reports it, so /metrics shows the leak."""
    monkeypatch.setenv("SGLANG_ENABLE_STRICT_MEM_CHECK_DURING_IDLE", "true")
    server = Server(tiny_nsa_model, cp_size=2, rank=1, pages_per_rank=4)
    server.cache(1)
    server.on_idle()  # the control: a whole pool does not raise
    assert _published(1)["leaked_pages"] == 0
    server.allocator.alloc(PAGE)
    server.scheduler.forward_ct += 1
    with pytest.raises(Exception, match="memory leak detected"):
        server.on_idle()
    record = _published(1)
    assert record["sglang_leak"] == 1 and record["leaked_pages"] == 1 and record["cp_size"] == 2


def test_on_idle_runs_even_where_the_audit_cannot_tell_whether_it_applies(tiny_nsa_model, monkeypatch):
    """_applies raising (here: the observability config unreadable) leaves SGLang's on_idle running, unaudited."""
    from sglang_cp_shared_kv import sglang_api as sg

    server = Server(tiny_nsa_model, cp_size=6, rank=3, pages_per_rank=4)
    ran = []
    with server.rank.active():
        assert idle_pool_audit.mark_idle_check(lambda s: ran.append(idle_pool_audit._IDLE_SCHEDULER.get()) or "done",
                                               server.scheduler) == "done"
        monkeypatch.setattr(sg, "get_observability", lambda: 1 / 0, raising=False)
        assert idle_pool_audit.mark_idle_check(lambda s: ran.append(idle_pool_audit._IDLE_SCHEDULER.get()) or "done",
                                               server.scheduler) == "done"
    assert ran == [server.scheduler, None]  # the control: named while it applies; not named, but run, after
