"""Where every page of an idle scheduler's KV pool is, beside SGLang's own idle memory check
(flag on, ``--enable-metrics``): how ``scripts/soak_pd.py`` tells that a load leaked no page
on any prefill CP rank and on decode.

SGLang 0.5.12.post1 checks a scheduler's pools each time it is fully idle
(``SchedulerRuntimeCheckerMixin.on_idle``, ``managers/scheduler_runtime_checker_mixin.py``
551-562), in the PD loops too (``disaggregation/prefill.py`` 417 and 458, ``decode.py`` 1592
and 1626; ``is_fully_idle``, ``managers/scheduler.py`` 3295-3340, counts the PD bootstrap,
in-flight, preallocation and transfer queues as work): ``available + evictable + protected +
session-held == max_total_num_tokens`` (``_check_full_pool`` / ``_check_pool_invariant``,
291-333, over ``_get_token_info``, 200-210). Its verdict stays inside the scheduler: a leak
raises (``SGLANG_ENABLE_STRICT_MEM_CHECK_DURING_IDLE``, on by default: the server stops) or
logs a warning; a whole pool says nothing, so nothing outside can show the check ran, or
when. The hook here runs AFTER SGLang's ``_check_all_pools`` (483-504) and publishes, per
scheduler process (labels ``rank``, ``field``), SGLang's verdict and the figures it compared,
plus the pool page by page: each page of ``1 .. size / page`` is free (the allocator's
``free_pages`` + ``release_pages``) or held by the radix tree (a node's device value; with
HiCache a node evicted to host memory holds none), once;
``leaked_pages`` are in neither, ``double_listed_pages`` in both or twice (a double free a
count can hide behind a leak), and when it looked (``checked_at_unix_s``).

Why this is exact under the flag: each CP rank's allocator is SGLang's
``PagedTokenToKVPoolAllocator`` over the *logical* pages (:mod:`.pool.allocator`, its size checked
equal to the physical pool x N), ``max_total_num_tokens`` is the logical count
(:func:`.pool.capacity.split_into_logical`) and the radix tree holds logical locations, so
SGLang's invariant holds over logical tokens exactly as on a stock server. Logical page ``p``
is physical page ``(p - 1) div N + 1`` of rank ``(p - 1) mod N`` and nothing else allocates a
physical page (:mod:`.cp_shared_kv_layout`): a physical page of rank ``r`` is leaked exactly
when its logical page is, and the ``rank_*`` fields count rank ``r``'s own pages. Every rank
schedules alike, so each rank's audit covers the whole logical pool and the ranks must agree.
Decode (flag on there: stock allocator, no CP) is audited the same way, as one rank.

Only when the scheduler is fully idle (SGLang's watchdog also calls ``_check_all_pools``,
mid-batch), and only when the pool changed or ``REFRESH_S`` passed, so an idle server spends
one audit every few seconds. An audit that fails logs one warning and never disturbs
SGLang's check. Configurations the page audit does not describe (hybrid SWA / SSM pools,
HiSparse, pools without a paged free list) publish nothing. The release-neutral part (the
fields, the page accounting, the bookkeeping) is :mod:`.idle_pool_audit`.
"""

from __future__ import annotations

from typing import Dict

from sglang_cp_shared_kv.settings.config import is_enabled
from sglang_cp_shared_kv.observability.idle_pool_audit import (AUDIT_METRIC, FIELDS, REFRESH_S, audit_when_changed,
                                                               held_locations_of_tree, leak_found, page_accounting,
                                                               pool_key, pool_record, publish)


def _applies(scheduler) -> bool:
    allocator = getattr(scheduler, "token_to_kv_pool_allocator", None)
    return (is_enabled(getattr(scheduler, "server_args", None)) and bool(getattr(scheduler, "enable_metrics", False))
            and not getattr(scheduler, "is_hybrid_swa", False) and not getattr(scheduler, "is_hybrid_ssm", False)
            and not getattr(scheduler, "enable_hisparse", False)
            and getattr(allocator, "free_pages", None) is not None and getattr(allocator, "page_size", 1) > 1)


def audit(scheduler, sglang_leak: bool) -> Dict[str, float]:
    """The pool of an idle ``scheduler`` (module docstring), SGLang's verdict ``sglang_leak``
    beside it; ``audits`` and ``checked_at_unix_s`` are the caller's."""
    allocator, tree_cache = scheduler.token_to_kv_pool_allocator, scheduler.tree_cache
    layout = getattr(allocator, "cp_layout", None)  # the shared-KV allocator's; decode: none
    cp_size, cp_rank = (layout.cp_size, layout.cp_rank) if layout is not None else (1, 0)
    import torch

    free = torch.cat([allocator.free_pages, allocator.release_pages])
    held_by_sessions = getattr(scheduler, "_session_held_tokens", None)
    req_pool = scheduler.req_to_token_pool
    held_reqs = getattr(scheduler, "_session_held_req_count", None)
    # NOTE: SGLang's _check_req_pool: a decode server preallocates beyond its running slots
    decode = getattr(getattr(scheduler, "server_args", None), "disaggregation_mode", None) == "decode"
    # NOTE: walked here rather than by SGLang's all_values_flatten, which concatenates every
    # node's value: HiRadixCache keeps a node whose KV it evicted to host memory with no device value
    return pool_record(
        free_pages=free, held_locations=held_locations_of_tree(tree_cache, free.device),
        page_size=allocator.page_size, num_pages=allocator.size // allocator.page_size,
        cp_size=cp_size, cp_rank=cp_rank, total=scheduler.max_total_num_tokens,
        available=allocator.available_size(), evictable=tree_cache.evictable_size(),
        protected=tree_cache.protected_size(),
        session_held=held_by_sessions() if held_by_sessions is not None else 0, sglang_leak=sglang_leak,
        req_slots_free=len(req_pool.free_slots),
        req_slots_session_held=held_reqs() if held_reqs is not None else 0,
        req_slots_total=req_pool.size + (req_pool.pre_alloc_size if decode else 0))


def _rank_of(scheduler) -> int:
    layout = getattr(scheduler.token_to_kv_pool_allocator, "cp_layout", None)
    return layout.cp_rank if layout is not None else int(getattr(scheduler, "tp_rank", 0) or 0)


def audit_idle_pools(result, scheduler, *args, **kwargs):
    """AFTER ``SchedulerRuntimeCheckerMixin._check_all_pools`` (``result``: SGLang's
    ``(has_leak, messages)``): flag on and ``--enable-metrics``, a fully idle scheduler's pool
    audited and published (module docstring) when it changed or ``REFRESH_S`` passed."""
    if not _applies(scheduler):
        return result

    def key():
        if not scheduler.is_fully_idle():
            return None
        return pool_key(getattr(scheduler, "forward_ct", None), scheduler.token_to_kv_pool_allocator,
                        scheduler.tree_cache, result[0])

    audit_when_changed(scheduler, key, lambda: audit(scheduler, sglang_leak=bool(result[0])),
                       lambda: _rank_of(scheduler))
    return result


__all__ = ["AUDIT_METRIC", "FIELDS", "REFRESH_S", "audit", "audit_idle_pools", "leak_found", "page_accounting",
           "publish"]
