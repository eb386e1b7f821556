"""Capacity split: the scheduler sees N x the tokens each rank physically stores.

The arithmetic and the startup record are the same on every release
(:func:`split_into_logical`, :func:`new_context`, :func:`record_capacity`); where they hook
in is the release's:

* SGLang 0.5.12.post1, three hooks on ``ModelRunnerKVCacheMixin`` (scheduler processes),
  here: ``_resolve_memory_pool_config`` AFTER (:func:`split_capacity`): re-validates the
  configuration and the hooks in this process, then turns the profiled per-rank token
  count into the logical capacity ``(physical div page) * N * page``. It runs after
  ``--max-total-tokens`` and ``max_running_requests`` were resolved from the *physical*
  count, so the request pool does not grow with the logical figure, and
  ``--max-total-tokens`` keeps its stock meaning: a cap on what one GPU stores;
  ``_init_pools`` AROUND (:func:`build_pools`): creates this rank's
  :class:`~sglang_cp_shared_kv.context.CpSharedKVContext` and builds the pool (bound to it)
  and allocator from our subclasses (physical buffers, logical size); ``init_memory_pool``
  AFTER (:func:`log_capacity`): records the :class:`CapacitySplit` on the context and logs
  one startup line per rank;
* SGLang 0.5.23: the same steps on its ``KVCacheConfigurator`` (:mod:`.pool.capacity_v0523`).
"""

from __future__ import annotations

import logging
from typing import Tuple

from sglang_cp_shared_kv import hook_check
from sglang_cp_shared_kv import sglang_api as sg
from sglang_cp_shared_kv.pool.allocator import CpSharedPagedTokenToKVPoolAllocator
from sglang_cp_shared_kv.settings.config import DEBUG_ENV, FLAG, PREFETCH_ENV, debug_enabled, prefetch_enabled, shares_kv
from sglang_cp_shared_kv.context import CapacitySplit, CpSharedKVContext
from sglang_cp_shared_kv.cp_shared_kv_layout import SHARD_POLICY, CpSharedKVLayout
from sglang_cp_shared_kv.context import new_prefetch_group
from sglang_cp_shared_kv.pool.page_split import page_by_page_chunk_unit
from sglang_cp_shared_kv.pool.kv_pool_base import CpSharedPoolMixin
from sglang_cp_shared_kv.settings.rank_settings import check_ranks_agree
from sglang_cp_shared_kv.settings.server_args import validate

logger = logging.getLogger(__name__)

#: Set on SGLang's ``MemoryPoolConfig`` beside the (logical) ``max_total_num_tokens``.
PHYSICAL_TOKENS_ATTR = "physical_max_total_num_tokens"


def context_of(runner):
    """The shared-KV context of a model runner's pool (None when the flag is off)."""
    pool = getattr(runner, "token_to_kv_pool", None)
    return pool.context if isinstance(pool, CpSharedPoolMixin) else None


def attention_cp_position(runner) -> Tuple[int, int]:
    """(CP rank, CP size) of this model runner.

    SGLang's ``TpModelWorker`` builds the ``ModelRunner`` without ``attn_cp_rank``, so in
    a server the rank comes from the attention-CP group, initialised before the pool."""
    if runner.attn_cp_rank is not None:
        return runner.attn_cp_rank, runner.attn_cp_size
    rank, size = sg.get_attention_cp_rank(), sg.get_attention_cp_size()
    if size != runner.attn_cp_size:
        raise RuntimeError(f"{FLAG}: the attention CP group has {size} ranks but the server "
                           f"arguments give attn_cp_size={runner.attn_cp_size}")
    return rank, size


def layout_for_runner(runner) -> CpSharedKVLayout:
    rank, size = attention_cp_position(runner)
    return CpSharedKVLayout(page_size=runner.page_size, cp_size=size, cp_rank=rank)


def split_capacity(config, runner, *args, **kwargs):
    """AFTER ``ModelRunnerKVCacheMixin._resolve_memory_pool_config``."""
    if not shares_kv(runner.server_args):
        return None
    hook_check.require_hooks_applied("scheduler process")
    validate(runner.server_args, hf_config=runner.model_config.hf_config, use_mla=runner.use_mla_backend)
    return split_into_logical(config, layout_for_runner(runner))


def split_into_logical(config, layout: CpSharedKVLayout):
    """SGLang's ``MemoryPoolConfig`` with the logical capacity, the profiled physical
    count kept beside it (:data:`PHYSICAL_TOKENS_ATTR`)."""
    if getattr(config, PHYSICAL_TOKENS_ATTR, None) is not None:
        raise RuntimeError(f"{FLAG}: the capacity split was applied twice to one MemoryPoolConfig")
    physical = config.max_total_num_tokens
    setattr(config, PHYSICAL_TOKENS_ATTR, physical)
    config.max_total_num_tokens = layout.logical_tokens(physical)
    return config


