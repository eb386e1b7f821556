"""The sharded HiCache (flag on) on a CP group of CPU processes, beside stock HiCache (flag off).

Each rank process (gloo, N ranks) applies the plugin's hooks (SGLang's plugin loader, inside
:func:`.hicache_rig_v0512.hicache_on_cpu`), then, per case, runs one request's round trip
(device -> host backup -> device eviction -> host hit -> load back, SGLang's real
``HiRadixCache``) twice with the same seeded content and the same gloo group: through a stock
``NSATokenToKVPool`` with SGLang's allocator (the replicated baseline: every rank holds every
page on device and host) and through the plugin's pool and allocator (each rank holds its own
pages). Each rank reports what the parent test asserts:

* ``bytes_equal``: the bytes read back after the load, assembled across ranks as a forward's
  dense view would (row i from its page's owner), equal the stock run's read back;
* ``new_locs``/``host_indices``: the logical locations (the same on every rank);
* ``owners_match_lanes``: every page loaded back lives on its host page's rank;
* ``host``: per-rank host buffer tokens, stock's for the rank's physical device pool, the
  logical host tokens, pages this rank backed up / loaded back;
* ``foreign_host_rows_untouched``: the host buffer rows the rank does not hold a page of
  stayed zero (no rank wrote a page of another).
"""

from __future__ import annotations

import os
import tempfile
import traceback
from contextlib import nullcontext
from typing import Dict, List

import torch
from sglang_cp_shared_kv.scoped import attributes_set
from sglang_cp_shared_kv.settings.config import DEBUG_ENV

from sglang_cp_shared_kv_testing.cp_harness import finish_rank
from sglang_cp_shared_kv_testing.hicache_rig_v0512 import (
    DTYPES,
    PAGE,
    HiCacheCase,
    HiCacheRequest,
    PoolAccess,
    PoolBytes,
    build_hicache,
    expected_host_size,
    hicache_on_cpu,
    host_pools,
    page_starts,
    round_trip,
    stock_allocator,
    stock_nsa_pool,
)
from sglang_cp_shared_kv_testing.support import (
    free_port,
    gloo_attention_cp_group,
    run_rank_processes,
)

CASES = (
    HiCacheCase("write_through", "bf16", "write_through", "layer_first", 8, 5),
    HiCacheCase("write_back", "bf16", "write_back", "layer_first", 8, 5),
    HiCacheCase("page_first_direct_fp8", "fp8_e4m3", "write_through", "page_first_direct", 8, 7),
    HiCacheCase("write_through_debug", "bf16", "write_through", "layer_first", 8, 6, debug=True),
)
CONTROL = HiCacheCase("control_lanes_ignored", "bf16", "write_through", "layer_first", 8, 5, lanes_ignored=True)


class ShardedAccess(PoolAccess):
    """The plugin's pool at logical locations: a rank writes the rows of the pages it owns
    (where a forward's owner-only write puts them); a read assembles every row from its
    owner over the group (what a forward's dense view materializes)."""

    def __init__(self, group):
        self.group = group

    def write(self, pool, locs: torch.Tensor, content: PoolBytes) -> None:
        layout = pool.cp_layout
        mine = layout.owned_by_this_rank(locs)
        pages = page_starts(locs, pool.page_size)
        mine_pages = layout.owned_pages_mask(pages)
        rows = layout.logical_locs_to_physical(locs[mine])
        physical_pages = layout.logical_pages_to_physical(pages[mine_pages])
        for layer in range(pool.layer_num):
            pool.kv_buffer[layer].view(torch.uint8)[rows] = content.mla[layer][mine]
            pool.index_k_with_scale_buffer[layer][physical_pages] = content.index[layer][mine_pages]

    def read(self, pool, locs: torch.Tensor) -> PoolBytes:
        layout = pool.cp_layout
        pages = page_starts(locs, pool.page_size)
        owners = layout.owner_for_logical_pages(pages)
        mine_pages = owners == layout.cp_rank
        mine = mine_pages.repeat_interleave(pool.page_size)
        rows = layout.logical_locs_to_physical(locs[mine])
        physical_pages = layout.logical_pages_to_physical(pages[mine_pages])
        mla, index = [], []
        for layer in range(pool.layer_num):
            buf = pool.kv_buffer[layer].view(torch.uint8)
            part = torch.zeros((locs.numel(), *buf.shape[1:]), dtype=torch.uint8)
            part[mine] = buf[rows]
            ibuf = pool.index_k_with_scale_buffer[layer]
            ipart = torch.zeros((pages.numel(), *ibuf.shape[1:]), dtype=ibuf.dtype)
            ipart[mine_pages] = ibuf[physical_pages]
            mla.append(self._from_owners(part, owners.repeat_interleave(pool.page_size)))
            index.append(self._from_owners(ipart, owners))
        return PoolBytes(mla=mla, index=index)

    def _from_owners(self, part: torch.Tensor, owners: torch.Tensor) -> torch.Tensor:
        parts = [torch.empty_like(part) for _ in range(torch.distributed.get_world_size(self.group))]
        torch.distributed.all_gather(parts, part, group=self.group)
        return torch.stack(parts)[owners, torch.arange(owners.numel())]


