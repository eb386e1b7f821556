"""What the storage-tier (L3) tests of every release assert on their rigs' per-rank reports
(:mod:`.hicache_l3_v0512`, :mod:`.hicache_l3_v0523`: the same cases, the same report fields),
indexed ``ranks[rank][case name]``; and the one step both rigs run inside a rank to produce the
``other_size`` report (:func:`lookup_as_other_cp_size`), with the negative control's keys
(:class:`SizeBlindKeys`)."""

from __future__ import annotations

from typing import Callable, Dict, List

from sglang_cp_shared_kv.hicache.storage import ShardKeys
from sglang_cp_shared_kv.scoped import attributes_set

PAGE = 64


class SizeBlindKeys(ShardKeys):
    """The negative control's page keys, ``{hash}@cp`` for a group of any size: keys that do not
    name the CP size (what :class:`.storage.ShardKeys` prevents). A group of another size then
    finds what this group stored, so :func:`check_other_cp_size_misses` must fail under them."""

    def __init__(self, cp_size: int):
        super().__init__(cp_size)
        self.suffix = "@cp"


def lookup_as_other_cp_size(storage, n: int, hashes: List[str], kv_host, prefetch_again: Callable) -> dict:
    """Inside the group of ``n`` that just stored a request (page hashes ``hashes``, through the
    rank's sharded ``storage``): how many of its pages the store holds under this group's keys
    (``found_under_own_size``), then ``prefetch_again()`` (a :class:`.hicache_rig_v0512.StorageTrip`:
    the request, out of device and host memory, prefetched from the store and loaded back) under
    the keys of a group of N + 1 (the same key scheme, ``type(storage.keys)``). A group's objects
    live in the store segments its own clients mount, so this is the only time another size can
    look for them: a group started after this one exits finds nothing, whatever the keys."""
    found = storage.backend.batch_exists(storage.keys(hashes))
    fetched_before = getattr(kv_host, "pages_copied", {}).get("fetched", 0)
    with attributes_set(storage, keys=type(storage.keys)(n + 1)):
        again = prefetch_again()
    return {"found_under_own_size": found, "device_hit_before": again.device_hit_before,
            "host_hit_before": again.host_hit_before, "loaded_tokens": again.loaded_tokens,
            "host_hit_length": again.host_hit_length, "host_tokens": list(again.host_tokens),
            "fetched": getattr(kv_host, "pages_copied", {}).get("fetched", 0) - fetched_before,
            "errors": again.device_bytes_after_load.mismatches(again.written)}


def _other_size(case, ranks: List[Dict[str, dict]]):
    """(rank, its ``other_size`` report), the request's pages confirmed in the store under the
    storing group's keys and out of device and host memory before the lookup."""
    for rank, cases in enumerate(ranks):
        other = cases[case.name]["other_size"]
        assert other["found_under_own_size"] == case.pages, rank  # (the objects are there)
        assert (other["device_hit_before"], other["host_hit_before"]) == (0, 0), rank
        assert other["errors"] == [], rank
        yield rank, other


def check_other_cp_size_misses(case, ranks: List[Dict[str, dict]]) -> None:
    """The request the group stored, still in the store, prefetched under the keys of a group of
    N + 1 (:func:`lookup_as_other_cp_size`): no page found, fetched or loaded back (the prefetch
    revoked, the prompt to compute), every host page free again."""
    for rank, other in _other_size(case, ranks):
        assert other["loaded_tokens"] == other["host_hit_length"] == other["fetched"] == 0, (rank, other)
        free, size = other["host_tokens"]
        assert free == size, f"rank {rank}: {size - free} host tokens leaked by the missed prefetch"


def check_size_blind_keys_hit(case, ranks: List[Dict[str, dict]]) -> None:
    """The negative control of :func:`check_other_cp_size_misses`: under keys that do not name
    the CP size (:class:`SizeBlindKeys`), the same lookup under the keys of a group of N + 1
    finds the whole request, fetches every page once over the group and loads it back intact."""
    total_fetched = 0
    for rank, other in _other_size(case, ranks):
        assert other["loaded_tokens"] == other["host_hit_length"] == case.pages * PAGE, (rank, other)
        total_fetched += other["fetched"]
        free, size = other["host_tokens"]
        assert free == size, f"rank {rank}: {size - free} host tokens leaked"
    assert total_fetched == case.pages, total_fetched


