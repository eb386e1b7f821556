"""The stand-ins of SGLang 0.5.23's top-k v2 JIT kernels (``stable_topk.topk_transform_ragged_v2``
and ``topk_transform_paged_v2``) against a naive loop written from the contract the module
documents (read off ``sglang/kernels/jit/csrc/deepseek_v4/topk_v2.cuh``): short rows
[0, L) then -1, long rows the largest scores with ties to the smaller index in key order, row
starts, a window past the score row reading on into the storage, the ragged offset, the page
transform (``table[j >> bits] << bits | j & mask``, int32, a -1 entry included) and the host
checks. Pure torch: runs under either SGLang."""

import numpy as np
import pytest
import torch

from sglang_cp_shared_kv_testing import stable_topk as st


def naive_positions(flat, row_base, lengths, starts, topk):
    """Row b: positions j of the L largest of ``flat[row_base[b] + start + j]`` (-inf past
    the storage), ties to the smaller j, ascending; L <= topk: [0, L); L < 0: -1 only."""
    out = np.full((len(lengths), topk), -1, dtype=np.int64)
    for b, length in enumerate(lengths):
        if length <= 0:
            continue
        if length <= topk:
            out[b, :length] = np.arange(length)
            continue
        at = row_base[b] + starts[b] + np.arange(length)
        window = np.where(at < flat.size, flat[np.clip(at, 0, flat.size - 1)], -np.inf)
        keys = sorted(range(length), key=lambda j: (-float(window[j]), j))[:topk]
        out[b] = sorted(keys)
    return out


def tied(rng, rows, cols):
    return torch.tensor(rng.integers(0, 7, size=(rows, cols)), dtype=torch.float32) / 4


def i32(values):
    return torch.tensor(values, dtype=torch.int32)


@pytest.mark.parametrize("seed", range(4))
def test_ragged_v2_selects_the_contracts_keys_plus_the_offset(seed, monkeypatch):
    monkeypatch.setattr(st, "_SORT_ELEMENTS", 89)  # several sort blocks per call
    rng = np.random.default_rng(seed)
    rows, cols, topk = 10, 64, 8
    scores = tied(rng, rows, cols) if seed % 2 else torch.randn(rows, cols, generator=torch.Generator().manual_seed(seed))
    lengths = rng.integers(0, 40, size=rows)
    lengths[:4] = [0, topk, topk + 1, 39]  # empty, both sides of the short path, long
    starts = rng.integers(0, cols - 40, size=rows)
    offsets = rng.integers(0, 10_000, size=rows)
    out = torch.full((rows, topk), 123, dtype=torch.int32)
    assert st.topk_transform_ragged_v2(scores, i32(lengths), out_offsets=i32(offsets), out_indices=out,
                                       row_starts=i32(starts)) is None
    want = naive_positions(scores.numpy().ravel(), np.arange(rows) * cols, lengths, starts, topk)
    np.testing.assert_array_equal(out.numpy(), np.where(want >= 0, want + offsets[:, None], -1))


def test_ragged_v2_without_row_starts_reads_from_column_0():
    scores = torch.randn(3, 32, generator=torch.Generator().manual_seed(3))
    lengths, offsets = [5, 20, 32], [0, 7, 1000]
    out = torch.empty(3, 4, dtype=torch.int32)
    st.topk_transform_ragged_v2(scores, i32(lengths), out_offsets=i32(offsets), out_indices=out)
    want = naive_positions(scores.numpy().ravel(), np.arange(3) * 32, lengths, [0, 0, 0], 4)
    np.testing.assert_array_equal(out.numpy(), np.where(want >= 0, want + np.array(offsets)[:, None], -1))


def test_a_ragged_window_past_its_row_reads_on_into_the_next_row_and_minus_inf_past_the_storage():
    """The kernel bounds neither the row start nor the length by the score width."""
    scores = torch.randn(3, 16, generator=torch.Generator().manual_seed(5))
    lengths, starts = [20, 9, 12], [10, 3, 8]  # row 0 runs into row 1; row 2 past the storage
    out = torch.empty(3, 4, dtype=torch.int32)
    st.topk_transform_ragged_v2(scores, i32(lengths), out_offsets=i32([0, 0, 0]), out_indices=out,
                                row_starts=i32(starts))
    want = naive_positions(scores.numpy().ravel(), np.arange(3) * 16, lengths, starts, 4)
    np.testing.assert_array_equal(out.numpy(), want)
    assert (out[2] < 8).all()  # only the 8 columns inside the storage can win