def shared_pool(rank: int, n: int, dtype_name: str, physical_pages: int):
    """Rank ``rank``'s shared-KV NSA pool of ``physical_pages`` pages (N x as many logical) and
    its allocator, metrics on (the flag-on side of the HiCache rigs)."""
    from sglang_cp_shared_kv.context import CpSharedKVContext
    from sglang_cp_shared_kv.cp_shared_kv_layout import CpSharedKVLayout
    from sglang_cp_shared_kv.pool.allocator import CpSharedPagedTokenToKVPoolAllocator
    from sglang_cp_shared_kv.pool.kv_pool_v0512 import CpSharedNSATokenToKVPool

    from sglang_cp_shared_kv_testing.hicache_rig_v0512 import (
        INDEX_DIM,
        KV_LORA_RANK,
        ROPE_DIM,
    )

    dtype, dim = DTYPES[dtype_name]
    logical = physical_pages * PAGE * n
    # metrics on, as with --enable-metrics: the host pool's Prometheus counter is checked too
    context = CpSharedKVContext(CpSharedKVLayout(PAGE, n, rank), metrics_enabled=True)
    pool = CpSharedNSATokenToKVPool(logical, context=context,
                                    page_size=PAGE, kv_lora_rank=KV_LORA_RANK, dtype=dtype, qk_rope_head_dim=ROPE_DIM,
                                    layer_num=2, device="cpu", index_head_dim=INDEX_DIM, enable_memory_saver=False,
                                    kv_cache_dim=dim)
    return pool, CpSharedPagedTokenToKVPoolAllocator(logical, PAGE, dtype, "cpu", pool, True)


def _metric_by(name: str, rank: int, label: str, values, missing=None) -> Dict[str, float]:
    """This process's samples of Prometheus metric ``name`` for ``rank``, by ``label`` value
    (``missing`` where it has none yet)."""
    import prometheus_client

    samples = {value: prometheus_client.REGISTRY.get_sample_value(name, {"cp_rank": str(rank), label: value})
               for value in values}
    return {value: missing if sample is None else sample for value, sample in samples.items()}


def _pages_metric(rank: int) -> Dict[str, float]:
    return _metric_by("sglang:cp_shared_kv_hicache_pages_total", rank, "direction", ("backed_up", "loaded_back"),
                      missing=0.0)


def _host_tokens_metric(rank: int) -> Dict[str, float]:
    return _metric_by("sglang:cp_shared_kv_hicache_host_tokens", rank, "kind", ("physical", "logical"))


def _host_rows_outside(kv_host, lane_pages: torch.Tensor) -> bool:
    """Whether the KV host buffer (zeroed before the round trip) is zero outside the physical
    host pages ``lane_pages``."""
    used = torch.zeros(kv_host.page_num, dtype=torch.bool)
    used[lane_pages] = True
    if kv_host.layout == "layer_first":
        rows = kv_host.kv_buffer.view(kv_host.layer_num, kv_host.page_num, PAGE, -1)[:, ~used]
    else:
        rows = kv_host.kv_buffer[~used]
    return not bool(rows.view(torch.uint8).any())


