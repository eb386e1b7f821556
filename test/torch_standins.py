"""Torch equivalents of SGLang Triton kernels that cannot run on a CPU.

Each stand-in reproduces one kernel's contract (inputs, outputs, in-place writes) in
plain torch, written from the contract, not from the kernel source. CPU tests install
them through the ``triton_standins`` fixture (test/integration/conftest.py) only;
test/gpu/test_standins_match_triton.py proves each one equal to the Triton kernel it
stands for on a GPU.
"""

from __future__ import annotations

import torch


def _ceil_pages(n: torch.Tensor, page_size: int) -> torch.Tensor:
    return (n + page_size - 1) // page_size


def alloc_extend_reference(prefix_lens, seq_lens, last_loc, free_pages, out_indices, page_size):
    """``alloc_extend_kernel``: request i's new tokens fill the tail of its last prefix
    page (continuing after ``last_loc[i]``), then whole new pages taken from
    ``free_pages`` in order, requests one after another; ``out_indices`` receives the
    token locations of all extend tokens, request by request."""
    out_pos = 0
    next_free = 0
    for pre, seq, last in zip(prefix_lens.tolist(), seq_lens.tolist(), last_loc.tolist()):
        positions = torch.arange(pre, seq, dtype=torch.int64)
        first_new_page_pos = -(-pre // page_size) * page_size
        in_old_page = positions < first_new_page_pos
        locs = torch.empty_like(positions)
        locs[in_old_page] = last + 1 + (positions[in_old_page] - pre)
        new = positions[~in_old_page]
        page_slot = next_free + (new // page_size - first_new_page_pos // page_size)
        locs[~in_old_page] = free_pages.cpu()[page_slot] * page_size + new % page_size
        out_indices[out_pos:out_pos + len(locs)] = locs.to(out_indices.device)
        out_pos += len(locs)
        next_free += int(_ceil_pages(torch.tensor(seq), page_size) - _ceil_pages(torch.tensor(pre), page_size))


def alloc_decode_reference(seq_lens, last_loc, free_pages, out_indices, page_size):
    """``alloc_decode_kernel``: one new token per request, after ``last_loc[i]`` when it
    stays in the same page, else at the start of the next free page (in order)."""
    next_free = 0
    for i, (seq, last) in enumerate(zip(seq_lens.tolist(), last_loc.tolist())):
        starts_page = (seq - 1) % page_size == 0
        if starts_page:
            out_indices[i] = free_pages[next_free] * page_size
            next_free += 1
        else:
            out_indices[i] = last + 1


class TritonLaunch:
    """Stands in for a ``@triton.jit`` allocator kernel launched as
    ``kernel[grid](*tensors, bs_upper, page_size)``; ``bs_upper`` only sizes Triton's
    block and has no meaning here."""

    def __init__(self, reference):
        self.reference = reference

    def __getitem__(self, grid):
        def launch(*args):
            *tensors, _bs_upper, page_size = args
            self.reference(*tensors, page_size)

        return launch


ALLOC_EXTEND_STANDIN = TritonLaunch(alloc_extend_reference)
ALLOC_DECODE_STANDIN = TritonLaunch(alloc_decode_reference)
