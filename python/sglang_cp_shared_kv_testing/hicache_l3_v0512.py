"""The sharded HiCache storage tier (L3) on a CP group of CPU processes and a real Mooncake store
on loopback, beside stock HiCache's storage (flag off) on the same store.

Each rank process (gloo, N ranks) applies the plugin's hooks, then per case builds SGLang's real
``HiRadixCache`` with ``--hicache-storage-backend mooncake`` (its ``MooncakeStore`` client, its
storage threads) and runs :func:`.hicache_rig_v0512.storage_round_trip`: device -> host ->
store, evicted from device and host, prefetched from the store, loaded back. Each rank reports
what the parent test asserts (``errors``: the bytes a forward's dense view reads after the load
against what was written; the hits; the host pool's audit; this rank's pages stored and fetched;
which keys the store holds).

Cases (:data:`CASES`): the round trip in bf16 and in fp8, flag off (``stock``) and on; a page
object lost from the store before the prefetch (the group's hit ends before it, on every rank);
a fetch that fails on one rank only (the group inserts the pages before it); a prefetch started
twice under one request id (the one SGLang forgets is freed too). Besides (:data:`OTHER_CP_SIZE`,
:data:`SIZE_BLIND_CONTROL`; the 0.5.23 rig runs both): the round trip, then,
inside the storing group while its objects are in the store, the request prefetched again under
the keys of a group of N + 1 (a clean miss); and the same under keys that do not name the CP
size (it hits: the negative control).
"""

from __future__ import annotations

import contextlib
import json
import tempfile
import traceback
from dataclasses import dataclass
from typing import Dict, List, Optional

import torch

from sglang_cp_shared_kv.scoped import attributes_set

from sglang_cp_shared_kv_testing.cp_harness import finish_rank
from sglang_cp_shared_kv_testing.hicache_cp_v0512 import ShardedAccess, shared_pool
from sglang_cp_shared_kv_testing.hicache_l3_checks import SizeBlindKeys, lookup_as_other_cp_size
from sglang_cp_shared_kv_testing.hicache_rig_v0512 import (
    PAGE,
    STOCK_ACCESS,
    HiCacheRequest,
    HiCacheScenario,
    build_hicache,
    hicache_on_cpu,
    host_pools,
    host_tokens_in_tree,
    stock_allocator,
    stock_nsa_pool,
    storage_round_trip,
)
from sglang_cp_shared_kv_testing.support import free_port, gloo_attention_cp_group, run_rank_processes

MLA_KEY_SUFFIX = "__k"  # SGLang's Mooncake key of a page's MLA latent: <key>_<mla suffix "">_k
INDEX_KEY_SUFFIX = "__indexer"


@dataclass(frozen=True)
class StorageCase:
    name: str
    seed: int  #: the request's tokens and bytes (a case of its own keys in the shared store)
    dtype_name: str = "bf16"
    flag: bool = True
    pages: int = 6
    lose_page: Optional[int] = None  #: this page's MLA object removed from the store before the prefetch
    #: (rank, page): that rank's fetches of its pages from that page on fail
    fail_fetch: Optional[tuple] = None
    physical_pages: int = 8
    #: the prefetch started twice under one request id (SGLang forgets the first)
    prefetch_twice: bool = False
    #: then the request prefetched again under the keys of a group of N + 1, inside this group
    #: (:func:`.hicache_l3_checks.lookup_as_other_cp_size`: report ``other_size``)
    other_cp_size: bool = False
    #: every key of the case names no CP size (:class:`.hicache_l3_checks.SizeBlindKeys`)
    size_blind_keys: bool = False


CASES = (
    StorageCase("stock", seed=101, flag=False),
    StorageCase("sharded", seed=101),
    StorageCase("sharded_fp8", seed=102, dtype_name="fp8_e4m3"),
    StorageCase("lost_page", seed=103, lose_page=3),
    StorageCase("fetch_fails_on_rank_1", seed=104, fail_fetch=(1, 2)),
    StorageCase("lost_page_fp8", seed=105, dtype_name="fp8_e4m3", lose_page=1),
    StorageCase("prefetch_started_twice", seed=106, prefetch_twice=True),
)


