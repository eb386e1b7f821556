"""Fused owner store of NSA indexer keys into SGLang's paged index K/scale buffer.

Quantises row ``rows[i]`` of ``key`` (128 values) to fp8 with one fp32 scale and writes
both at token location ``locs[i]``, in one launch, no host synchronisation. With the
owned rows and their physical locations it replaces ``index_select`` of the owned keys
followed by SGLang's ``Indexer._store_index_k_cache``; with ``rows=None`` it stores every
key (the current chunk into the dense scratch).

Buffer layout (SGLang's ``NSATokenToKVPool.index_k_with_scale_buffer``, one row per page
of P = 64 tokens): P x 128 fp8 K bytes, then P x 4 bytes of fp32 scales.

Quantisation, as SGLang's fused CUDA store (the path SGLang takes on CUDA) computes it,
with IEEE divisions: scale = max(max|x|, 1e-4) / 448, q = clamp(x * (1 / scale), ±448)
rounded to nearest-even fp8 e4m3.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from sglang_cp_shared_kv.pool.kv_geometry import NSA_INDEX_HEAD_DIM, PAGE_SIZE
from sglang_cp_shared_kv_kernel._rows import source_rows

HEAD_DIM = NSA_INDEX_HEAD_DIM
FP8_MAX = 448.0
MIN_AMAX = 1e-4


def _check(index_buffer, rows, locs, key, page_size) -> int:
    n = locs.numel()
    if index_buffer.dtype != torch.uint8 or index_buffer.dim() != 2 or not index_buffer.is_contiguous() \
            or index_buffer.shape[1] != page_size * (HEAD_DIM + 4):
        raise ValueError(f"the index buffer must be contiguous uint8 (pages, {page_size * (HEAD_DIM + 4)}), "
                         f"got {tuple(index_buffer.shape)} {index_buffer.dtype}")
    if key.shape[-1] != HEAD_DIM:
        raise ValueError(f"index keys have {HEAD_DIM} values, got {key.shape[-1]}")
    if rows is not None and rows.numel() != n:
        raise ValueError(f"rows ({rows.numel()}) and locs ({n}) differ in length")
    if rows is None and key.numel() // HEAD_DIM != n:
        raise ValueError(f"rows=None stores every key: {key.numel() // HEAD_DIM} keys for {n} locs")
    return n


@triton.jit
def _store_index_rows_kernel(
    q_ptr, s_ptr, rows_ptr, locs_ptr, key_ptr, n, key_stride,
    PAGE_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr, HAS_ROWS: tl.constexpr, BLOCK_ROWS: tl.constexpr,
    MIN_AMAX: tl.constexpr, FP8_MAX: tl.constexpr,
):
    i = tl.program_id(0) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    live = i < n
    src = source_rows(rows_ptr, i, live, HAS_ROWS)
    loc = tl.load(locs_ptr + i, mask=live, other=0).to(tl.int64)
    page, slot = loc // PAGE_SIZE, loc % PAGE_SIZE
    c = tl.arange(0, HEAD_DIM)
    x = tl.load(key_ptr + src[:, None] * key_stride + c[None, :], mask=live[:, None], other=0.0).to(tl.float32)
    # IEEE divisions (div_rn), as the CUDA store compiles them; Triton's `/` is approximate.
    scale = tl.div_rn(tl.maximum(tl.max(tl.abs(x), axis=1), MIN_AMAX), tl.full([BLOCK_ROWS], FP8_MAX, tl.float32))
    inv = tl.div_rn(tl.full([BLOCK_ROWS], 1.0, tl.float32), scale)
    q = tl.clamp(x * inv[:, None], -FP8_MAX, FP8_MAX).to(q_ptr.dtype.element_ty)
    page_bytes = PAGE_SIZE * (HEAD_DIM + 4)
    tl.store(q_ptr + (page * page_bytes + slot * HEAD_DIM)[:, None] + c[None, :], q, mask=live[:, None])
    tl.store(s_ptr + page * (page_bytes // 4) + PAGE_SIZE * HEAD_DIM // 4 + slot, scale, mask=live)


def store_index_rows(index_buffer: torch.Tensor, rows: Optional[torch.Tensor], locs: torch.Tensor,
                     key: torch.Tensor, page_size: int = PAGE_SIZE) -> None:
    """Quantise ``key[rows[i]]`` and store K and scale at token location ``locs[i]``.

    ``index_buffer``: (pages, page_size * 132) uint8; ``key``: (n, 128) (or reshapeable)
    bf16 / fp16 / fp32; ``rows``: row indices or None (every row); ``locs``: int32/int64.
    """
    n = _check(index_buffer, rows, locs, key, page_size)
    if n == 0:
        return
    key = key.reshape(-1, HEAD_DIM)
    if key.stride(1) != 1:
        key = key.contiguous()
    flat = index_buffer.view(-1)
    block_rows = 8
    _store_index_rows_kernel[(triton.cdiv(n, block_rows),)](
        flat.view(torch.float8_e4m3fn), flat.view(torch.float32), rows if rows is not None else locs, locs,
        key, n, key.stride(0), PAGE_SIZE=page_size, HEAD_DIM=HEAD_DIM, HAS_ROWS=rows is not None,
        BLOCK_ROWS=block_rows, MIN_AMAX=MIN_AMAX, FP8_MAX=FP8_MAX, num_warps=4,
    )


def quantize_index_k_reference(key: torch.Tensor):
    """(fp8 K (n, 128), fp32 scale (n,)) of ``key``, torch only, IEEE divisions."""
    x = key.reshape(-1, HEAD_DIM).float()
    # tensor / tensor: a python-scalar divisor becomes a multiply by its reciprocal on CUDA
    scale = x.abs().amax(-1).clamp_min(MIN_AMAX) / torch.full((), FP8_MAX, device=x.device)
    q = (x * torch.reciprocal(scale)[:, None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q, scale


def store_index_rows_reference(index_buffer, rows, locs, key, page_size: int = PAGE_SIZE) -> None:
    """Torch reference of :func:`store_index_rows`."""
    n = _check(index_buffer, rows, locs, key, page_size)
    if n == 0:
        return
    key = key.reshape(-1, HEAD_DIM)
    if rows is not None:
        key = key.index_select(0, rows)
    q, scale = quantize_index_k_reference(key)
    locs = locs.long()
    page, slot = locs // page_size, locs % page_size
    k_area = index_buffer[:, : page_size * HEAD_DIM].view(-1, page_size, HEAD_DIM)
    k_area[page, slot] = q.view(torch.uint8)
    s_area = index_buffer[:, page_size * HEAD_DIM:].view(-1, page_size, 4)
    s_area[page, slot] = scale.view(torch.uint8).view(n, 4)