def _case(rank: int, n: int, group, case: HiCacheCase) -> dict:
    name, dtype_name, physical_pages, request_pages = case.name, case.dtype_name, case.physical_pages, case.request_pages
    policy, mem_layout = case.write_policy, case.mem_layout
    os.environ[DEBUG_ENV] = "1" if case.debug else "0"  # read when the pool, allocator and host pool are built
    cpu_group = group.cpu_group
    seed = 7 + request_pages
    options = dict(page_size=PAGE, hicache_ratio=2.0, write_policy=policy, mem_layout=mem_layout, group=cpu_group)
    # flag off: SGLang's replicated pool of the same logical size
    stock_pool = stock_nsa_pool(physical_pages * PAGE * n, dtype_name=dtype_name)
    stock_trip = round_trip(build_hicache(stock_pool, stock_allocator(stock_pool), **options),
                            HiCacheRequest.seeded(stock_pool, pages=request_pages, seed=seed))
    # flag on
    pool, allocator = shared_pool(rank, n, dtype_name, physical_pages)
    cache = build_hicache(pool, allocator, **options)
    host_pools(cache)[0].kv_buffer.view(torch.uint8).zero_()  # (SGLang leaves host memory uninitialised)
    access = ShardedAccess(cpu_group)
    request = HiCacheRequest.seeded(pool, pages=request_pages, seed=seed)
    metric_before = _pages_metric(rank)
    if case.lanes_ignored:
        allocator.alloc(PAGE)  # the request then starts on logical page 2, rank 1's
        with attributes_set(type(host_pools(cache)[0]), pages_in_lanes=lambda self, lanes: nullcontext()):
            trip = round_trip(cache, request, access=access)
    else:
        trip = round_trip(cache, request, access=access)
    metric_after = _pages_metric(rank)
    kv_host, index_host = host_pools(cache)
    layout = pool.cp_layout
    new_pages = page_starts(trip.new_locs)
    host_pages = page_starts(trip.host_indices)
    mine = kv_host.rule.lanes(host_pages) == rank
    return {
        "name": name,
        "errors": (stock_trip.device_bytes_after_load.mismatches(stock_trip.written)
                   + trip.device_bytes_after_load.mismatches(stock_trip.device_bytes_after_load)),
        "host_hit_length": trip.host_hit_length, "stock_host_hit_length": stock_trip.host_hit_length,
        "device_hit_after_load": trip.device_hit_after_load,
        "new_locs": trip.new_locs.tolist(), "host_indices": trip.host_indices.tolist(),
        "owners_match_lanes": torch.equal(layout.owner_for_logical_pages(new_pages), kv_host.rule.lanes(host_pages)),
        "host": {"physical_size": kv_host.physical_size, "size": kv_host.size,
                 "stock_size_for_physical_pool": expected_host_size(pool.physical_size, 2.0),
                 "stock_size": host_pools(build_hicache(stock_pool, stock_allocator(stock_pool), **options))[0].size,
                 "pages_backed_up": kv_host.pages_backed_up, "pages_loaded_back": kv_host.pages_loaded_back,
                 "own_pages": int(mine.sum()),
                 # what the planner must say a rank's host memory is (pool.planner.plan_host_tier)
                 "device_physical_size": pool.physical_size, "kv_host_bytes": kv_host.kv_buffer.nbytes,
                 "index_host_bytes": index_host.index_k_with_scale_buffer.nbytes,
                 "metric_pages": {d: metric_after[d] - metric_before[d] for d in metric_after},
                 "metric_host_tokens": _host_tokens_metric(rank)},
        "foreign_host_rows_untouched": _host_rows_outside(kv_host, kv_host.rule.physical_pages(host_pages[mine])),
        "sync_calls": {step: dict(c) for step, c in trip.sync_calls.items()},
    }


def _rank_main(rank, n, port, out_dir, cases):
    result: dict = {"cases": []}
    try:
        torch.set_num_threads(1)
        group = gloo_attention_cp_group(rank, n, port, local_rank=rank, timeout_s=120)
        with hicache_on_cpu():
            from sglang.srt.plugins import load_plugins

            load_plugins()  # the plugin's hooks, as every SGLang process applies them
            for case in cases:
                result["cases"].append(_case(rank, n, group, case))
    except BaseException:  # noqa: BLE001 - reported to the parent
        result["fatal"] = traceback.format_exc()[-4000:]
    finish_rank(out_dir, rank, result)


def run_hicache_group(n: int, cases=CASES + (CONTROL,), *, timeout_s: float = 300.0) -> List[Dict[str, dict]]:
    """Each rank's outcome of every case (module docstring), indexed [rank][case name]."""
    import torch.multiprocessing as mp

    out_dir = tempfile.mkdtemp(prefix=f"hicache-cp-{n}-")
    per_rank = run_rank_processes(mp.get_context("spawn"), _rank_main, n, out_dir,
                                  args=(n, free_port(), out_dir, cases), timeout_s=timeout_s, what="sharded HiCache")
    return [{c["name"]: c for c in r["cases"]} for r in per_rank]


__all__ = ["CASES", "CONTROL", "HiCacheCase", "ShardedAccess", "run_hicache_group", "shared_pool"]
