"""The deterministic top-k stand-in selects the keys SGLang's NSA top-k kernels select
(sgl_kernel, real CUDA kernels; scores without ties), in key order where the kernel's
order depends on its atomics."""

import pytest
import torch

from sglang_cp_shared_kv_testing import stable_topk as st

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


# --- rows past the tensors' widths: SGLang's padding rows on an uneven in-seq split -------------

#: (chunk tokens, cached tokens before it, CP size): chunks SGLang pads to a multiple of the CP
#: size (test/unit/test_stable_topk.py: IN_SEQ_CHUNKS); the padding rows' lengths run past the
#: request's page table. 1,500 at CP8 is the prompt that stopped the stand-in's server (2026-12-04)
PADDED_CHUNKS = [(1500, 0, 8), (1501, 0, 2), (1501, 0, 4), (1501, 0, 8), (907, 4096, 2), (907, 4096, 8),
                 (13, 4096, 8), (1019, 1984, 4)]
KERNEL_PATHS = {"paged": dict(paged=True), "ragged": dict(paged=False), "unfused": dict(fused=False)}


@pytest.fixture(scope="module")
def sglang_0512():
    from sglang_cp_shared_kv.releases import installed, v0512

    if installed.INSTALLED is not v0512.RELEASE:
        pytest.skip("the in-seq split is SGLang 0.5.12.post1's")


@pytest.mark.parametrize("path", list(KERNEL_PATHS))
@pytest.mark.parametrize("chunk_len,prefix_len,cp_size", PADDED_CHUNKS)
def test_sglangs_padding_rows_get_the_kernels_answer(sgl_kernel, sglang_0512, chunk_len, prefix_len, cp_size, path):
    """Every top-k call SGLang 0.5.12.post1's indexer makes for the chunk on every rank
    (``stable_topk.in_seq_split_topk_calls``: SGLang's padding, split and indexer code,
    random scores), answered by the stand-in and again by the stock kernel on the same
    arguments: the same shape and, row by row, the same entries and the same -1 padding.
    Where a padding row's key lies past the request's page table (a copy of its
    ``req_to_token`` row, as SGLang makes it) the kernel reads memory the table does not
    own: there the stand-in writes -1 and every entry it did read is among the kernel's;
    with the table a view of a wider buffer (those reads defined) the rows are equal."""
    calls = st.in_seq_split_topk_calls(chunk_len, prefix_len, cp_size, st.STAND_INS, device="cuda",
                                       seed=chunk_len + cp_size, **KERNEL_PATHS[path])
    assert len(calls) == 2 * cp_size
    assert sum(int((c.arguments["lengths"] > c.sequence_len).sum()) for c in calls) == (-chunk_len) % cp_size
    for call in calls:
        where = f"rank {call.rank} {call.half}"
        stock = getattr(sgl_kernel, call.kernel)(**call.arguments)
        ours = call.result
        assert stock.shape == ours.shape == (call.arguments["score"].shape[0], TOPK) and ours.dtype == stock.dtype
        if call.kernel != "fast_topk_transform_fused":
            assert torch.equal(_sorted_rows(stock), _sorted_rows(ours)), where
            continue
        table = call.arguments["page_table_size_1"]
        inside = call.arguments["lengths"] <= table.shape[1]
        assert torch.equal(_sorted_rows(stock[inside]), _sorted_rows(ours[inside])), where
        for row in torch.nonzero(~inside).flatten().tolist():  # table entries are distinct (a permutation)
            read = ours[row][ours[row] >= 0]
            assert torch.isin(read, stock[row]).all(), f"{where} row {row}"
        wide = torch.cat([table, torch.randperm(table.numel() + 64, device="cuda")[:64].to(table.dtype)
                          .add_(1 << 30).view(1, 64).expand(table.shape[0], 64)], dim=1)
        arguments = {**call.arguments, "page_table_size_1": wide[:, :table.shape[1]]}
        stock = sgl_kernel.fast_topk_transform_fused(**arguments)
        ours = st.fast_topk_transform_fused(**arguments)
        assert torch.equal(_sorted_rows(stock), _sorted_rows(ours)), where


def test_a_window_past_its_score_row_reads_what_the_kernel_reads(sgl_kernel):
    """row_starts + lengths past the score's width: the kernel reads on into the next row;
    so does the stand-in (the last row stays inside the storage here)."""
    g = torch.Generator(device="cuda").manual_seed(21)
    score = torch.randn(4, 6000, device="cuda", generator=g)
    lengths = torch.tensor([5000, 7000, 2500, 3000], device="cuda", dtype=torch.int32)
    starts = torch.tensor([3000, 1000, 5000, 2000], device="cuda", dtype=torch.int32)
    for kernel, extra in (("fast_topk_v2", {}),
                          ("fast_topk_transform_ragged_fused",
                           {"topk_indices_offset": torch.arange(4, device="cuda", dtype=torch.int32) * 10000})):
        stock = getattr(sgl_kernel, kernel)(score=score, lengths=lengths, topk=TOPK, row_starts=starts, **extra)
        ours = st.STAND_INS[kernel](score=score, lengths=lengths, topk=TOPK, row_starts=starts, **extra)
        assert torch.equal(_sorted_rows(stock), _sorted_rows(ours)), kernel


def test_zero_and_negative_lengths_as_in_the_kernel(sgl_kernel):
    """Length 0: -1 only. A negative length: -1 only from fast_topk_v2, every position
    [0, topk) through the transforms (the first run of this test, 2026-12-04, found the
    stock paged transform writing the request's first 2,048 table entries for length -1:
    its fast-path loop index is unsigned). Every row lies in a request of ``cu_seqlens_q``,
    as in SGLang's calls: rows of no request and negative length made the kernel read
    through a table pointer it never set (an illegal memory access, the same day)."""
    score = torch.randn(6, 3000, device="cuda")
    lengths = torch.tensor([0, -1, 2100, 5, -7, 0], device="cuda", dtype=torch.int32)
    starts = torch.zeros(6, device="cuda", dtype=torch.int32)
    table = torch.randperm(6000, device="cuda").to(torch.int32).view(2, 3000)
    cu = torch.tensor([0, 3, 6], device="cuda", dtype=torch.int32)
    stock = sgl_kernel.fast_topk_transform_fused(score, lengths, table, cu, TOPK, row_starts=starts)
    ours = st.fast_topk_transform_fused(score, lengths, table, cu, TOPK, row_starts=starts)
    assert torch.equal(_sorted_rows(stock), _sorted_rows(ours))
    assert ours[[0, 5]].eq(-1).all() and torch.equal(ours[1], table[0, :TOPK]) and torch.equal(ours[4], table[1, :TOPK])
    offsets = torch.arange(6, device="cuda", dtype=torch.int32) * 100
    for kernel, extra in (("fast_topk_v2", {}), ("fast_topk_transform_ragged_fused", {"topk_indices_offset": offsets})):
        stock = getattr(sgl_kernel, kernel)(score=score, lengths=lengths, topk=TOPK, row_starts=starts, **extra)
        ours = st.STAND_INS[kernel](score=score, lengths=lengths, topk=TOPK, row_starts=starts, **extra)
        assert torch.equal(_sorted_rows(stock), _sorted_rows(ours)), kernel
