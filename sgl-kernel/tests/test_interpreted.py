"""Each Triton kernel against its torch reference, run by Triton's interpreter on CPU
tensors (``TRITON_INTERPRET=1``; test/unit/test_kernel_triton_interpreter.py runs this
file in a subprocess with it set). Shapes stay small: the interpreter runs every
program in Python.

Two interpreter artefacts are handled here rather than in the kernels:

* its float32 -> fp8 cast rounds half-up without carrying into the exponent; the cast
  is replaced by torch's round-to-nearest-even, which is what the GPU's
  ``cvt.rn.satfinite.e4m3x2.f32`` does for the clamped values the kernels convert;
* its clamp keeps NaN where the GPU's ``min.xorsign.abs`` returns the bound, so the
  all-zero nope tile (0 * inf) is left to the GPU tests.
"""

import os
from importlib.util import find_spec, module_from_spec, spec_from_file_location
from pathlib import Path

import numpy as np
import pytest
import torch

if os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("needs TRITON_INTERPRET=1 (see test/unit/test_kernel_triton_interpreter.py)",
                allow_module_level=True)

import triton.language as tl  # noqa: E402
import triton.runtime.interpreter as interpreter  # noqa: E402

_interpreter_convert_float = interpreter._convert_float


def _convert_float_rne(data, input_dtype, output_dtype, rounding_mode):
    if output_dtype == tl.float8e4nv and input_dtype == tl.float32:
        as_f32 = torch.from_numpy(np.ascontiguousarray(data, dtype=np.float32))
        return as_f32.to(torch.float8_e4m3fn).view(torch.uint8).numpy()
    return _interpreter_convert_float(data, input_dtype, output_dtype, rounding_mode)


interpreter._convert_float = _convert_float_rne

import sglang_cp_shared_kv_kernel as K  # noqa: E402
from sglang_cp_shared_kv.pool.kv_geometry import PAGE_SIZE as PAGE  # noqa: E402

np.seterr(all="ignore")  # masked-out lanes divide by zero in numpy


