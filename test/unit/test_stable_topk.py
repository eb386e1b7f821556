"""The deterministic NSA top-k stand-in (sglang_cp_shared_kv_testing/stable_topk.py) against a naive loop
written from its contract: the kernel's fast path for short rows, the largest scores
with ties to the smaller index, returned in key order; and the three transforms. Then
the rows the kernel is handed on an uneven in-seq split (SGLang's padding rows, whose
lengths run past the request's page table), driven through SGLang 0.5.12.post1's own
indexer code, against a line-by-line reading of the CUDA kernel (``kernel_reference``)."""

import numpy as np
import pytest
import torch

from sglang_cp_shared_kv.releases import installed, v0512
from sglang_cp_shared_kv_testing import stable_topk as st


def naive_indices(score, lengths, topk, row_starts=None):
    out = np.full((score.shape[0], topk), -1, dtype=np.int64)
    for i, length in enumerate(lengths):
        start = 0 if row_starts is None else int(row_starts[i])
        if length <= topk:
            out[i, :length] = np.arange(length)
            continue
        keys = sorted(range(length), key=lambda j: (-float(score[i, start + j]), j))[:topk]
        out[i] = sorted(keys)
    return out


def tied_scores(rng, rows, cols):
    """Scores drawn from only 7 values, so every long row has ties at its threshold."""
    return torch.tensor(rng.integers(0, 7, size=(rows, cols)), dtype=torch.float32) / 4


@pytest.mark.parametrize("seed", range(6))
def test_indices_match_the_contract_with_ties_and_row_starts(seed, monkeypatch):
    monkeypatch.setattr(st, "_SORT_ELEMENTS", 97)  # several sort blocks per call
    rng = np.random.default_rng(seed)
    rows, cols, topk = 9, 60, 8
    score = tied_scores(rng, rows, cols)
    lengths = rng.integers(0, 31, size=rows)
    lengths[0], lengths[1] = topk, topk + 1  # both sides of the fast path
    starts = rng.integers(0, cols - 30, size=rows)
    got = st.stable_topk_indices(score, torch.tensor(lengths, dtype=torch.int32), topk,
                                 torch.tensor(starts, dtype=torch.int32))
    assert got.dtype == torch.int32
    np.testing.assert_array_equal(got.numpy(), naive_indices(score.numpy(), lengths, topk, starts))


def test_minus_infinity_scores_still_pick_valid_keys():
    score = torch.full((1, 12), float("-inf"))
    score[0, 3] = 1.0
    got = st.fast_topk_v2(score, torch.tensor([10], dtype=torch.int32), 4)
    assert got.tolist() == [[0, 1, 2, 3]]  # key 3 plus the three first -inf keys, never a column >= 10


def test_paged_transform_maps_each_row_through_its_requests_page_table():
    rng = np.random.default_rng(7)
    topk, rows = 4, 5
    score = tied_scores(rng, rows, 20)
    lengths = np.array([3, 9, 12, 2, 7])
    starts = np.array([0, 0, 1, 5, 2])
    cu = torch.tensor([0, 2, 5], dtype=torch.int32)  # request 0: rows 0-1, request 1: rows 2-4
    table = torch.tensor(rng.permutation(40)[:40].reshape(2, 20), dtype=torch.int32)
    got = st.fast_topk_transform_fused(score, torch.tensor(lengths, dtype=torch.int32), table, cu, topk,
                                       torch.tensor(starts, dtype=torch.int32))
    idx = naive_indices(score.numpy(), lengths, topk, starts)
    request = [0, 0, 1, 1, 1]
    want = np.where(idx >= 0, table.numpy()[np.array(request)[:, None], np.maximum(idx, 0)], -1)
    np.testing.assert_array_equal(got.numpy(), want)


