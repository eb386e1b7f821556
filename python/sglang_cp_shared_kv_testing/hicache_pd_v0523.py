"""A prefix loaded back from HiCache on a sharded CP prefill, sent to a non-CP decode over the real
Mooncake engine exactly like a freshly computed one, on SGLang 0.5.23: the 0.5.23 twin of
:mod:`.hicache_pd_v0512`, whose run, rooms, sends, decode, expected-pages file, control and checks
it reuses. This module is only the release seam (:class:`HiCachePrefill0523`): what a prefill CP
rank builds of 0.5.23's HiCache and how a request makes its round trip there.

Each prefill rank process is CP rank r of an interleave PD prefill server with
``--enable-hierarchical-cache --hicache-storage-backend mooncake`` (:func:`.hicache_l3_v0523.storage_server_args`
for a tiny DeepSeek-V3.2 config; its runtime context and attention-CP ``GroupCoordinator`` over
gloo, :func:`.cp_harness_v0523.init_interleave_rank`) and builds 0.5.23's real
``UnifiedRadixCache`` with ``HybridCacheController``, KV and DSA index-K host pools and
``MooncakeStore`` (:func:`.hicache_cp_v0523.build_cache`) twice: over a stock replicated
``DSATokenToKVPool`` (flag off) and over the plugin's pool (flag on). The round trips are the
0.5.23 rigs': ``l2`` :func:`.hicache_cp_v0523.round_trip` (device -> host, evicted from the device,
a host hit, loaded back), ``l3`` :func:`.hicache_l3_v0523.storage_round_trip` (device -> host ->
store, evicted from device and host, prefetched, loaded back). The rank's ``MooncakeKVManager``
(:class:`.pd.prefill.PrefillInstance`) is built in that same runtime context, interleave CP's
attention-CP rank r of N, which 0.5.23's connection layer reads.
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any, Dict, List

from sglang_cp_shared_kv_testing.hicache_cp_v0523 import (
    build_cache,
    hicache_on_cpu,
    round_trip,
    shared_pool,
    stock_pool,
)
from sglang_cp_shared_kv_testing.hicache_l3_v0523 import evict_everything, storage_round_trip, storage_server_args
from sglang_cp_shared_kv_testing.hicache_pd_v0512 import GROUP_TIMEOUT_S, PHYSICAL_PAGES, REQUEST_PAGES, run_hicache_pd
from sglang_cp_shared_kv_testing.hicache_rig_v0512 import PAGE, HiCacheRequest, settle


class HiCachePrefill0523:
    """What a prefill CP rank builds of SGLang 0.5.23's HiCache (with the Mooncake store) and how
    a request makes its round trip there: the 0.5.23 seam of :func:`.hicache_pd_v0512._prefill_rank`
    (the same methods as :class:`.hicache_pd_v0512.HiCachePrefill0512`)."""

    def __init__(self):
        self.server_args = None  # the rank's, once it joined its group

    def join_group(self, rank: int, n: int, port: int, workdir: Path, extra: dict, stack: contextlib.ExitStack):
        """This process as CP rank ``rank`` of an interleave prefill server of ``n`` ranks with the
        Mooncake store of ``extra`` (its runtime context active until ``stack`` closes), HiCache
        runnable on a CPU; returns the attention-CP group's CPU group."""
        from sglang.srt.runtime_context import get_parallel

        from sglang_cp_shared_kv_testing.cp_harness_v0523 import init_interleave_rank
        from sglang_cp_shared_kv_testing.pd.releases import write_tiny_dsv32

        # NOTE: not the PD rig's Release0523.setup_process: it would publish a TP 1 server into the
        # active context, this rank's interleave server, which HiCache and the manager read
        model = str(write_tiny_dsv32(workdir))
        self.server_args = storage_server_args(model, n, extra)
        group = init_interleave_rank(rank, n, port, model, stack, server_args=self.server_args, timeout_s=GROUP_TIMEOUT_S)
        # NOTE: PP 1 builds no pipeline group, yet a prefill manager reads it (as the PD rig states it)
        get_parallel().override_permanently(pp_group=None)
        stack.enter_context(hicache_on_cpu())
        return group.cpu_group

    def stock_cache(self, n: int, dtype_name: str, cpu_group, extra: dict):
        """(a stock replicated ``DSATokenToKVPool`` of the group's logical size, the flag-off HiCache)."""
        pool, allocator = stock_pool(PHYSICAL_PAGES * PAGE * n, dtype_name)
        return pool, build_cache(allocator, self.server_args, cpu_group)

    def shared_cache(self, rank: int, n: int, dtype_name: str, cpu_group, extra: dict):
        """(this rank's shared-KV pool, the flag-on HiCache over the plugin's allocator)."""
        pool, allocator = shared_pool(rank, n, dtype_name, PHYSICAL_PAGES)
        return pool, build_cache(allocator, self.server_args, cpu_group)

    def trip(self, cache, tier: str, seed: int, access, req_id: str):
        """The round trip of the request of ``seed`` through ``tier``, on a cache emptied of
        earlier requests first (device and host): (its device locations after the load-back,
        the tokens found in host memory: for ``l3`` after the prefetch from the store), the
        loaded-back pages left in the device tree, as for a request that hit them."""
        settle(cache, lambda: not cache.ongoing_backup, what="the earlier backups to storage")
        evict_everything(cache)
        request = HiCacheRequest.seeded(cache.token_to_kv_pool_allocator.get_kvcache(), pages=REQUEST_PAGES,
                                        seed=seed)
        if tier == "l2":
            trip = round_trip(cache, request, access)
            return trip["new_locs"], trip["host_hit_length"]
        trip = storage_round_trip(cache, request, access, req_id=req_id, audit=False)
        return trip.new_locs, trip.host_hit_length


def run_hicache_pd_v0523(n: int, dtype_name: str, extra: dict, *, timeout_s: float = 300.0) -> List[Dict[str, Any]]:
    """:func:`.hicache_pd_v0512.run_hicache_pd` with the 0.5.23 seam: each process's result,
    decode's last (``[n]``)."""
    return run_hicache_pd(n, dtype_name, extra, rig=HiCachePrefill0523(), timeout_s=timeout_s)


__all__ = ["HiCachePrefill0523", "run_hicache_pd_v0523"]
