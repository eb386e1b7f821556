"""The sharded HiCache host tier (flag on) on SGLang 0.5.23, on a CP group of CPU processes,
beside stock HiCache (flag off). The 0.5.23 twin of :mod:`.hicache_cp_v0512`.

Each rank process is CP rank r of an interleave prefill server with ``--enable-hierarchical-cache``
(its runtime context, :class:`.cpu_kv_configurator.CpuDsaRank`, the attention-CP
``GroupCoordinator`` over gloo), applies the plugin's hooks (SGLang's plugin loader), and per
case runs one request's round trip through SGLang 0.5.23's real ``UnifiedRadixCache``,
``HybridCacheController``, ``HostPoolGroup``, ``MLATokenToKVPoolHost`` (KV) and
``DSAIndexerPoolHost`` (index K): device -> host backup -> device eviction -> host hit -> load
back to new device locations; twice with the same content and group, through a stock
``DSATokenToKVPool`` with SGLang's allocator (replicated: every rank holds every page) and
through the plugin's pool and allocator (each rank holds its own pages).

What SGLang cannot do on a CPU, and what stands in (nothing else of SGLang is replaced), inside
:func:`hicache_on_cpu`: the host pools' copy functions (``sgl_kernel.kvcacheio``, imported by
``pool_host/mla.py`` and ``pool_host/dsa.py`` only on CUDA/ROCm) are the torch stand-ins of
:mod:`.hicache_rig_v0512` (the ``direct`` io backend's contract); host buffers on ``cpu`` are
allocated unpinned (``ALLOC_MEMORY_FUNCS["cpu"]``); the 10 GiB host-RAM reserve is 0. The
controller's events and streams are ``torch.cpu``'s (SGLang's ``get_device_module()`` on a CPU).

Each rank reports what the parent test asserts (:func:`_case`).
"""

from __future__ import annotations

import contextlib
import os
import tempfile
import traceback
import types
from array import array
from typing import Dict, List

import torch
from sglang_cp_shared_kv.pool.kv_geometry import NSA_INDEX_HEAD_DIM as INDEX_DIM
from sglang_cp_shared_kv.pool.kv_geometry import NSA_KV_LORA_RANK as KV_LORA_RANK
from sglang_cp_shared_kv.pool.kv_geometry import NSA_QK_ROPE_HEAD_DIM as ROPE_DIM
from sglang_cp_shared_kv.scoped import attributes_set
from sglang_cp_shared_kv.settings.config import DEBUG_ENV

from sglang_cp_shared_kv_testing.cp_harness import finish_rank
from sglang_cp_shared_kv_testing.hicache_rig_v0512 import (
    DTYPES,
    KVCACHEIO_STANDINS,
    PAGE,
    STOCK_ACCESS,
    HiCacheCase,
    HiCacheRequest,
    expected_host_size,
    page_starts,
    seeded_bytes,
)
from sglang_cp_shared_kv_testing.support import free_port, run_rank_processes

LAYERS = 2
HICACHE_RATIO = 2.0
TIMEOUT_S = 120  # a rank stuck in a collective fails the run instead of hanging it
MAX_STEPS = 200  # scheduler steps a backup or load-back may take (each step agreed over the group)


CASES = (
    HiCacheCase("write_through_bf16", "bf16", "write_through", "layer_first", 8, 5),
    HiCacheCase("write_through_fp8", "fp8_e4m3", "write_through", "layer_first", 8, 6),
    HiCacheCase("write_back_bf16", "bf16", "write_back", "layer_first", 8, 5),
    HiCacheCase("page_first_direct_fp8", "fp8_e4m3", "write_through", "page_first_direct", 8, 7),
    HiCacheCase("write_through_debug", "bf16", "write_through", "layer_first", 8, 6, debug=True),
)
#: the host tier under pressure (17 host pages a rank; 4N + 1 fillers of 5 pages, then the probe)
PRESSURE = HiCacheCase("host_pressure_bf16", "bf16", "write_through", "layer_first", 8, 5, fillers=4)
CONTROL = HiCacheCase("control_lanes_ignored", "bf16", "write_through", "layer_first", 8, 5, lanes_ignored=True)