def test_a_negative_length_gets_only_padding():
    """Not a length the v2 kernels take (unsigned: ~4e9 keys); SGLang clamps such rows to 0."""
    scores = torch.randn(2, 16)
    out = torch.empty(2, 4, dtype=torch.int32)
    st.topk_transform_ragged_v2(scores, i32([-3, 2]), out_offsets=i32([5, 5]), out_indices=out)
    assert out.tolist() == [[-1] * 4, [5, 6, -1, -1]]
    metadata = torch.zeros(3, 2, dtype=torch.int32)
    st.topk_transform_paged_v2(scores, i32([-3, 2]), None, out, 4, metadata)
    assert out.tolist() == [[-1] * 4, [0, 1, -1, -1]]


def paged_reference(scores, lengths, table, page, topk):
    want = naive_positions(scores.numpy().ravel(), np.arange(scores.shape[0]) * scores.stride(0), lengths,
                           [0] * len(lengths), topk)
    if table is None:
        return want, want
    flat = table.numpy().ravel()
    mapped = np.full_like(want, -1)
    for b in range(want.shape[0]):
        for k, j in enumerate(want[b]):
            at = b * table.stride(0) + j // page
            if j >= 0 and at < flat.size:
                mapped[b, k] = int(np.int32(np.int64(flat[at]) * page + j % page))
    return mapped, want


@pytest.mark.parametrize("page", [1, 4, 64])
@pytest.mark.parametrize("seed", range(3))
def test_paged_v2_maps_each_rows_keys_through_its_page_table_row(page, seed):
    rng = np.random.default_rng(seed)
    rows, cols, topk = 6, 200, 16
    scores = tied(rng, rows, cols) if seed == 1 else torch.randn(rows, cols, generator=torch.Generator().manual_seed(seed))
    lengths = rng.integers(0, cols, size=rows)
    lengths[:3] = [0, topk, topk + 1]
    pages = (cols + page - 1) // page
    table = torch.tensor(rng.permutation(rows * pages * 3)[:rows * pages], dtype=torch.int32).view(rows, pages)
    table[0, 0] = -1  # an unset entry: the kernel's shift-and-or of -1
    out, raw = torch.empty(rows, topk, dtype=torch.int32), torch.empty(rows, topk, dtype=torch.int32)
    metadata = torch.zeros(rows + 1, 2, dtype=torch.int32)
    assert st.topk_transform_paged_v2(scores, i32(lengths), table, out, page, metadata, out_raw_indices=raw) is None
    mapped, positions = paged_reference(scores, lengths, table, page, topk)
    np.testing.assert_array_equal(out.numpy(), mapped)
    np.testing.assert_array_equal(raw.numpy(), positions)
    # without a table: the positions themselves
    st.topk_transform_paged_v2(scores, i32(lengths), None, out, page, metadata)
    np.testing.assert_array_equal(out.numpy(), positions)


def test_a_minus_one_page_entry_transforms_as_the_kernel_computes_it():
    scores = torch.zeros(1, 8)
    table = i32([[-1, 3]])
    out = torch.empty(1, 8, dtype=torch.int32)
    st.topk_transform_paged_v2(scores, i32([8]), table, out, 4, torch.zeros(2, 2, dtype=torch.int32))
    assert out.tolist() == [[-4, -3, -2, -1, 12, 13, 14, 15]]  # (-1 << 2) | r = -4 + r


def test_a_page_entry_past_the_tables_storage_is_padding():
    """A key whose page lies past the table's width reads on (the next row); past the storage
    the stand-in writes -1 (the kernel reads memory the table does not own)."""
    scores = torch.randn(2, 16, generator=torch.Generator().manual_seed(9))
    table = i32([[10, 11], [20, 21]])  # 2 pages of 4: keys >= 8 lie past each row's pages
    out = torch.empty(2, 16, dtype=torch.int32)
    st.topk_transform_paged_v2(scores, i32([16, 12]), table, out, 4, torch.zeros(3, 2, dtype=torch.int32))
    # row 0: keys 8..15 read row 1's entries; row 1: keys 8..11 lie past the storage
    assert out[0].tolist() == [40, 41, 42, 43, 44, 45, 46, 47, 80, 81, 82, 83, 84, 85, 86, 87]
    assert out[1].tolist() == [80, 81, 82, 83, 84, 85, 86, 87] + [-1] * 8


