"""The idle pool audit's release-neutral part: what it publishes (:data:`AUDIT_METRIC`,
:data:`FIELDS`), the page-by-page accounting (:func:`page_accounting`), the record beside
SGLang's own counts (:func:`pool_record`), the verdict (:func:`leak_found`) and the
once-per-change bookkeeping (:func:`audit_when_changed`). Where SGLang checks an idle pool,
and why the accounting is exact under the flag, is each release's:
:mod:`.idle_pool_audit_v0512`, :mod:`.idle_pool_audit_v0523`, which import this module (it
imports neither)."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Callable, Dict, Hashable, Optional

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
#: where a scheduler keeps its :class:`AuditState` (its ``__dict__``: no module global)
STATE_ATTR = "_cp_shared_kv_idle_pool_audit"


@dataclass
class AuditState:
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


def held_locations_of_tree(tree_cache, device):
    """Token locations a ``TreeNode`` radix tree (``root_node``, ``children``, ``value``)
    holds in device memory, walked node by node: a node whose KV HiCache evicted to host
    memory keeps no device value (``value`` None) and holds no device page."""
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


def pool_record(*, free_pages, held_locations, page_size: int, num_pages: int, cp_size: int, cp_rank: int,
                total: int, available: int, evictable: int, protected: int, session_held: int, sglang_leak: bool,
                req_slots_free: int, req_slots_session_held: int, req_slots_total: int,
                uncached: int = 0) -> Dict[str, float]:
    """One audit's fields but its bookkeeping (``audits``, ``leak_audits``,
    ``checked_at_unix_s``): the pages (:func:`page_accounting`) beside the figures SGLang's
    idle check compared (``uncached``: what SGLang adds for requests it knows hold pages, 0
    when the scheduler is idle)."""
    return {
        **page_accounting(free_pages, held_locations, page_size, num_pages, cp_size, cp_rank),
        "total_tokens": total, "available_tokens": available, "evictable_tokens": evictable,
        "protected_tokens": protected, "session_held_tokens": session_held, "sglang_leak": int(bool(sglang_leak)),
        "accounted_minus_total_tokens": available + evictable + protected + session_held + uncached - total,
        "req_slots_free": req_slots_free, "req_slots_session_held": req_slots_session_held,
        "req_slots_total": req_slots_total, "cp_size": cp_size,
    }


def leak_found(record: Dict[str, float]) -> bool:
    """Whether an audit shows a page out of place (SGLang's count or the page listing)."""
    return bool(record["sglang_leak"] or record["accounted_minus_total_tokens"] or record["leaked_pages"]
                or record["double_listed_pages"] or record["out_of_range_pages"]
                or record["req_slots_free"] + record["req_slots_session_held"] != record["req_slots_total"])


def publish(rank: int, record: Dict[str, float]) -> None:
    gauge = prometheus_metric("gauge", AUDIT_METRIC,
                              "An idle scheduler's KV pool page by page, beside SGLang's own idle check "
                              "(CP shared KV; docs: observability/idle_pool_audit.py).", ("rank", "field"),
                              multiprocess_mode="mostrecent")
    for field in FIELDS:
        gauge.labels(rank=str(rank), field=field).set(float(record[field]))


def pool_key(forward_ct, allocator, tree_cache, sglang_leak: bool) -> tuple:
    """What, unchanged, lets an idle scheduler skip its next audit (until :data:`REFRESH_S`):
    the forward count, the allocator's free counts, the tree's, SGLang's verdict."""
    return (forward_ct, allocator.available_size(), len(allocator.free_pages), tree_cache.evictable_size(),
            tree_cache.protected_size(), bool(sglang_leak))


def audit_when_changed(scheduler, key_of: Callable[[], Optional[Hashable]], record_of: Callable[[], Dict[str, float]],
                       rank_of: Callable[[], int]) -> None:
    """Audit ``scheduler``'s pool (``record_of``) and publish it under ``rank_of()`` when
    ``key_of()`` (None: not now, e.g. not idle) changed or :data:`REFRESH_S` passed. An audit
    that fails logs one warning and leaves the audit off in this process; nothing raises."""
    state = scheduler.__dict__.setdefault(STATE_ATTR, AuditState())
    if state.audits < 0:  # an earlier audit failed here: off in this process
        return
    try:
        key = key_of()
        if key is None:
            return
        now = time.time()
        if key == state.key and now - state.at < REFRESH_S:
            return
        record = record_of()
        state.key, state.at, state.audits = key, now, state.audits + 1
        state.leak_audits += int(leak_found(record))
        record.update(checked_at_unix_s=now, audits=state.audits, leak_audits=state.leak_audits)
        publish(rank_of(), record)
    except Exception:  # noqa: BLE001 -- the audit must never disturb SGLang's own check
        logger.warning("CP shared KV: the idle pool audit failed and is off in this process (SGLang's own "
                       "idle check is unaffected)", exc_info=True)
        state.audits = -1


__all__ = ["AUDIT_METRIC", "FIELDS", "REFRESH_S", "STATE_ATTR", "AuditState", "audit_when_changed",
           "held_locations_of_tree", "leak_found", "page_accounting", "pool_key", "pool_record", "publish"]
