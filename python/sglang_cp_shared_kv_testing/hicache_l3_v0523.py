"""The sharded HiCache storage tier (L3) on SGLang 0.5.23, on a CP group of CPU processes and a
real Mooncake store on loopback, beside stock HiCache's storage (flag off) on the same store. The
0.5.23 twin of :mod:`.hicache_l3_v0512` (the same cases, :data:`.hicache_l3_v0512.CASES`).

Each rank process is CP rank r of an interleave prefill server with ``--enable-hierarchical-cache
--hicache-storage-backend mooncake`` (the rig of :mod:`.hicache_cp_v0523`), applies the plugin's
hooks, and per case builds SGLang 0.5.23's real ``UnifiedRadixCache`` and
``HybridCacheController`` with its ``MooncakeStore`` client and storage threads, and runs
:func:`storage_round_trip`: device -> host -> store, evicted from device and host, prefetched
from the store (``prefetch_from_storage`` and ``check_prefetch_progress`` as the scheduler calls
them), loaded back; in :data:`.hicache_l3_v0512.BACKEND_RAISES`, with one CP rank's backend
raising on every call of one operation. Each rank reports what the parent test asserts
(``errors``: the bytes a forward's dense view reads after the load against what was written; the
hits; the host tier's audit; this rank's pages stored and fetched; which keys the store holds; the
backend calls that raised, counted and logged).
"""

from __future__ import annotations

import contextlib
import json
import tempfile
import traceback
import types
from array import array
from typing import Dict, List

import torch

from sglang_cp_shared_kv.scoped import attributes_set
from sglang_cp_shared_kv_testing.cp_harness import finish_rank
from sglang_cp_shared_kv_testing.hicache_cp_v0523 import (
    build_cache,
    hicache_on_cpu,
    host_pools,
    load_back,
    place_and_insert,
    shared_pool,
    stock_pool,
)
from sglang_cp_shared_kv_testing.hicache_l3_checks import SizeBlindKeys, lookup_as_other_cp_size
from sglang_cp_shared_kv_testing.hicache_l3_v0512 import (
    BACKEND_RAISES,
    CASES,
    OTHER_CP_SIZE,
    SIZE_BLIND_CONTROL,
    StorageCase,
    storage_faults,
)
from sglang_cp_shared_kv_testing.hicache_rig_v0512 import (
    PAGE,
    STOCK_ACCESS,
    HiCacheRequest,
    StorageTrip,
    free_host_tokens,
    seeded_bytes,
    settle,
)
from sglang_cp_shared_kv_testing.mooncake_master import close_store_clients
from sglang_cp_shared_kv_testing.support import free_port, run_rank_processes

TIMEOUT_S = 120  # a rank stuck in a collective fails the run instead of hanging it
#: a case of this module alone: the key tag of --hicache-storage-backend-extra-config (0.5.23
#: applies it once)
TAGGED = StorageCase("tagged", seed=107)


def storage_server_args(model_dir: str, n: int, extra: dict):
    """The interleave prefill server of ``n`` ranks with HiCache and the Mooncake store of ``extra``."""
    from sglang_cp_shared_kv_testing.cpu_kv_configurator import interleave_prefill_server_args

    return interleave_prefill_server_args(
        model_dir, "--enable-hierarchical-cache", "--hicache-io-backend", "direct",
        "--hicache-mem-layout", "page_first_direct", "--hicache-ratio", "2.0", "--hicache-write-policy",
        "write_through", "--hicache-storage-backend", "mooncake", "--hicache-storage-backend-extra-config",
        json.dumps(extra), "--hicache-storage-prefetch-policy", "wait_complete", tp=n)


# ---------------------------------------------------------------- the round trip
def _free_host_tokens(cache) -> tuple:
    kv_host = host_pools(cache)[0]
    return free_host_tokens(kv_host), getattr(kv_host, "logical_size", kv_host.size)


def evict_everything(cache) -> tuple:
    """Every page out of device and host memory; (free host tokens, the host tier's size)."""
    from sglang.srt.mem_cache.base_prefix_cache import EvictParams

    kv_host = host_pools(cache)[0]
    everything = getattr(kv_host, "logical_size", kv_host.size)
    cache.evict(EvictParams(num_tokens=everything))
    cache.evict_host(everything)
    return _free_host_tokens(cache)