def new_context(layout: CpSharedKVLayout, server_args, cp_group) -> CpSharedKVContext:
    """This rank's context, once the ranks of ``cp_group`` (SGLang's attention-CP
    ``GroupCoordinator``) agree on the settings that change which collectives they issue."""
    context = CpSharedKVContext(layout, metrics_enabled=bool(getattr(server_args, "enable_metrics", False)))
    # Before anything depends on them: both change which collectives this rank issues.
    check_ranks_agree(cp_group.cpu_group, {PREFETCH_ENV: prefetch_enabled(), DEBUG_ENV: debug_enabled()})
    if prefetch_enabled():
        context.prefetch_group = new_prefetch_group(cp_group)
        logger.info("CP shared KV: MLA history prefetch on (%s=1): one layer ahead on its own communicator",
                    PREFETCH_ENV)
    return context


def build_pools(original, runner, *args, **kwargs):
    """AROUND ``ModelRunnerKVCacheMixin._init_pools``."""
    if not shares_kv(runner.server_args):
        return original(runner, *args, **kwargs)
    if getattr(runner.memory_pool_config, PHYSICAL_TOKENS_ATTR, None) is None:
        raise RuntimeError(f"{FLAG}: the pools are being built before the capacity split ran")
    # NOTE: imported here, not at the top: pool/kv_pool_v0512.py subclasses 0.5.12's NSATokenToKVPool when
    # imported, and this module's shared half serves 0.5.23 too (capacity_v0523)
    from sglang_cp_shared_kv.pool.kv_pool_v0512 import use_cp_shared_pool_classes

    context = new_context(layout_for_runner(runner), runner.server_args, sg.get_attention_cp_group())
    with use_cp_shared_pool_classes(context):
        result = original(runner, *args, **kwargs)
    pool, allocator = runner.token_to_kv_pool, runner.token_to_kv_pool_allocator
    if context_of(runner) is not context or not isinstance(allocator, CpSharedPagedTokenToKVPoolAllocator):
        raise RuntimeError(
            f"{FLAG}: SGLang built {type(pool).__name__} / {type(allocator).__name__} instead of "
            "the shared-KV pool and allocator; this model or configuration takes a pool path the "
            "plugin does not support"
        )
    return result


def log_capacity(result, runner, *args, **kwargs):
    """AFTER ``ModelRunnerKVCacheMixin.init_memory_pool``."""
    context = context_of(runner)
    if not shares_kv(runner.server_args) or context is None:
        return result
    record_capacity(context, runner.token_to_kv_pool, runner.server_args, logical_tokens=runner.max_total_num_tokens,
                    max_running_requests=runner.max_running_requests, local_writes=True)
    return result


def record_capacity(context: CpSharedKVContext, pool, settings, *, logical_tokens: int,
                    max_running_requests: int, local_writes: bool) -> CapacitySplit:
    """The rank's :class:`CapacitySplit` on its context, and its one startup line.
    ``settings``: the resolved ``max_total_tokens`` and ``chunked_prefill_size`` (0.5.12's
    ``ServerArgs``; 0.5.23's resolved view). ``.local_writes_v0512``: whether full chunks can be
    stored where they are computed (in-seq CP; under interleave every page's rows are
    computed on every rank)."""
    layout = context.layout
    split = CapacitySplit(
        physical_tokens_per_rank=pool.physical_size,
        logical_tokens=logical_tokens,
        cp_size=layout.cp_size,
        cp_rank=layout.cp_rank,
        page_size=layout.page_size,
        kv_gb_per_rank=pool.mem_usage,
        max_running_requests=max_running_requests,
    )
    context.split = split
    cap = settings.max_total_tokens
    chunk, unit = settings.chunked_prefill_size, page_by_page_chunk_unit(layout.cp_size, layout.page_size)
    chunked = local_writes and chunk is not None and chunk > 0  # SGLang's -1 / None: chunked prefill off
    logger.info(
        "CP shared KV: physical_tokens_per_rank=%d logical_tokens=%d cp_size=%d cp_rank=%d "
        "shard_policy=%s kv_gb_per_rank=%.2f (same as without the flag) max_running_requests=%d%s "
        "chunked_prefill_size=%s%s",
        split.physical_tokens_per_rank, split.logical_tokens, split.cp_size, split.cp_rank,
        SHARD_POLICY, split.kv_gb_per_rank, split.max_running_requests,
        f" (--max-total-tokens {cap} capped the per-rank physical pool)" if cap else "", chunk,
        f" (full chunks are stored where they are computed: a multiple of {unit})"
        if chunked and chunk % unit == 0 else "",
    )
    if chunked and chunk % unit and layout.cp_rank == 0:
        logger.warning(
            "CP shared KV: --chunked-prefill-size %d is not a multiple of 2 x CP size x page size = %d, so "
            "SGLang cuts every chunk mid-page and every chunk keeps its per-layer all-gather of the chunk's "
            "KV (correct, but more bytes and N-fold stores per layer); with --chunked-prefill-size %d the "
            "full chunks are stored where they are computed (docs/user-guide.md, 'Where each chunk's KV "
            "is written')", chunk, unit, max(unit, chunk // unit * unit))
    return split