# ---------------------------------------------------------------- SGLang's HiCache on a CPU
@contextlib.contextmanager
def hicache_on_cpu():
    """SGLang 0.5.23's host pools runnable on a CPU for the block (module docstring)."""
    from sglang.srt.mem_cache.pool_host import base, common, dsa, mla

    with contextlib.ExitStack() as stack:
        for module in (mla, dsa):
            # NOTE: on a CPU these names are never bound (SGLang imports them under is_cuda()/is_hip())
            saved = {name: module.__dict__.get(name) for name in KVCACHEIO_STANDINS}
            for name, standin in KVCACHEIO_STANDINS.items():
                setattr(module, name, standin)
            stack.callback(_restore, module, saved)
        stack.enter_context(attributes_set(base, HICACHE_HOST_MEMORY_RESERVE_BYTES=0))
        funcs = common.ALLOC_MEMORY_FUNCS
        saved_alloc = funcs["cpu"] if "cpu" in funcs else None
        funcs["cpu"] = _alloc_unpinned
        stack.callback(lambda: funcs.__setitem__("cpu", saved_alloc) if saved_alloc is not None
                       else funcs.pop("cpu", None))
        yield


def _restore(module, saved) -> None:
    for name, value in saved.items():
        if value is None:
            module.__dict__.pop(name, None)
        else:
            setattr(module, name, value)


def _alloc_unpinned(dims, dtype, device, pin_memory, allocator, **kwargs):
    """An ``ALLOC_MEMORY_FUNCS`` entry that ignores ``pin_memory`` (no CUDA to pin with)."""
    return allocator.allocate(dims, dtype=dtype, device=device)


def hicache_server_args(model_dir: str, n: int, case: HiCacheCase):
    """The interleave prefill server of ``n`` ranks with HiCache as ``case`` configures it."""
    from sglang_cp_shared_kv_testing.cpu_kv_configurator import (
        interleave_prefill_server_args,
    )

    return interleave_prefill_server_args(
        model_dir, "--enable-hierarchical-cache", "--hicache-io-backend", "direct",
        "--hicache-mem-layout", case.mem_layout, "--hicache-ratio", str(HICACHE_RATIO),
        "--hicache-write-policy", case.write_policy, tp=n)


# ---------------------------------------------------------------- pools and the cache
def _pool_kwargs(dtype_name: str) -> dict:
    dtype, dim = DTYPES[dtype_name]
    return dict(page_size=PAGE, kv_lora_rank=KV_LORA_RANK, dtype=dtype, qk_rope_head_dim=ROPE_DIM, layer_num=LAYERS,
                device="cpu", index_head_dim=INDEX_DIM, enable_memory_saver=False, kv_cache_dim=dim)


def stock_pool(size: int, dtype_name: str):
    """A stock ``DSATokenToKVPool`` of ``size`` tokens and SGLang's allocator over it."""
    from sglang.srt.mem_cache.allocator import PagedTokenToKVPoolAllocator
    from sglang.srt.mem_cache.memory_pool import DSATokenToKVPool

    pool = DSATokenToKVPool(size, **_pool_kwargs(dtype_name))
    return pool, PagedTokenToKVPoolAllocator(pool.size, PAGE, pool.dtype, "cpu", pool, True)


def shared_pool(rank: int, n: int, dtype_name: str, physical_pages: int):
    """Rank ``rank``'s shared-KV DSA pool of ``physical_pages`` pages (N x as many logical) and
    the plugin's interleave allocator."""
    from sglang_cp_shared_kv.context import CpSharedKVContext
    from sglang_cp_shared_kv.cp_shared_kv_layout import CpSharedKVLayout
    from sglang_cp_shared_kv.pool.allocator import CpSharedInterleavedPagesAllocator
    from sglang_cp_shared_kv.pool.kv_pool_v0523 import CpSharedDSATokenToKVPool

    kwargs = _pool_kwargs(dtype_name)
    logical = physical_pages * PAGE * n
    # metrics on, as with --enable-metrics: the host pool's Prometheus counter is checked too
    context = CpSharedKVContext(CpSharedKVLayout(PAGE, n, rank), metrics_enabled=True)
    pool = CpSharedDSATokenToKVPool(logical, context=context, **kwargs)
    return pool, CpSharedInterleavedPagesAllocator(logical, PAGE, kwargs["dtype"], "cpu", pool, True)


