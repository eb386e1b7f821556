"""HiCache's storage tier (L3) under the flag: each CP rank stores and fetches only its own pages.

SGLang 0.5.12.post1 gives its storage backend logical host locations and page keys that name
the tokens only (a SHA-256 chain). Under the flag a rank's host buffer holds only the pages of
its lane (:mod:`.host_lanes`), so :class:`ShardedStorage` stands between the controller and
the backend:

* a page's key is ``{hash}@cp{N}``: a page's bytes depend on its tokens and on how the CP
  group of N computed them, not on which rank of the group holds it, so a CP-N group finds
  what a CP-N group stored and a group of another size misses (never a page of another split);
* a store, a fetch or an existence query touches only this rank's pages (those of its host
  lane), at their physical rows, MLA latent and index K alike; the other pages' entries read
  as done, since their own ranks move them;
* the hit of a prefetch is this rank's pages up to its first missing one, which SGLang's own
  MIN over the attention-CP group (the prefetch thread's) turns into the group's hit; a page
  lost between the query and the fetch shortens what the owner fetched, and SGLang's MIN in
  ``check_prefetch_progress`` shortens the group's insert the same way.

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
from typing import Dict, List, Optional, Sequence, Tuple

import torch

from sglang_cp_shared_kv import sglang_api as sg
from sglang_cp_shared_kv.hicache.host_lanes import HostPageRule
from sglang_cp_shared_kv.scoped import attributes_set
from sglang_cp_shared_kv.settings.config import FLAG

logger = logging.getLogger(__name__)

class ShardKeys:
    """``key(h) = f"{h}@cp{N}"``: a page hash in the namespace of a CP group of N (stateless)."""

    def __init__(self, cp_size: int):
        self.suffix = f"@cp{cp_size}"

    def __call__(self, keys: Sequence[str]) -> List[str]:
        return [f"{key}{self.suffix}" for key in keys]


class ShardedStorage:
    """The storage backend as one CP rank uses it (module docstring). Every attribute it does
    not define is the backend's (stats, ``clear``, ``close``, ...)."""

    def __init__(self, backend, rule: HostPageRule, metrics=None):
        self.backend = backend
        self.rule = rule
        self.cp_rank = rule.layout.cp_rank
        self.keys = ShardKeys(rule.cp_size)
        self._metrics = metrics  # count_copied_pages(direction, pages) of the KV host pool, or None
        self._query_lanes = _QueryLanes()
        #: logical host pages of this rank whose index K the last sidecar fetch missed (the
        #: storage thread fetches a prefetch's index pages, then its KV pages)
        self._index_missing: set = set()

    def __getattr__(self, name):
        # NOTE: only reached for names this class does not define
        return getattr(self.__dict__["backend"], name)

    # ------------------------------------------------------------ this rank's pages
    def lanes_of(self, host_indices: torch.Tensor) -> torch.Tensor:
        return self.rule.lanes(self.rule.first_pages(host_indices.cpu()))

    def _own(self, host_indices: torch.Tensor) -> Tuple[List[int], torch.Tensor]:
        """(the positions of this rank's pages among ``host_indices``'s pages, their physical
        host rows)."""
        page = self.rule.page_size
        host_indices = host_indices.cpu()
        positions = (self.lanes_of(host_indices) == self.cp_rank).nonzero().flatten()
        rows = host_indices.view(-1, page).index_select(0, positions).reshape(-1)
        return positions.tolist(), self.rule.physical_rows(rows)

    @staticmethod
    def _expand(own_results: Sequence[bool], positions: List[int], pages: int) -> List[bool]:
        """A result per page: this rank's from ``own_results``, every other page done."""
        out = [True] * pages
        for position, ok in zip(positions, own_results):
            out[position] = bool(ok)
        return out

    def _count(self, direction: str, results: Sequence[bool]) -> None:
        if self._metrics is not None:
            self._metrics(direction, sum(1 for ok in results if ok))

    # ------------------------------------------------------------ the KV pool (v1, zero copy)
    def batch_get_v1(self, keys: List[str], host_indices: torch.Tensor, extra_info=None) -> List[bool]:
        positions, rows = self._own(host_indices)
        if not positions:
            return [True] * len(keys)
        got = self.backend.batch_get_v1(self.keys([keys[i] for i in positions]), rows, extra_info)
        # NOTE: a page fetched without its index K is not fetched: SGLang counts a prefetch by its
        # KV pages only, and would insert the page with whatever the index host rows held
        pages = self.rule.first_pages(host_indices.cpu()).tolist()
        got = [ok and pages[i] not in self._index_missing for i, ok in zip(positions, got)]
        self._count("fetched", got)
        return self._expand(got, positions, len(keys))

    def batch_set_v1(self, keys: List[str], host_indices: torch.Tensor, extra_info=None) -> List[bool]:
        positions, rows = self._own(host_indices)
        if not positions:
            return [True] * len(keys)
        done = self.backend.batch_set_v1(self.keys([keys[i] for i in positions]), rows, extra_info)
        self._count("stored", done)
        return self._expand(done, positions, len(keys))

    # ------------------------------------------------------------ sidecar pools (v2: the index K)
    def _own_transfers(self, transfers) -> Tuple[list, Dict[str, Tuple[List[int], int]]]:
        own, where = [], {}
        for transfer in transfers:
            positions, rows = self._own(transfer.host_indices)
            where[transfer.name] = (positions, len(transfer.keys))
            if positions:
                own.append(dataclasses.replace(transfer, host_indices=rows,
                                               keys=self.keys([transfer.keys[i] for i in positions])))
        return own, where

    def _v2(self, transfers, extra_info, *, store: bool) -> dict:
        own, where = self._own_transfers(transfers)
        io = self.backend.batch_set_v2 if store else self.backend.batch_get_v2
        results = io(own, extra_info) if own else {}
        out = {name: self._expand(results.get(name, []), positions, pages)
               for name, (positions, pages) in where.items()}
        if not store:
            self._index_missing = {page for transfer in transfers
                                   for page, ok in zip(self.rule.first_pages(transfer.host_indices.cpu()).tolist(),
                                                       out[transfer.name]) if not ok}
        return out

    def batch_get_v2(self, transfers, extra_info=None) -> dict:
        return self._v2(transfers, extra_info, store=False)

    def batch_set_v2(self, transfers, extra_info=None) -> dict:
        return self._v2(transfers, extra_info, store=True)

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
        found = exists_prefix(self.keys([keys[i] for i in positions])) if positions else 0
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
    storage thread of this rank touches them any more."""

    request_id: str
    operation: object
    host_indices: torch.Tensor
    release_from: Optional[int] = None
    idle: bool = False


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
        pages are freed in prefetch order (class docstring); a capturing thread counts them."""
        released = getattr(self._capture, "released", None)
        if released is not None:
            released.tokens += int(host_indices.numel())

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
        oldest open entry of each is idle, and free from its first token if the scheduler had
        not resolved it yet."""
        with self._lock:
            for request_id in request_ids:
                entry = next((e for e in self._entries if e.request_id == request_id and not e.idle), None)
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