def _owned(n, rank, locs):
    page = locs // PAGE
    owned = (page > 0) & ((page - 1) % n == rank)
    rows = owned.nonzero().squeeze(1)
    return rows, ((page[rows] - 1) // n + 1) * PAGE + locs[rows] % PAGE


def _chunk(n_rows, seed):
    g = torch.Generator().manual_seed(seed)
    pages = -(-n_rows // PAGE) + 1
    seq_pages = torch.randperm(6 * pages, generator=g)[:pages] + 1
    positions = torch.arange(n_rows) + 5  # the chunk starts inside its first page
    return seq_pages[positions // PAGE] * PAGE + positions % PAGE, g


def _top(locs):
    return int(locs.max()) if locs.numel() else 0


def _buffers(shape, dtype):
    return torch.zeros(shape, dtype=dtype), torch.zeros(shape, dtype=dtype)


@pytest.mark.parametrize("n,rank", [(1, 0), (3, 2), (8, 5)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_store_mla_rows(n, rank, dtype):
    locs, g = _chunk(40, seed=n)
    latent = torch.randn(40, 576, generator=g).to(dtype)
    k_nope, k_rope = latent[:, :512].unsqueeze(1), latent[:, 512:].unsqueeze(1)
    rows, physical = _owned(n, rank, locs)
    ours, ref = _buffers((_top(physical) + PAGE, 1, 576), dtype)
    K.store_mla_rows(ours, rows, physical, k_nope, k_rope)
    K.store_mla_rows_reference(ref, rows, physical, k_nope, k_rope)
    assert torch.equal(ours.view(torch.uint8), ref.view(torch.uint8))
    # every row (the dense chunk write), int32 locations
    dense = torch.randperm(60, generator=g)[:40].to(torch.int32)
    ours.zero_(), ref.zero_()
    K.store_mla_rows(ours, None, dense, k_nope, k_rope)
    K.store_mla_rows_reference(ref, None, dense, k_nope, k_rope)
    assert torch.equal(ours.view(torch.uint8), ref.view(torch.uint8))


def test_store_mla_rows_casts_like_sglang():
    k = torch.randn(6, 576)
    ours, ref = _buffers((8, 1, 576), torch.bfloat16)
    locs = torch.tensor([7, 1, 2, 3, 4, 5])
    K.store_mla_rows(ours, None, locs, k[:, :512], k[:, 512:])
    K.store_mla_rows_reference(ref, None, locs, k[:, :512], k[:, 512:])
    assert torch.equal(ours.view(torch.uint8), ref.view(torch.uint8))


@pytest.mark.parametrize("n,rank", [(1, 0), (4, 1), (8, 7)])
def test_store_mla_rows_fp8(n, rank):
    locs, g = _chunk(24, seed=10 + n)
    latent = (torch.randn(24, 576, generator=g) * torch.logspace(-4, 4, 24)[:, None]).bfloat16()
    rows, physical = _owned(n, rank, locs)
    ours, ref = _buffers((_top(physical) + PAGE, 1, 656), torch.uint8)
    K.store_mla_rows_fp8(ours, rows, physical, latent[:, :512], latent[:, 512:])
    K.store_mla_rows_fp8_reference(ref, rows, physical, latent[:, :512], latent[:, 512:])
    assert torch.equal(ours, ref)
    ours.zero_(), ref.zero_()
    dense = torch.arange(24) * 2 + 1
    K.store_mla_rows_fp8(ours, None, dense, latent[:, :512].unsqueeze(1), latent[:, 512:].unsqueeze(1))
    K.store_mla_rows_fp8_reference(ref, None, dense, latent[:, :512], latent[:, 512:])
    assert torch.equal(ours, ref)


def _sglang_quantizer():
    """SGLang's fp8 MLA quantiser module, loaded from its file (torch + triton only)."""
    path = Path(find_spec("sglang").origin).parent / "srt/layers/attention/nsa/quant_k_cache.py"
    spec = spec_from_file_location("_sglang_quant_k_cache", path)
    module = module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_store_mla_rows_fp8_equals_sglang_quantizer():
    """The same float operations as SGLang's Triton quantiser, interpreted side by side."""
    g = torch.Generator().manual_seed(5)
    latent = (torch.randn(8, 576, generator=g) * torch.logspace(-3, 3, 8)[:, None]).bfloat16()
    nope_part, rope_part = _sglang_quantizer().quantize_k_cache_separate(latent[:, :512], latent[:, 512:])
    theirs = torch.cat([nope_part.squeeze(1), rope_part.squeeze(1)], 1)
    ours = torch.zeros(8, 1, 656, dtype=torch.uint8)
    K.store_mla_rows_fp8(ours, None, torch.arange(8), latent[:, :512], latent[:, 512:])
    assert torch.equal(ours.squeeze(1), theirs)


@pytest.mark.parametrize("n,rank", [(2, 0), (5, 3), (8, 0)])
def test_store_index_rows(n, rank):
    locs, g = _chunk(50, seed=20 + n)
    key = (torch.randn(50, 128, generator=g) * torch.logspace(-6, 2, 50)[:, None]).bfloat16()
    key[7] = 0
    rows, physical = _owned(n, rank, locs)
    pages = _top(physical) // PAGE + 1
    ours, ref = _buffers((pages, PAGE * 132), torch.uint8)
    K.store_index_rows(ours, rows, physical, key)
    K.store_index_rows_reference(ref, rows, physical, key)
    assert torch.equal(ours, ref)
    ours.zero_(), ref.zero_()
    dense = torch.randperm(pages * PAGE, generator=g)[:50]
    K.store_index_rows(ours, None, dense, key)
    K.store_index_rows_reference(ref, None, dense, key)
    assert torch.equal(ours, ref)


@pytest.mark.parametrize("words", [3, 1056])
def test_pack_pages(words):
    g = torch.Generator().manual_seed(words)
    shard = torch.randint(-2**62, 2**62, (9, words), dtype=torch.int64, generator=g)
    send = torch.tensor([4, 0, 8, 2, 0])
    assert torch.equal(K.pack_pages(shard, send), K.pack_pages_reference(shard, send))
    dense = torch.zeros(12, words, dtype=torch.int64)
    K.pack_pages(shard, send, out=dense[3:8])  # straight into a rank's slice of the gather output
    assert torch.equal(dense[3:8], shard[send]) and not dense[:3].any() and not dense[8:].any()


@pytest.mark.parametrize("row_bytes", [656, 1152])
def test_copy_mla_rows(row_bytes):
    g = torch.Generator().manual_seed(row_bytes)
    src = torch.randint(0, 256, (40, 1, row_bytes), dtype=torch.uint8, generator=g)
    ours = torch.randint(0, 256, (30, 1, row_bytes), dtype=torch.uint8, generator=g)
    ref = ours.clone()
    src_locs, dst_locs = torch.tensor([3, 39, 0, 17, 8]), torch.tensor([29, 1, 5, 6, 0])
    K.copy_mla_rows(ours, dst_locs, src, src_locs)
    K.copy_mla_rows_reference(ref, dst_locs, src, src_locs)
    assert torch.equal(ours, ref)


def test_copy_index_rows():
    g = torch.Generator().manual_seed(5)
    src = torch.randint(0, 256, (4, PAGE * 132), dtype=torch.uint8, generator=g)
    ours = torch.randint(0, 256, (3, PAGE * 132), dtype=torch.uint8, generator=g)
    ref = ours.clone()
    src_locs, dst_locs = torch.randperm(4 * PAGE, generator=g)[:70], torch.randperm(3 * PAGE, generator=g)[:70]
    K.copy_index_rows(ours, dst_locs, src, src_locs)
    K.copy_index_rows_reference(ref, dst_locs, src, src_locs)
    assert torch.equal(ours, ref)


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
def test_page_inverse_and_remap(dtype):
    g = torch.Generator().manual_seed(1)
    seq_pages = torch.randperm(199, generator=g)[:37] + 1
    dense_page = torch.randperm(37, generator=g) + 1
    inverse = K.build_page_inverse(seq_pages, dense_page, 200)
    assert torch.equal(inverse, K.build_page_inverse_reference(seq_pages, dense_page, 200))
    locs = seq_pages[torch.randint(0, 37, (3, 700), generator=g)] * PAGE + torch.randint(0, PAGE, (3, 700))
    locs[:, -50:] = -1
    locs[0, :3] = torch.tensor([0, 5 * PAGE + 1, 300 * PAGE])  # dummy page, (maybe) unknown page, off table
    locs = locs.to(dtype)
    assert torch.equal(K.remap_locs(locs, inverse, PAGE), K.remap_locs_reference(locs, inverse, PAGE))
    assert torch.equal(K.remap_locs(seq_pages, inverse, 1), dense_page)


def _zigzag(total, n):
    q, extra = divmod(total, 2 * n)
    blocks = [q + (j < extra) for j in range(2 * n)]
    return dict(max_rank_len=[-(-total // n)] * n,
                per_rank_actual_token=[blocks[r] + blocks[2 * n - 1 - r] for r in range(n)],
                reverse_split_len=[blocks[j] for r in range(n) for j in (r, 2 * n - 1 - r)],
                cp_reverse_index=[2 * r for r in range(n)] + [2 * (n - 1 - r) + 1 for r in range(n)])


@pytest.mark.parametrize("n", [1, 2, 3, 8])
@pytest.mark.parametrize("row_shape,dtype", [((1, 576), torch.bfloat16), ((3,), torch.bfloat16),
                                             ((5,), torch.uint8), ((4,), torch.float32)])
def test_rerange(n, row_shape, dtype):
    total = 37 if n < 8 else 13  # 13 < 2 * 8: some blocks are empty
    meta = _zigzag(total, n)
    gathered = torch.randint(0, 100, (sum(meta["max_rank_len"]), *row_shape)).to(dtype)
    expected = K.rerange_in_seq_reference(gathered, **meta)
    assert torch.equal(K.rerange_in_seq(gathered, **meta), expected)
