"""Capacity split: the scheduler sees N x the tokens each rank physically stores.

Three hooks on ``ModelRunnerKVCacheMixin`` (scheduler processes):

* ``_resolve_memory_pool_config`` AFTER (:func:`split_capacity`): re-validates the
  configuration and the hooks in this process, then turns the profiled per-rank
  token count into the logical capacity ``(physical div page) * N * page``. It runs
  after ``--max-total-tokens`` and ``max_running_requests`` were resolved from the
  *physical* count, so the request pool does not grow with the logical figure, and
  ``--max-total-tokens`` keeps its stock meaning: a cap on what one GPU stores.
* ``_init_pools`` AROUND (:func:`build_pools`): builds the pool and allocator from our
  subclasses (physical buffers, logical size).
* ``init_memory_pool`` AFTER (:func:`log_capacity`): one startup line per rank.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Optional, Tuple

from sglang_cp_shared_kv.config import FLAG, is_enabled
from sglang_cp_shared_kv.cp_shared_kv_layout import SHARD_POLICY, CpSharedKVLayout

logger = logging.getLogger(__name__)

#: Set on SGLang's ``MemoryPoolConfig`` beside the (logical) ``max_total_num_tokens``.
PHYSICAL_TOKENS_ATTR = "physical_max_total_num_tokens"


@dataclass(frozen=True)
class CapacitySplit:
    """What one CP rank of this process stores and what its group exposes."""

    physical_tokens_per_rank: int
    logical_tokens: int
    cp_size: int
    cp_rank: int
    page_size: int
    kv_gb_per_rank: float
    max_running_requests: int


_current_split: Optional[CapacitySplit] = None


def current_split() -> Optional[CapacitySplit]:
    """The split of this process's model runner, once its pool exists (else None)."""
    return _current_split


def attention_cp_position(runner) -> Tuple[int, int]:
    """(CP rank, CP size) of this model runner.

    SGLang's ``TpModelWorker`` builds the ``ModelRunner`` without ``attn_cp_rank``, so in
    a server the rank comes from the attention-CP group, initialised before the pool."""
    if runner.attn_cp_rank is not None:
        return runner.attn_cp_rank, runner.attn_cp_size
    from sglang.srt.layers.dp_attention import get_attention_cp_rank, get_attention_cp_size

    rank, size = get_attention_cp_rank(), get_attention_cp_size()
    if size != runner.attn_cp_size:
        raise RuntimeError(f"{FLAG}: the attention CP group has {size} ranks but the server "
                           f"arguments give attn_cp_size={runner.attn_cp_size}")
    return rank, size


def layout_for_runner(runner) -> CpSharedKVLayout:
    rank, size = attention_cp_position(runner)
    return CpSharedKVLayout(page_size=runner.page_size, cp_size=size, cp_rank=rank)


def split_capacity(config, runner, *args, **kwargs):
    """AFTER ``ModelRunnerKVCacheMixin._resolve_memory_pool_config``."""
    if not is_enabled(runner.server_args):
        return None
    from sglang_cp_shared_kv.hook_check import require_hooks_applied
    from sglang_cp_shared_kv.server_args import validate

    require_hooks_applied("scheduler process")
    validate(runner.server_args, hf_config=runner.model_config.hf_config, use_mla=runner.use_mla_backend)
    if getattr(config, PHYSICAL_TOKENS_ATTR, None) is not None:
        raise RuntimeError(f"{FLAG}: the capacity split was applied twice to one MemoryPoolConfig")
    physical = config.max_total_num_tokens
    setattr(config, PHYSICAL_TOKENS_ATTR, physical)
    config.max_total_num_tokens = layout_for_runner(runner).logical_tokens(physical)
    return config


def build_pools(original, runner, *args, **kwargs):
    """AROUND ``ModelRunnerKVCacheMixin._init_pools``."""
    if not is_enabled(runner.server_args):
        return original(runner, *args, **kwargs)
    from sglang_cp_shared_kv.allocator import CpSharedPagedTokenToKVPoolAllocator
    from sglang_cp_shared_kv.pool import CpSharedNSATokenToKVPool, use_cp_shared_pool_classes

    if getattr(runner.memory_pool_config, PHYSICAL_TOKENS_ATTR, None) is None:
        raise RuntimeError(f"{FLAG}: the pools are being built before the capacity split ran")
    with use_cp_shared_pool_classes(layout_for_runner(runner)):
        result = original(runner, *args, **kwargs)
    pool, allocator = runner.token_to_kv_pool, runner.token_to_kv_pool_allocator
    if not isinstance(pool, CpSharedNSATokenToKVPool) or not isinstance(
        allocator, CpSharedPagedTokenToKVPoolAllocator
    ):
        raise RuntimeError(
            f"{FLAG}: SGLang built {type(pool).__name__} / {type(allocator).__name__} instead of "
            "the shared-KV pool and allocator; this model or configuration takes a pool path the "
            "plugin does not support"
        )
    return result


def log_capacity(result, runner, *args, **kwargs):
    """AFTER ``ModelRunnerKVCacheMixin.init_memory_pool``."""
    global _current_split
    if not is_enabled(runner.server_args):
        return result
    pool = runner.token_to_kv_pool
    layout = pool.cp_layout
    split = CapacitySplit(
        physical_tokens_per_rank=pool.physical_size,
        logical_tokens=runner.max_total_num_tokens,
        cp_size=layout.cp_size,
        cp_rank=layout.cp_rank,
        page_size=layout.page_size,
        kv_gb_per_rank=pool.mem_usage,
        max_running_requests=runner.max_running_requests,
    )
    _current_split = split
    cap = runner.server_args.max_total_tokens
    logger.info(
        "CP shared KV: physical_tokens_per_rank=%d logical_tokens=%d cp_size=%d cp_rank=%d "
        "shard_policy=%s kv_gb_per_rank=%.2f (same as without the flag) max_running_requests=%d%s",
        split.physical_tokens_per_rank, split.logical_tokens, split.cp_size, split.cp_rank,
        SHARD_POLICY, split.kv_gb_per_rank, split.max_running_requests,
        f" (--max-total-tokens {cap} capped the per-rank physical pool)" if cap else "",
    )
    return result
