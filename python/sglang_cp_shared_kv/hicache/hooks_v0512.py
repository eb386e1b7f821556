"""The HiCache hooks of SGLang 0.5.12.post1 (thin: translate, call the host tier).

Each passes straight through unless the device pool is the shared-KV pool (flag on).

* ``build_kv_host_pool`` AROUND: the KV host pool is :class:`.host_pool_v0512.CpSharedMLATokenToKVPoolHost`,
  sized per rank;
* ``attach_hybrid_nsa_pool_to_hiradix_cache`` AFTER: with the index-K sidecar built, the KV
  host pool turns logical (capacity and allocation);
* ``HybridCacheController.write`` AROUND: the backup's host pages in its device pages' owner
  lanes; ``HybridCacheController.load`` AROUND: the load-back's device pages in its host
  pages' lanes (both in :mod:`.lane_hooks`, shared with 0.5.23);
* ``HiCacheController.move_indices`` AROUND: every copy (KV and index K, backup and load-back)
  narrowed to this rank's rows, in physical rows of its host and device buffers;
* ``HostPoolGroup.backup_from_device_all_layer`` / ``.load_to_device_per_layer`` AROUND: a copy
  with no row on this rank is skipped (SGLang's kernels are not launched with no row);
* ``HiRadixCache.loading_check`` AROUND: a load-back counts as done when it is done on every
  rank (SGLang then unlocks the nodes, which changes what eviction may take: that must
  happen in the same step everywhere).

With a storage tier (L3, :mod:`.storage_v0512`):

* ``HybridCacheController.attach_storage_backend`` AFTER: the backend behind
  :class:`~.storage_v0512.PrefetchLaneStorage` (own pages, physical rows, keys naming the CP size),
  every rank storing;
* ``HybridCacheController._storage_hit_query`` AROUND: a prefetch's existence query checks the
  pages of this rank's lane;
* the host pages of a prefetch freed in prefetch order (``PrefetchHostPages``):
  ``HiRadixCache.prefetch_from_storage`` AROUND opens an entry; ``check_prefetch_progress`` and
  ``release_aborted_request`` AROUND resolve it; ``HybridCacheController._page_transfer`` AROUND
  marks it idle; ``HiCacheController.append_host_mem_release`` AROUND drops the storage threads'
  per-rank releases; ``drain_storage_control_queues`` AROUND frees the entries ready on every
  rank in SGLang's one MIN of the step; ``_force_release_pending_storage_ops`` AROUND frees what
  a detach leaves.
"""

from __future__ import annotations

import logging

import torch

from sglang_cp_shared_kv.hicache.lane_hooks import owner_local_host
from sglang_cp_shared_kv.pool.kv_pool_base import CpSharedPoolMixin

logger = logging.getLogger(__name__)


def build_owner_local_host_pool(original, *, kv_pool, page_size, server_args, use_mla, override_kv_cache_dim=None):
    if not isinstance(kv_pool, CpSharedPoolMixin):
        return original(kv_pool=kv_pool, page_size=page_size, server_args=server_args, use_mla=use_mla,
                        override_kv_cache_dim=override_kv_cache_dim)
    from sglang_cp_shared_kv.hicache.host_pool_v0512 import CpSharedMLATokenToKVPoolHost

    extra = {} if override_kv_cache_dim is None else {"override_kv_cache_dim": override_kv_cache_dim}
    return CpSharedMLATokenToKVPoolHost(kv_pool, server_args.hicache_ratio, server_args.hicache_size, page_size,
                                        server_args.hicache_mem_layout,
                                        allocator_type=server_args.hicache_storage_backend, **extra)