#: the round trip, then the request prefetched again under the keys of a group of N + 1 while the
#: objects this group stored are still in the store: a clean miss (a group's objects live in the
#: store segments its own clients mount, so a group started after this one exits finds none anyway)
OTHER_CP_SIZE = StorageCase("other_cp_size_misses", seed=108, other_cp_size=True)
#: the negative control of OTHER_CP_SIZE: the same under keys that do not name the CP size, which hits
SIZE_BLIND_CONTROL = StorageCase("size_blind_keys_control", seed=109, other_cp_size=True, size_blind_keys=True)


@contextlib.contextmanager
def failing_fetches(case: StorageCase, rank: int, storage, hashes_seen: List[str]):
    """Within the block, on the rank ``case.fail_fetch`` names, the backend's KV fetches of the
    pages from ``case.fail_fetch[1]`` on (of ``hashes_seen``, filled before the prefetch) fail."""
    if case.fail_fetch is None or case.fail_fetch[0] != rank:
        yield
        return
    backend = storage.backend
    original = backend.batch_get_v1

    def failing_get(keys, host_indices, extra_info=None):
        got = original(keys, host_indices, extra_info)
        failing = set(storage.keys(hashes_seen[case.fail_fetch[1]:]))
        return [ok and key not in failing for key, ok in zip(keys, got)]

    backend.batch_get_v1 = failing_get
    try:
        yield
    finally:
        del backend.batch_get_v1


def _keys(hashes: List[str], suffix: str) -> List[str]:
    return [f"{h}{suffix}" for h in hashes]


def _case(rank: int, n: int, group, case: StorageCase, extra: dict) -> dict:
    cpu_group = group.cpu_group
    options = dict(page_size=PAGE, hicache_ratio=2.0, write_policy="write_through", mem_layout="page_first_direct",
                   group=cpu_group, hicache_storage_backend="mooncake",
                   hicache_storage_backend_extra_config=json.dumps(extra),
                   hicache_storage_prefetch_policy="wait_complete")
    if case.flag:
        pool, allocator = shared_pool(rank, n, case.dtype_name, case.physical_pages)
        access = ShardedAccess(cpu_group)
    else:
        pool = stock_nsa_pool(case.physical_pages * PAGE * n, dtype_name=case.dtype_name)
        allocator, access = stock_allocator(pool), STOCK_ACCESS
    cache = build_hicache(pool, allocator, **options)
    controller = cache.cache_controller
    storage = controller.storage_backend
    store = getattr(storage, "backend", storage).store  # the MooncakeDistributedStore client
    kv_host = host_pools(cache)[0]
    request = HiCacheRequest.seeded(pool, pages=case.pages, seed=case.seed)
    suffix = f"@cp{n}" if case.flag else ""

    def lose(hashes):
        if case.lose_page is not None and rank == 0:
            key = f"{hashes[case.lose_page]}{suffix}{MLA_KEY_SUFFIX}"
            if store.remove(key, True) != 0:
                raise RuntimeError(f"could not remove {key} from the store")
        torch.distributed.barrier(group=cpu_group)

    hashes_seen: List[str] = []
    prefetch_lanes: List[int] = []

    def before_prefetch(hashes):
        hashes_seen.extend(hashes)
        if case.flag:  # the lanes the prefetch's host pages will take (its allocation, just below)
            prefetch_lanes.extend(kv_host.lanes.cyclic_lanes(case.pages).tolist())
        lose(hashes)

    pages = getattr(kv_host, "prefetch_pages", None)
    released = (lambda: len(pages) == 0) if pages is not None else (lambda: True)

    def prefetch_again():  # the request out of device and host memory, then prefetched again
        scenario = HiCacheScenario(cache, access)
        scenario.evict(len(request.token_ids))
        cache.evict_host(len(request.token_ids))
        return storage_round_trip(cache, request, access=access, req_id=f"{case.name}-again", store=False,
                                  released=released)

    copied_before = dict(getattr(kv_host, "pages_copied", {}))
    with contextlib.ExitStack() as stack:
        if case.size_blind_keys:
            stack.enter_context(attributes_set(storage, keys=SizeBlindKeys(n)))
        with failing_fetches(case, rank, storage, hashes_seen):
            trip = storage_round_trip(cache, request, access=access, req_id=f"{case.name}-req",
                                      before_prefetch=before_prefetch, released=released,
                                      prefetches=2 if case.prefetch_twice else 1)
        copied = {d: v - copied_before.get(d, 0) for d, v in getattr(kv_host, "pages_copied", {}).items()}
        hashes = trip.stored_hashes
        other_size = (lookup_as_other_cp_size(storage, n, hashes, kv_host, prefetch_again)
                      if case.other_cp_size else None)
    stored = {}
    if hashes:
        for what, suffix_ in (("mla", MLA_KEY_SUFFIX), ("index", INDEX_KEY_SUFFIX)):
            stored[f"{what}_ours"] = store.batch_is_exist(_keys([h + f"@cp{n}" for h in hashes], suffix_))
            stored[f"{what}_stock"] = store.batch_is_exist(_keys(hashes, suffix_))
    cache.detach_storage_backend()
    host_after_detach = [kv_host.available_size() + host_tokens_in_tree(cache), kv_host.size]
    return {
        "name": case.name,
        "errors": trip.device_bytes_after_load.mismatches(trip.written),
        "device_hit_before": trip.device_hit_before, "host_hit_before": trip.host_hit_before,
        "loaded_tokens": trip.loaded_tokens, "host_hit_length": trip.host_hit_length,
        "new_locs": trip.new_locs.tolist(), "host_tokens": list(trip.host_tokens),
        "steps": trip.steps, "stored": {k: [int(x) for x in v] for k, v in stored.items()},
        "pages_copied": copied, "backup_skip": bool(controller.backup_skip),
        "sharded": type(storage).__name__ == "PrefetchLaneStorage",
        "host_tokens_after_detach": host_after_detach, "prefetch_lanes": prefetch_lanes, "other_size": other_size,
    }