def test_paged_transform_for_decode_uses_one_table_row_per_query():
    rng = np.random.default_rng(8)
    score = tied_scores(rng, 3, 16)
    lengths = np.array([16, 2, 9])
    table = torch.tensor(rng.permutation(48).reshape(3, 16), dtype=torch.int32)
    cu = torch.tensor([0, 0, 0, 3], dtype=torch.int32)  # the kernel ignores it for decode
    got = st.fast_topk_transform_fused(score, torch.tensor(lengths, dtype=torch.int32), table, cu, 4)
    idx = naive_indices(score.numpy(), lengths, 4)
    want = np.where(idx >= 0, table.numpy()[np.arange(3)[:, None], np.maximum(idx, 0)], -1)
    np.testing.assert_array_equal(got.numpy(), want)


def test_ragged_transform_adds_each_rows_offset():
    rng = np.random.default_rng(9)
    score = tied_scores(rng, 4, 30)
    lengths = np.array([5, 30, 11, 0])
    offsets = torch.tensor([0, 100, 200, 300], dtype=torch.int32)
    got = st.fast_topk_transform_ragged_fused(score, torch.tensor(lengths, dtype=torch.int32), offsets, 6)
    idx = naive_indices(score.numpy(), lengths, 6)
    np.testing.assert_array_equal(got.numpy(), np.where(idx >= 0, idx + offsets.numpy()[:, None], -1))


def test_the_stand_ins_cover_the_kernels_sglang_calls():
    assert set(st.STAND_INS) == {"fast_topk_v2", "fast_topk_transform_fused", "fast_topk_transform_ragged_fused"}


# --- the kernel's contract on every row it accepts (sgl-kernel/csrc/elementwise/topk.cu) ----------


