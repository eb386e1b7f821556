"""SGLang 0.5.23's top-k kernels on a GPU against their deterministic stand-ins
(``sglang_cp_shared_kv_testing.stable_topk``): the same key SET per row (the kernels' order is
their radix select's), continuous scores (no ties). The two v2 JIT kernels the DSA backend
routes to (``sglang.kernels.ops.attention.dsv4.topk``: ragged for extend, paged for decode,
every size path: register, streaming, cluster and split). sgl-kernel's three
(``fast_topk_v2`` / ``fast_topk_transform_fused`` / ``fast_topk_transform_ragged_fused``, the
same in 0.4.10) are test_stable_topk_cuda.py's, which runs on both releases.

Written from the kernels' sources without a GPU run (2026-12-07): the first run on the device
is its first."""

import pytest
import torch

from sglang_cp_shared_kv_testing import stable_topk as st

TOPK = 2048
BIG = torch.iinfo(torch.int32).max


@pytest.fixture(scope="module")
def v2():
    from sglang_cp_shared_kv.releases import installed, v0523

    if installed.INSTALLED is not v0523.RELEASE:
        pytest.skip("the top-k v2 kernels are SGLang 0.5.23's")
    from sglang.kernels.ops.attention.dsv4 import topk

    return topk



def _sorted_rows(x):
    """Each row's entries ascending, -1 padding last (a set compare that keeps padding)."""
    return torch.sort(torch.where(x < 0, BIG, x), dim=1).values


def _in_key_order(x):
    s = _sorted_rows(x)
    return torch.equal(x, s.masked_fill(s == BIG, -1))


def _scores(seed, rows, width):
    g = torch.Generator(device="cuda").manual_seed(seed)
    return torch.randn(rows, width, device="cuda", generator=g), g  # continuous: no ties


# --- v2 ragged (extend: fp8 KV with flashmla_sparse, any CP split) --------------------------------

RAGGED_LENGTHS = [0, 1, TOPK, TOPK + 1, 5000, 8192, 8193, 12000, 16384, 16385, 30000, 60000]


@pytest.mark.parametrize("seed", range(3))
def test_ragged_v2_selects_the_kernels_keys(v2, seed):
    rows, width = 48, 65536
    scores, g = _scores(seed, rows, width)
    lengths = torch.randint(0, 60000, (rows,), device="cuda", generator=g, dtype=torch.int32)
    lengths[:len(RAGGED_LENGTHS)] = torch.tensor(RAGGED_LENGTHS, dtype=torch.int32)
    # row starts of every residue mod 4 (the kernel masks the <= 3 columns its aligned load pulls in)
    # (start + length stays inside the row: the kernel reads past it unchecked)
    starts = (torch.randint(0, width - 60000 - 4, (rows,), device="cuda", generator=g, dtype=torch.int32) // 4 * 4
              + torch.arange(rows, device="cuda", dtype=torch.int32) % 4)
    offsets = torch.randint(0, 1 << 20, (rows,), device="cuda", generator=g, dtype=torch.int32)
    stock = torch.empty(rows, TOPK, dtype=torch.int32, device="cuda")
    ours = torch.empty_like(stock)
    v2.topk_transform_ragged_v2(scores.clone(), lengths, out_offsets=offsets, out_indices=stock, row_starts=starts)
    st.topk_transform_ragged_v2(scores.clone(), lengths, out_offsets=offsets, out_indices=ours, row_starts=starts)
    assert torch.equal(_sorted_rows(stock), _sorted_rows(ours))
    assert _in_key_order(ours)
    short = lengths <= TOPK  # the kernel's trivial path writes [offset, offset + L) in order
    assert torch.equal(stock[short], ours[short])
    # without row starts
    v2.topk_transform_ragged_v2(scores.clone(), lengths, out_offsets=offsets, out_indices=stock)
    st.topk_transform_ragged_v2(scores.clone(), lengths, out_offsets=offsets, out_indices=ours)
    assert torch.equal(_sorted_rows(stock), _sorted_rows(ours))


# --- v2 paged (decode: one row per request, the indexer's page table, page size 64) --------------


@pytest.mark.parametrize("rows,max_len", [(1, 120000), (4, 100000), (16, 70000), (64, 40000), (256, 9000)])
def test_paged_v2_selects_the_kernels_pages(v2, rows, max_len):
    """Few long rows take the kernel's cluster / split paths, many rows its per-row ones; the
    plan (``plan_topk_v2``) is built from the same lengths, as the backend builds it."""
    page = 64
    width = (max_len + 3) // 4 * 4
    scores, g = _scores(rows * 7 + max_len, rows, width)
    lengths = torch.randint(0, max_len + 1, (rows,), device="cuda", generator=g, dtype=torch.int32)
    lengths[0] = max_len
    if rows >= 4:
        lengths[1:4] = torch.tensor([0, TOPK, TOPK + 1], dtype=torch.int32)
    pages = (width + page - 1) // page
    table = torch.randperm(rows * pages * 2, device="cuda", generator=g)[:rows * pages].to(torch.int32)
    table = table.view(rows, pages)
    plan = v2.plan_topk_v2(lengths)
    outs = {}
    for who, kernel in (("stock", v2.topk_transform_paged_v2), ("ours", st.topk_transform_paged_v2)):
        out = torch.empty(rows, TOPK, dtype=torch.int32, device="cuda")
        raw = torch.empty(rows, TOPK, dtype=torch.int32, device="cuda")
        kernel(scores, lengths, table, out, page, plan, out_raw_indices=raw)
        only = torch.empty(rows, TOPK, dtype=torch.int32, device="cuda")
        kernel(scores, lengths, table, only, page, plan)
        positions = torch.empty(rows, TOPK, dtype=torch.int32, device="cuda")
        kernel(scores, lengths, None, positions, page, plan)
        outs[who] = (out, raw, only, positions)
    for stock, ours in zip(outs["stock"], outs["ours"]):
        assert torch.equal(_sorted_rows(stock), _sorted_rows(ours))
    assert _in_key_order(outs["ours"][1]) and _in_key_order(outs["ours"][3])


def test_the_v2_kernels_key_order_is_what_varies(v2):
    """Evidence for the stand-ins: over repeated launches the stock ragged kernel keeps its key
    set (order printed); the stand-in returns one order."""
    rows, width = 128, 32768
    scores, g = _scores(11, rows, width)
    lengths = torch.randint(TOPK + 1, width, (rows,), device="cuda", generator=g, dtype=torch.int32)
    offsets = torch.zeros(rows, dtype=torch.int32, device="cuda")
    first = torch.empty(rows, TOPK, dtype=torch.int32, device="cuda")
    v2.topk_transform_ragged_v2(scores.clone(), lengths, out_offsets=offsets, out_indices=first)
    orders_differ = sets_differ = 0
    for _ in range(10):
        again = torch.empty_like(first)
        v2.topk_transform_ragged_v2(scores.clone(), lengths, out_offsets=offsets, out_indices=again)
        orders_differ += int(not torch.equal(first, again))
        sets_differ += int(not torch.equal(_sorted_rows(first), _sorted_rows(again)))
    print(f"stock topk_transform_ragged_v2, 10 repeats: order differed {orders_differ}x, "
          f"key set differed {sets_differ}x")
    assert sets_differ == 0
    ours = [torch.empty_like(first) for _ in range(2)]
    for out in ours:
        st.topk_transform_ragged_v2(scores.clone(), lengths, out_offsets=offsets, out_indices=out)
    assert torch.equal(ours[0], ours[1])
