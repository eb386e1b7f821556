"""The idle pool audit on SGLang 0.5.23 (the 0.5.12.post1 twin, and the idea, are
:mod:`.idle_pool_audit_v0512`'s; the published fields, the page accounting and the
bookkeeping are :mod:`.idle_pool_audit`'s): per scheduler process, SGLang's own idle memory
check verdict and the KV pool page by page on :data:`~.idle_pool_audit.AUDIT_METRIC`, so that
``scripts/soak_pd.py`` can tell that a load leaked no page.

Where 0.5.23 checks the idle pool (paths under ``sglang/srt/``): ``Scheduler.on_idle``
(``managers/scheduler.py`` 5240-5329) returns at once unless ``is_fully_idle()`` (5254-5255;
5337-5406: the PD bootstrap, in-flight, preallocation, transfer and deferred-release queues
count as work), and skips the check under HiSparse or while a decode server holds deferred
KV releases (5282-5291); otherwise it calls ``self.invariant_checker._check_all_pools(
self.pool_stats_observer.get_pool_stats())`` (5292-5294), reports a leak through
``_report_leak`` (raise or warn: ``SGLANG_ENABLE_STRICT_MEM_CHECK_DURING_IDLE``), then
``_check_req_pool`` (5297). The PD loops reach it as well (``disaggregation/prefill.py`` 718
and 858, ``decode.py`` 3159 and 3220). The check moved off the scheduler: it is
``SchedulerInvariantChecker`` (``managers/scheduler_components/invariant_checker.py``, a
slotted dataclass holding the allocator, tree cache, request pool, pool-stats observer and
``max_total_num_tokens``, but not the scheduler): ``_check_all_pools`` (461-482) ->
``_check_full_pool`` (97-173) -> ``_check_pool_invariant`` (78-95): ``available + evictable
+ protected + session_held + uncached == total``, with ``available`` the allocator's
``available_size()`` and ``evictable`` the tree's (``pool_stats_observer.py`` 235-246),
``session_held`` from the observer (197-199) and ``total`` the checker's
``max_total_num_tokens``. SGLang's watchdog calls the same ``_check_all_pools`` from its own
thread, mid-batch, to dump state (``invariant_checker.py`` 508).

Hence two hooks: AROUND ``Scheduler.on_idle`` (:func:`mark_idle_check`) names the scheduler
for the call's duration, on its own thread (a context variable: the checker has no link back
and no ``__dict__``), and AFTER ``SchedulerInvariantChecker._check_all_pools``
(:func:`audit_idle_pools`) audits only a check made inside that scheduler's ``on_idle``
(so only fully idle, never the watchdog's). Its bookkeeping stays on the scheduler.

Why the accounting is exact under the flag on 0.5.23: the plugin's CP strategy there is
interleave with the plugin's own pool (upstream ``--enable-kv-cache-sharding`` is refused
beside the flag). Each CP rank's allocator is ``CpSharedInterleavedPagesAllocator``
(:mod:`.pool.allocator`), a subclass of 0.5.23's ``PagedTokenToKVPoolAllocator``
(``mem_cache/allocator/paged.py`` 136) over the *logical* pages, its size checked equal to
the physical pool x N; it is no ``PageInterleavePoolAllocator``
(``mem_cache/allocator/page_interleave.py`` 58), so ``page_interleave_shard_size`` is 1
(410-420) and ``_check_full_pool`` takes its plain branch (no aggregate free size, no DCP
slack); the checker's ``max_total_num_tokens`` is the logical count (the scheduler's x
``kv_shard_widening`` = 1; :func:`.pool.capacity.split_into_logical`). A free page is in
``free_pages`` or, with ``need_sort``, in the ``staged_pages`` list until an allocation
runs short (``get_all_free_pages``, paged.py 171-172; ``_release_page_ids`` 375-380), and
``available_size()`` counts both (168-169). The tree cache is 0.5.23's ``UnifiedRadixCache``
(``mem_cache/registry.py`` 83-146: also with the radix cache disabled), whose
``all_values_flatten`` (``unified_radix_cache.py`` 3831) lists the device KV locations of
every node and, in the Python tree core, leaves out a node HiCache evicted to host memory
(its value None: ``unified_cache/unified_tree_core.py`` 3433-3446); the default Rust core
(``SGLANG_UNIFIED_RADIX_TREE_CORE_BACKEND``, ``environ.py`` 741) answers the same call from
its compiled binding (``rust_tree_core/adapter.py`` 741-742: the device-resident cases are
tested on both cores; a host-evicted node on the Rust core is not); a tree without it
(0.5.23's older ``RadixCache``) is walked node by node. Its values are logical locations,
so SGLang's invariant holds over logical tokens as on a stock server, and logical page
``p`` is physical page ``(p - 1) div N + 1`` of rank ``(p - 1) mod N``
(:mod:`.cp_shared_kv_layout`; interleave computes every page on every rank, so no page has
a computing rank, but the owner rule is the same): a physical page of rank ``r`` is leaked
exactly when its logical page is, and the ``rank_*`` fields count rank ``r``'s own pages.
Every rank schedules alike, so the ranks must agree. Decode (flag on there: stock
allocator, no CP) is audited as one rank (its tensor-parallel rank), its request slots
including the preallocation headroom as ``_check_req_pool`` counts them (428-450).

What it does not cover: a check SGLang skips (HiSparse, deferred decode releases pending),
hybrid SWA / SSM pools, an upstream widened allocator (``page_interleave_shard_size`` > 1),
pools without a paged free list (nothing is published there); host (HiCache) pages, and
pages held in an open free group (``free_group_begin`` .. ``free_group_end``, never open
while idle). Only when the pool changed or ``REFRESH_S`` passed; an audit that fails logs
one warning and never disturbs SGLang's check.
"""