def poison_host(cache, seed: int) -> None:
    """Random bytes over both host pools (every row), so a prefetch that fetched nothing cannot pass."""
    kv_host, index_host = host_pools(cache)
    gen = torch.Generator().manual_seed(seed)
    for buffer in (getattr(kv_host, "host_pool", kv_host).kv_buffer, index_host.index_k_with_scale_buffer):
        raw = buffer.view(torch.uint8)
        raw.copy_(torch.randint(0, 256, raw.shape, generator=gen, dtype=torch.uint8))


def host_releases_drained(cache) -> bool:
    """No host page waits in the controller's release queues on any rank (an agreed answer: the
    MAX over the group). Stock frees a prefetch's unused host pages through them, a few scheduler
    steps after the prefetch is done."""
    controller = cache.cache_controller
    queues = [controller.host_mem_release_queue, *getattr(controller, "extra_host_mem_release_queues", {}).values()]
    pending = torch.tensor(sum(queue.qsize() for queue in queues), dtype=torch.int)
    cache._all_reduce(pending, torch.distributed.ReduceOp.MAX)
    return int(pending.item()) == 0


def storage_round_trip(cache, request: HiCacheRequest, access, *, req_id: str, store: bool = True,
                       before_prefetch=None, prefetches: int = 1, audit: bool = True) -> StorageTrip:
    """One request through the storage tier of ``cache``: place and insert it (write-through
    backs it up to host, and from host to the store), evict it from device and host memory,
    poison both, prefetch it from the store (``prefetches`` times under one request handle; SGLang
    ignores a prefetch of a request it already tracks), load the host hit back, read it; then
    await the release of the prefetch's unused host pages (:func:`host_releases_drained`),
    evict everything and audit the host tier (``StorageTrip.host_tokens``: (free host tokens, the
    host tier's size) with nothing in device or host memory). ``store=False``: only the prefetch;
    ``audit=False``: no audit (``host_tokens`` empty), the loaded-back pages left in the device
    tree as a server leaves them for the request that hit them (to send them, say)."""
    from sglang.srt.mem_cache.base_prefix_cache import CacheRequestHandle, EvictParams, MatchPrefixParams
    from sglang.srt.mem_cache.radix_cache import RadixKey

    pool = cache.token_to_kv_pool_allocator.get_kvcache()
    tokens = len(request.token_ids)
    key = RadixKey(token_ids=array("q", request.token_ids))
    steps: Dict[str, int] = {}
    hashes: List[str] = []
    if store:
        key, locs = place_and_insert(cache, request, access)
        steps["backed_up"] = settle(cache, lambda: not cache.ongoing_write_through, what="the backup to host")
        steps["stored"] = settle(cache, lambda: not cache.ongoing_backup, what="the backup to storage")
        node = cache.match_prefix(MatchPrefixParams(key=key)).last_host_node
        hashes = list(cache.tree_core.get_prefix_hash_values(node)) + list(cache.tree_core.get_hash_values(node))
        cache.evict(EvictParams(num_tokens=tokens))
        cache.evict_host(tokens)
        access.write(pool, locs, seeded_bytes(pool, tokens, 0xBAD))
    poison_host(cache, seed=0xBAD + 1)
    before = cache.match_prefix(MatchPrefixParams(key=key))
    if before_prefetch is not None:
        before_prefetch(hashes)
    handle = CacheRequestHandle(req_id, 0)
    for _ in range(prefetches):
        cache.prefetch_from_storage(handle, before.last_host_node, array("q", request.token_ids), None, None,
                                    matched_prefix_tokens=[])
    steps["prefetched"] = settle(cache, lambda: cache.check_prefetch_progress(handle), what="the prefetch")
    loaded = cache.pop_prefetch_loaded_tokens(handle)
    match = cache.match_prefix(MatchPrefixParams(key=key))
    new_locs = torch.empty(0, dtype=torch.int64)
    if match.host_hit_length:
        _loaded, new_locs, steps["loaded"] = load_back(cache, match)
    device_bytes = access.read(pool, new_locs)
    if audit:  # (a prefetch that loaded nothing back gives no load-back's steps for the releases)
        steps["released"] = settle(cache, lambda: host_releases_drained(cache),
                                   what="the release of the prefetch's host pages")
    return StorageTrip(stored_hashes=hashes, device_hit_before=before.device_prefix_len,
                       host_hit_before=before.host_hit_length, loaded_tokens=loaded,
                       host_hit_length=match.host_hit_length, new_locs=new_locs,
                       written=request.content.prefix(len(new_locs), PAGE), device_bytes_after_load=device_bytes,
                       host_tokens=evict_everything(cache) if audit else (), steps=steps)


