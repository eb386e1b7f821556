"""Capacity split on SGLang 0.5.23: the scheduler sees N x the tokens each rank stores.

0.5.23 moved pool sizing and construction out of the model runner into
``KVCacheConfigurator`` (``mem_cache/kv_cache_configurator.py``; a slots dataclass: the
plugin keeps nothing on it). Two hooks, the 0.5.12 steps of :mod:`.pool.capacity` in their new
places (scheduler processes):

* ``KVCacheConfigurator._resolve_memory_pool_config`` AFTER (:func:`split_capacity`):
  re-validates the settings and the hooks in this process, then records the profiled
  per-rank count and turns it into the logical capacity. ``max_running_requests`` and
  ``--max-total-tokens`` were resolved from the physical count before, as on 0.5.12;
* ``KVCacheConfigurator.configure`` AROUND (:func:`configure_shared_pools`): creates this
  rank's context, builds the pools with our DSA pool and allocator in SGLang's places
  (``pool_dsa.use_cp_shared_dsa_pool_classes``), checks that SGLang built those and that
  the split ran, and records and logs the capacity.

The CP rank and group come from 0.5.23's runtime context (``get_parallel()``), which every
scheduler process publishes before it builds its pools.
"""

from __future__ import annotations

from sglang_cp_shared_kv import hook_check
from sglang_cp_shared_kv import sglang_api as sg
from sglang_cp_shared_kv.pool.allocator import CpSharedInterleavedPagesAllocator
from sglang_cp_shared_kv.pool.capacity import PHYSICAL_TOKENS_ATTR, new_context, record_capacity, split_into_logical
from sglang_cp_shared_kv.settings.config import FLAG, shares_kv
from sglang_cp_shared_kv.cp_shared_kv_layout import CpSharedKVLayout
from sglang_cp_shared_kv.settings.server_args_v0523 import validate_in_scheduler


def layout_of(configurator) -> CpSharedKVLayout:
    """This rank's layout: its place in the attention-CP group, the configurator's page size."""
    parallel = sg.get_parallel()
    return CpSharedKVLayout(page_size=configurator.page_size, cp_size=parallel.attn_cp_size,
                            cp_rank=parallel.attn_cp_rank)


def split_capacity(config, configurator, *args, **kwargs):
    """AFTER ``KVCacheConfigurator._resolve_memory_pool_config``."""
    if not shares_kv(configurator.server_args):
        return None
    hook_check.require_hooks_applied("scheduler process")
    validate_in_scheduler(configurator.server_args)
    return split_into_logical(config, layout_of(configurator))


def configure_shared_pools(original, configurator, *args, **kwargs):
    """AROUND ``KVCacheConfigurator.configure``."""
    if not shares_kv(configurator.server_args) or configurator.is_draft_worker:
        return original(configurator, *args, **kwargs)
    # NOTE: imported here: pool_dsa subclasses 0.5.23's DSATokenToKVPool when imported, and
    # this module is imported wherever 0.5.23's hook table is built (its tests on 0.5.12 too)
    from sglang_cp_shared_kv.pool.kv_pool_v0523 import CpSharedDSATokenToKVPool, use_cp_shared_dsa_pool_classes

    context = new_context(layout_of(configurator), configurator.server_args, sg.get_parallel().attn_cp_group)
    with use_cp_shared_dsa_pool_classes(context):
        result = original(configurator, *args, **kwargs)
    pool, allocator = result.token_to_kv_pool, result.token_to_kv_pool_allocator
    if getattr(result.memory_pool_config, PHYSICAL_TOKENS_ATTR, None) is None:
        raise RuntimeError(f"{FLAG}: the pools were built without the capacity split "
                           "(KVCacheConfigurator._resolve_memory_pool_config was not hooked)")
    if (not isinstance(pool, CpSharedDSATokenToKVPool) or pool.context is not context
            or not isinstance(allocator, CpSharedInterleavedPagesAllocator)):
        raise RuntimeError(
            f"{FLAG}: SGLang built {type(pool).__name__} / {type(allocator).__name__} instead of the shared-KV "
            "pool and allocator; this model or configuration takes a pool path the plugin does not support")
    record_capacity(context, pool, sg.resolved_view(configurator.server_args),
                    logical_tokens=result.max_total_num_tokens,
                    max_running_requests=result.max_running_requests, local_writes=False)
    return result