def build_cache(allocator, server_args, cpu_group):
    """SGLang's ``UnifiedRadixCache`` with HiCache over ``allocator``, as
    ``registry.create_unified_radix_cache`` builds it (tree component FULL), the group's CPU
    group as its TP and attention-CP cache group (interleave CP: attention CP = TP)."""
    from sglang.srt.mem_cache.cache_init_params import CacheInitParams
    from sglang.srt.mem_cache.unified_cache.components import ComponentType
    from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache

    n = torch.distributed.get_world_size(cpu_group)
    params = CacheInitParams(disable=False, req_to_token_pool=None, token_to_kv_pool_allocator=allocator,
                             page_size=PAGE, tp_cache_group=cpu_group, attn_cp_cache_group=cpu_group,
                             attn_cp_rank=torch.distributed.get_rank(cpu_group), attn_cp_size=n,
                             tree_components=(ComponentType.FULL,))
    cache = UnifiedRadixCache(params)
    cache.init_hicache(server_args, params)
    return cache


def host_pools(cache):
    """(the KV host pool as the group holds it, the index-K host pool)."""
    from sglang.srt.mem_cache.hicache_storage import PoolName

    group = cache.host_pool_group
    return group.get_pool(PoolName.KV), group.get_pool(PoolName.INDEXER)


def _inner(kv_host):
    return getattr(kv_host, "host_pool", kv_host)


class CopyLog:
    """The host rows each host pool copied, by direction (pages of a backup; layer 0 of a load)."""

    def __init__(self, cache):
        kv_host, index_host = host_pools(cache)
        self.pages = {"kv": {"backed_up": [], "loaded_back": []}, "index": {"backed_up": [], "loaded_back": []}}
        for name, pool in (("kv", _inner(kv_host)), ("index", index_host)):
            self._wrap(pool, name)

    def _wrap(self, pool, name):
        backup, load = pool.backup_from_device_all_layer, pool.load_to_device_per_layer
        log = self.pages[name]

        def counted_backup(device_pool, host_indices, device_indices, io_backend, *args, **kwargs):
            log["backed_up"] += page_starts(host_indices.cpu(), PAGE).tolist()
            return backup(device_pool, host_indices, device_indices, io_backend, *args, **kwargs)

        def counted_load(device_pool, host_indices, device_indices, layer_id, io_backend, *args, **kwargs):
            if layer_id == 0 and not kwargs.get("is_draft"):
                log["loaded_back"] += page_starts(host_indices.cpu(), PAGE).tolist()
            return load(device_pool, host_indices, device_indices, layer_id, io_backend, *args, **kwargs)

        pool.backup_from_device_all_layer = counted_backup
        pool.load_to_device_per_layer = counted_load


# ---------------------------------------------------------------- the round trip
def _settle(cache, done, what: str) -> int:
    """Scheduler steps (``check_hicache_events``, with its agreed counts) until ``done()``, whose
    answer is the same on every rank; bounded."""
    for step in range(1, MAX_STEPS + 1):
        cache.check_hicache_events()
        if done():
            return step
    raise TimeoutError(f"{what}: not done after {MAX_STEPS} scheduler steps")


def place_and_insert(cache, request: HiCacheRequest, access, locs=None):
    """Place the request's content (at ``locs``, or new device locations) and insert it into the
    tree (write-through then backs it up); (its radix key, its device locations)."""
    from sglang.srt.mem_cache.base_prefix_cache import InsertParams
    from sglang.srt.mem_cache.radix_cache import RadixKey

    key = RadixKey(token_ids=array("q", request.token_ids))
    if locs is None:
        locs = cache.token_to_kv_pool_allocator.alloc(len(request.token_ids))
    access.write(cache.token_to_kv_pool_allocator.get_kvcache(), locs, request.content)
    cache.insert(InsertParams(key=key, value=locs))
    return key, locs


