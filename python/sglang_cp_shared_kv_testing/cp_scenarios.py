"""The scenarios the CP harness runs on every rank, in the same order (each a function of
one :class:`~.cp_rig.Rig`): one chunk, chunked prefill with mid-page boundaries, radix
prefix hits, a prefix ending mid-page, fewer pages than ranks, the phase-2 full view,
chunks SGLang cuts page by page (local writes) with and without a radix prefix, a
negative control (one corrupted history page must be caught) and a randomized soak; on
0.5.23, batches of several requests, planned and in a soak.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Dict, List

import numpy as np

from sglang_cp_shared_kv.pool.kv_geometry import PAGE_SIZE as PAGE
from sglang_cp_shared_kv.pool.page_split import page_by_page_chunk_unit
from sglang_cp_shared_kv_testing.cp_rig import Request, Rig


def single_chunk(rig: Rig):
    req = rig.new_request()
    rig.extend(req, 437, pad_rows=3)


def chunked_prefill(rig: Rig):
    req = rig.new_request()
    for chunk in (200, 130, 256, 77):  # boundaries mid-page (200, 330, 663) and page-aligned
        rig.extend(req, chunk, pad_rows=chunk % 3)


def radix_prefix_hit(rig: Rig):
    donor = rig.new_request()
    rig.extend(donor, 500)
    hit = rig.share_prefix(donor, pages=5)
    rig.extend(hit, 300)


def prefix_mid_page(rig: Rig):
    req = rig.new_request()
    rig.extend(req, 100)  # the prefix ends in the middle of page 2
    rig.extend(req, 90)  # the next chunk starts on the shared page and ends mid-page too
    rig.extend(req, 1)


def fewer_pages_than_ranks(rig: Rig):
    req = rig.new_request()
    rig.extend(req, 70)  # two pages: with N > 2 some ranks own nothing
    rig.extend(req, 5)
    short = rig.new_request()
    rig.extend(short, 10)


def aligned_chunked_prefill(rig: Rig):
    """Chunks of 2N x 64 rows from a page boundary, which SGLang's token-balanced split cuts
    page by page: each rank stores the rows it computed (``forward.local_writes_v0512``) -- with
    fp8 KV the first chunk (no prefix) keeps SGLang's latent gather -- then a chunk one row
    short (SGLang's padding row closes rank 0's rows, the last page partial), then a
    prompt's last, shorter chunk (phase 3)."""
    unit = page_by_page_chunk_unit(rig.n, PAGE)
    req = rig.new_request()
    rig.extend(req, unit)
    rig.extend(req, unit)
    rig.extend(req, unit - 1, pad_rows=1)
    rig.extend(req, 100, pad_rows=(-100) % rig.n)


def aligned_radix_hit(rig: Rig):
    """A radix-cache prefix of whole pages, then a page-aligned chunk: local writes after a
    prefix whose pages have interleaved and compute-owner owners alike."""
    unit = page_by_page_chunk_unit(rig.n, PAGE)
    donor = rig.new_request()
    rig.extend(donor, 3 * PAGE)  # interleaved pages (fewer than 2N... or not: both are history)
    rig.extend(donor, unit)
    hit = rig.share_prefix(donor, pages=3 + 2 * rig.n - 1)
    rig.extend(hit, 2 * unit)


def batched_requests(rig: Rig):
    """Several requests per prefill batch (0.5.23's interleave deals their tokens out
    together): two fresh requests; then one of a single token beside them (absent from the
    tables of the ranks it deals no query token to); then two radix hits on one donor's
    prefix in the same batch as the donor (its first pages listed three times, placed once),
    the donor's chunk starting mid-page and one layer a full view; then a batch shorter than
    the CP group at N >= 4 (run unsplit)."""
    donor, other = rig.new_request(), rig.new_request()
    rig.extend_batch([(donor, 300), (other, 130)])
    rig.extend_batch([(donor, 77), (rig.new_request(), 1), (other, 64)])
    first_hit, second_hit = rig.share_prefix(donor, pages=4), rig.share_prefix(donor, pages=3)
    rig.extend_batch([(first_hit, 100), (second_hit, 200), (other, 5), (donor, 50)], full_view_layers=(1,))
    rig.extend_batch([(rig.new_request(), 2), (rig.new_request(), 1)])


def full_view_fallback(rig: Rig):
    """The chunk was written earlier (save_kv_cache=False): the current region is gathered."""
    req = rig.new_request()
    rig.extend(req, 300, full_view_layers=(0, 1))
    rig.extend(req, 150, full_view_layers=(1,))


def corrupted_shard_is_detected(rig: Rig):
    """Negative control: one rank corrupts one history page; the comparison must catch it."""
    req = rig.new_request()
    rig.extend(req, 256)
    history_page = req.pages[1]
    if rig.layout.owner_for_logical_pages_np([history_page])[0] == rig.rank:
        physical = int(rig.layout.logical_pages_to_physical_np([history_page])[0])
        rig.shared.kv_buffer[0][physical * PAGE: (physical + 1) * PAGE] = 0
    before = len(rig.errors)
    rig.extend(req, 64)
    rig.stats["detected"] = len(rig.errors) > before
    rig.errors.clear()