def flat_storage(t):
    """``t``'s whole storage as a 1-D numpy array: what the kernel, handed ``t``'s data
    pointer and row stride, can read."""
    return t.as_strided((t.untyped_storage().nbytes() // t.element_size(),), (1,), 0).cpu().numpy()


def kernel_reference(kernel, arguments):
    """What ``sgl_kernel.<kernel>`` writes, read off topk.cu one row (CUDA block) at a time:
    row i of ``score`` starts at ``score``'s data pointer + i x its row stride; a row of
    length L <= topk gets [0 .. L-1, -1 ...] without reading a score (L <= 0: all -1);
    a longer one the topk largest of the L scores from ``row_starts[i]`` on (ties: the
    smaller index, the stand-in's rule; the kernel's is its atomics'). The transforms' fast
    path compares ``i < L`` with an unsigned i: a negative L keeps every i in [0, topk).
    The paged transform reads the page-table entry ``idx`` of its request's row the same
    way as a score: the request b
    with ``cu_seqlens_q[b] <= i < cu_seqlens_q[b + 1]``, or b = i in the decode kernel (no
    row starts, one request per row). A read the tensor's storage does not hold (the
    kernel reads on into memory it does not own) has no defined value; here it is -inf
    for a score and -1 for a page entry, as the stand-in documents; a row outside every
    request likewise gets -1."""
    score, lengths, topk = arguments["score"], arguments["lengths"].cpu().numpy(), arguments["topk"]
    starts = arguments.get("row_starts")
    rows = score.shape[0]
    starts = np.zeros(rows, dtype=np.int64) if starts is None else starts.cpu().numpy().astype(np.int64)
    values, stride, offset = flat_storage(score), score.stride(0), score.storage_offset()
    out = np.full((rows, topk), -1, dtype=np.int64)
    for i in range(rows):
        length = int(lengths[i])
        if length <= topk:
            out[i, :max(length, 0)] = np.arange(max(length, 0))
            continue
        at = offset + i * stride + int(starts[i]) + np.arange(length)
        inside = (at >= 0) & (at < values.size)
        window = np.where(inside, values[np.clip(at, 0, values.size - 1)], -np.inf)
        out[i] = np.sort(np.lexsort((np.arange(length), -window))[:topk])
    if kernel == "fast_topk_v2":
        return out
    out[lengths < 0] = np.arange(topk)  # (unsigned) i < (unsigned) L: every i
    if kernel == "fast_topk_transform_ragged_fused":
        offsets = arguments["topk_indices_offset"].cpu().numpy().astype(np.int64)
        return np.where(out >= 0, out + offsets[:, None], -1)
    table, cu = arguments["page_table_size_1"], arguments["cu_seqlens_q"].cpu().numpy()
    entries, table_stride, table_offset = flat_storage(table), table.stride(0), table.storage_offset()
    decode = arguments.get("row_starts") is None and cu.size - 1 == rows
    transformed = np.full_like(out, -1)
    for i in range(rows):
        if decode:
            request = i
        else:
            request = next((b for b in range(cu.size - 1) if cu[b] <= i < cu[b + 1]), None)
            if request is None:
                continue
        at = table_offset + request * table_stride + out[i]
        readable = (out[i] >= 0) & (at >= 0) & (at < entries.size)
        transformed[i] = np.where(readable, entries[np.clip(at, 0, entries.size - 1)], -1)
    return transformed


def test_a_key_past_its_page_table_row_reads_on_in_the_tables_storage():
    """The kernel reads page-table entry j of a row wherever j is (no bound): past a row's
    width it reads on into the tensor's storage (the next row, the columns a view hides),
    and past the storage into memory the tensor does not own (the stand-in: -1)."""
    rng = np.random.default_rng(3)
    score = tied_scores(rng, 4, 12)
    lengths = torch.tensor([3, 7, 9, 12], dtype=torch.int32)  # 7, 9, 12 > the table's 6 columns
    cu = torch.tensor([0, 2, 4], dtype=torch.int32)
    starts = torch.zeros(4, dtype=torch.int32)
    wide = torch.tensor(rng.permutation(100)[:2 * 10].reshape(2, 10), dtype=torch.int32)
    for table in (wide[:, :6], wide[:, :6].contiguous()):  # a view of a wider buffer; a tensor of its own
        arguments = dict(score=score, lengths=lengths, page_table_size_1=table, cu_seqlens_q=cu, topk=8,
                         row_starts=starts)
        got = st.fast_topk_transform_fused(**arguments)
        np.testing.assert_array_equal(got.numpy(), kernel_reference("fast_topk_transform_fused", arguments))
    own = wide[:, :6].contiguous()
    got = st.fast_topk_transform_fused(score, lengths, own, cu, 8, starts)
    assert got[1, :7].tolist() == own[0].tolist() + [own[1, 0].item()]  # request 0's row 1 reads into row 1
    keys = st.fast_topk_v2(score, lengths, 8, starts)[3].long()  # request 1 (the table's last row), 8 of 12 keys
    past = keys >= 6  # past the storage's end
    assert past.any() and got[3][past].eq(-1).all() and torch.equal(got[3][~past], own[1][keys[~past]])


def test_rows_outside_every_request_get_only_padding():
    """Rows before cu_seqlens_q[0] or from its last entry on belong to no request: of
    length 0 the kernel writes -1 only; of any other length it reads through a page-table
    pointer it never set (undefined; on an H200 negative ones faulted); the stand-in writes -1."""
    score = torch.arange(36, dtype=torch.float32).view(6, 6)
    lengths = torch.tensor([0, 5, 4, 6, -3, 2], dtype=torch.int32)
    cu = torch.tensor([2, 4], dtype=torch.int32)  # one request: rows 2 and 3
    table = torch.arange(100, 106, dtype=torch.int32).view(1, 6)
    got = st.fast_topk_transform_fused(score, lengths, table, cu, 4, torch.zeros(6, dtype=torch.int32))
    assert got[[0, 1, 4, 5]].eq(-1).all()
    assert got[2].tolist() == [100, 101, 102, 103] and got[3].tolist() == [102, 103, 104, 105]


@pytest.mark.parametrize("kernel", ["fast_topk_v2", "fast_topk_transform_fused", "fast_topk_transform_ragged_fused"])
def test_zero_and_negative_lengths_read_no_score(kernel):
    """Length 0: padding only. A negative length: padding only from fast_topk_v2, but every
    position [0, topk) through the transforms (their loop index is unsigned; stock did so on
    an H200: test/gpu/test_stable_topk_cuda.py)."""
    score = torch.randn(3, 5)
    arguments = {"score": score, "lengths": torch.tensor([0, -1, -7], dtype=torch.int32), "topk": 4}
    every = torch.arange(4, dtype=torch.int32)
    want = torch.stack([torch.full((4,), -1, dtype=torch.int32), every, every])
    if kernel == "fast_topk_v2":
        want[1:] = -1
    if kernel == "fast_topk_transform_fused":
        table = torch.arange(15, dtype=torch.int32).view(3, 5)
        arguments.update(page_table_size_1=table, cu_seqlens_q=torch.arange(4, dtype=torch.int32))
        want[1:] = table[1:, :4]
    if kernel == "fast_topk_transform_ragged_fused":
        arguments["topk_indices_offset"] = torch.tensor([10, 20, 30], dtype=torch.int32)
        want[1:] += torch.tensor([[20], [30]], dtype=torch.int32)
    got = st.STAND_INS[kernel](**arguments)
    assert got.dtype == torch.int32 and torch.equal(got, want)
    np.testing.assert_array_equal(got.numpy(), kernel_reference(kernel, arguments))


def test_a_window_past_its_score_row_reads_the_next_row():
    """row_starts[i] + lengths[i] beyond the row's width: the kernel reads on from the row's
    start (the next row's scores, then memory it does not own)."""
    score = torch.full((2, 6), -5.0)
    score[1, 0], score[1, 1] = 9.0, 8.0  # the two best keys of row 0's window (its columns 7, 8)
    arguments = dict(score=score, lengths=torch.tensor([9, 2], dtype=torch.int32), topk=2,
                     row_starts=torch.tensor([1, 0], dtype=torch.int32))
    got = st.fast_topk_v2(**arguments)
    assert got[0].tolist() == [5, 6]  # relative to the start: columns 6 and 7 = row 1's 0 and 1
    np.testing.assert_array_equal(got.numpy(), kernel_reference("fast_topk_v2", arguments))


@pytest.mark.parametrize("change", ["lengths", "row_starts", "table_rows", "prefill_bs", "offsets"])
def test_shapes_the_kernel_refuses_are_refused(change):
    """The checks of topk.cu's host functions (TORCH_CHECK, a RuntimeError): a call stock
    SGLang would not survive must not pass with the stand-in."""
    score, topk = torch.randn(4, 10), 4
    lengths, starts = torch.full((4,), 5, dtype=torch.int32), torch.zeros(4, dtype=torch.int32)
    table, cu = torch.zeros(2, 10, dtype=torch.int32), torch.tensor([0, 2, 4], dtype=torch.int32)
    offsets = torch.zeros(4, dtype=torch.int32)
    if change == "lengths":
        lengths = lengths[:3]
    if change == "row_starts":
        starts = starts[:3]
    if change == "table_rows":
        table = table[:1]
    if change == "prefill_bs":
        table, cu = torch.zeros(5, 10, dtype=torch.int32), torch.arange(6, dtype=torch.int32)
    if change == "offsets":
        offsets = offsets[:3]
    with pytest.raises(RuntimeError, match="to be true"):
        if change == "offsets":
            st.fast_topk_transform_ragged_fused(score, lengths, offsets, topk, starts)
        else:
            st.fast_topk_transform_fused(score, lengths, table, cu, topk, starts)


# --- SGLang's own in-seq split: the rows it pads (0.5.12.post1 only) ----------------------------

on_0512 = pytest.mark.skipif(installed.INSTALLED is not v0512.RELEASE,
                             reason="the in-seq split is SGLang 0.5.12.post1's (0.5.23 splits by interleave)")


def _shapes_only():
    """Kernels that only return the shape the real ones return (-1 everywhere): what SGLang
    hands a kernel, whatever the kernel does with it."""
    def kernel(score, *args, **kwargs):
        return torch.full((score.shape[0], 2048), -1, dtype=torch.int32, device=score.device)

    return {name: kernel for name in st.STAND_INS}


@on_0512
def test_sglang_pads_an_uneven_in_seq_chunk_past_the_page_table():
    """1,500 tokens at CP8: SGLang pads the chunk to a multiple of 8 (1,504 = 16 x 94), so every
    rank computes 188 rows; the last 4 rows of the chunk are padding. They fall in segment 15,
    rank 0's second half, whose top-k call gets lengths up to 1,504 (the row's causal key
    count, counting the padding) while the request's page table has 1,500 columns."""
    calls = st.in_seq_split_topk_calls(1500, 0, 8, _shapes_only())
    assert len(calls) == 16 and all(c.kernel == "fast_topk_transform_fused" for c in calls)
    assert all(c.arguments["score"].shape[0] == 94 for c in calls)
    padded = [c for c in calls if int(c.arguments["lengths"].max()) > c.sequence_len]
    assert [(c.rank, c.half) for c in padded] == [(0, "next")]
    call = padded[0]
    assert call.arguments["lengths"][-5:].tolist() == [1500, 1501, 1502, 1503, 1504]
    assert call.arguments["score"].shape == (94, 1504)
    assert call.arguments["page_table_size_1"].shape == (1, 1500)
    assert call.arguments["cu_seqlens_q"].tolist() == [0, 94] and call.arguments["row_starts"].eq(0).all()
    # an even chunk (1,504 tokens) has no such row
    assert all(int(c.arguments["lengths"].max()) <= c.sequence_len
               for c in st.in_seq_split_topk_calls(1504, 0, 8, _shapes_only()))


#: (chunk tokens, cached tokens before it, CP size): the chunks of 1,500-, 1,501-, 4,097- and
#: 5,003-token prompts (--chunked-prefill-size 2048), a last chunk of 13 tokens (one row per
#: segment at CP8: whole segments of padding) and a radix hit of 1,984 tokens
IN_SEQ_CHUNKS = [(1500, 0, 8), (1501, 0, 2), (1501, 0, 4), (1501, 0, 8), (2048, 2048, 2), (2048, 2048, 8),
                 (907, 4096, 2), (907, 4096, 8), (13, 4096, 8), (1019, 1984, 4)]
KERNEL_PATHS = {"paged": dict(paged=True), "ragged": dict(paged=False), "unfused": dict(fused=False)}


@on_0512
@pytest.mark.parametrize("path", list(KERNEL_PATHS))
@pytest.mark.parametrize("chunk_len,prefix_len,cp_size", IN_SEQ_CHUNKS)
def test_the_stand_in_follows_the_kernel_on_every_row_of_sglangs_in_seq_split(chunk_len, prefix_len, cp_size, path):
    """Every top-k call SGLang's indexer makes for the chunk on every rank, through the
    stand-ins: each answer equals the kernel's contract (``kernel_reference``) on every row,
    SGLang's padding rows included (scores with ties on every other chunk)."""
    tied = IN_SEQ_CHUNKS.index((chunk_len, prefix_len, cp_size)) % 2 == 1
    calls = st.in_seq_split_topk_calls(chunk_len, prefix_len, cp_size, st.STAND_INS, tied_scores=tied,
                                       **KERNEL_PATHS[path])
    assert len(calls) == 2 * cp_size
    padding_rows = sum(int((c.arguments["lengths"] > c.sequence_len).sum()) for c in calls)
    assert padding_rows == (-chunk_len) % cp_size  # SGLang pads the chunk to a multiple of the CP size
    for call in calls:
        assert call.result.shape == (call.arguments["score"].shape[0], 2048) and call.result.dtype == torch.int32
        np.testing.assert_array_equal(call.result.numpy(), kernel_reference(call.kernel, call.arguments),
                                      err_msg=f"rank {call.rank} {call.half}")


@on_0512
def test_a_chunk_too_short_to_split_makes_no_in_seq_call():
    """The last chunk of a 4,097-token prompt (1 token, padded to 8 rows at CP8) is not split
    (``can_nsa_cp_split``): SGLang takes its unsplit path, with no padding rows in a call."""
    assert st.in_seq_split_topk_calls(1, 4096, 8, _shapes_only()) == []
    assert st.in_seq_split_topk_calls(1, 4096, 2, _shapes_only()) == []