def load_back(cache, match, settle=None):
    """Load ``match``'s host hit back as the scheduler does (``init_load_back``,
    ``ready_to_load_host_cache``, steps until acked); (tokens loaded, the device locations the
    load-back took, the steps). ``settle(cache, done, what)``: the step loop (default the rig's)."""
    from sglang.srt.mem_cache.base_prefix_cache import InitLoadBackParams

    req = types.SimpleNamespace(rid="req", last_node=match.last_device_node, swa_host_hit_length=0,
                                mamba_host_hit_length=0, kv=types.SimpleNamespace(mamba_pool_idx=None))
    loaded, _node = cache.init_load_back(InitLoadBackParams(best_match_node=match.best_match_node,
                                                            host_hit_length=match.host_hit_length, req=req))
    # the device locations the load-back took (as init_load_back collects them)
    new_locs = cache.tree_core.collect_full_device_indices(match.best_match_node, match.last_device_node)
    new_locs = torch.as_tensor(new_locs).to(torch.int64).cpu()
    cache.ready_to_load_host_cache()
    steps = (settle or _settle)(cache, lambda: not cache.ongoing_load_back, "the load-back")
    return loaded, new_locs, steps


def round_trip(cache, request: HiCacheRequest, access, locs=None) -> dict:
    """Place the request's content, insert it (write-through backs it up), settle the backup,
    evict it from the device, poison the freed rows, match (a host hit), load it back (the
    scheduler's ``init_load_back``, ``ready_to_load_host_cache``, steps until acked), read."""
    from sglang.srt.mem_cache.base_prefix_cache import EvictParams, MatchPrefixParams

    pool = cache.token_to_kv_pool_allocator.get_kvcache()
    tokens = len(request.token_ids)
    key, locs = place_and_insert(cache, request, access, locs)
    backup_steps = _settle(cache, lambda: not cache.ongoing_write_through, "the backup")
    evicted = cache.evict(EvictParams(num_tokens=tokens)).num_tokens_evicted
    access.write(pool, locs, seeded_bytes(pool, tokens, 0xBAD))
    match = cache.match_prefix(MatchPrefixParams(key=key))
    loaded, new_locs, load_steps = load_back(cache, match)
    after = cache.match_prefix(MatchPrefixParams(key=key))
    return {"old_locs": locs, "new_locs": new_locs, "evicted": evicted, "host_hit_length": match.host_hit_length,
            "loaded": loaded, "device_hit_after_load": after.device_prefix_len, "steps": (backup_steps, load_steps),
            "bytes": access.read(pool, new_locs)}


def fill_host(cache, access, pool, count: int, pages: int) -> list:
    """``count`` requests placed, inserted, backed up and evicted from the device, one after
    another; returns their radix keys."""
    from sglang.srt.mem_cache.base_prefix_cache import EvictParams, InsertParams
    from sglang.srt.mem_cache.radix_cache import RadixKey

    keys = []
    for i in range(count):
        request = HiCacheRequest.seeded(pool, pages=pages, seed=1000 + i)
        key = RadixKey(token_ids=array("q", request.token_ids))
        locs = cache.token_to_kv_pool_allocator.alloc(len(request.token_ids))
        access.write(pool, locs, request.content)
        cache.insert(InsertParams(key=key, value=locs))
        _settle(cache, lambda: not cache.ongoing_write_through, f"the backup of filler {i}")
        cache.evict(EvictParams(num_tokens=len(request.token_ids)))
        keys.append(key)
    return keys


def host_hits(cache, keys) -> List[int]:
    """Each key's host hit now (what host eviction left of it)."""
    from sglang.srt.mem_cache.base_prefix_cache import MatchPrefixParams

    return [cache.match_prefix(MatchPrefixParams(key=key)).host_hit_length for key in keys]


