"""The deterministic NSA top-k stand-in (testing/stable_topk.py) against a naive loop
written from its contract: the kernel's fast path for short rows, the largest scores
with ties to the smaller index, returned in key order; and the three transforms."""

import numpy as np
import pytest
import torch

from sglang_cp_shared_kv.testing import stable_topk as st


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