def _rank_main(rank, n, port, out_dir, cases, extra):
    result: dict = {"cases": []}
    try:
        torch.set_num_threads(1)
        group = gloo_attention_cp_group(rank, n, port, local_rank=rank, timeout_s=120)
        from sglang.srt.distributed import parallel_state as ps

        ps._TP = group  # NOTE: in-seq CP's TP group is its attention-CP group (the storage config reads TP)
        with hicache_on_cpu():
            from sglang.srt.plugins import load_plugins

            load_plugins()
            for case in cases:
                result["cases"].append(_case(rank, n, group, case, extra))
    except BaseException:  # noqa: BLE001 - reported to the parent
        result["fatal"] = traceback.format_exc()[-4000:]
    finish_rank(out_dir, rank, result)


def run_storage_group(n: int, extra: dict, cases=CASES + (OTHER_CP_SIZE, SIZE_BLIND_CONTROL), *,
                      timeout_s: float = 300.0) -> List[Dict[str, dict]]:
    """Each rank's outcome of every case (module docstring), indexed [rank][case name];
    ``extra``: the Mooncake backend configuration (:meth:`.mooncake_master.MooncakeMaster.extra_config`)."""
    import torch.multiprocessing as mp

    out_dir = tempfile.mkdtemp(prefix=f"hicache-l3-{n}-")
    per_rank = run_rank_processes(mp.get_context("spawn"), _rank_main, n, out_dir,
                                  args=(n, free_port(), out_dir, cases, extra), timeout_s=timeout_s,
                                  what="sharded HiCache storage")
    return [{c["name"]: c for c in r["cases"]} for r in per_rank]


__all__ = ["CASES", "OTHER_CP_SIZE", "SIZE_BLIND_CONTROL", "StorageCase", "failing_fetches", "run_storage_group"]