def expose_logical_host_capacity(result, radix_cache, *args, **kwargs):
    host = owner_local_host(radix_cache.token_to_kv_pool_host)
    if host is not None:
        host.expose_logical_capacity()
        controller = radix_cache.cache_controller
        if getattr(controller, "enable_storage", False):
            # NOTE: SGLang's bound on tokens held by prefetches, from logical sizes: it was computed
            # while the host pool showed one rank's tokens against the logical device pool
            controller.prefetch_capacity_limit = max(0, int(0.8 * (host.size - controller.mem_pool_device.size)))
    return result


def move_own_rows(original, controller, host_indices, device_indices):
    host = owner_local_host(controller.mem_pool_host)
    if host is not None:
        host_indices, device_indices = host.own_rows(host_indices, device_indices)
    return original(controller, host_indices, device_indices)


def _nothing_to_copy(host_indices, pool_transfers) -> bool:
    return host_indices.numel() == 0 and all(
        t.host_indices is None or t.host_indices.numel() == 0 for t in (pool_transfers or ()))


def backup_own_rows(original, group, device_pool, host_indices, device_indices, io_backend, pool_transfers=None):
    host = owner_local_host(group)
    if host is not None:
        if _nothing_to_copy(host_indices, pool_transfers):
            return None
        host.count_copied_pages("backed_up", host_indices.numel() // host.page_size)
    return original(group, device_pool, host_indices, device_indices, io_backend, pool_transfers=pool_transfers)


def load_own_rows(original, group, device_pool, host_indices, device_indices, layer_id, io_backend,
                  pool_transfers=None):
    host = owner_local_host(group)
    if host is not None:
        if _nothing_to_copy(host_indices, pool_transfers):
            return None
        if layer_id == 0:
            host.count_copied_pages("loaded_back", host_indices.numel() // host.page_size)
    return original(group, device_pool, host_indices, device_indices, layer_id, io_backend,
                    pool_transfers=pool_transfers)


def agree_on_loads_done(original, radix_cache):
    if owner_local_host(radix_cache.token_to_kv_pool_host) is None or not radix_cache.ongoing_load_back:
        return original(radix_cache)  # (ongoing_load_back is the same on every rank)
    controller = radix_cache.cache_controller
    queue = controller.ack_load_queue
    done = 0
    for ack in queue:
        if not ack.finish_event.query():
            break
        done += 1
    # NOTE: the same all-reduce SGLang's writing_check runs for backups, in the same place
    # of every rank's scheduler loop (check_hicache_events)
    agreed = torch.tensor(done, dtype=torch.int, device="cpu")
    radix_cache._all_reduce_attn_groups(agreed, torch.distributed.ReduceOp.MIN)
    agreed = int(agreed.item())
    controller.ack_load_queue = queue[:agreed]
    try:
        return original(radix_cache)
    finally:
        controller.ack_load_queue = controller.ack_load_queue + queue[agreed:]


# ---------------------------------------------------------------- the storage tier (L3)
def _sharded_storage(controller):
    """The controller's :class:`.storage_v0512.PrefetchLaneStorage`, or None (flag off, no L3)."""
    from sglang_cp_shared_kv.hicache.storage_v0512 import PrefetchLaneStorage

    backend = getattr(controller, "storage_backend", None)
    return backend if isinstance(backend, PrefetchLaneStorage) else None


def _every_rank_stores(controller) -> None:
    # NOTE: stock lets only attention-TP rank 0 store an MLA model's pages (every rank holds all
    # of them); here each CP rank holds, so stores, only its own
    controller.backup_skip = False


def shard_storage_backend(result, controller, *args, **kwargs):
    from sglang_cp_shared_kv.hicache.storage import shard_controller_storage
    from sglang_cp_shared_kv.hicache.storage_v0512 import PrefetchLaneStorage

    shard_controller_storage(controller, PrefetchLaneStorage, _every_rank_stores)
    return result


def hit_query_own_pages(original, controller, operation):
    storage = _sharded_storage(controller)
    if storage is None:
        return original(controller, operation)
    with storage.query_for(operation.host_indices):
        return original(controller, operation)


def _prefetch_pages(controller):
    """This rank's prefetch host pages (:class:`.storage_v0512.PrefetchHostPages`), or None (flag off)."""
    host = owner_local_host(controller.mem_pool_host)
    return host.prefetch_pages if host is not None else None


def mark_prefetch_transfer_done(original, controller, operation):
    pages = _prefetch_pages(controller)
    try:
        return original(controller, operation)
    finally:
        if pages is not None:
            pages.transfer_done(operation)


def release_host_pages_in_prefetch_order(original, controller, host_indices):
    pages = _prefetch_pages(controller)
    if pages is None:
        return original(controller, host_indices)
    pages.note_release(host_indices)
    return None


def open_prefetch_pages(original, radix_cache, req_id, *args, **kwargs):
    before = radix_cache.ongoing_prefetch.get(req_id)
    result = original(radix_cache, req_id, *args, **kwargs)
    pages = _prefetch_pages(radix_cache.cache_controller)
    after = radix_cache.ongoing_prefetch.get(req_id)
    if pages is not None and after is not None and after is not before:
        if before is not None:
            # NOTE: SGLang replaced a prefetch it still tracked under this request id, and will never
            # resolve it: its pages go back once its storage threads are done with it
            pages.resolved(before[3], 0)
        _node, _key, host_indices, operation = after
        pages.opened(req_id, operation, host_indices)
    return result


def _resolving_prefetch(original, radix_cache, req_id, *, first_free):
    pages = _prefetch_pages(radix_cache.cache_controller)
    if pages is None:
        return original(radix_cache, req_id)
    entry = radix_cache.ongoing_prefetch.get(req_id)
    with pages.capturing() as released:
        result = original(radix_cache, req_id)
    if entry is not None and radix_cache.ongoing_prefetch.get(req_id) is not entry:
        operation = entry[3]
        pages.resolved(operation, first_free(operation, released.tokens))
    return result


def resolve_prefetch_pages(original, radix_cache, req_id):
    # NOTE: SGLang releases the tokens between the group's fetched count (its MIN) and this
    # rank's; the tree took every token before that MIN (or freed it, as already cached)
    return _resolving_prefetch(original, radix_cache, req_id,
                               first_free=lambda operation, released: operation.completed_tokens - released)


def resolve_aborted_prefetch_pages(original, radix_cache, rid):
    return _resolving_prefetch(original, radix_cache, rid, first_free=lambda operation, released: 0)


def drain_with_prefetch_pages(original, radix_cache):
    controller = radix_cache.cache_controller
    pages = _prefetch_pages(controller)
    if pages is None:
        return original(radix_cache)
    counts = torch.tensor([controller.prefetch_revoke_queue.qsize(), controller.ack_backup_queue.qsize(),
                           controller.host_mem_release_queue.qsize(), pages.ready_count()], dtype=torch.int)
    # NOTE: SGLang's one MIN of this step over the attention-CP group, with one more count
    radix_cache._all_reduce_attn_groups(counts, torch.distributed.ReduceOp.MIN)
    n_revoke, n_backup, n_release, n_ready = (int(c) for c in counts.tolist())
    revoked = list(controller.prefetch_revoke_queue.queue)[:n_revoke]  # (only this thread takes from it)
    radix_cache._drain_storage_control_queues_impl(n_revoke=n_revoke, n_backup=n_backup, n_release=n_release,
                                                   log_metrics=True)
    pages.revoked(revoked)
    free = pages.release(n_ready)
    if free.numel():
        controller.mem_pool_host.free(free)


def release_prefetch_pages_on_detach(original, radix_cache):
    pages = _prefetch_pages(radix_cache.cache_controller)
    tracked = [info[3] for info in radix_cache.ongoing_prefetch.values()]
    result = original(radix_cache)
    if pages is not None:
        free = pages.release_at_detach(tracked)
        if free.numel():
            radix_cache.cache_controller.mem_pool_host.free(free)
    return result
