"""The logical pages the plugin's real allocator hands one request, without a pool.

The PD rig and benchmark describe a request by its logical page list; with compute-owner
allocation that list depends on how the request was chunked. :func:`request_pages` runs
:class:`~sglang_cp_shared_kv.pool.allocator.CpSharedPagedTokenToKVPoolAllocator` itself --
SGLang's ``alloc_extend`` included -- on a fresh free list, chunk by chunk, as the
scheduler would, and returns the request's pages in sequence order. The allocator reads
only the layout and the physical size of its KV cache, so a stand-in carries those;
SGLang's Triton allocation kernel runs as its torch stand-in (:mod:`.torch_standins`),
installed for the call and removed after it.
"""

from __future__ import annotations

import importlib
from contextlib import contextmanager
from types import SimpleNamespace
from typing import Iterator, List, Sequence

import torch

from sglang_cp_shared_kv.pool.allocator import AllocationStats, CpSharedPagedTokenToKVPoolAllocator
from sglang_cp_shared_kv.cp_shared_kv_layout import CpSharedKVLayout
from sglang_cp_shared_kv.pool.kv_geometry import PAGE_SIZE
from sglang_cp_shared_kv_testing import torch_standins


@contextmanager
def allocation_standins() -> Iterator[None]:
    """SGLang's allocation kernels as their torch stand-ins, for the block only."""
    saved = []
    try:
        for module_name, attribute, standin in torch_standins.STANDINS_0512:
            if module_name == "sglang.srt.mem_cache.allocator":
                module = importlib.import_module(module_name)
                saved.append((module, attribute, getattr(module, attribute)))
                setattr(module, attribute, standin)
        yield
    finally:
        for module, attribute, value in saved:
            setattr(module, attribute, value)


def request_pages(cp_size: int, physical_pages: int, chunk_ends: Sequence[int],
                  page_size: int = PAGE_SIZE) -> "tuple[List[int], AllocationStats]":
    """(logical pages of one request whose chunks end at ``chunk_ends`` tokens, the
    allocator's decisions), on a fresh pool of ``physical_pages`` pages per rank."""
    layout = CpSharedKVLayout(page_size, cp_size, 0)
    kvcache = SimpleNamespace(cp_layout=layout, physical_size=physical_pages * page_size)
    allocator = CpSharedPagedTokenToKVPoolAllocator(physical_pages * page_size * cp_size, page_size,
                                                    torch.bfloat16, "cpu", kvcache, True)
    locs, prefix = [], 0
    t = lambda v: torch.tensor([v], dtype=torch.int64)  # noqa: E731
    with allocation_standins():
        for end in chunk_ends:
            last = locs[-1] if locs else -1
            out = allocator.alloc_extend(t(prefix), t(prefix), t(end), t(end), t(last), end - prefix)
            if out is None:
                raise ValueError(f"{physical_pages} pages per rank cannot hold a {end}-token request")
            locs += out.tolist()
            prefix = end
    return [loc // page_size for loc in locs[::page_size]], allocator.stats
