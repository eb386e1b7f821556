"""The HiCache hooks of SGLang 0.5.23 (thin: translate, call the host tier).

0.5.23's HiCache is ``UnifiedRadixCache`` with a ``HybridCacheController`` over a
``HostPoolGroup`` (KV anchor + DSA index-K sidecar). Stock already agrees every step's
HiCache progress in one MIN over the attention-CP group (``_sync_hicache_ready_counts``),
skips empty copies, and narrows the KV copy and every sidecar through the anchor's
``owned_rows`` once the controller is sharded (``_move_kv_shard_indices``). Each hook passes
straight through unless the device pool is the shared-KV pool (flag on):

* ``hybrid_pool_assembler.build_kv_host_pool`` AROUND: the pool's ``host_capacity_tokens`` set
  to its physical size (stock then sizes this rank's host buffers, and the sidecar after them,
  as for a rank of that device pool), and the built pool wrapped in
  :class:`.host_pool_v0523.CpSharedKVHostPool` (lanes, ``owned_rows``, the lane floor);
* ``hybrid_pool_assembler.attach_hybrid_pool_to_unified_cache`` AFTER: the controller marked
  sharded (``is_kv_sharded``: stock decides it by upstream's own host-pool class);
* ``HybridCacheController.allocate_host_transfers`` AROUND: a backup's host pages in its device
  pages' owner lanes; ``HybridCacheController.load`` AROUND: a load-back's device pages in its
  host pages' lanes (both in :mod:`.lane_hooks`, shared with 0.5.12.post1).

With a storage tier (L3, :mod:`.storage`, shared with 0.5.12.post1):

* ``HybridCacheController.attach_storage_backend`` AFTER (at startup and at a runtime attach):
  the backend behind :class:`~.storage.ShardedStorage` (own pages at physical rows, keys naming
  the CP size, the existence query asking for every page's key), every rank storing;
* ``Scheduler._hicache_l3_layout`` AFTER: the external L3 object layout (the startup handshake's
  and ``/hicache/l3_layout``'s, which a router reads to look pages up in the store itself)
  reported off with the reason (:func:`describe_sharded_l3_layout`).

Nothing else: 0.5.23 asks whether pages exist before it allocates a prefetch's host pages (on
the scheduler thread, from the group's agreed hit), clamps a fetch to the pages whose KV and
index K both arrived, agrees the fetched count (MIN per batch) and frees every host page of a
prefetch on the scheduler thread, from agreed counts and after every rank's I/O thread is done
with it (the acks are drained by the MIN of the queue lengths), so the lanes' free lists stay
identical on every rank without 0.5.12.post1's ``PrefetchHostPages``.
"""

from __future__ import annotations

import dataclasses

from sglang_cp_shared_kv.hicache.lane_hooks import owner_local_host
from sglang_cp_shared_kv.pool.kv_pool_base import CpSharedPoolMixin


def build_owner_local_host_pool(original, *args, kv_pool, **kwargs):
    if not isinstance(kv_pool, CpSharedPoolMixin):
        return original(*args, kv_pool=kv_pool, **kwargs)
    from sglang_cp_shared_kv.hicache.host_pool_v0523 import CpSharedKVHostPool

    # NOTE: stock sizes the host pool from host_capacity_tokens when set, else from the (logical) size
    kv_pool.host_capacity_tokens = kv_pool.physical_size
    return CpSharedKVHostPool(original(*args, kv_pool=kv_pool, **kwargs), kv_pool)


def mark_controller_sharded(result, cache, *args, **kwargs):
    controller = getattr(cache, "cache_controller", None)
    host = owner_local_host(getattr(controller, "mem_pool_host", None))
    if host is not None:
        # NOTE: stock sets it from isinstance(anchor, PageInterleaveHostPool), upstream's own facade
        controller.is_kv_sharded = True
    return result


# ---------------------------------------------------------------- the storage tier (L3)
def _every_rank_stores(controller) -> None:
    # NOTE: stock's backup_skip is "not storage_config.is_storage_writer", which lets only TP rank
    # 0 store an MLA model's (replicated) pages; here each CP rank holds, so stores, only its own.
    # The controller reads is_mla_model for nothing else (the backend keeps its own config, and
    # the storage metrics' labels read the ranks), and a re-attach builds a new config
    controller.storage_config = dataclasses.replace(controller.storage_config, is_mla_model=False)


#: why the external L3 lookup is off for a sharded storage tier (the layout's ``reason``)
SHARDED_L3_LAYOUT_REASON = (
    "CP-sharded HiCache storage (--enable-prefill-cp-shared-kv): each page is stored once, by the CP rank that "
    "owns it, under <hash>@cp<N> (N the prefill's CP size); the external L3 object layout names no such "
    "key, so external L3 lookup is off for this server (its own prefetches hit as usual)")


def shard_storage_backend(result, controller, *args, **kwargs):
    from sglang_cp_shared_kv.hicache.storage import shard_controller_storage

    # (the startup line says why once; describe_sharded_l3_layout answers every query)
    shard_controller_storage(controller, every_rank_stores=_every_rank_stores,
                             note=f"; HiCache external L3 layout: off ({SHARDED_L3_LAYOUT_REASON})")
    return result


def describe_sharded_l3_layout(result, scheduler, *args, **kwargs):
    from sglang_cp_shared_kv.hicache.storage import ShardedStorage

    controller = getattr(getattr(scheduler, "tree_cache", None), "cache_controller", None)
    if not isinstance(getattr(controller, "storage_backend", None), ShardedStorage):
        return result
    # NOTE: stock already answers "off" here (the wrapper is no MooncakeStore) but says Mooncake is
    # not attached; a layout without the @cp<N> suffix would send a router to keys nobody wrote
    return {**result, "enabled": False, "backend": "mooncake", "hicache_object_layout": {"pools": []},
            "reason": SHARDED_L3_LAYOUT_REASON}