from __future__ import annotations

import contextvars
import logging
from typing import Dict

from sglang_cp_shared_kv import sglang_api as sg
from sglang_cp_shared_kv.settings.config import is_enabled
from sglang_cp_shared_kv.observability.idle_pool_audit import (AUDIT_METRIC, FIELDS, audit_when_changed,
                                                               held_locations_of_tree, pool_key, pool_record)

logger = logging.getLogger(__name__)

#: the scheduler whose ``on_idle`` runs on this thread (None elsewhere: the watchdog's thread)
_IDLE_SCHEDULER: contextvars.ContextVar = contextvars.ContextVar("cp_shared_kv_idle_scheduler", default=None)


def _applies(scheduler) -> bool:
    allocator = getattr(scheduler, "token_to_kv_pool_allocator", None)
    return (is_enabled(getattr(scheduler, "server_args", None)) and bool(sg.get_observability().enable_metrics)
            and not getattr(scheduler, "is_hybrid_swa", False) and not getattr(scheduler, "is_hybrid_ssm", False)
            and not getattr(scheduler, "enable_hisparse", False)
            and isinstance(allocator, sg.PagedTokenToKVPoolAllocator) and allocator.page_size > 1
            and sg.page_interleave_shard_size(allocator) == 1)


def mark_idle_check(original, scheduler, *args, **kwargs):
    """AROUND ``Scheduler.on_idle``: the scheduler named, on this thread, while its idle
    housekeeping (SGLang's idle pool check among it) runs (module docstring)."""
    try:
        applies = _applies(scheduler)
    except Exception:  # noqa: BLE001 -- the audit must never disturb SGLang's idle housekeeping
        logger.warning("CP shared KV: the idle pool audit could not tell whether it applies; not audited",
                       exc_info=True)
        applies = False
    if not applies:
        return original(scheduler, *args, **kwargs)
    token = _IDLE_SCHEDULER.set(scheduler)
    try:
        return original(scheduler, *args, **kwargs)
    finally:
        _IDLE_SCHEDULER.reset(token)


def held_locations(tree_cache, device):
    """The device KV locations ``tree_cache`` holds (module docstring)."""
    import torch

    if getattr(tree_cache, "tree_core", None) is None:
        return held_locations_of_tree(tree_cache, device)
    return tree_cache.all_values_flatten().to(device=device, dtype=torch.int64)


def audit(checker, pool_stats, sglang_leak: bool, uncached: int = 0) -> Dict[str, float]:
    """The pool SGLang's ``checker`` just checked (``pool_stats``: the figures it compared),
    page by page, SGLang's verdict ``sglang_leak`` beside it."""
    allocator, tree_cache = checker.token_to_kv_pool_allocator, checker.tree_cache
    observer = checker.pool_stats_observer
    layout = getattr(allocator, "cp_layout", None)  # the shared-KV allocator's; decode: none
    cp_size, cp_rank = (layout.cp_size, layout.cp_rank) if layout is not None else (1, 0)
    free = allocator.get_all_free_pages()
    req_pool = checker.req_to_token_pool
    return pool_record(
        free_pages=free, held_locations=held_locations(tree_cache, free.device), page_size=allocator.page_size,
        num_pages=allocator.size // allocator.page_size, cp_size=cp_size, cp_rank=cp_rank,
        total=checker.max_total_num_tokens, available=pool_stats.full_available_size,
        evictable=pool_stats.full_evictable_size, protected=tree_cache.protected_size(),
        session_held=observer.session_held_tokens(), sglang_leak=sglang_leak, uncached=uncached,
        req_slots_free=len(req_pool.free_slots), req_slots_session_held=observer.session_held_req_count(),
        req_slots_total=req_pool.size + getattr(req_pool, "pre_alloc_size", 0))


def _rank_of(scheduler) -> int:
    layout = getattr(scheduler.token_to_kv_pool_allocator, "cp_layout", None)
    if layout is not None:
        return layout.cp_rank
    parallel = sg.get_parallel()
    return int(getattr(parallel, "tp_rank", 0) or 0)


def audit_idle_pools(result, checker, pool_stats=None, uncached: int = 0, *args, **kwargs):
    """AFTER ``SchedulerInvariantChecker._check_all_pools(ps, uncached=0)`` (``result``:
    SGLang's ``(has_leak, messages)``): a check made inside the ``on_idle`` of a scheduler
    the audit applies to (:func:`mark_idle_check`) is audited and published (module
    docstring) when the pool changed or ``REFRESH_S`` passed; any other call passes."""
    pool_stats = kwargs.get("ps", pool_stats)
    scheduler = _IDLE_SCHEDULER.get()
    if scheduler is None or getattr(scheduler, "invariant_checker", None) is not checker or pool_stats is None:
        return result

    def key():
        return pool_key(getattr(scheduler, "forward_ct", None), checker.token_to_kv_pool_allocator,
                        checker.tree_cache, result[0])

    audit_when_changed(scheduler, key, lambda: audit(checker, pool_stats, bool(result[0]), uncached),
                       lambda: _rank_of(scheduler))
    return result


__all__ = ["AUDIT_METRIC", "FIELDS", "audit", "audit_idle_pools", "held_locations", "mark_idle_check"]
