"""HiCache's storage tier (L3) under the flag, the same on every release: each CP rank stores
and fetches only its own pages.

SGLang gives its storage backend logical host locations and page keys that name the tokens
only (a SHA-256 chain). Under the flag a rank's host buffers hold only the pages of its lane
(:mod:`.host_lanes`), so :class:`ShardedStorage` stands between the controller and the
backend:

* a page's key is ``{hash}@cp{N}`` (:class:`ShardKeys`): a page's bytes depend on its tokens
  and on how the CP group of N computed them, not on which rank of the group holds it, so a
  CP-N group finds what a CP-N group stored and a group of another size misses (never a page
  of another split);
* a store or a fetch touches only this rank's pages (those of its host lane), at their
  physical rows, MLA latent (v1) and index K (v2, the sidecar pools) alike; the other pages'
  entries read as done, since their own ranks move them. A fetch that fails on this rank
  therefore ends this rank's count at its first failed page, and SGLang's MIN over the
  attention-CP group ends the group's there;
* an existence query asks for every page's key (:meth:`ShardedStorage.batch_exists`): the
  store holds each page once, whichever rank stored it, so every rank sees the same answer and
  SGLang's MIN over the group is the group's hit. A release whose prefetch knows its host pages
  before it asks narrows the query to the rank's lane instead
  (:class:`.storage_v0512.PrefetchLaneStorage`).

A backend call that raises (a Mooncake client whose master is out of reach, say) is this rank's
pages failing, never an exception out of the storage tier (:meth:`ShardedStorage._call_backend`):
a fetch's or a store's own pages read as failed, an existence query finds none of its pages. So
the rank's storage threads live on and reach the same agreement points as the other ranks, whose
MIN then shortens the group's hit on every rank alike (a store that raised leaves the rank's pages
out of the store, which a later prefetch finds missing). Each such call is counted; the logs say
it once per outage and operation (:class:`RaiseStreaks`).

What a rank stores and fetches, and its backend calls that raised, are counted in its KV host
pool's :class:`.metrics.HostTierCounts` (directions ``stored`` and ``fetched``; operations
``fetch``, ``store``, ``query``).
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from typing import Callable, Dict, List, Optional, Sequence, Tuple, TypeVar

import torch

from sglang_cp_shared_kv import sglang_api as sg
from sglang_cp_shared_kv.hicache.host_lanes import HostPageRule
from sglang_cp_shared_kv.hicache.metrics import HostTierCounts

logger = logging.getLogger(__name__)

Result = TypeVar("Result")

#: what follows for the CP group from a backend call that raised, by operation (its log line)
_AFTER_A_RAISE = {
    "fetch": "they count as not fetched: the CP group's agreed hit ends at the first of them on every rank, "
             "the rest is recomputed",
    "store": "they count as not stored: a later prefetch of them ends at the first on every rank, the rest is "
             "recomputed",
    "query": "it counts as finding none of them: the CP group's agreed hit ends at the first on every rank, the "
             "rest is recomputed",
}


class RaiseStreaks:
    """When a raising backend call is logged, per operation: the first raise after a call that
    answered (a streak's first) at ERROR with its traceback; later raises of the streak as one
    ERROR line with how many raised, at most every ``repeat_s`` seconds; the first call that
    answers again at WARNING with the streak's length."""

    # NOTE: 60 s: a store out of reach makes every prefetch, query and backup raise, several a
    # second on a busy server; one traceback says why, a line a minute says it still holds
    REPEAT_S = 60.0

    def __init__(self, cp_rank: int, backend_name: str, clock: Callable[[], float] = time.monotonic,
                 repeat_s: float = REPEAT_S):
        self.cp_rank = cp_rank
        self.backend_name = backend_name
        self.clock = clock
        self.repeat_s = repeat_s
        #: operation -> [calls that raised in the streak, when the last ERROR line was written]
        self._streaks: Dict[str, List[float]] = {}
        # (SGLang's storage threads, prefetch and backup, call the backend concurrently)
        self._lock = threading.Lock()

    def raised(self, operation: str, pages: int) -> None:
        """Log a raise of ``operation`` on ``pages`` pages; call inside the ``except`` block."""
        now = self.clock()
        with self._lock:
            streak = self._streaks.get(operation)
            first = streak is None
            if first:
                streak = self._streaks[operation] = [1, now]
            else:
                streak[0] += 1
            repeat = not first and now - streak[1] >= self.repeat_s
            if repeat:
                streak[1] = now
            raised = int(streak[0])
        if first:
            logger.exception("CP shared KV HiCache storage: CP rank %d: the storage backend %s raised in a %s of "
                             "%d page(s); %s", self.cp_rank, self.backend_name, operation, pages,
                             _AFTER_A_RAISE[operation])
        elif repeat:
            logger.error("CP shared KV HiCache storage: CP rank %d: the storage backend %s still raises: %d %s call(s) "
                         "raised since its first raise (the last on %d page(s)); each time %s", self.cp_rank,
                         self.backend_name, raised, operation, pages, _AFTER_A_RAISE[operation])

    def answered(self, operation: str) -> None:
        """A call of ``operation`` returned: a streak of raises, if any, ends (logged)."""
        if operation not in self._streaks:  # (the common case, without the lock)
            return
        with self._lock:
            streak = self._streaks.pop(operation, None)
        if streak is not None:
            logger.warning("CP shared KV HiCache storage: CP rank %d: the storage backend %s answers a %s again "
                           "after %d call(s) that raised", self.cp_rank, self.backend_name, operation, int(streak[0]))


class ShardKeys:
    """``key(h) = f"{h}@cp{N}"``: a page hash in the namespace of a CP group of N (stateless)."""

    def __init__(self, cp_size: int):
        self.suffix = f"@cp{cp_size}"

    def __call__(self, keys: Sequence[str]) -> List[str]:
        return [f"{key}{self.suffix}" for key in keys]


class ShardedStorage:
    """The storage backend as one CP rank uses it (module docstring). Every attribute it does
    not define is the backend's (stats, ``clear``, ``close``, registration, ...)."""

    def __init__(self, backend, rule: HostPageRule, counts: HostTierCounts):
        self.backend = backend
        self.rule = rule
        self.cp_rank = rule.layout.cp_rank
        self.keys = ShardKeys(rule.cp_size)
        self.counts = counts
        self.raises = RaiseStreaks(self.cp_rank, type(backend).__name__)

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
        """A result per page: this rank's from ``own_results``, every other page done. An own
        page the backend gave no result for failed (never taken as written)."""
        out = [True] * pages
        for i, position in enumerate(positions):
            out[position] = i < len(own_results) and bool(own_results[i])
        return out

    def _count(self, direction: str, results: Sequence[bool]) -> None:
        self.counts.count(direction, sum(1 for ok in results if ok))

    def _call_backend(self, operation: str, pages: int, call: Callable[[], Result],
                      failed: Callable[[], Result]) -> Result:
        """``call()``: the backend's ``operation`` (``fetch``, ``store`` or ``query``) on ``pages``
        pages (a fetch's or a store's: this rank's own). If it raises, ``failed()`` (those pages
        failed, or none found), the exception logged and counted (module docstring)."""
        try:
            result = call()
        except Exception:
            # NOTE: never re-raised: a storage thread of SGLang's that a raise ends (0.5.12.post1's
            # I/O, prefetch and backup threads) leaves the other ranks waiting for this one at their
            # next agreement (a MIN) forever; 0.5.23 catches some of these calls, each its own way
            self.raises.raised(operation, pages)
            self.counts.count_storage_error(operation)
            return failed()
        self.raises.answered(operation)
        return result

    @staticmethod
    def _query_miss():
        """An existence query (v2) that found no page."""
        return sg.PoolTransferResult.empty()

    def _fetched(self, host_indices: torch.Tensor, positions: List[int], got: Sequence[bool]) -> List[bool]:
        """This rank's KV fetch results as counted (a subclass may withhold pages)."""
        return [bool(ok) for ok in got]

    def _sidecar_fetched(self, transfers, results: Dict[str, List[bool]]) -> None:
        """A sidecar fetch (the index K) just returned ``results`` (expanded), per pool name."""

    # ------------------------------------------------------------ the KV pool (v1, zero copy)
    def batch_get_v1(self, keys: List[str], host_indices: torch.Tensor, extra_info=None) -> List[bool]:
        positions, rows = self._own(host_indices)
        if not positions:
            return [True] * len(keys)
        own_keys = self.keys([keys[i] for i in positions])
        got = self._call_backend("fetch", len(positions), lambda: self.backend.batch_get_v1(own_keys, rows, extra_info),
                                 lambda: [False] * len(positions))
        got = self._fetched(host_indices, positions, got)
        self._count("fetched", got)
        return self._expand(got, positions, len(keys))

    def batch_set_v1(self, keys: List[str], host_indices: torch.Tensor, extra_info=None) -> List[bool]:
        positions, rows = self._own(host_indices)
        if not positions:
            return [True] * len(keys)
        own_keys = self.keys([keys[i] for i in positions])
        done = self._call_backend("store", len(positions), lambda: self.backend.batch_set_v1(own_keys, rows, extra_info),
                                  lambda: [False] * len(positions))
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
        results = {}
        if own:
            results = self._call_backend("store" if store else "fetch", sum(len(t.keys) for t in own),
                                         lambda: io(own, extra_info), lambda: {t.name: [False] * len(t.keys) for t in own})
        out = {name: self._expand(results.get(name, []), positions, pages)
               for name, (positions, pages) in where.items()}
        if not store:
            self._sidecar_fetched(transfers, out)
        return out

    def batch_get_v2(self, transfers, extra_info=None) -> dict:
        return self._v2(transfers, extra_info, store=False)

    def batch_set_v2(self, transfers, extra_info=None) -> dict:
        return self._v2(transfers, extra_info, store=True)

    # ------------------------------------------------------------ existence (every page's key)
    def _keyed(self, transfers):
        """``transfers`` with any keys they carry in the group's namespace."""
        if transfers is None:
            return None
        return [dataclasses.replace(t, keys=self.keys(t.keys)) if t.keys else t for t in transfers]

    def batch_exists(self, keys: List[str], extra_info=None) -> int:
        return self._call_backend("query", len(keys), lambda: self.backend.batch_exists(self.keys(keys), extra_info),
                                  lambda: 0)

    def batch_exists_v2(self, keys: List[str], pool_transfers=None, extra_info=None):
        return self._call_backend(
            "query", len(keys),
            lambda: self.backend.batch_exists_v2(self.keys(keys), self._keyed(pool_transfers), extra_info),
            self._query_miss)


def shard_controller_storage(controller, storage_class=ShardedStorage,
                             every_rank_stores: Optional[Callable[[object], None]] = None,
                             note: str = "") -> Optional[ShardedStorage]:
    """Put the controller's storage backend behind ``storage_class`` (a :class:`ShardedStorage`)
    when its KV host pool is the shared-KV one and a backend is attached, and make every CP rank
    a storer (``every_rank_stores(controller)``: each rank holds, so stores, only its own pages;
    stock lets one rank store an MLA model's replicated pages). Logs it once per attached backend,
    with ``note`` (what a release adds). Returns the sharded storage, or None (flag off, no
    storage tier). Idempotent."""
    from sglang_cp_shared_kv.hicache.lane_hooks import owner_local_host

    host = owner_local_host(controller.mem_pool_host)
    backend = getattr(controller, "storage_backend", None)
    if host is None or not getattr(controller, "enable_storage", False) or backend is None:
        return None
    if isinstance(backend, ShardedStorage):
        return backend
    storage = storage_class(backend, host.rule, host.counts)
    controller.storage_backend = storage
    if every_rank_stores is not None:
        every_rank_stores(controller)
    logger.info("CP shared KV HiCache storage: CP rank %d stores and fetches only its own pages in %s, under "
                "keys <page hash>%s (a CP group of another size misses them)%s", host.rule.layout.cp_rank,
                type(backend).__name__, storage.keys.suffix, note)
    return storage


__all__ = ["RaiseStreaks", "ShardKeys", "ShardedStorage", "shard_controller_storage"]
