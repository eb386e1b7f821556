"""HiCache's storage tier (L3) under the flag on SGLang 0.5.12.post1: each CP rank stores and
fetches only its own pages.

:class:`PrefetchLaneStorage` is :class:`.storage.ShardedStorage` (keys ``{hash}@cp{N}``, this
rank's pages at their physical rows, MLA latent and index K alike) with what 0.5.12.post1's
prefetch needs besides:

* the existence query of a prefetch touches only this rank's pages (0.5.12.post1 allocates a
  prefetch's host pages before it asks, so their lanes are known): the hit is this rank's pages
  up to its first missing one, which SGLang's own MIN over the attention-CP group (the prefetch
  thread's) turns into the group's hit; a page lost between the query and the fetch shortens
  what the owner fetched, and SGLang's MIN in ``check_prefetch_progress`` shortens the group's
  insert the same way; a query that raises finds none of this rank's pages (the hit ends at its
  first, :meth:`.storage.ShardedStorage._call_backend`);
* a page fetched without its index K counts as not fetched (0.5.12.post1 counts a prefetch by
  its KV pages only; its storage thread fetches the index pages first).

:class:`PrefetchHostPages` keeps the host pages of prefetches rank-identical. SGLang frees a
prefetch's unused host pages from its storage threads (through ``host_mem_release_queue``),
at times and in amounts that differ per rank; stock tolerates that because each rank's host
pool is its own. Ours is one logical pool allocated lane by lane on every rank, so under the
flag those releases are dropped and each prefetch's unused pages are freed by the scheduler
thread, in prefetch order, once every rank has resolved the prefetch and no storage thread
of any rank still writes into them (agreed in the MIN SGLang already runs in
``drain_storage_control_queues``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import threading
import types
from typing import Dict, List, Optional, Sequence

import torch

from sglang_cp_shared_kv import sglang_api as sg
from sglang_cp_shared_kv.hicache.host_lanes import HostPageRule
from sglang_cp_shared_kv.hicache.metrics import HostTierCounts
from sglang_cp_shared_kv.hicache.storage import ShardedStorage
from sglang_cp_shared_kv.scoped import attributes_set
from sglang_cp_shared_kv.settings.config import FLAG

logger = logging.getLogger(__name__)

class PrefetchLaneStorage(ShardedStorage):
    """The storage backend as one CP rank uses it on SGLang 0.5.12.post1 (module docstring):
    :class:`.storage.ShardedStorage`, with the existence query of a prefetch narrowed to the
    pages of this rank's lane, and a page fetched without its index K counted as not fetched."""

    def __init__(self, backend, rule: HostPageRule, counts: HostTierCounts):
        super().__init__(backend, rule, counts)
        self._query_lanes = _QueryLanes()
        #: logical host pages of this rank whose index K the last sidecar fetch missed (the
        #: storage thread fetches a prefetch's index pages, then its KV pages)
        self._index_missing: set = set()

    def _fetched(self, host_indices: torch.Tensor, positions: List[int], got: Sequence[bool]) -> List[bool]:
        # NOTE: a page fetched without its index K is not fetched: SGLang counts a prefetch by its
        # KV pages only, and would insert the page with whatever the index host rows held
        pages = self.rule.first_pages(host_indices.cpu()).tolist()
        return [bool(ok) and pages[i] not in self._index_missing for i, ok in zip(positions, got)]

    def _sidecar_fetched(self, transfers, results: Dict[str, List[bool]]) -> None:
        self._index_missing = {page for transfer in transfers
                               for page, ok in zip(self.rule.first_pages(transfer.host_indices.cpu()).tolist(),
                                                   results[transfer.name]) if not ok}

    # ------------------------------------------------------------ existence (a prefetch's hit)
    def query_for(self, host_indices: Optional[torch.Tensor]):
        """Within the block, existence queries are for a prefetch into ``host_indices`` (its
        pages' lanes say which keys this rank checks). The prefetch thread's own state."""
        return attributes_set(self._query_lanes, lanes=None if host_indices is None else self.lanes_of(host_indices))

    def _own_hit(self, keys: List[str], exists_prefix) -> int:
        """The pages of ``keys`` up to this rank's first missing own page (pages with no host
        page behind them end the hit: no rank could fetch them)."""
        lanes = self._query_lanes.lanes
        if lanes is None:
            raise RuntimeError(f"{FLAG}: a storage existence query outside a prefetch (no host pages to "
                               "say which of its pages are this rank's)")
        pages = min(len(keys), int(lanes.numel()))
        positions = (lanes[:pages] == self.cp_rank).nonzero().flatten().tolist()
        found = 0
        if positions:
            own_keys = self.keys([keys[i] for i in positions])
            found = self._call_backend("query", len(positions), lambda: exists_prefix(own_keys), lambda: 0)
        return positions[found] if found < len(positions) else pages

    def batch_exists(self, keys: List[str], extra_info=None) -> int:
        return self._own_hit(keys, lambda own: self.backend.batch_exists(own, extra_info))

    def batch_exists_v2(self, keys: List[str], pool_transfers=None, extra_info=None):
        hit = self._own_hit(keys, lambda own: self.backend.batch_exists_v2(own, pool_transfers, extra_info).kv_hit_pages)
        return sg.PoolTransferResult(hit, {t.name: hit for t in pool_transfers or ()} if hit else {})


