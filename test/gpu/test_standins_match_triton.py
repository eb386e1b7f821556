"""Each torch stand-in the CPU tests use equals the SGLang Triton kernel it stands for."""

import numpy as np
import pytest
import torch

from sglang_cp_shared_kv.pool.kv_geometry import PAGE_SIZE as PAGE
from sglang_cp_shared_kv_testing.torch_standins import alloc_decode_reference, alloc_extend_reference


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


# ---------------------------------------------------------------- MLA KV store
@pytest.mark.parametrize("dtype_name", ["bf16", "fp8"])
@pytest.mark.parametrize("rows", [5, 300, 1000])  # SGLang switches to a JIT store at >= 768 rows
def test_mla_store_standins_match_sglang(dtype_name, rows):
    from sglang.srt.layers.attention.nsa.quant_k_cache import quantize_k_cache_separate
    from sglang.srt.mem_cache.utils import set_mla_kv_buffer_triton

    from sglang_cp_shared_kv_testing.torch_standins import (
        quantize_k_cache_separate_reference,
        set_mla_kv_buffer_reference,
    )

    g = torch.Generator(device="cuda").manual_seed(rows)
    k_nope = torch.randn(rows, 1, 512, generator=g, device="cuda").to(torch.bfloat16) * 3
    k_rope = torch.randn(rows, 1, 64, generator=g, device="cuda").to(torch.bfloat16)
    loc = torch.randperm(2048, generator=g, device="cuda")[:rows] + 64
    if dtype_name == "fp8":
        ours_parts = quantize_k_cache_separate_reference(k_nope, k_rope)
        theirs_parts = quantize_k_cache_separate(k_nope, k_rope)
        for a, b in zip(ours_parts, theirs_parts):
            assert torch.equal(a, b)
        nope, rope, dim, dtype = *theirs_parts, 656, torch.uint8
    else:
        nope, rope, dim, dtype = k_nope, k_rope, 576, torch.bfloat16
    ours = torch.zeros(2048 + 128, 1, dim, dtype=dtype, device="cuda")
    theirs = ours.clone()
    set_mla_kv_buffer_reference(ours, loc, nope, rope)
    set_mla_kv_buffer_triton(theirs, loc, nope, rope)
    assert torch.equal(ours.view(torch.uint8), theirs.view(torch.uint8))


# ---------------------------------------------------------------- NSA index K
@pytest.mark.parametrize("scale_fmt", [None, "ue8m0"])
def test_act_quant_standin_matches_triton(scale_fmt):
    from sglang.srt.layers.attention.nsa.triton_kernel import act_quant

    from sglang_cp_shared_kv_testing.torch_standins import act_quant_reference

    g = torch.Generator(device="cuda").manual_seed(7)
    x = torch.randn(777, 128, generator=g, device="cuda").to(torch.bfloat16) * 5
    x[3] = 0  # the 1e-4 clamp
    y_ours, s_ours = act_quant_reference(x, 128, scale_fmt)
    y_theirs, s_theirs = act_quant(x, 128, scale_fmt)
    assert torch.equal(s_ours, s_theirs)
    assert torch.equal(y_ours.view(torch.uint8), y_theirs.view(torch.uint8))


def test_index_accessor_standins_match_triton():
    from sglang.srt.layers.attention.nsa import index_buf_accessor as acc

    from sglang_cp_shared_kv_testing.torch_standins import (
        get_k_and_s_reference,
        get_k_reference,
        get_s_reference,
        set_k_and_s_reference,
    )

    g = torch.Generator(device="cuda").manual_seed(3)
    pages, n = 40, 900
    buf_ours = torch.randint(0, 256, (pages, PAGE * 132), generator=g, device="cuda", dtype=torch.uint8)
    buf_theirs = buf_ours.clone()
    loc = torch.randperm((pages - 1) * PAGE, generator=g, device="cuda")[:n] + PAGE
    k = torch.randn(n, 128, generator=g, device="cuda").to(torch.float8_e4m3fn)
    s = torch.rand(n, 1, generator=g, device="cuda")
    set_k_and_s_reference(buf_ours, loc, k, s, PAGE)
    acc._set_k_and_s_triton(buf_theirs, loc, k, s, PAGE)
    assert torch.equal(buf_ours, buf_theirs)
    page_indices = torch.randperm(pages, generator=g, device="cuda")[:10]
    for seq_len in (1, 64, 500, 640):
        assert torch.equal(get_k_reference(buf_ours, page_indices, seq_len, PAGE, 128),
                           acc._get_k_triton(buf_ours, page_indices, seq_len, PAGE, 128))
        assert torch.equal(get_s_reference(buf_ours, page_indices, seq_len, PAGE, 128),
                           acc._get_s_triton(buf_ours, page_indices, seq_len, PAGE, 128))
    table = page_indices.view(1, -1).repeat(2, 1)
    lens = torch.tensor([500, 93], device="cuda")
    for a, b in zip(get_k_and_s_reference(buf_ours, table, lens, 593, 500, PAGE, 128),
                    acc._get_k_and_s_triton(buf_ours, table, lens, 593, 500, PAGE, 128)):
        assert torch.equal(a, b)
