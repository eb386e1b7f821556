"""The torch references of the kernel package (sgl-kernel/) against naive per-element
loops written from each kernel's contract, and the plugin's fallbacks
(sglang_cp_shared_kv.kernels) against the references.

Edge cases: empty ownership, padding rows on the dummy page 0, a partial last page,
-1 top-k padding, locations outside the inverse table, N = 1..8.
"""

import bisect
import math

import numpy as np
import pytest
import torch

import sglang_cp_shared_kv_kernel as K
from sglang_cp_shared_kv.cp_shared_kv_layout import CpSharedKVLayout
from sglang_cp_shared_kv.kernels import KernelDispatch
from sglang_cp_shared_kv.pool.kv_geometry import PAGE_SIZE as PAGE


# ------------------------------------------------------------------ naive helpers
def _fp8_e4m3_table():
    """(values, codes) of the non-negative finite float8_e4m3fn numbers, from the format:
    4 exponent bits (bias 7), 3 mantissa bits, no infinities, 0x7F is NaN."""
    values = []
    for code in range(0x7F):
        exponent, mantissa = code >> 3, code & 7
        values.append(mantissa * 2.0 ** -9 if exponent == 0 else (1 + mantissa / 8) * 2.0 ** (exponent - 7))
    return values


FP8_VALUES = _fp8_e4m3_table()


def fp8_code(v: float) -> int:
    """Round-to-nearest-even float8_e4m3fn code of a finite |v| <= 448."""
    sign = 0x80 if math.copysign(1.0, v) < 0 else 0
    a = abs(v)
    hi = bisect.bisect_left(FP8_VALUES, a)
    if hi < len(FP8_VALUES) and FP8_VALUES[hi] == a:
        return sign | hi
    lo = hi - 1
    below, above = a - FP8_VALUES[lo], FP8_VALUES[hi] - a
    code = lo if below < above else hi if above < below else (lo if lo % 2 == 0 else hi)
    return sign | code


