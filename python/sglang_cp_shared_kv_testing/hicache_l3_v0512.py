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
twice under one request id (the one SGLang forgets is freed too). :data:`BACKEND_RAISES`: on one
CP rank only, every backend call of a fetch, of an existence query or of a store raises (as a
Mooncake client whose master is unreachable might), each rank reporting the calls that raised,
its storage errors counted and logged. Besides (:data:`OTHER_CP_SIZE`,
:data:`SIZE_BLIND_CONTROL`; the 0.5.23 rig runs both): the round trip, then,
inside the storing group while its objects are in the store, the request prefetched again under
the keys of a group of N + 1 (a clean miss); and the same under keys that do not name the CP
size (it hits: the negative control).
"""

from __future__ import annotations

import contextlib
import json
import logging
import tempfile
import time
import traceback
from dataclasses import dataclass
from typing import Dict, List, Optional

import torch

from sglang_cp_shared_kv.scoped import attributes_set

from sglang_cp_shared_kv_testing.cp_harness import finish_rank
from sglang_cp_shared_kv_testing.hicache_cp_v0512 import ShardedAccess, shared_pool
from sglang_cp_shared_kv_testing.hicache_l3_checks import SizeBlindKeys, failing_fetch, lookup_as_other_cp_size
from sglang_cp_shared_kv_testing.hicache_rig_v0512 import (
    PAGE,
    STOCK_ACCESS,
    HiCacheRequest,
    HiCacheScenario,
    build_hicache,
    free_host_tokens,
    hicache_on_cpu,
    host_pools,
    host_tokens_in_tree,
    stock_allocator,
    stock_nsa_pool,
    storage_round_trip,
)
from sglang_cp_shared_kv_testing.mooncake_master import close_store_clients
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
    #: (rank, operation): on that rank every backend call of the operation (:data:`BACKEND_CALLS`)
    #: raises :class:`InjectedBackendError` (:func:`raising_backend`)
    backend_raises: Optional[tuple] = None


CASES = (
    StorageCase("stock", seed=101, flag=False),
    StorageCase("sharded", seed=101),
    StorageCase("sharded_fp8", seed=102, dtype_name="fp8_e4m3"),
    StorageCase("lost_page", seed=103, lose_page=3),
    StorageCase("fetch_fails_on_rank_1", seed=104, fail_fetch=(1, 2)),
    StorageCase("lost_page_fp8", seed=105, dtype_name="fp8_e4m3", lose_page=1),
    StorageCase("prefetch_started_twice", seed=106, prefetch_twice=True),
)


#: CP rank 1's backend raises on every call of one operation: the KV pages' fetch (the hit ends at
#: rank 1's first page), the existence query (a query narrowed to rank 1's lane ends the hit at its
#: first page, a query of every page's key at 0), the store during the backup (rank 1's pages never
#: reach the store; the prefetch ends at the first); and CP rank 0's fetch (it holds the first
#: page: nothing is fetched into the prefetch's allocated host pages, which all go back)
BACKEND_RAISES = (
    StorageCase("fetch_raises_on_rank_1", seed=110, backend_raises=(1, "fetch")),
    StorageCase("query_raises_on_rank_1", seed=111, backend_raises=(1, "query")),
    StorageCase("store_raises_on_rank_1", seed=112, backend_raises=(1, "store")),
    StorageCase("fetch_raises_on_rank_0", seed=113, backend_raises=(0, "fetch")),
)


#: the round trip, then the request prefetched again under the keys of a group of N + 1 while the
#: objects this group stored are still in the store: a clean miss (a group's objects live in the
#: store segments its own clients mount, so a group started after this one exits finds none anyway)
OTHER_CP_SIZE = StorageCase("other_cp_size_misses", seed=108, other_cp_size=True)
#: the negative control of OTHER_CP_SIZE: the same under keys that do not name the CP size, which hits
SIZE_BLIND_CONTROL = StorageCase("size_blind_keys_control", seed=109, other_cp_size=True, size_blind_keys=True)


#: the backend methods the sharded storage calls for each operation a case can make raise
BACKEND_CALLS = {"fetch": ("batch_get_v1", "batch_get_v2"), "store": ("batch_set_v1", "batch_set_v2"),
                 "query": ("batch_exists", "batch_exists_v2")}


class InjectedBackendError(ConnectionError):
    """What a backend call raises in a ``backend_raises`` case."""


@contextlib.contextmanager
def _methods_replaced(backend, methods: dict):
    """Within the block, ``backend``'s methods ``methods`` (name -> replacement) are replaced on the
    instance (the class's come back after it)."""
    for name, method in methods.items():
        setattr(backend, name, method)
    try:
        yield
    finally:
        for name in methods:
            delattr(backend, name)


@contextlib.contextmanager
def failing_fetches(case: StorageCase, rank: int, storage, hashes_seen: List[str]):
    """Within the block, on the rank ``case.fail_fetch`` names, the backend's KV fetches of the
    pages from ``case.fail_fetch[1]`` on (of ``hashes_seen``, filled before the prefetch) fail."""
    if case.fail_fetch is None or case.fail_fetch[0] != rank:
        yield
        return
    original = storage.backend.batch_get_v1

    def failing_get(keys, host_indices, extra_info=None):
        got = original(keys, host_indices, extra_info)
        failing = set(storage.keys(hashes_seen[case.fail_fetch[1]:]))
        return [ok and key not in failing for key, ok in zip(keys, got)]

    with _methods_replaced(storage.backend, {"batch_get_v1": failing_get}):
        yield


def _call_keys(keys_or_transfers) -> List[str]:
    """The page keys of a backend call's first argument (keys, or v2 pool transfers)."""
    items = list(keys_or_transfers or ())
    if items and not isinstance(items[0], str):
        return [key for transfer in items for key in (transfer.keys or ())]
    return items


@contextlib.contextmanager
def raising_backend(case: StorageCase, rank: int, storage):
    """Within the block, on the rank ``case.backend_raises`` names, every backend call of its
    operation raises :class:`InjectedBackendError`. Yields the keys of each call that raised."""
    raised: List[List[str]] = []
    if case.backend_raises is None or case.backend_raises[0] != rank:
        yield raised
        return

    def raising(name):
        def call(keys_or_transfers, *args, **kwargs):
            raised.append(_call_keys(keys_or_transfers))
            raise InjectedBackendError(f"(injected) {name}: the Mooncake master is unreachable")
        return call

    with _methods_replaced(storage.backend, {name: raising(name) for name in BACKEND_CALLS[case.backend_raises[1]]}):
        yield raised


class _ExceptionRecords(logging.Handler):
    """Keeps ``[level, message, exception type]`` of each record logged with an exception."""

    def __init__(self):
        super().__init__(level=logging.WARNING)
        self.records: List[list] = []

    def emit(self, record):
        if record.exc_info:
            self.records.append([record.levelname, record.getMessage(), record.exc_info[0].__name__])


@contextlib.contextmanager
def storage_error_logs():
    """Within the block, what the plugin's HiCache modules log with an exception at WARNING or
    above (yields the list of ``[level, message, exception type]``)."""
    handler = _ExceptionRecords()
    logger = logging.getLogger("sglang_cp_shared_kv.hicache")
    logger.addHandler(handler)
    try:
        yield handler.records
    finally:
        logger.removeHandler(handler)


@contextlib.contextmanager
def storage_faults(case: StorageCase, rank: int, storage, kv_host, hashes_seen: List[str]):
    """Within the block, the case's injected faults on this rank (:func:`failing_fetches`,
    :func:`raising_backend`). Yields a dict the block's end fills with what the parent checks of a
    ``backend_raises`` case: ``backend_raised`` (the calls that raised and their pages, by index
    among ``hashes_seen``), ``storage_errors`` (this rank's counted storage errors) and
    ``storage_error_logs`` (:func:`storage_error_logs`)."""
    counts = getattr(kv_host, "counts", None)
    errors_before = dict(getattr(counts, "storage_errors", {}))
    report: dict = {}
    with storage_error_logs() as logs, raising_backend(case, rank, storage) as raised, \
            failing_fetches(case, rank, storage, hashes_seen):
        yield report
    page_of = dict(zip(storage.keys(hashes_seen), range(len(hashes_seen)))) if raised else {}  # (stock: no keys)
    report["backend_raised"] = {"calls": len(raised),
                                "pages": sorted({page_of[key] for keys in raised for key in keys if key in page_of})}
    report["storage_errors"] = {op: count - errors_before.get(op, 0)
                                for op, count in getattr(counts, "storage_errors", {}).items()}
    report["storage_error_logs"] = logs
    report["query_in_lanes"] = hasattr(storage, "query_for")  # (the query asks for this rank's pages only)


#: how long a rank waits for its own prefetch I/O (:func:`_case`'s ``own_io_done``)
IO_WAIT_S = 60.0


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

    def own_io_done(req_id):
        # NOTE: a rank whose fetch fails ends its own prefetch there (stock marks it terminated),
        # and stock's can_terminate_prefetch then stops every rank's prefetch wherever its I/O
        # thread is (a MAX over "terminated"): best effort, so the group's hit is the failing
        # rank's first failed page only if the other ranks' I/O finished first, and shorter if a
        # scheduler step came between (the CI of 3e89b3a: hit 0 instead of 1 page, once). Waiting
        # here, each rank for its own I/O and before any agreement, fixes that order so the
        # checks can ask for the exact hit
        if failing_fetch(case) is None:
            return
        operation = cache.ongoing_prefetch[req_id][3]
        deadline = time.monotonic() + IO_WAIT_S
        while not (operation.is_terminated()
                   or (operation.hash_value and operation.completed_tokens == len(operation.hash_value) * PAGE)):
            if time.monotonic() > deadline:
                raise TimeoutError(f"CP rank {rank}: the prefetch's I/O not done after {IO_WAIT_S} s")
            time.sleep(0.01)

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
        with storage_faults(case, rank, storage, kv_host, hashes_seen) as faults:
            trip = storage_round_trip(cache, request, access=access, req_id=f"{case.name}-req",
                                      before_prefetch=before_prefetch, released=released,
                                      prefetches=2 if case.prefetch_twice else 1, before_progress=own_io_done)
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
    close_store_clients([store], cpu_group)
    host_after_detach = [free_host_tokens(kv_host) + host_tokens_in_tree(cache), kv_host.size]
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
        **faults,
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


def run_storage_group(n: int, extra: dict, cases=CASES + BACKEND_RAISES + (OTHER_CP_SIZE, SIZE_BLIND_CONTROL), *,
                      timeout_s: float = 300.0) -> List[Dict[str, dict]]:
    """Each rank's outcome of every case (module docstring), indexed [rank][case name];
    ``extra``: the Mooncake backend configuration (:meth:`.mooncake_master.MooncakeMaster.extra_config`)."""
    import torch.multiprocessing as mp

    out_dir = tempfile.mkdtemp(prefix=f"hicache-l3-{n}-")
    per_rank = run_rank_processes(mp.get_context("spawn"), _rank_main, n, out_dir,
                                  args=(n, free_port(), out_dir, cases, extra), timeout_s=timeout_s,
                                  what="sharded HiCache storage")
    return [{c["name"]: c for c in r["cases"]} for r in per_rank]


__all__ = ["BACKEND_CALLS", "BACKEND_RAISES", "CASES", "InjectedBackendError", "OTHER_CP_SIZE", "SIZE_BLIND_CONTROL",
           "StorageCase", "failing_fetches", "raising_backend", "run_storage_group", "storage_error_logs",
           "storage_faults"]
