"""Where each page of a sequence sits in the dense scratch the stock NSA kernels read.

Each CP rank stores only the pages it owns, so before a layer's attention and indexer
read the sequence, the group materializes a *dense scratch*: one buffer holding every
page the layer reads, identical on all ranks, addressed by remapped page tables.

The scratch is **owner-major**, so the all-gather output *is* the scratch (no unpack):

    page 0                      dummy page (padding locations land here, as in the pool)
    history region   N x M_h    rank 0's history pages, then rank 1's, ... (gathered)
    current region   N x M_c    rank 0's current-only pages, then rank 1's, ...

*History* pages hold at least one token before ``prefix_len`` (the page shared by the
end of the prefix and the start of the chunk included); *current-only* pages hold
only tokens of this chunk. Within a rank's block, pages keep sequence order; each
block is padded to ``M`` = the largest number of pages any one rank owns in that
region. ``M_h`` and ``M_c`` derive from the sequence's logical page list, which every
CP rank holds identically, so the collective sizes are rank-identical by construction.

The history region is filled by one all-gather of each rank's owned history pages. When
a rank's pages of a region are consecutive in its pool, in sequence order (compute-owner
pages usually are), the all-gather reads them straight from the shard: no pack
(``history_run`` / ``current_run``; the padding slots after a run hold whatever follows it
in the pool, which nothing reads).
The current region is filled locally from the current chunk's KV, which every rank
already has after SGLang's in-seq CP all-gather (phase 3); when that KV is not at hand
the current region is gathered the same way (the phase-2 full view).

A batch of several requests (0.5.23) is placed as one page list: every request's history
pages, then every request's current-only pages. A radix prefix two requests share lists its
pages twice; with ``repeats`` each page takes one dense page, its first listing's, and the
later listings only read it (``first_listings``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence, Tuple

import torch

from sglang_cp_shared_kv.cp_shared_kv_layout import CpSharedKVLayout, owner_counts
from sglang_cp_shared_kv.pool.kv_geometry import DENSE_DUMMY_PAGES


@dataclass(frozen=True)
class DensePageMap:
    """The dense placement of one sequence's pages, as seen from one CP rank."""

    layout: CpSharedKVLayout
    num_pages: int  # P: pages of the sequence
    history_pages: int  # H: the first H pages are history
    history_pad: int  # M_h: pages per rank block in the history region
    current_pad: int  # M_c: pages per rank block in the current region
    dense_page: torch.Tensor  # (P,) int64: dense page of each sequence page
    history_send: torch.Tensor  # (M_h,) int64: this rank's physical pages, history region order
    current_send: torch.Tensor  # (M_c,) int64: same for the current region
    current_owners: Tuple[int, ...] = ()  # owner of each current-only page, in sequence order (host)
    #: first physical page of this rank's history / current pages when they are consecutive
    #: in its pool in sequence order (the send list is then a run: no pack); -1 otherwise
    history_run: int = -1
    current_run: int = -1
    #: the caller's ``read_also`` values, read on the host in the same synchronisation
    read_also: Tuple[int, ...] = ()

    @property
    def num_dense_pages(self) -> int:
        return DENSE_DUMMY_PAGES + self.layout.cp_size * (self.history_pad + self.current_pad)

    @property
    def history_region(self) -> Tuple[int, int]:
        """[first, end) dense pages of the history region."""
        start = DENSE_DUMMY_PAGES
        return start, start + self.layout.cp_size * self.history_pad

    @property
    def current_region(self) -> Tuple[int, int]:
        start = self.history_region[1]
        return start, start + self.layout.cp_size * self.current_pad

    def dense_locs_of_positions(self, positions: torch.Tensor) -> torch.Tensor:
        """Dense token locations of sequence positions (all < P * page_size)."""
        page_size = self.layout.page_size
        return self.dense_page[positions // page_size] * page_size + positions % page_size

    def dense_token_table(self, seq_len: int, width: int) -> torch.Tensor:
        """(width,) dense locations of positions 0..width-1; 0 (the dummy page) past seq_len."""
        positions = torch.arange(width, device=self.dense_page.device, dtype=torch.int64)
        valid = positions < seq_len
        locs = self.dense_locs_of_positions(torch.where(valid, positions, 0))
        return torch.where(valid, locs, 0)


def _place_region(owners: torch.Tensor, physical: torch.Tensor, rank: int, cp_size: int, block_pad: int,
                  base: int, placed: Optional[torch.Tensor] = None) -> Tuple[torch.Tensor, torch.Tensor]:
    """Dense pages of a region's pages, and this rank's send list (padded with page 0).
    ``placed``: which entries take a dense page of their own (default all); the others' dense
    pages are meaningless here (the caller reads their first listing's)."""
    if owners.numel() == 0:
        empty = torch.zeros(0, dtype=torch.int64, device=owners.device)
        return empty, torch.zeros(block_pad, dtype=torch.int64, device=owners.device)
    one_hot = torch.nn.functional.one_hot(owners, cp_size)
    if placed is not None:
        one_hot = one_hot * placed[:, None]
    index_in_block = (one_hot.cumsum(0) * one_hot).sum(1) - 1
    dense = base + owners * block_pad + index_in_block
    # Scatter this rank's physical pages to their block slot; other ranks' pages land in
    # the spare last slot, which is dropped. Page 0 (the sender's dummy) pads the tail.
    sends = owners == rank if placed is None else (owners == rank) & placed
    slots = torch.where(sends, index_in_block, block_pad)
    send = torch.zeros(block_pad + 1, dtype=torch.int64, device=owners.device)
    send.scatter_(0, slots, physical)
    return dense, send[:block_pad]


_NO_RUN = -1


def _run_of(owned: torch.Tensor, physical: torch.Tensor) -> torch.Tensor:
    """(first page, is a run) of the ``owned`` entries of ``physical`` (device scalars): a run
    when they are consecutive pages in sequence order."""
    index_in_run = owned.cumsum(0) - 1
    offset = physical - index_in_run
    big = torch.iinfo(offset.dtype).max
    first = torch.where(owned, offset, big).min() if owned.numel() else offset.new_tensor(big)
    is_run = torch.where(owned, offset, first).eq(first).all() & owned.any()
    return torch.stack([first, is_run.to(first.dtype)])


def first_listings(pages: torch.Tensor) -> torch.Tensor:
    """For each entry of ``pages``, the index of the first entry listing the same page
    (an entry that is its page's first listing answers its own index); on the device, no
    host synchronisation. NOTE: a stable sort keeps equal pages in listing order, so each
    run of equal pages starts at its first listing."""
    count = pages.numel()
    order = torch.sort(pages, stable=True).indices
    ordered = pages[order]
    starts = torch.ones(count, dtype=torch.bool, device=pages.device)
    starts[1:] = ordered[1:] != ordered[:-1]
    positions = torch.arange(count, device=pages.device)
    run_start = torch.cummax(torch.where(starts, positions, 0), dim=0).values if count else positions
    first = torch.empty_like(order)
    first[order] = order[run_start]
    return first


def build_dense_page_map(layout: CpSharedKVLayout, seq_pages: torch.Tensor, history_pages: int, *,
                         read_also: Sequence[torch.Tensor] = (), repeats: bool = False) -> DensePageMap:
    """Place the ``P`` logical pages of one sequence (``seq_pages``, in sequence order;
    the first ``history_pages`` are history) in the dense scratch. ``repeats``: the list may
    name a page more than once (a batch of requests sharing a radix prefix); each page is
    then placed once, where it is first listed.

    One host synchronisation -- the forward's only one -- reads the two block sizes, which
    size the collectives, whether this rank's pages of each region form a run in its pool,
    the owners of the current-only pages (``forward.local_writes_v0512`` compares them with the
    ranks that compute those pages) and the caller's ``read_also`` (one-element integer
    device tensors, returned as ``DensePageMap.read_also``).
    """
    seq_pages = seq_pages.to(torch.int64)
    num_pages = int(seq_pages.numel())
    if not 0 <= history_pages <= num_pages:
        raise ValueError(f"history_pages={history_pages} outside [0, {num_pages}]")
    owners = layout.owner_for_logical_pages(seq_pages, validate=False)
    physical = layout.logical_pages_to_physical(seq_pages, validate=False)
    n = layout.cp_size
    first = first_listings(seq_pages) if repeats else None
    placed = None if first is None else first == torch.arange(num_pages, device=seq_pages.device)
    hist_placed, cur_placed = (None, None) if placed is None else (placed[:history_pages], placed[history_pages:])
    counts = torch.stack([owner_counts(owners[:history_pages], n, hist_placed),
                          owner_counts(owners[history_pages:], n, cur_placed)])
    mine = owners == layout.cp_rank if placed is None else (owners == layout.cp_rank) & placed
    runs = torch.cat([_run_of(mine[:history_pages], physical[:history_pages]),
                      _run_of(mine[history_pages:], physical[history_pages:])])
    extra = [t.reshape(1).to(torch.int64) for t in read_also]
    host = torch.cat([counts.max(dim=1).values, runs, owners[history_pages:], *extra]).tolist()
    history_pad, current_pad = int(host[0]), int(host[1])
    owners_end = 6 + num_pages - history_pages  # 2 block sizes, 2 x (run, is run), the current owners
    current_owners = tuple(int(x) for x in host[6: owners_end])
    history_run = int(host[2]) if host[3] else _NO_RUN
    current_run = int(host[4]) if host[5] else _NO_RUN
    hist_dense, hist_send = _place_region(owners[:history_pages], physical[:history_pages],
                                          layout.cp_rank, n, history_pad, DENSE_DUMMY_PAGES, hist_placed)
    cur_dense, cur_send = _place_region(owners[history_pages:], physical[history_pages:],
                                        layout.cp_rank, n, current_pad,
                                        DENSE_DUMMY_PAGES + n * history_pad, cur_placed)
    dense_page = torch.cat([hist_dense, cur_dense])
    return DensePageMap(
        layout=layout,
        num_pages=num_pages,
        history_pages=history_pages,
        history_pad=history_pad,
        current_pad=current_pad,
        dense_page=dense_page if first is None else dense_page[first],
        history_send=hist_send,
        current_send=cur_send,
        current_owners=current_owners,
        history_run=history_run,
        current_run=current_run,
        read_also=tuple(int(x) for x in host[owners_end:]),
    )