def _host_rows_outside(buffer: torch.Tensor, layout: str, own_pages: torch.Tensor, page_num: int, layers: int,
                       per_token: bool) -> bool:
    """Whether a host buffer (zeroed before the round trip) is zero outside physical host pages ``own_pages``."""
    used = torch.zeros(page_num, dtype=torch.bool)
    used[own_pages] = True
    if layout == "layer_first":
        view = buffer.view(layers, page_num, PAGE, -1) if per_token else buffer[:, :page_num]
        rows = view[:, ~used]
    else:
        rows = buffer[:page_num][~used]
    return not bool(rows.reshape(-1).view(torch.uint8).any()) if rows.numel() else True


def _case(rank: int, n: int, cpu_group, case: HiCacheCase, model_dir: str) -> dict:
    from sglang.srt.runtime_context import get_parallel
    from sglang_cp_shared_kv.hicache.host_pool_v0523 import CpSharedKVHostPool

    from sglang_cp_shared_kv_testing.cpu_kv_configurator import CpuDsaRank
    from sglang_cp_shared_kv_testing.hicache_cp_v0512 import (
        ShardedAccess,
        _host_tokens_metric,
        _pages_metric,
    )

    os.environ[DEBUG_ENV] = "1" if case.debug else "0"  # read when the pools are built
    server_args = hicache_server_args(model_dir, n, case)
    group = get_parallel().attn_cp_group
    seed = 7 + case.request_pages
    with contextlib.ExitStack() as stack:
        stack.enter_context(CpuDsaRank(server_args, available_bytes=0, tp_rank=rank).active())
        stack.enter_context(get_parallel().override(attn_cp_group=group))
        # flag off: SGLang's replicated pool of the same logical size
        spool, sallocator = stock_pool(case.physical_pages * PAGE * n, case.dtype_name)
        stock_cache = build_cache(sallocator, server_args, cpu_group)
        stock = round_trip(stock_cache, HiCacheRequest.seeded(spool, pages=case.request_pages, seed=seed),
                           STOCK_ACCESS)
        # what stock gives one rank whose device pool is this rank's physical pool
        ppool, pallocator = stock_pool(case.physical_pages * PAGE, case.dtype_name)
        per_rank_stock = host_pools(build_cache(pallocator, server_args, cpu_group))
        # flag on
        pool, allocator = shared_pool(rank, n, case.dtype_name, case.physical_pages)
        cache = build_cache(allocator, server_args, cpu_group)
        kv_host, index_host = host_pools(cache)
        kv_host.kv_buffer.view(torch.uint8).zero_()  # (SGLang leaves host memory uninitialised)
        index_host.index_k_with_scale_buffer.view(torch.uint8).zero_()
        copies = CopyLog(cache)
        metric_before = _pages_metric(rank)
        request = HiCacheRequest.seeded(pool, pages=case.request_pages, seed=seed)
        access = ShardedAccess(cpu_group)
        fillers = fill_host(cache, access, pool, case.fillers * n + 1, case.request_pages) if case.fillers else []
        if case.lanes_ignored:
            allocator.alloc(PAGE)  # the request then starts on logical page 2, rank 1's
            with attributes_set(CpSharedKVHostPool, pages_in_lanes=lambda self, lanes: contextlib.nullcontext()):
                trip = round_trip(cache, request, access)
        else:
            trip = round_trip(cache, request, access)
        filler_hits = host_hits(cache, fillers)
        metric_after = _pages_metric(rank)
        layout = pool.cp_layout
        new_pages = page_starts(trip["new_locs"])
        own = (layout.owner_for_logical_pages(new_pages) == rank)
        own_physical_host = torch.tensor(sorted(set(copies.pages["kv"]["backed_up"])), dtype=torch.int64)
        inner = _inner(kv_host)
        stock_kv, stock_index = per_rank_stock
        return {
            "name": case.name,
            "errors": (stock["bytes"].mismatches(request.content) + trip["bytes"].mismatches(stock["bytes"])),
            "host_hit_length": trip["host_hit_length"], "stock_host_hit_length": stock["host_hit_length"],
            "device_hit_after_load": trip["device_hit_after_load"], "loaded": trip["loaded"],
            "new_locs": trip["new_locs"].tolist(),
            "sharded": bool(cache.cache_controller.is_kv_sharded),
            "stock_sharded": bool(stock_cache.cache_controller.is_kv_sharded),
            "own_pages": int(own.sum()),
            "filler_host_hits": filler_hits,
            "host_tokens_in_tree": sum(filler_hits) + trip["host_hit_length"],
            "copied": copies.pages,
            "pages_copied": dict(kv_host.pages_copied),
            "metric_pages": {d: metric_after[d] - metric_before[d] for d in metric_after},
            "metric_host_tokens": _host_tokens_metric(rank),
            "host": {"physical_size": kv_host.size, "logical_size": kv_host.logical_size,
                     "group_size": cache.host_pool_group.size, "group_logical_size": cache.host_pool_group.logical_size,
                     "expected_physical": expected_host_size(pool.physical_size, HICACHE_RATIO),
                     "stock_size_for_physical_pool": stock_kv.size,
                     "kv_bytes": inner.kv_buffer.nbytes, "stock_kv_bytes": stock_kv.kv_buffer.nbytes,
                     "index_bytes": index_host.index_k_with_scale_buffer.nbytes,
                     "stock_index_bytes": stock_index.index_k_with_scale_buffer.nbytes,
                     "stock_replicated_size": host_pools(stock_cache)[0].size,
                     "free_after": kv_host.free_size(), "lane_floor_after": kv_host.available_size()},
            "foreign_host_rows_untouched": (
                _host_rows_outside(inner.kv_buffer, inner.layout, own_physical_host, inner.page_num, LAYERS, True)
                and _host_rows_outside(index_host.index_k_with_scale_buffer, index_host.layout, own_physical_host,
                                       inner.page_num, LAYERS, False)),
            "physical_host_pages_in_own_lane": bool(
                own_physical_host.numel() == 0 or int(own_physical_host.max()) < inner.page_num),
        }