def check_the_miss_check_fails_without_cp_size_keys(case, ranks: List[Dict[str, dict]]) -> None:
    """The control ``case`` ran size-blind (nothing stored under ``<hash>@cp<N>``), its lookup as a
    group of N + 1 hit (:func:`check_size_blind_keys_hit`), and :func:`check_other_cp_size_misses`
    fails on it."""
    for rank, cases in enumerate(ranks):
        stored = cases[case.name]["stored"]
        assert stored["mla_ours"] == stored["index_ours"] == [0] * case.pages, rank
    check_size_blind_keys_hit(case, ranks)
    try:
        check_other_cp_size_misses(case, ranks)
    except AssertionError:
        return
    raise AssertionError(f"{case.name}: the other-CP-size check passed on keys that do not name the CP size")


def failing_fetch(case):
    """(rank, first page) of a rank whose fetches fail from that page on (a failed or a raising
    fetch), or None."""
    if case.fail_fetch is not None:
        return case.fail_fetch
    if case.backend_raises is not None and case.backend_raises[1] == "fetch":
        return case.backend_raises[0], 0
    return None


def _store_failed_pages(case, ranks: List[Dict[str, dict]]) -> List[int]:
    """The pages whose store raised on the rank of a raising store (its own pages at the backup)."""
    if case.backend_raises is None or case.backend_raises[1] != "store":
        return []
    return ranks[case.backend_raises[0]][case.name]["backend_raised"]["pages"]


def _own_pages(case, ranks: List[Dict[str, dict]], rank: int) -> List[int]:
    """The pages of ``rank``'s lane among the prefetch's host pages."""
    lanes = ranks[0][case.name]["prefetch_lanes"]
    return [p for p in range(case.pages) if lanes[p] == rank]


def expected_hit_pages(case, ranks: List[Dict[str, dict]]) -> int:
    """The group's agreed hit, in pages: a lost page ends it there; a rank whose fetches fail
    (or raise) from a page on ends it at its first own page from there (the prefetch's lanes); a
    rank whose existence query raises finds none of the pages it asks for: its own (a query
    narrowed to its lane) end the hit at its first own page, every page's key ends it at 0; a
    rank whose store raised left its pages out of the store, which ends the hit at the first;
    else all."""
    if case.lose_page is not None:
        return case.lose_page
    failing = failing_fetch(case)
    if failing is not None:
        rank, first = failing
        return next((p for p in _own_pages(case, ranks, rank) if p >= first), case.pages)
    if case.backend_raises is not None and case.backend_raises[1] == "query":
        rank = case.backend_raises[0]
        if ranks[rank][case.name]["query_in_lanes"]:
            return next(iter(_own_pages(case, ranks, rank)), case.pages)
        return 0
    return min(_store_failed_pages(case, ranks), default=case.pages)


def check_round_trip(case, ranks: List[Dict[str, dict]]) -> None:
    """The bytes after the load equal what was written, the request came back from the store
    only, and every rank agrees on the hit, the locations and the steps."""
    hit = expected_hit_pages(case, ranks) * PAGE
    first = ranks[0][case.name]
    for rank, cases in enumerate(ranks):
        result = cases[case.name]
        assert result["errors"] == [], f"rank {rank}: {result['errors']}"
        # the request had left device and host memory: only the store could give it back
        assert (result["device_hit_before"], result["host_hit_before"]) == (0, 0), rank
        assert result["loaded_tokens"] == result["host_hit_length"] == hit, rank
        assert result["new_locs"] == first["new_locs"] and len(result["new_locs"]) == hit, rank
        assert result["steps"] == first["steps"], rank  # (the same scheduler steps on every rank)


def check_no_leak(case, ranks: List[Dict[str, dict]], n: int) -> None:
    """Every host token free or the tree's after the round trip and after the detach; the flag's
    host tier N times a rank's (ratio 2 x 8 pages + 1 per rank)."""
    for rank, cases in enumerate(ranks):
        result = cases[case.name]
        for field, what in (("host_tokens", ""), ("host_tokens_after_detach", " by the detach")):
            accounted, size = result[field]
            assert accounted == size, f"rank {rank}: {size - accounted} host tokens leaked{what}"
    if case.flag:
        assert ranks[0][case.name]["host_tokens"][1] == n * (2 * 8 + 1) * PAGE


