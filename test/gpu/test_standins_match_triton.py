"""Each torch stand-in the CPU tests use equals the SGLang Triton kernel it stands for."""

import numpy as np
import pytest
import torch
from torch_standins import alloc_decode_reference, alloc_extend_reference

PAGE = 64


def _free_pages(n, device, seed):
    g = torch.Generator().manual_seed(seed)
    return (torch.randperm(n, generator=g) + 1).to(device)


@pytest.mark.parametrize("seed", range(12))
def test_alloc_extend_standin_matches_triton(seed):
    from sglang.srt.mem_cache.allocator import alloc_extend_kernel
    from sglang.srt.utils import next_power_of_2

    rng = np.random.default_rng(seed)
    bs = int(rng.integers(1, 9))
    prefix = rng.integers(0, 5 * PAGE, bs)
    seq = prefix + rng.integers(1, 6 * PAGE, bs)
    # a prefix's last location: any page-consistent location (its page is the prefix's last page)
    last_pages = rng.integers(100, 200, bs)
    last_loc = np.where(prefix > 0, last_pages * PAGE + (prefix - 1) % PAGE, -1)
    free = _free_pages(512, "cuda", seed)
    args = [torch.tensor(a, dtype=torch.int64, device="cuda") for a in (prefix, seq, last_loc)]
    total = int((seq - prefix).sum())
    ours = torch.full((total,), -7, dtype=torch.int64, device="cuda")
    theirs = torch.full((total,), -7, dtype=torch.int64, device="cuda")
    alloc_extend_reference(*args, free, ours, PAGE)
    alloc_extend_kernel[(bs,)](*args, free, theirs, next_power_of_2(bs), PAGE)
    torch.cuda.synchronize()
    assert torch.equal(ours, theirs)


@pytest.mark.parametrize("seed", range(12))
def test_alloc_decode_standin_matches_triton(seed):
    from sglang.srt.mem_cache.allocator import alloc_decode_kernel
    from sglang.srt.utils import next_power_of_2

    rng = np.random.default_rng(seed)
    bs = int(rng.integers(1, 17))
    seq = rng.integers(1, 6 * PAGE, bs) + 1
    last_loc = rng.integers(100, 200, bs) * PAGE + (seq - 2) % PAGE
    free = _free_pages(256, "cuda", seed)
    args = [torch.tensor(a, dtype=torch.int64, device="cuda") for a in (seq, last_loc)]
    ours = torch.full((bs,), -7, dtype=torch.int64, device="cuda")
    theirs = torch.full((bs,), -7, dtype=torch.int64, device="cuda")
    alloc_decode_reference(*args, free, ours, PAGE)
    alloc_decode_kernel[(bs,)](*args, free, theirs, next_power_of_2(bs), PAGE)
    torch.cuda.synchronize()
    assert torch.equal(ours, theirs)
