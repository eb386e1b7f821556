"""What the shard transfer checks and reads once, when a prefill ``MooncakeKVManager`` starts.

* :func:`manager_problems` -- what the manager must be for the transfer to run (Mooncake,
  an MLA pool, every CP rank sending, more than one CP rank, KV buffers registered);
* :func:`rank_layout` and :class:`RegisteredBuffers` -- what the rest reads from it: this
  rank's page layout, and the shape of the buffers it registered with Mooncake, which bound
  the pages chunk admission accepts (:mod:`.chunk_admission`) and count the descriptors the
  writes issue (:mod:`.shard_writes`);
* :func:`pool_mismatch` -- once the prefill bootstrap queue hands over its pool: whether the
  manager sees the pool this rank built.

Each check returns its problem as text and :class:`.prefill.PrefillShardTransfer` raises
it while SGLang builds the manager or the queue: a prefill SGLang cannot serve this way
refuses to start instead of failing its first request, on every CP rank alike (they share
the configuration).
"""

from __future__ import annotations

import dataclasses
import types
from typing import List, Mapping, Optional

from sglang_cp_shared_kv import sglang_api as sg
from sglang_cp_shared_kv.cp_shared_kv_layout import CpSharedKVLayout
from sglang_cp_shared_kv.settings.config import FLAG


def manager_problems(kv_mgr) -> List[str]:
    """Why the shard transfer cannot run on ``kv_mgr`` (empty: it can)."""
    problems = []
    if not isinstance(kv_mgr, sg.MooncakeKVManager):
        problems.append(f"the transfer backend is {type(kv_mgr).__name__}; only Mooncake is supported")
    if not kv_mgr.is_mla_backend:
        problems.append("the KV pool is not an MLA pool")
    if not kv_mgr.enable_all_cp_ranks_for_transfer:
        problems.append("SGLANG_DISAGGREGATION_ALL_CP_RANKS_TRANSFER is not 1, so non-zero CP ranks "
                        "would not send their pages")
    if kv_mgr.attn_cp_size <= 1:
        problems.append(f"the attention CP size is {kv_mgr.attn_cp_size}")
    if not kv_mgr.kv_args.kv_data_ptrs:
        problems.append("no KV buffers are registered")
    return problems


def rank_layout(kv_mgr) -> CpSharedKVLayout:
    """This rank's page layout as the manager sees it."""
    return CpSharedKVLayout(page_size=int(kv_mgr.kv_args.page_size), cp_size=int(kv_mgr.attn_cp_size),
                            cp_rank=int(kv_mgr.attn_cp_rank))


@dataclasses.dataclass(frozen=True)
class RegisteredBuffers:
    """The shape of the buffers one prefill rank registered with Mooncake.

    ``kv_layers``: KV buffers (one per layer); ``kv_buffer_pages``: pages each of them holds;
    ``state_buffer_pages`` and ``state_layers``: the same per NSA index state entry (its
    index in SGLang's state payload), for those entries only."""

    kv_layers: int
    kv_buffer_pages: int
    state_buffer_pages: Mapping[int, int]
    state_layers: Mapping[int, int]

    @classmethod
    def of_manager(cls, kv_mgr) -> RegisteredBuffers:
        args = kv_mgr.kv_args
        kv_layers = len(args.kv_data_ptrs)
        # Registered KV buffers hold (physical pages + page 0) pages each.
        kv_buffer_pages = min(n // item for n, item in zip(args.kv_data_lens, args.kv_item_lens))
        state_buffer_pages, state_layers = {}, {}
        index_state = sg.INDEX_STATE_TYPE  # StateType.NSA on 0.5.12.post1, .DSA on 0.5.23
        for i, state_type in enumerate(getattr(args, "state_types", []) or []):
            if state_type == index_state:
                state_buffer_pages[i] = min(
                    n // item for n, item in zip(args.state_data_lens[i], args.state_item_lens[i]))
                state_layers[i] = len(args.state_data_ptrs[i])
        # Read-only views: what startup read stays what it read.
        return cls(kv_layers=kv_layers, kv_buffer_pages=kv_buffer_pages,
                   state_buffer_pages=types.MappingProxyType(state_buffer_pages),
                   state_layers=types.MappingProxyType(state_layers))


def pool_mismatch(layout: CpSharedKVLayout, buffers: RegisteredBuffers, pool) -> Optional[str]:
    """Why the manager's view (``layout``, ``buffers``) differs from ``pool``, the pool this
    rank built (None: it does not)."""
    pool_layout = pool.cp_layout
    expected = (pool_layout.cp_size, pool_layout.cp_rank, pool_layout.page_size,
                pool.physical_size // pool_layout.page_size + 1)
    actual = (layout.cp_size, layout.cp_rank, layout.page_size, buffers.kv_buffer_pages)
    if expected == actual:
        return None
    return (f"{FLAG}: the Mooncake manager sees (cp_size, cp_rank, page_size, registered pages) = "
            f"{actual} but this rank's pool was built for {expected}; the transfer would send "
            "the wrong pages")


__all__ = ["manager_problems", "rank_layout", "RegisteredBuffers", "pool_mismatch"]