def check_own_pages(case, ranks: List[Dict[str, dict]]) -> None:
    """Each rank stored, fetched and loaded back only its own pages (by the prefetch's lanes),
    every page under the CP-size key (MLA latent and index K) and none under stock's; the pages
    a raising store failed are in the store under no key."""
    hit_pages = expected_hit_pages(case, ranks)
    store_failed = _store_failed_pages(case, ranks)
    assert sum(cases[case.name]["pages_copied"]["stored"] for cases in ranks) == case.pages - len(store_failed)
    failing = failing_fetch(case)
    for rank, cases in enumerate(ranks):
        result = cases[case.name]
        assert result["sharded"] and not result["backup_skip"], rank  # (every rank stores)
        own = _own_pages(case, ranks, rank)
        assert result["pages_copied"]["loaded_back"] == sum(1 for p in own if p < hit_pages), rank
        # what this rank fetched: its pages in the group's agreed hit (a lost page ends it before
        # any fetch); a rank whose fetches fail from a page on fetched its pages before that page
        # only, while the others fetched all of theirs (the group then inserts the shorter run)
        if failing is None:
            fetched = sum(1 for p in own if p < hit_pages)
        elif failing[0] == rank:
            fetched = sum(1 for p in own if p < failing[1])
        else:
            fetched = len(own)
        assert result["pages_copied"]["fetched"] == fetched, rank
        stored = result["stored"]
        missing = set(store_failed)
        expected_index = [0 if p in missing else 1 for p in range(case.pages)]
        expected_mla = [0 if p == case.lose_page else ok for p, ok in enumerate(expected_index)]
        assert stored["mla_ours"] == expected_mla and stored["index_ours"] == expected_index, rank
        assert stored["mla_stock"] == stored["index_stock"] == [0] * case.pages, rank


def check_backend_error_contained(case, ranks: List[Dict[str, dict]]) -> None:
    """On the rank of ``case.backend_raises``, the backend raised (at least once, on pages of its
    own: of its lane for a fetch or a query narrowed to it, every page's key for a query of every
    page) and each call that raised was counted once as a storage error of that operation; the
    first was logged, at WARNING or above with the exception, naming the rank and the operation,
    and the rest of the run's raises (within a minute: :class:`~sglang_cp_shared_kv.hicache.storage.RaiseStreaks`)
    were not; no other rank raised, counted or logged one. (The group's agreed outcome: :func:`check_round_trip`,
    :func:`check_own_pages`, :func:`check_no_leak`.)"""
    failing, operation = case.backend_raises
    for rank, cases in enumerate(ranks):
        result = cases[case.name]
        raised, errors, logs = result["backend_raised"], result["storage_errors"], result["storage_error_logs"]
        if rank != failing:
            assert raised["calls"] == 0 and not any(errors.values()) and logs == [], (rank, raised, errors, logs)
            continue
        assert raised["calls"] >= 1 and raised["pages"], (rank, raised)
        if operation == "fetch" or (operation == "query" and result["query_in_lanes"]):
            assert raised["pages"] == _own_pages(case, ranks, rank), (rank, raised)
        elif operation == "query":
            assert raised["pages"] == list(range(case.pages)), (rank, raised)
        assert errors.get(operation) == sum(errors.values()) == raised["calls"], (rank, errors, raised)
        assert len(logs) == 1, (rank, raised, logs)
        ((level, message, exception),) = logs
        assert level in ("WARNING", "ERROR") and exception == "InjectedBackendError", (rank, level, exception)
        assert f"CP rank {rank}" in message and operation in message, (rank, message)


__all__ = ["SizeBlindKeys", "check_backend_error_contained", "check_no_leak", "check_other_cp_size_misses",
           "check_own_pages", "check_round_trip", "check_size_blind_keys_hit",
           "check_the_miss_check_fails_without_cp_size_keys", "expected_hit_pages", "failing_fetch",
           "lookup_as_other_cp_size"]
