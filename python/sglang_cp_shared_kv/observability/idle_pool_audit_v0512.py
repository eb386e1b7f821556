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
HiSparse, pools without a paged free list) publish nothing.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Dict, Optional

from sglang_cp_shared_kv.settings.config import is_enabled
from sglang_cp_shared_kv.cp_shared_kv_layout import CpSharedKVLayout
from sglang_cp_shared_kv.observability.prometheus_registry import prometheus_metric

logger = logging.getLogger(__name__)

#: the gauge, one sample per (scheduler rank, field)
AUDIT_METRIC = "sglang:cp_shared_kv_idle_pool_audit"
#: an idle scheduler audits again after this long even when nothing changed
REFRESH_S = 5.0
#: what each audit publishes (tokens and pages are logical, ``rank_*`` this rank's own)
FIELDS = (
    "checked_at_unix_s", "audits", "leak_audits",
    "total_tokens", "available_tokens", "evictable_tokens", "protected_tokens", "session_held_tokens",
    "sglang_leak", "accounted_minus_total_tokens",
    "pages", "free_pages", "cached_pages", "leaked_pages", "double_listed_pages", "out_of_range_pages",
    "rank_pages", "rank_free_pages", "rank_cached_pages", "rank_leaked_pages",
    "req_slots_free", "req_slots_session_held", "req_slots_total", "cp_size",
)
_STATE_ATTR = "_cp_shared_kv_idle_pool_audit"


@dataclass
class _AuditState:
    """One scheduler's audit bookkeeping (kept on the scheduler: no module global)."""

    key: Optional[tuple] = None
    at: float = 0.0
    audits: int = 0
    leak_audits: int = 0