def owned_rows_naive(out_cache_loc, n, rank):
    rows, physical = [], []
    for row, loc in enumerate(out_cache_loc.tolist()):
        page = loc // PAGE
        if page != 0 and (page - 1) % n == rank:
            rows.append(row)
            physical.append(((page - 1) // n + 1) * PAGE + loc % PAGE)
    return rows, physical


def chunk_locs(seq_pages, prefix_len, extend_len, padded_len):
    """out_cache_loc of a chunk on logical pages ``seq_pages``, padded with location 0."""
    positions = range(prefix_len, prefix_len + extend_len)
    locs = [seq_pages[p // PAGE] * PAGE + p % PAGE for p in positions]
    return torch.tensor(locs + [0] * (padded_len - extend_len), dtype=torch.int64)


def owned(layout, out_cache_loc):
    """What the batch state computes: owned rows and their physical locations."""
    rows = layout.owned_by_this_rank(out_cache_loc).nonzero().squeeze(1)
    return rows, layout.logical_locs_to_physical(out_cache_loc[rows])


CASES = [  # (N, rank, prefix_len, extend_len, padding rows)
    (1, 0, 0, 100, 0), (2, 1, 0, 130, 3), (3, 2, 70, 64, 0), (4, 0, 10, 200, 5),
    (5, 4, 0, 63, 1), (8, 7, 128, 300, 4), (8, 3, 0, 40, 2),  # 40 rows on page 1: rank 3 owns none
    (6, 1, 33, 1, 0),
]


def _case(n, rank, prefix, extend, pad, seed):
    g = torch.Generator().manual_seed(seed)
    pages = -(-(prefix + extend) // PAGE)
    seq_pages = (torch.randperm(4 * pages * n, generator=g)[:pages] + 1).tolist()
    out_cache_loc = chunk_locs(seq_pages, prefix, extend, extend + pad)
    return CpSharedKVLayout(PAGE, n, rank), out_cache_loc, g


# -------------------------------------------------------------------- MLA stores
@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_mla_reference_matches_naive_loop(case, dtype):
    layout, out_cache_loc, g = _case(*case, seed=sum(case))
    n_rows = out_cache_loc.numel()
    latent = torch.randn(n_rows, 576, generator=g).to(dtype)
    k_nope, k_rope = latent[:, :512].unsqueeze(1), latent[:, 512:].unsqueeze(1)  # strided views
    rows, physical = owned(layout, out_cache_loc)
    slots = int(physical.max()) + PAGE if physical.numel() else 2 * PAGE
    buffer = torch.zeros(slots, 1, 576, dtype=dtype)
    K.store_mla_rows_reference(buffer, rows, physical, k_nope, k_rope)

    expected = torch.zeros_like(buffer)
    naive_rows, naive_physical = owned_rows_naive(out_cache_loc, layout.cp_size, layout.cp_rank)
    assert rows.tolist() == naive_rows and physical.tolist() == naive_physical
    for row, loc in zip(naive_rows, naive_physical):
        expected[loc, 0, :512] = latent[row, :512]
        expected[loc, 0, 512:] = latent[row, 512:]
    assert torch.equal(buffer, expected)
    assert not buffer[:PAGE].any(), "the dummy page is never written"


def naive_fp8_row(nope: np.ndarray, rope: torch.Tensor) -> list:
    """656 bytes of one packed fp8 row, value by value (float32 IEEE arithmetic)."""
    out = []
    scales = []
    for tile in nope.reshape(4, 128):
        amax = np.float32(np.max(np.abs(tile)))
        scale = np.float32(amax / np.float32(448.0))
        inv = np.float32(np.float32(1.0) / scale) if scale != 0 else np.float32(np.inf)
        for x in tile:
            with np.errstate(invalid="ignore"):
                v = np.float32(x * inv)
            v = 448.0 if math.isnan(v) else min(max(float(v), -448.0), 448.0)  # GPU clamp: NaN -> +448
            out.append(fp8_code(v))
        scales.append(scale)
    out += list(np.array(scales, dtype=np.float32).view(np.uint8))
    out += rope.to(torch.bfloat16).view(torch.uint8).tolist()
    return out


@pytest.mark.parametrize("case", CASES[:5])
def test_mla_fp8_reference_matches_naive_loop(case):
    layout, out_cache_loc, g = _case(*case, seed=7 * sum(case))
    n_rows = out_cache_loc.numel()
    latent = (torch.randn(n_rows, 576, generator=g) * torch.logspace(-3, 3, n_rows)[:, None]).bfloat16()
    latent[0, 128:256] = 0  # an all-zero tile: scale 0, every value +448
    latent[-1, :4] = torch.tensor([448.0, -0.0, 1e-8, -3.3e-3])  # saturation, signed zero, subnormals
    rows, physical = owned(layout, out_cache_loc)
    buffer = torch.zeros(int(physical.max()) + PAGE if physical.numel() else PAGE, 1, 656, dtype=torch.uint8)
    K.store_mla_rows_fp8_reference(buffer, rows, physical, latent[:, :512], latent[:, 512:])

    nope = latent[:, :512].float().numpy()
    for row, loc in zip(*owned_rows_naive(out_cache_loc, layout.cp_size, layout.cp_rank)):
        assert buffer[loc, 0].tolist() == naive_fp8_row(nope[row], latent[row, 512:]), f"row {row}"
    written = torch.zeros(buffer.shape[0], dtype=torch.bool)
    written[physical] = True
    assert not buffer[~written].any()


# ------------------------------------------------------------------- index store
def naive_index_row(key: np.ndarray):
    amax = max(np.float32(np.max(np.abs(key))), np.float32(1e-4))
    scale = np.float32(amax / np.float32(448.0))
    inv = np.float32(np.float32(1.0) / scale)
    q = [fp8_code(min(max(float(np.float32(x * inv)), -448.0), 448.0)) for x in key]
    return q, list(np.array([scale], dtype=np.float32).view(np.uint8))


@pytest.mark.parametrize("case", CASES)
def test_index_reference_matches_naive_loop(case):
    layout, out_cache_loc, g = _case(*case, seed=11 * sum(case))
    n_rows = out_cache_loc.numel()
    key = (torch.randn(n_rows, 128, generator=g) * 3).bfloat16()
    key[n_rows // 2] = 0  # scale floor 1e-4 / 448
    rows, physical = owned(layout, out_cache_loc)
    pages = int(physical.max()) // PAGE + 1 if physical.numel() else 1
    buffer = torch.zeros(pages, PAGE * 132, dtype=torch.uint8)
    K.store_index_rows_reference(buffer, rows, physical, key)

    expected = torch.zeros_like(buffer)
    flat = expected.view(-1)
    keys = key.float().numpy()
    for row, loc in zip(*owned_rows_naive(out_cache_loc, layout.cp_size, layout.cp_rank)):
        page, slot = divmod(loc, PAGE)
        q, scale_bytes = naive_index_row(keys[row])
        base = page * PAGE * 132
        flat[base + slot * 128: base + slot * 128 + 128] = torch.tensor(q, dtype=torch.uint8)
        flat[base + PAGE * 128 + slot * 4: base + PAGE * 128 + slot * 4 + 4] = torch.tensor(scale_bytes,
                                                                                          dtype=torch.uint8)
    assert torch.equal(buffer, expected)


def test_stores_of_every_row_and_of_nothing():
    key = torch.randn(5, 128).bfloat16()
    a = torch.zeros(2, PAGE * 132, dtype=torch.uint8)
    b = torch.zeros_like(a)
    locs = torch.tensor([64, 70, 71, 100, 127])
    K.store_index_rows_reference(a, None, locs, key)
    K.store_index_rows_reference(b, torch.arange(5), locs, key)
    assert torch.equal(a, b) and a[1].any() and not a[0].any()
    empty = torch.zeros(0, dtype=torch.int64)
    K.store_index_rows_reference(a, empty, empty, key)
    K.store_mla_rows_reference(torch.zeros(4, 1, 576).bfloat16(), empty, empty,
                               torch.zeros(3, 512).bfloat16(), torch.zeros(3, 64).bfloat16())
    with pytest.raises(ValueError):
        K.store_index_rows_reference(a, torch.arange(2), locs, key)


# ---------------------------------------------------------------------- page pack
@pytest.mark.parametrize("words", [1, 33, 1056])
def test_pack_reference_matches_naive_loop(words):
    g = torch.Generator().manual_seed(words)
    shard = torch.randint(-2**62, 2**62, (9, words), dtype=torch.int64, generator=g)
    send = torch.tensor([4, 0, 8, 1, 0])  # padded with the dummy page 0
    packed = K.pack_pages_reference(shard, send)
    for k, page in enumerate(send.tolist()):
        assert torch.equal(packed[k], shard[page])
    out = torch.empty_like(packed)
    assert K.pack_pages_reference(shard, send, out=out) is out and torch.equal(out, packed)
    assert torch.equal(KernelDispatch().pack_pages(shard, send), packed)
    assert K.pack_pages_reference(shard, send[:0]).shape == (0, words)


# ------------------------------------------------------------------- owner copy
def _random_bytes(shape, g):
    return torch.randint(0, 256, shape, dtype=torch.uint8, generator=g)


@pytest.mark.parametrize("row_bytes", [656, 1152])
def test_mla_row_copy_reference_matches_naive_loop(row_bytes):
    g = torch.Generator().manual_seed(row_bytes)
    src, dst = _random_bytes((40, 1, row_bytes), g), _random_bytes((30, 1, row_bytes), g)
    if row_bytes == 1152:  # bf16 rows as the pool holds them
        src, dst = src.view(torch.bfloat16), dst.view(torch.bfloat16)
    src_locs, dst_locs = torch.tensor([3, 39, 0, 17]), torch.tensor([29, 1, 5, 6])
    want = dst.clone()
    for s, d in zip(src_locs.tolist(), dst_locs.tolist()):
        want[d] = src[s]
    K.copy_mla_rows_reference(dst, dst_locs, src, src_locs)
    assert torch.equal(dst.view(torch.uint8), want.view(torch.uint8))
    KernelDispatch().copy_mla_rows(dst, dst_locs[:0], src, src_locs[:0])  # nothing owned: no-op
    with pytest.raises(ValueError):
        K.copy_mla_rows_reference(dst, dst_locs, src, src_locs[:2])


@pytest.mark.parametrize("page_size", [1, 4, 64])
def test_index_row_copy_reference_matches_naive_loop(page_size):
    g = torch.Generator().manual_seed(page_size)
    width = page_size * 132
    src, dst = _random_bytes((7, width), g), _random_bytes((5, width), g)
    src_locs = torch.randperm(7 * page_size, generator=g)[: 3 * page_size]
    dst_locs = torch.randperm(5 * page_size, generator=g)[: 3 * page_size]
    want = dst.clone()
    for s, d in zip(src_locs.tolist(), dst_locs.tolist()):  # K bytes, then the scale, of one token
        sp, ss, dp, ds = s // page_size, s % page_size, d // page_size, d % page_size
        want[dp, ds * 128: ds * 128 + 128] = src[sp, ss * 128: ss * 128 + 128]
        base = page_size * 128
        want[dp, base + ds * 4: base + ds * 4 + 4] = src[sp, base + ss * 4: base + ss * 4 + 4]
    KernelDispatch().copy_index_rows(dst, dst_locs, src, src_locs, page_size)
    assert torch.equal(dst, want)


# -------------------------------------------------------------------- page remap
@pytest.mark.parametrize("n", range(1, 9))
def test_page_inverse_and_remap_match_naive_loop(n):
    from sglang_cp_shared_kv.forward.dense_layout import build_dense_page_map

    g = torch.Generator().manual_seed(n)
    layout = CpSharedKVLayout(PAGE, n, n - 1)
    num_logical_pages = 40 * n
    seq_pages = torch.randperm(num_logical_pages - 1, generator=g)[: 5 * n + 3] + 1
    page_map = build_dense_page_map(layout, seq_pages, history_pages=2 * n)
    inverse = K.build_page_inverse_reference(seq_pages, page_map.dense_page, num_logical_pages)
    naive = {p: d for p, d in zip(seq_pages.tolist(), page_map.dense_page.tolist())}
    assert inverse.tolist() == [naive.get(p, 0) for p in range(num_logical_pages)]

    # a page table (logical locations of the sequence, then padding) and top-k rows
    positions = torch.arange(seq_pages.numel() * PAGE - 17)  # partial last page
    table = seq_pages[positions // PAGE] * PAGE + positions % PAGE
    topk = torch.cat([table[torch.randperm(table.numel(), generator=g)[:50]], torch.full((14,), -1)])
    stray = torch.tensor([0, 5, num_logical_pages * PAGE + 3])  # dummy page, unknown page, off the table
    for locs, dtype in ((table, torch.int32), (topk.view(2, 32), torch.int32), (stray, torch.int64)):
        locs = locs.to(dtype)
        remapped = K.remap_locs_reference(locs, inverse, PAGE)
        expected = [-1 if loc < 0 else naive.get(loc // PAGE, 0) * PAGE + loc % PAGE
                    for loc in locs.flatten().tolist()]
        assert remapped.dtype == dtype and remapped.flatten().tolist() == expected
        assert torch.equal(KernelDispatch().remap_locs(locs, inverse, PAGE), remapped)
    # the page table remaps to exactly the dense token table the batch state builds
    dense_table = page_map.dense_token_table(positions.numel(), positions.numel())
    assert torch.equal(K.remap_locs_reference(table, inverse, PAGE), dense_table)
    # page-level tables (real_page_table) with page_size 1
    assert torch.equal(K.remap_locs_reference(seq_pages, inverse, 1), page_map.dense_page)
    assert torch.equal(KernelDispatch().build_page_inverse(seq_pages, page_map.dense_page, num_logical_pages), inverse)


# ------------------------------------------------------------------------ rerange
def zigzag_metadata(total, n):
    """The in-seq-split metadata lists for ``total`` tokens over ``n`` ranks, from the
    split's definition: 2n blocks as equal as possible (the first ``total % 2n`` one row
    longer), rank r holds blocks r and 2n-1-r, each rank's rows padded to ceil(total/n)."""
    q, extra = divmod(total, 2 * n)
    blocks = [q + (j < extra) for j in range(2 * n)]
    max_len = -(-total // n)
    return dict(max_rank_len=[max_len] * n,
                per_rank_actual_token=[blocks[r] + blocks[2 * n - 1 - r] for r in range(n)],
                reverse_split_len=[blocks[j] for r in range(n) for j in (r, 2 * n - 1 - r)],
                cp_reverse_index=[2 * r for r in range(n)] + [2 * (n - 1 - r) + 1 for r in range(n)]), blocks


def naive_rerange(gathered, total, n):
    _, blocks = zigzag_metadata(total, n)
    max_len = -(-total // n)
    out = []
    for j in range(2 * n):  # sequence order
        rank = j if j < n else 2 * n - 1 - j
        offset = 0 if j < n else blocks[rank]
        out += [gathered[rank * max_len + offset + i] for i in range(blocks[j])]
    return torch.stack(out) if out else gathered[:0]


@pytest.mark.parametrize("n", range(1, 9))
@pytest.mark.parametrize("total", [1, 7, 16, 101])
def test_rerange_reference_matches_naive_zigzag(n, total):
    meta, _ = zigzag_metadata(total, n)
    rows = n * -(-total // n)
    gathered = torch.randn(rows, 3, 5).bfloat16()
    expected = naive_rerange(gathered, total, n)
    assert torch.equal(K.rerange_in_seq_reference(gathered, **meta), expected)
    segments = K.in_seq_segments(**meta)
    covered = sorted(d + i for _, d, length in segments for i in range(length))
    assert covered == list(range(total)), "the segments cover every output row once"
    assert all(length > 0 for *_, length in segments)


def test_rerange_fallback_and_segment_cache():
    from types import SimpleNamespace

    meta_lists, _ = zigzag_metadata(50, 4)
    metadata = SimpleNamespace(**meta_lists)
    gathered = torch.randn(4 * 13, 8)
    expected = K.rerange_in_seq_reference(gathered, **meta_lists)
    assert torch.equal(KernelDispatch().rerange_in_seq(gathered, metadata), expected)
    out = torch.empty_like(expected)
    assert KernelDispatch().rerange_in_seq(gathered, metadata, out=out) is out and torch.equal(out, expected)