class _QueryLanes(threading.local):
    """The lanes of the prefetch whose existence query runs on this thread (None: none)."""

    lanes: Optional[torch.Tensor] = None


@dataclasses.dataclass(eq=False)
class _Prefetch:
    """One prefetch's host pages. ``release_from``: the first token of ``host_indices`` the
    radix tree did not take (set when the scheduler resolves the prefetch); ``idle``: no
    storage thread of this rank touches them any more; ``revoke_seen``: this rank's prefetch
    thread released all of them, as it does when it revokes the prefetch."""

    request_id: str
    operation: object
    host_indices: torch.Tensor
    release_from: Optional[int] = None
    idle: bool = False
    revoke_seen: bool = False


class PrefetchHostPages:
    """The host pages of prefetches in flight, in the order the scheduler started them (the
    same on every rank). The scheduler thread opens and resolves entries and frees the
    leading entries every rank reports ready (:meth:`ready_count`, MIN over the group); the
    storage threads only mark an entry idle."""

    def __init__(self):
        self._entries: List[_Prefetch] = []
        self._lock = threading.Lock()
        self._capture = threading.local()

    @contextlib.contextmanager
    def capturing(self):
        """Within the block, releases this thread asks for (:meth:`note_release`) are counted in
        the yielded ``released.tokens`` (the scheduler thread resolving a prefetch)."""
        released = types.SimpleNamespace(tokens=0)
        self._capture.released = released
        try:
            yield released
        finally:
            self._capture.released = None

    def note_release(self, host_indices: torch.Tensor) -> None:
        """SGLang asks to release ``host_indices`` (``append_host_mem_release``). Not done: these
        pages are freed in prefetch order (class docstring); a capturing thread counts them. A
        release of a prefetch's whole allocation (the very tensor it was started with: the
        prefetch thread revoking it) marks that prefetch for :meth:`revoked`."""
        released = getattr(self._capture, "released", None)
        if released is not None:
            released.tokens += int(host_indices.numel())
            return
        with self._lock:
            # NOTE: by identity: stock's other releases of a prefetch's pages pass slices of it
            entry = next((e for e in self._entries if e.host_indices is host_indices), None)
            if entry is not None:
                entry.revoke_seen = True

    def __len__(self) -> int:
        return len(self._entries)

    def opened(self, request_id: str, operation, host_indices: torch.Tensor) -> None:
        with self._lock:
            self._entries.append(_Prefetch(request_id, operation, host_indices))

    def _entry(self, operation) -> Optional[_Prefetch]:
        return next((e for e in self._entries if e.operation is operation), None)

    def resolved(self, operation, release_from: int) -> None:
        """The scheduler is done with ``operation``: its tokens from ``release_from`` on are free
        once idle."""
        with self._lock:
            entry = self._entry(operation)
            if entry is not None and entry.release_from is None:
                entry.release_from = release_from

    def transfer_done(self, operation) -> None:
        """This rank's storage thread is done writing ``operation``'s host pages."""
        with self._lock:
            entry = self._entry(operation)
            if entry is not None:
                entry.idle = True

    def revoked(self, request_ids: Sequence[str]) -> None:
        """The prefetch thread revoked these (agreed over the group): none was fetched, so the
        revoked entry of each is idle, and free from its first token if the scheduler had not
        resolved it yet. The revoked entry: the one whose allocation the prefetch thread released
        whole (:meth:`note_release`), else the oldest open entry of the request id."""
        with self._lock:
            for request_id in request_ids:
                # NOTE: a request id can have two prefetches open (SGLang replaced one it still
                # tracked); the older may be in this rank's I/O buffer, writing its host rows
                candidates = [e for e in self._entries if e.request_id == request_id and not e.idle]
                entry = next((e for e in candidates if e.revoke_seen), candidates[0] if candidates else None)
                if entry is not None:
                    entry.idle = True
                    if entry.release_from is None:
                        entry.release_from = 0

    def ready_count(self) -> int:
        """How many leading entries this rank could free now."""
        with self._lock:
            count = 0
            for entry in self._entries:
                if entry.release_from is None or not entry.idle:
                    break
                count += 1
            return count

    def release(self, count: int) -> torch.Tensor:
        """Remove the first ``count`` entries; the host pages to free (logical host locations)."""
        with self._lock:
            done, self._entries = self._entries[:count], self._entries[count:]
        return _unused_pages(done)

    def release_at_detach(self, freed_by_sglang: Sequence[object]) -> torch.Tensor:
        """Drop every entry; the host pages to free of those whose operation is not in
        ``freed_by_sglang`` (SGLang's detach frees the whole allocation of the prefetches it
        still tracks; the storage threads are stopped by then)."""
        with self._lock:
            done, self._entries = self._entries, []
        skip = {id(op) for op in freed_by_sglang}
        return _unused_pages([e for e in done if id(e.operation) not in skip])

    def clear(self) -> None:
        with self._lock:
            self._entries = []


def _unused_pages(entries: Sequence[_Prefetch]) -> torch.Tensor:
    """The host locations the radix tree did not take of ``entries`` (all of an unresolved one's)."""
    parts = [e.host_indices[e.release_from or 0:] for e in entries]
    return torch.cat(parts) if parts else torch.empty(0, dtype=torch.int64)