# ---------------------------------------------------------------- one case on one rank
def object_keys(backend, hashes: List[str]) -> Dict[str, List[str]]:
    """The Mooncake object keys of pages ``hashes`` (as ``backend`` writes them): MLA latent, index K."""
    from sglang.srt.mem_cache.hicache_storage import PoolName, PoolTransfer

    tagged = backend._tag_keys(hashes)
    index, _ = backend._get_hybrid_page_component_keys(hashes, PoolTransfer(name=PoolName.INDEXER))
    return {"mla": [f"{key}_{backend.mla_suffix}_k" for key in tagged], "index": backend._tag_keys(index)}


def external_l3_layout(cache) -> dict:
    """What the scheduler's startup handshake (and ``/hicache/l3_layout``) reports for this
    cache: the real ``Scheduler._hicache_l3_layout`` (the plugin's hook included) on a scheduler
    holding only what it reads."""
    from sglang.srt.managers.scheduler import Scheduler
    from sglang.srt.utils.msgspec_utils import msgspec_to_builtins

    scheduler = types.SimpleNamespace(enable_hierarchical_cache=True, tree_cache=cache, page_size=PAGE)
    return msgspec_to_builtins(Scheduler._hicache_l3_layout(scheduler))


def _case(rank: int, n: int, cpu_group, case: StorageCase, model_dir: str, extra: dict) -> dict:
    from sglang.srt.runtime_context import get_parallel
    from sglang_cp_shared_kv.hicache.storage import ShardedStorage

    from sglang_cp_shared_kv_testing.cpu_kv_configurator import CpuDsaRank
    from sglang_cp_shared_kv_testing.hicache_cp_v0512 import ShardedAccess

    if case.name == TAGGED.name:
        extra = {**extra, "extra_backend_tag": f"tag{n}"}
    server_args = storage_server_args(model_dir, n, extra)
    group = get_parallel().attn_cp_group
    with contextlib.ExitStack() as stack:
        stack.enter_context(CpuDsaRank(server_args, available_bytes=0, tp_rank=rank).active())
        stack.enter_context(get_parallel().override(attn_cp_group=group))
        if case.flag:
            pool, allocator = shared_pool(rank, n, case.dtype_name, case.physical_pages)
            access = ShardedAccess(cpu_group)
        else:
            pool, allocator = stock_pool(case.physical_pages * PAGE * n, case.dtype_name)
            access = STOCK_ACCESS
        cache = build_cache(allocator, server_args, cpu_group)
        controller = cache.cache_controller
        storage = controller.storage_backend
        backend = getattr(storage, "backend", storage)
        store = backend.store  # the MooncakeDistributedStore client
        kv_host = host_pools(cache)[0]
        request = HiCacheRequest.seeded(pool, pages=case.pages, seed=case.seed)
        suffix = f"@cp{n}" if case.flag else ""
        hashes_seen: List[str] = []
        prefetch_lanes: List[int] = []
        def before_prefetch(hashes):
            hashes_seen.extend(hashes)
            if case.flag:  # the lanes the prefetch's host pages will take (allocated at its hit)
                prefetch_lanes.extend(kv_host.lanes.cyclic_lanes(case.pages).tolist())
            if case.lose_page is not None and rank == 0:
                lost = object_keys(backend, [hashes[case.lose_page] + suffix])["mla"][0]
                if store.remove(lost, True) != 0:
                    raise RuntimeError(f"could not remove {lost} from the store")
            torch.distributed.barrier(group=cpu_group)

        copied_before = dict(getattr(kv_host, "pages_copied", {}))
        with contextlib.ExitStack() as keys:
            if case.size_blind_keys:  # the negative control of the other-CP-size check
                keys.enter_context(attributes_set(storage, keys=SizeBlindKeys(n)))
            with storage_faults(case, rank, storage, kv_host, hashes_seen) as faults:
                trip = storage_round_trip(cache, request, access, req_id=f"{case.name}-req",
                                          before_prefetch=before_prefetch, prefetches=2 if case.prefetch_twice else 1)
            copied = {d: v - copied_before.get(d, 0) for d, v in getattr(kv_host, "pages_copied", {}).items()}
            hashes = trip.stored_hashes
            other_size = None
            if case.other_cp_size:  # (the trip evicted everything: the request is only in the store)
                other_size = lookup_as_other_cp_size(storage, n, hashes, kv_host, lambda: storage_round_trip(
                    cache, request, access, req_id=f"{case.name}-again", store=False))
        stored = {}
        if hashes:
            ours, stock = object_keys(backend, [h + "@cp" + str(n) for h in hashes]), object_keys(backend, hashes)
            for what in ("mla", "index"):
                stored[f"{what}_ours"] = [int(x) for x in store.batch_is_exist(ours[what])]
                stored[f"{what}_stock"] = [int(x) for x in store.batch_is_exist(stock[what])]
        l3_layout = external_l3_layout(cache)
        ok, message = cache.detach_storage_backend()
        close_store_clients([store], cpu_group)
        return {
            "name": case.name,
            "errors": trip.device_bytes_after_load.mismatches(trip.written),
            "device_hit_before": trip.device_hit_before, "host_hit_before": trip.host_hit_before,
            "loaded_tokens": trip.loaded_tokens, "host_hit_length": trip.host_hit_length,
            "new_locs": trip.new_locs.tolist(), "host_tokens": list(trip.host_tokens), "steps": trip.steps,
            "stored": stored, "pages_copied": copied, "backup_skip": bool(controller.backup_skip),
            "sharded": isinstance(storage, ShardedStorage), "detached": ok, "detach_message": message,
            "host_tokens_after_detach": list(_free_host_tokens(cache)), "prefetch_lanes": prefetch_lanes,
            "key_prefix": backend.config_prefix, "other_size": other_size, "l3_layout": l3_layout, **faults,
        }


