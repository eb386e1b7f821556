"""Compute-owner allocation on CUDA never makes the host wait for the device: under SGLang's
overlap schedule the scheduler allocates the next chunk while the current forward runs, so a
host read there would wait for that forward (torch's sync debug mode turns one into an error
here). The pages are the readable reference's."""

from types import SimpleNamespace

import pytest
import torch

from sglang_cp_shared_kv.pool.allocator import (
    CpSharedPagedTokenToKVPoolAllocator,
    compute_owner_order,
    compute_owner_order_on_device,
)
from sglang_cp_shared_kv.cp_shared_kv_layout import CpSharedKVLayout


class sync_errors:
    """Every host synchronisation inside the block raises (torch.cuda.set_sync_debug_mode)."""

    def __enter__(self):
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")

    def __exit__(self, *exc):
        torch.cuda.set_sync_debug_mode("default")


def test_the_device_decision_reads_nothing_on_the_host_and_equals_the_reference():
    g = torch.Generator().manual_seed(0)
    for cp_size, ranks in ((2, [0] * 32 + [1] * 64 + [0] * 32), (8, [r for r in range(8) for _ in range(16)]),
                           (4, [3] * 400)):  # the last: rank 3's lane runs dry -> fallback
        free = torch.randperm(2000, generator=g)[:1500] + 1
        want = compute_owner_order(free, ranks, cp_size)
        cuda_free = free.cuda()
        with sync_errors():
            order, found = compute_owner_order_on_device(cuda_free, ranks, cp_size, 2001)
        assert bool(found) == (want is not None)
        assert torch.equal(order.cpu(), free if want is None else want)
        with pytest.raises(RuntimeError, match="synchroniz"), sync_errors():  # the check itself bites:
            compute_owner_order(cuda_free, ranks, cp_size)  # the reference reads the device per rank


def test_the_allocator_decides_without_waiting_and_counts_once_read():
    layout = CpSharedKVLayout(64, 2, 0)
    kvcache = SimpleNamespace(cp_layout=layout, physical_size=256 * 64)
    allocator = CpSharedPagedTokenToKVPoolAllocator(2 * 256 * 64, 64, torch.bfloat16, "cuda", kvcache, True)
    prefix, seq = torch.tensor([0]), torch.tensor([8192])  # host tensors, as SGLang passes them
    with sync_errors():
        ranks = allocator._compute_owner_ranks(prefix, seq)
    assert len(ranks) == 128
    assert allocator.stats.compute_owner_chunks == 1 and allocator.stats.lane_fallbacks == 0
    owners = layout.owner_for_logical_pages(allocator.free_pages[:128].cpu()).tolist()
    assert owners == list(ranks)