def _rank_main(rank, n, port, out_dir, cases, model_dir):
    result: dict = {"cases": []}
    try:
        from sglang_cp_shared_kv_testing.cp_harness_v0523 import init_interleave_rank

        with contextlib.ExitStack() as stack:
            group = init_interleave_rank(rank, n, port, model_dir, stack, timeout_s=TIMEOUT_S,
                                         server_args=hicache_server_args(model_dir, n, cases[0]))
            stack.enter_context(hicache_on_cpu())
            from sglang.srt.plugins import load_plugins

            load_plugins()  # the plugin's hooks, as every SGLang process applies them
            for case in cases:
                result["cases"].append(_case(rank, n, group.cpu_group, case, model_dir))
    except BaseException:  # noqa: BLE001 - reported to the parent
        result["fatal"] = traceback.format_exc()[-4000:]
    finish_rank(out_dir, rank, result)


def run_hicache_group(n: int, model_dir: str, cases=CASES + (PRESSURE, CONTROL), *,
                      timeout_s: float = 300.0) -> List[Dict[str, dict]]:
    """Each rank's outcome of every case, indexed [rank][case name]."""
    import torch.multiprocessing as mp

    out_dir = tempfile.mkdtemp(prefix=f"hicache-cp-v0523-{n}-")
    per_rank = run_rank_processes(mp.get_context("spawn"), _rank_main, n, out_dir,
                                  args=(n, free_port(), out_dir, cases, model_dir), timeout_s=timeout_s,
                                  what="sharded HiCache (0.5.23)")
    return [{c["name"]: c for c in r["cases"]} for r in per_rank]


__all__ = ["CASES", "CONTROL", "PRESSURE", "fill_host", "load_back", "place_and_insert", "HiCacheCase", "hicache_on_cpu", "run_hicache_group", "round_trip", "build_cache",
           "shared_pool", "stock_pool"]
