"""The HiCache hooks of SGLang 0.5.12.post1 (thin: translate, call the host tier).

Each passes straight through unless the device pool is the shared-KV pool (flag on).

* ``build_kv_host_pool`` AROUND: the KV host pool is :class:`.host_pool_v0512.CpSharedMLATokenToKVPoolHost`,
  sized per rank;
* ``attach_hybrid_nsa_pool_to_hiradix_cache`` AFTER: with the index-K sidecar built, the KV
  host pool turns logical (capacity and allocation);
* ``HybridCacheController.write`` AROUND: the backup's host pages in its device pages' owner
  lanes; ``HybridCacheController.load`` AROUND: the load-back's device pages in its host
  pages' lanes;
* ``HiCacheController.move_indices`` AROUND: every copy (KV and index K, backup and load-back)
  narrowed to this rank's rows, in physical rows of its host and device buffers;
* ``HostPoolGroup.backup_from_device_all_layer`` / ``.load_to_device_per_layer`` AROUND: a copy
  with no row on this rank is skipped (SGLang's kernels are not launched with no row);
* ``HiRadixCache.loading_check`` AROUND: a load-back counts as done when it is done on every
  rank (SGLang then unlocks the nodes, which changes what eviction may take: that must
  happen in the same step everywhere).
"""

from __future__ import annotations

import logging
from typing import Optional

import torch

from sglang_cp_shared_kv.hicache.host_lanes import HostPageRule
from sglang_cp_shared_kv.pool.kv_pool_base import CpSharedPoolMixin

logger = logging.getLogger(__name__)


def _owner_local_host(host_pool) -> Optional[object]:
    """The shared-KV KV host pool behind ``host_pool`` (SGLang's pool group or a host pool), or None."""
    anchor = getattr(host_pool, "anchor_entry", None)
    pool = anchor.host_pool if anchor is not None else host_pool
    return pool if isinstance(getattr(pool, "rule", None), HostPageRule) else None


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
    host = _owner_local_host(radix_cache.token_to_kv_pool_host)
    if host is not None:
        host.expose_logical_capacity()
    return result


def backup_in_owner_lanes(original, controller, device_indices, *args, **kwargs):
    host = _owner_local_host(controller.mem_pool_host)
    if host is None or device_indices.numel() == 0:
        return original(controller, device_indices, *args, **kwargs)
    # NOTE: one small device read per backup (the device pages' owners): a host page must be
    # in its device page's lane, and the radix tree holds device locations on the device.
    owners = host.rule.layout.owner_for_logical_pages(host.rule.first_pages(device_indices), validate=False).cpu()
    with host.pages_in_lanes(owners):
        return original(controller, device_indices, *args, **kwargs)


def load_back_in_host_lanes(original, controller, host_indices, *args, **kwargs):
    host = _owner_local_host(controller.mem_pool_host)
    if host is None or host_indices.numel() == 0:
        return original(controller, host_indices, *args, **kwargs)
    allocator = controller.mem_pool_device_allocator
    allocator = getattr(allocator, "full_attn_allocator", allocator)
    lanes = host.rule.lanes(host.rule.first_pages(host_indices.cpu()))
    with allocator.pages_in_lanes(lanes):
        return original(controller, host_indices, *args, **kwargs)


def move_own_rows(original, controller, host_indices, device_indices):
    host = _owner_local_host(controller.mem_pool_host)
    if host is not None:
        host_indices, device_indices = host.own_rows(host_indices, device_indices)
    return original(controller, host_indices, device_indices)


def _nothing_to_copy(host_indices, pool_transfers) -> bool:
    return host_indices.numel() == 0 and all(
        t.host_indices is None or t.host_indices.numel() == 0 for t in (pool_transfers or ()))


def backup_own_rows(original, group, device_pool, host_indices, device_indices, io_backend, pool_transfers=None):
    host = _owner_local_host(group)
    if host is not None:
        if _nothing_to_copy(host_indices, pool_transfers):
            return None
        host.count_copied_pages("backed_up", host_indices.numel() // host.page_size)
    return original(group, device_pool, host_indices, device_indices, io_backend, pool_transfers=pool_transfers)


def load_own_rows(original, group, device_pool, host_indices, device_indices, layer_id, io_backend,
                  pool_transfers=None):
    host = _owner_local_host(group)
    if host is not None:
        if _nothing_to_copy(host_indices, pool_transfers):
            return None
        if layer_id == 0:
            host.count_copied_pages("loaded_back", host_indices.numel() // host.page_size)
    return original(group, device_pool, host_indices, device_indices, layer_id, io_backend,
                    pool_transfers=pool_transfers)


def agree_on_loads_done(original, radix_cache):
    if _owner_local_host(radix_cache.token_to_kv_pool_host) is None or not radix_cache.ongoing_load_back:
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