def lane_exhaustion(rig: Rig):
    """Free pages skewed to rank 0's owner lane: a chunk the other lanes cannot serve takes
    interleaved pages (the same fallback on every rank) and stays bit-exact -- SGLang cuts
    it page by page, but its pages are not their computing ranks', so it is gathered, not
    stored where computed; a chunk the lanes can serve afterwards is compute-owner again,
    and stored where it was computed."""
    import torch

    alloc = rig.allocator
    held = torch.unique(alloc.alloc(alloc.available_size()) // PAGE)  # every free page
    lanes = (held - 1) % rig.n
    back = torch.cat([held[lanes == 0]] + [held[lanes == r][:2] for r in range(1, rig.n)])
    alloc.free(rig.page_locs(back))
    before = dataclasses.replace(alloc.stats)
    req = rig.new_request()
    served = rig.extend(req, 4 * rig.n * PAGE)  # 4N pages: more than the 2 free pages of lanes 1..N-1 can hold
    rig.stats["lane_fallbacks"] = alloc.stats.lane_fallbacks - before.lane_fallbacks
    rig.release(req, set())
    rest = held[~torch.isin(held, back)]
    alloc.free(rig.page_locs(rest))
    served = rig.extend(rig.new_request(), 2 * rig.n * PAGE) and served
    if not served:
        rig.errors.append("lane_exhaustion: a request was refused while the logical pool had room")
    rig.stats["compute_owner_after"] = alloc.stats.compute_owner_chunks - before.compute_owner_chunks


def soak(rig: Rig, mixes: int = 200, seed: int = 20261129, most_requests_per_batch: int = 1):
    """Random request mixes: fresh and chunked requests, radix prefix hits, frees and page
    reuse (so ownership of a sequence's pages gets uneven), padding rows. One request in
    four is long enough (2N to 2N + 3 pages) for compute-owner allocation of its chunks.
    ``most_requests_per_batch`` > 1 (0.5.23): each mix brings 1 to that many requests, whose
    chunks run together, one forward per round (a request with chunks left joins each)."""
    rng = np.random.default_rng(seed)
    live: List[Request] = []

    def users(exclude):
        return {p for r in live if r is not exclude for p in r.pages}

    def new_request():
        donor = live[int(rng.integers(len(live)))] if live and rng.random() < 0.35 else None
        if donor is not None and len(donor.pages) > 1:
            return rig.share_prefix(donor, int(rng.integers(1, len(donor.pages))))
        return rig.new_request()

    def chunks_of_a_prompt():
        long_request, unit = rng.random() < 0.25, page_by_page_chunk_unit(rig.n, PAGE)
        if long_request and rng.random() < 0.5:  # chunks SGLang cuts page by page: local writes
            units = int(rng.integers(1, 3))
            total = units * unit - int(rng.integers(0, 2))  # one row short: SGLang's padding row
            cuts = [unit] if units == 2 and rng.random() < 0.5 else []
        else:
            total = int(rng.integers(unit, unit + 4 * PAGE)) if long_request else int(rng.integers(1, 400))
            cuts = sorted(set(rng.integers(1, total, size=int(rng.integers(0, 3))).tolist())) if total > 1 else []
        return [int(chunk) for chunk in np.diff([0, *cuts, total])]

    for mix in range(mixes):
        if live and (len(live) > 5 or rng.random() < 0.3):
            victim = live.pop(int(rng.integers(len(live))))
            rig.release(victim, users(victim))
        # NOTE: no draw for one request per batch: the one-request soak keeps its random stream (and mixes)
        count = 1 if most_requests_per_batch == 1 else int(rng.integers(1, most_requests_per_batch + 1))
        # NOTE: two requests of one mix hitting the same donor list its pages twice in a batch
        prompts = [(new_request(), chunks_of_a_prompt()) for _ in range(count)]
        ok, round_ = True, 0
        while ok and any(round_ < len(chunks) for _, chunks in prompts):
            batch = [(req, chunks[round_]) for req, chunks in prompts if round_ < len(chunks)]
            full_view = (0,) if rng.random() < 0.1 else ()
            rows = sum(chunk for _, chunk in batch)
            pad = (-rows) % rig.n if rng.random() < 0.5 else int(rng.integers(0, 2 * rig.n))
            ok = rig.extend_batch(batch, full_view_layers=full_view, pad_rows=pad)
            round_ += 1
        if ok:
            live.extend(req for req, _ in prompts)
        else:  # out of memory: give everything back and go on
            for req, _ in prompts:
                rig.release(req, users(req) | {p for other, _ in prompts if other is not req for p in other.pages})
            while live:
                victim = live.pop()
                rig.release(victim, users(victim))
    rig.stats["mixes"] = mixes


def batched_soak(rig: Rig):
    """The soak with up to three requests per prefill batch (0.5.23's interleave)."""
    soak(rig, mixes=120, seed=20261203, most_requests_per_batch=3)


SCENARIOS: Dict[str, Callable[[Rig], None]] = {
    f.__name__: f for f in (single_chunk, chunked_prefill, radix_prefix_hit, prefix_mid_page,
                            fewer_pages_than_ranks, full_view_fallback, aligned_chunked_prefill,
                            aligned_radix_hit, corrupted_shard_is_detected, lane_exhaustion, soak)
}

#: The scenarios of the 0.5.23 harness (``cp_harness_dsa``, interleave CP). Left out: the
#: page-by-page chunks (local writes) and lane exhaustion, which exercise 0.5.12.post1's
#: compute-owner allocation and local writes; interleave has neither (docs/design.md).
#: Added: batches of several requests, which 0.5.12.post1's in-seq split never forms.
INTERLEAVE_SCENARIOS: Dict[str, Callable[[Rig], None]] = {
    **{name: SCENARIOS[name] for name in ("single_chunk", "chunked_prefill", "radix_prefix_hit", "prefix_mid_page",
                                          "fewer_pages_than_ranks", "full_view_fallback",
                                          "corrupted_shard_is_detected", "soak")},
    "batched_requests": batched_requests,
    "batched_soak": batched_soak,
}