def _rank_main(rank, n, port, out_dir, cases, model_dir, extra):
    result: dict = {"cases": []}
    try:
        from sglang_cp_shared_kv_testing.cp_harness_v0523 import init_interleave_rank

        with contextlib.ExitStack() as stack:
            group = init_interleave_rank(rank, n, port, model_dir, stack, timeout_s=TIMEOUT_S,
                                         server_args=storage_server_args(model_dir, n, extra))
            stack.enter_context(hicache_on_cpu())
            from sglang.srt.plugins import load_plugins

            load_plugins()  # the plugin's hooks, as every SGLang process applies them
            for case in cases:
                result["cases"].append(_case(rank, n, group.cpu_group, case, model_dir, extra))
    except BaseException:  # noqa: BLE001 - reported to the parent
        result["fatal"] = traceback.format_exc()[-4000:]
    finish_rank(out_dir, rank, result)


def run_storage_group(n: int, model_dir: str, extra: dict,
                      cases=CASES + BACKEND_RAISES + (TAGGED, OTHER_CP_SIZE, SIZE_BLIND_CONTROL), *,
                      timeout_s: float = 300.0) -> List[Dict[str, dict]]:
    """Each rank's outcome of every case (module docstring), indexed [rank][case name];
    ``extra``: the Mooncake backend configuration (:meth:`.mooncake_master.MooncakeMaster.extra_config`)."""
    import torch.multiprocessing as mp

    out_dir = tempfile.mkdtemp(prefix=f"hicache-l3-v0523-{n}-")
    per_rank = run_rank_processes(mp.get_context("spawn"), _rank_main, n, out_dir,
                                  args=(n, free_port(), out_dir, cases, model_dir, extra), timeout_s=timeout_s,
                                  what="sharded HiCache storage (0.5.23)")
    return [{c["name"]: c for c in r["cases"]} for r in per_rank]


__all__ = ["BACKEND_RAISES", "CASES", "OTHER_CP_SIZE", "SIZE_BLIND_CONTROL", "TAGGED", "StorageCase", "evict_everything",
           "host_releases_drained", "object_keys", "run_storage_group",
           "storage_round_trip", "storage_server_args"]
