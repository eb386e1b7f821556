"""The deterministic top-k stand-in selects the keys SGLang's NSA top-k kernels select
(sgl_kernel, real CUDA kernels; scores without ties), in key order where the kernel's
order depends on its atomics."""

import pytest
import torch

from sglang_cp_shared_kv.testing import stable_topk as st

TOPK = 2048


@pytest.fixture(scope="module")
def sgl_kernel():
    return pytest.importorskip("sgl_kernel")


def _case(seed, rows=48, width=24000):
    g = torch.Generator(device="cuda").manual_seed(seed)
    score = torch.randn(rows, width, device="cuda", generator=g)  # continuous: no ties
    lengths = torch.randint(1, 20000, (rows,), device="cuda", generator=g, dtype=torch.int32)
    lengths[:4] = torch.tensor([1, TOPK, TOPK + 1, 20000], dtype=torch.int32)
    starts = torch.randint(0, width - 20000, (rows,), device="cuda", generator=g, dtype=torch.int32)
    return score, lengths, starts


def _sorted_rows(x):
    """Each row's entries ascending, -1 padding last (a set compare that keeps padding)."""
    big = torch.iinfo(torch.int32).max
    return torch.sort(torch.where(x < 0, big, x), dim=1).values


@pytest.mark.parametrize("seed", range(3))
def test_v2_and_ragged_select_the_kernels_keys(sgl_kernel, seed):
    score, lengths, starts = _case(seed)
    stock = sgl_kernel.fast_topk_v2(score, lengths, TOPK, row_starts=starts)
    ours = st.fast_topk_v2(score, lengths, TOPK, row_starts=starts)
    assert torch.equal(_sorted_rows(stock), _sorted_rows(ours))
    assert torch.equal(ours, _sorted_rows(ours).masked_fill(_sorted_rows(ours) == torch.iinfo(torch.int32).max, -1))
    offsets = torch.arange(score.shape[0], device="cuda", dtype=torch.int32) * 100000
    stock = sgl_kernel.fast_topk_transform_ragged_fused(score, lengths, offsets, TOPK, row_starts=starts)
    ours = st.fast_topk_transform_ragged_fused(score, lengths, offsets, TOPK, row_starts=starts)
    assert torch.equal(_sorted_rows(stock), _sorted_rows(ours))


@pytest.mark.parametrize("decode", [False, True])
def test_paged_transform_selects_the_kernels_pages(sgl_kernel, decode):
    score, lengths, starts = _case(5, rows=12)
    rows, width = score.shape
    if decode:
        cu, row_starts, requests = torch.arange(rows + 1, device="cuda", dtype=torch.int32), None, rows
    else:
        cu, row_starts, requests = torch.tensor([0, 5, 12], device="cuda", dtype=torch.int32), starts, 2
    table = torch.randperm(requests * width, device="cuda").to(torch.int32).view(requests, width)
    stock = sgl_kernel.fast_topk_transform_fused(score, lengths, table, cu, TOPK, row_starts=row_starts)
    ours = st.fast_topk_transform_fused(score, lengths, table, cu, TOPK, row_starts=row_starts)
    assert torch.equal(_sorted_rows(stock), _sorted_rows(ours))


def test_the_kernels_key_order_is_what_varies(sgl_kernel):
    """Evidence for the module docstring: the stock kernel returns the same keys in a
    varying order over repeated launches; the stand-in returns one order."""
    score, lengths, starts = _case(11, rows=256)
    first = sgl_kernel.fast_topk_v2(score, lengths, TOPK, row_starts=starts)
    orders_differ = sets_differ = 0
    for _ in range(20):
        again = sgl_kernel.fast_topk_v2(score, lengths, TOPK, row_starts=starts)
        orders_differ += int(not torch.equal(first, again))
        sets_differ += int(not torch.equal(_sorted_rows(first), _sorted_rows(again)))
    print(f"stock fast_topk_v2, 20 repeats: order differed {orders_differ}x, key set differed {sets_differ}x")
    assert sets_differ == 0
    assert all(torch.equal(st.fast_topk_v2(score, lengths, TOPK, row_starts=starts),
                           st.fast_topk_v2(score, lengths, TOPK, row_starts=starts)) for _ in range(3))
