"""The host pages of HiCache storage prefetches under the flag (``hicache.storage_v0512``, pure):
freed in prefetch order once resolved by the scheduler and idle in the storage threads, so every
rank frees the same pages in the same step; and the keys that name the CP size."""

import threading

import torch

from sglang_cp_shared_kv.hicache.storage import ShardKeys
from sglang_cp_shared_kv.hicache.storage_v0512 import PrefetchHostPages


def _pages(first_page, count, page=64):
    return (torch.arange(first_page, first_page + count)[:, None] * page + torch.arange(page)).reshape(-1)


def test_keys_name_the_cp_size():
    assert ShardKeys(4)(["ab", "cd"]) == ["ab@cp4", "cd@cp4"]
    assert ShardKeys(2)(["ab"]) != ShardKeys(3)(["ab"])  # a group of another size misses


def test_an_entry_is_freed_only_when_resolved_and_idle_and_in_order():
    ledger, first, second = PrefetchHostPages(), object(), object()
    ledger.opened("a", first, _pages(0, 4))
    ledger.opened("b", second, _pages(4, 2))
    assert ledger.ready_count() == 0
    ledger.resolved(second, release_from=0)
    ledger.transfer_done(second)
    assert ledger.ready_count() == 0  # the older prefetch holds the line: the order is the start order
    ledger.resolved(first, release_from=128)  # the tree took its first two pages
    assert ledger.ready_count() == 0  # its storage thread may still write the other two
    ledger.transfer_done(first)
    assert ledger.ready_count() == 2
    freed = ledger.release(2)
    assert torch.equal(freed, torch.cat([_pages(2, 2), _pages(4, 2)]))
    assert len(ledger) == 0


def test_a_revoked_prefetch_is_idle_and_free_from_its_first_token():
    ledger, op = PrefetchHostPages(), object()
    ledger.opened("a", op, _pages(0, 3))
    ledger.revoked(["a"])
    assert ledger.ready_count() == 1 and torch.equal(ledger.release(1), _pages(0, 3))


def test_a_revoked_prefetch_the_scheduler_already_resolved_keeps_its_release_point():
    ledger, op = PrefetchHostPages(), object()
    ledger.opened("a", op, _pages(0, 3))
    ledger.resolved(op, release_from=0)  # terminated (e.g. aborted) before the prefetch thread ran
    ledger.revoked(["a"])
    assert torch.equal(ledger.release(ledger.ready_count()), _pages(0, 3))


def test_revocations_of_a_request_id_seen_twice_go_to_the_oldest_open_entry():
    ledger, first, second = PrefetchHostPages(), object(), object()
    ledger.opened("a", first, _pages(0, 1))
    ledger.transfer_done(first)
    ledger.opened("a", second, _pages(1, 1))  # (a retracted request prefetching again)
    ledger.revoked(["a"])
    ledger.resolved(first, release_from=64)
    assert ledger.ready_count() == 2
    assert torch.equal(ledger.release(2), _pages(1, 1))


def test_a_revocation_goes_to_the_prefetch_whose_whole_allocation_the_prefetch_thread_released():
    """Two prefetches open under one request id, the older in this rank's I/O (not idle): the
    prefetch thread revokes the newer and releases its whole allocation (that very tensor); the
    revocation marks the newer idle, never the older, whose host rows the I/O thread still
    writes (freeing them would hand them to another allocation while they are written)."""
    ledger, older, newer = PrefetchHostPages(), object(), object()
    older_pages, newer_pages = _pages(0, 2), _pages(2, 2)
    ledger.opened("a", older, older_pages)
    ledger.opened("a", newer, newer_pages)
    ledger.note_release(older_pages[64:])  # (a slice: the I/O thread's unfetched tail, not a revoke)
    ledger.note_release(newer_pages)  # the prefetch thread revoking the newer prefetch
    ledger.revoked(["a"])
    ledger.resolved(older, release_from=0)
    assert ledger.ready_count() == 0  # the older is still in I/O: nothing may be freed yet
    ledger.transfer_done(older)
    assert ledger.ready_count() == 2
    assert torch.equal(ledger.release(2), torch.cat([older_pages, newer_pages]))


def test_releases_asked_by_sglang_are_counted_on_the_capturing_thread_only():
    ledger = PrefetchHostPages()
    seen = []
    with ledger.capturing() as released:
        ledger.note_release(_pages(0, 2))
        other = threading.Thread(target=lambda: seen.append(ledger.note_release(_pages(2, 1))))
        other.start()
        other.join()
    ledger.note_release(_pages(3, 1))  # outside the block: dropped, not counted
    assert released.tokens == 128 and seen == [None]


def test_a_detach_frees_what_sglang_does_not():
    ledger, tracked, resolved, revoked = PrefetchHostPages(), object(), object(), object()
    ledger.opened("a", tracked, _pages(0, 2))  # still in SGLang's ongoing prefetches: SGLang frees it
    ledger.opened("b", resolved, _pages(2, 2))
    ledger.resolved(resolved, release_from=64)
    ledger.opened("c", revoked, _pages(4, 1))  # drained as revoked by SGLang, never resolved
    freed = ledger.release_at_detach([tracked])
    assert torch.equal(freed, torch.cat([_pages(3, 1), _pages(4, 1)]))
    assert len(ledger) == 0