def test_the_stand_ins_are_deterministic_and_in_key_order():
    scores = torch.randn(32, 4096, generator=torch.Generator().manual_seed(1))
    lengths = torch.randint(1, 4096, (32,), generator=torch.Generator().manual_seed(2), dtype=torch.int32)
    outs = []
    for _ in range(2):
        out = torch.empty(32, 2048, dtype=torch.int32)
        st.topk_transform_ragged_v2(scores, lengths, out_offsets=torch.zeros(32, dtype=torch.int32), out_indices=out)
        outs.append(out)
    assert torch.equal(outs[0], outs[1])
    valid = outs[0].masked_fill(outs[0] < 0, torch.iinfo(torch.int32).max)
    assert torch.equal(valid, torch.sort(valid, dim=1).values)


def test_the_v2_installer_names_the_kernels_sglang_0523_calls():
    assert st.V2_MODULE == "sglang.kernels.ops.attention.dsv4.topk"
    assert st.V2_STAND_INS == {"topk_transform_ragged_v2": st.topk_transform_ragged_v2,
                               "topk_transform_paged_v2": st.topk_transform_paged_v2}


def _ragged_args(**change):
    args = dict(scores=torch.zeros(2, 16), seq_lens=i32([3, 4]), out_offsets=i32([0, 0]),
                out_indices=torch.empty(2, 4, dtype=torch.int32), row_starts=None)
    args.update(change)
    return args


def _paged_args(**change):
    args = dict(scores=torch.zeros(2, 16), seq_lens=i32([3, 4]), page_tables=i32([[0, 1, 2, 3]] * 2),
                out_page_indices=torch.empty(2, 4, dtype=torch.int32), page_size=4,
                metadata=torch.zeros(3, 2, dtype=torch.int32), out_raw_indices=None)
    args.update(change)
    return args


@pytest.mark.parametrize("change", [
    dict(seq_lens=torch.tensor([3, 4])),  # int64
    dict(seq_lens=i32([3])),
    dict(out_offsets=torch.tensor([0, 0])),
    dict(row_starts=torch.tensor([0, 0])),
    dict(scores=torch.zeros(2, 16, dtype=torch.float16)),
    dict(scores=torch.zeros(2, 18)[:, :16]),  # row stride 18: not a multiple of 4
    dict(scores=torch.zeros(16, 2).t()),  # column stride 2
    dict(out_indices=torch.empty(2, 2049, dtype=torch.int32)),
    dict(out_indices=torch.empty(2, 4, dtype=torch.int64)),
])
def test_ragged_v2_refuses_what_the_kernel_refuses(change):
    args = _ragged_args(**change)
    scores, seq_lens = args.pop("scores"), args.pop("seq_lens")
    with pytest.raises(RuntimeError):
        st.topk_transform_ragged_v2(scores, seq_lens, **args)
    accepted = _ragged_args()
    st.topk_transform_ragged_v2(accepted.pop("scores"), accepted.pop("seq_lens"), **accepted)  # the defaults


@pytest.mark.parametrize("change", [
    dict(metadata=torch.zeros(2, 2, dtype=torch.int32)),  # not B + 1 rows
    dict(metadata=torch.zeros(3, 2, dtype=torch.int64)),
    dict(page_size=3),
    dict(page_tables=None, out_raw_indices=torch.empty(2, 4, dtype=torch.int32)),
    dict(page_tables=torch.zeros(3, 4, dtype=torch.int32)),
    dict(page_tables=torch.zeros(2, 4, dtype=torch.int64)),
    dict(out_page_indices=torch.empty(2, 0, dtype=torch.int32)),
    dict(seq_lens=torch.tensor([3, 4])),
])
def test_paged_v2_refuses_what_the_kernel_refuses(change):
    with pytest.raises(RuntimeError):
        st.topk_transform_paged_v2(**_paged_args(**change))
    st.topk_transform_paged_v2(**_paged_args())  # the defaults are accepted