def page_accounting(free_pages, held_locations, page_size: int, num_pages: int, cp_size: int = 1,
                    cp_rank: int = 0) -> Dict[str, int]:
    """Where each logical page ``1 .. num_pages`` is: ``free_pages`` (page ids, as the
    allocator lists them, a page listed twice counts twice) and ``held_locations`` (token
    locations the radix tree holds). ``rank_*``: the pages rank ``cp_rank`` of ``cp_size``
    stores (its owned pages, as :class:`.cp_shared_kv_layout.CpSharedKVLayout` assigns them)."""
    import torch

    free = free_pages.reshape(-1).to(torch.int64)
    held = torch.unique(held_locations.reshape(-1).to(torch.int64) // page_size)
    listed = torch.cat([free, held.to(free.device)])
    in_range = (listed >= 1) & (listed <= num_pages)
    counts = torch.bincount(listed[in_range], minlength=num_pages + 1)[1:]
    free_counts = torch.bincount(free[(free >= 1) & (free <= num_pages)], minlength=num_pages + 1)[1:]
    lane = CpSharedKVLayout(page_size, cp_size, cp_rank).owned_pages_mask(
        torch.arange(1, num_pages + 1, device=counts.device), validate=False)
    leaked = counts == 0
    return {
        "pages": num_pages,
        "free_pages": int((free_counts > 0).sum()),
        "cached_pages": int(held.numel()),
        "leaked_pages": int(leaked.sum()),
        "double_listed_pages": int((counts > 1).sum()),
        "out_of_range_pages": int((~in_range).sum()),
        "rank_pages": int(lane.sum()),
        "rank_free_pages": int(((free_counts > 0) & lane).sum()),
        "rank_cached_pages": int(((counts - free_counts > 0) & lane).sum()),
        "rank_leaked_pages": int((leaked & lane).sum()),
    }


def _held_locations(tree_cache, device):
    """Token locations the prefix cache holds in device memory (none for a chunk cache or an
    empty tree). NOTE: walked here rather than by SGLang's ``all_values_flatten``, which
    concatenates every node's value: HiRadixCache keeps a node whose KV it evicted to host
    memory with no device value (``value`` None), which holds no device page."""
    import torch

    empty = torch.empty((0,), dtype=torch.int64, device=device)
    root = getattr(tree_cache, "root_node", None)
    if not tree_cache.is_tree_cache() or root is None:
        return empty
    values, stack = [], list(root.children.values())
    while stack:
        node = stack.pop()
        if node.value is not None:
            values.append(node.value.to(device=device, dtype=torch.int64))
        stack.extend(node.children.values())
    return torch.cat(values) if values else empty


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
    pages = page_accounting(free, _held_locations(tree_cache, free.device), allocator.page_size,
                            allocator.size // allocator.page_size, cp_size, cp_rank)
    available = allocator.available_size()
    evictable, protected = tree_cache.evictable_size(), tree_cache.protected_size()
    held_by_sessions = getattr(scheduler, "_session_held_tokens", None)
    session_held = held_by_sessions() if held_by_sessions is not None else 0
    total = scheduler.max_total_num_tokens
    req_pool = scheduler.req_to_token_pool
    held_reqs = getattr(scheduler, "_session_held_req_count", None)
    # NOTE: SGLang's _check_req_pool: a decode server preallocates beyond its running slots
    decode = getattr(getattr(scheduler, "server_args", None), "disaggregation_mode", None) == "decode"
    return {
        **pages,
        "total_tokens": total, "available_tokens": available, "evictable_tokens": evictable,
        "protected_tokens": protected, "session_held_tokens": session_held, "sglang_leak": int(bool(sglang_leak)),
        "accounted_minus_total_tokens": available + evictable + protected + session_held - total,
        "req_slots_free": len(req_pool.free_slots),
        "req_slots_session_held": held_reqs() if held_reqs is not None else 0,
        "req_slots_total": req_pool.size + (req_pool.pre_alloc_size if decode else 0),
        "cp_size": cp_size,
    }


def leak_found(record: Dict[str, float]) -> bool:
    """Whether an audit shows a page out of place (SGLang's count or the page listing)."""
    return bool(record["sglang_leak"] or record["accounted_minus_total_tokens"] or record["leaked_pages"]
                or record["double_listed_pages"] or record["out_of_range_pages"]
                or record["req_slots_free"] + record["req_slots_session_held"] != record["req_slots_total"])


def publish(rank: int, record: Dict[str, float]) -> None:
    gauge = prometheus_metric("gauge", AUDIT_METRIC,
                              "An idle scheduler's KV pool page by page, beside SGLang's own idle check "
                              "(CP shared KV; docs: observability/idle_pool_audit_v0512.py).", ("rank", "field"),
                              multiprocess_mode="mostrecent")
    for field in FIELDS:
        gauge.labels(rank=str(rank), field=field).set(float(record[field]))


def _rank_of(scheduler) -> int:
    layout = getattr(scheduler.token_to_kv_pool_allocator, "cp_layout", None)
    return layout.cp_rank if layout is not None else int(getattr(scheduler, "tp_rank", 0) or 0)


def audit_idle_pools(result, scheduler, *args, **kwargs):
    """AFTER ``SchedulerRuntimeCheckerMixin._check_all_pools`` (``result``: SGLang's
    ``(has_leak, messages)``): flag on and ``--enable-metrics``, a fully idle scheduler's pool
    audited and published (module docstring) when it changed or ``REFRESH_S`` passed."""
    if not _applies(scheduler):
        return result
    state = scheduler.__dict__.setdefault(_STATE_ATTR, _AuditState())
    if state.audits < 0:  # an earlier audit failed here: off in this process
        return result
    try:
        if not scheduler.is_fully_idle():
            return result
        allocator, tree_cache = scheduler.token_to_kv_pool_allocator, scheduler.tree_cache
        key = (getattr(scheduler, "forward_ct", None), allocator.available_size(), len(allocator.free_pages),
               tree_cache.evictable_size(), tree_cache.protected_size(), bool(result[0]))
        now = time.time()
        if key == state.key and now - state.at < REFRESH_S:
            return result
        record = audit(scheduler, sglang_leak=bool(result[0]))
        state.key, state.at, state.audits = key, now, state.audits + 1
        state.leak_audits += int(leak_found(record))
        record.update(checked_at_unix_s=now, audits=state.audits, leak_audits=state.leak_audits)
        publish(_rank_of(scheduler), record)
    except Exception:  # noqa: BLE001 -- the audit must never disturb SGLang's own check
        logger.warning("CP shared KV: the idle pool audit failed and is off in this process (SGLang's own "
                       "idle check is unaffected)", exc_info=True)
        state.audits = -1
    return result


__all__ = ["AUDIT_METRIC", "FIELDS", "REFRESH_S", "audit", "audit_idle_pools", "leak_found", "page_accounting",
           "publish"]
