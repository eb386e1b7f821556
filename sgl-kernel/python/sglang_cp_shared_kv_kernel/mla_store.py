"""Fused owner store of MLA latent rows.

Writes row ``rows[i]`` of (``k_nope`` | ``k_rope``) to row ``locs[i]`` of one layer's KV
buffer, in one launch, with no host synchronisation and no intermediate copy. With
``rows`` = the rows of ``out_cache_loc`` a CP rank owns and ``locs`` = their physical
locations, it replaces ``index_select`` of the owned rows followed by SGLang's
``MLATokenToKVPool.set_mla_kv_buffer``; with ``rows=None`` it stores every row (the
current chunk into the dense scratch).

Two row formats, as SGLang's NSA pool stores them:

* bf16 / fp16 (:func:`store_mla_rows`): 576 values, ``[nope 512 | rope 64]``, copied as
  wide words;
* packed fp8 (:func:`store_mla_rows_fp8`): 656 bytes, ``[512 fp8 nope | 4 fp32 tile
  scales | 64 bf16 rope]``. Each 128-value nope tile is quantised exactly as SGLang's
  ``quantize_k_cache_separate`` does it (same float operations in the same order, so the
  same bits on the same GPU): scale = max|x| / 448, x * (1 / scale) clamped to
  [-448, 448], rounded to nearest-even fp8 e4m3.

Note on bit-compatibility: Triton compiles fp32 ``/`` to the approximate
``div.full.f32``; on sm90 ptxas turns ``max|x| / 448`` into a multiply by fp32(1/448) and
``1 / scale`` into the hardware reciprocal (``MUFU.RCP``, within 1 ulp, not always
correctly rounded). SGLang's quantiser does the same, so this kernel writes SGLang's
bytes. The torch reference below divides exactly (IEEE): on a GPU its scales and, at
rare rounding ties, its fp8 codes can differ from the kernel's by one step. On a CPU
(and under the Triton interpreter) both divide exactly and agree bit for bit.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from sglang_cp_shared_kv.pool.kv_geometry import NOPE_FP8_GROUP, NSA_KV_LORA_RANK, NSA_QK_ROPE_HEAD_DIM, mla_row_bytes
from sglang_cp_shared_kv_kernel._rows import source_rows
from sglang_cp_shared_kv_kernel._words import int64_rows, same_word_views

NOPE_DIM = NSA_KV_LORA_RANK
ROPE_DIM = NSA_QK_ROPE_HEAD_DIM
TILE = NOPE_FP8_GROUP  # values per fp8 scale
FP8_MAX = 448.0  # largest finite float8_e4m3fn
FP8_NOPE_BYTES = NOPE_DIM  # one byte per value
FP8_SCALE_BYTES = NOPE_DIM // TILE * 4
FP8_ROPE_BYTES = ROPE_DIM * 2  # bf16
FP8_ROW_BYTES = mla_row_bytes("fp8_e4m3")  # 656 = the three parts above
assert FP8_ROW_BYTES == FP8_NOPE_BYTES + FP8_SCALE_BYTES + FP8_ROPE_BYTES


def _check_rows(rows, locs, k_nope, k_rope) -> int:
    n = locs.numel()
    if rows is not None and rows.numel() != n:
        raise ValueError(f"rows ({rows.numel()}) and locs ({n}) differ in length")
    if k_nope.shape[0] != k_rope.shape[0]:
        raise ValueError(f"k_nope has {k_nope.shape[0]} rows, k_rope {k_rope.shape[0]}")
    if rows is None and k_nope.shape[0] != n:
        raise ValueError(f"rows=None stores every row: {k_nope.shape[0]} rows for {n} locs")
    return n


# ---------------------------------------------------------------- bf16 / fp16 rows
@triton.jit
def _store_mla_rows_kernel(
    buf_ptr, rows_ptr, locs_ptr, nope_ptr, rope_ptr, n, nope_stride, rope_stride,
    NOPE_WORDS: tl.constexpr, ROPE_WORDS: tl.constexpr,
    NOPE_BLOCK: tl.constexpr, ROPE_BLOCK: tl.constexpr,
    HAS_ROWS: tl.constexpr, BLOCK_ROWS: tl.constexpr,
):
    i = tl.program_id(0) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    live = i < n
    src = source_rows(rows_ptr, i, live, HAS_ROWS)
    dst = tl.load(locs_ptr + i, mask=live, other=0).to(tl.int64) * (NOPE_WORDS + ROPE_WORDS)
    wn = tl.arange(0, NOPE_BLOCK)
    wr = tl.arange(0, ROPE_BLOCK)
    # Column masks only where a part is not a power of two wide (never for 512 + 64):
    # a mask that varies along the row stops the compiler from using 16-byte accesses.
    if NOPE_BLOCK == NOPE_WORDS:
        mn = live[:, None]
    else:
        mn = live[:, None] & (wn[None, :] < NOPE_WORDS)
    if ROPE_BLOCK == ROPE_WORDS:
        mr = live[:, None]
    else:
        mr = live[:, None] & (wr[None, :] < ROPE_WORDS)
    # Both loads before either store: the store may alias the source as far as the
    # compiler knows, so storing first would serialise the two round trips.
    nope = tl.load(nope_ptr + src[:, None] * nope_stride + wn[None, :], mask=mn)
    rope = tl.load(rope_ptr + src[:, None] * rope_stride + wr[None, :], mask=mr)
    tl.store(buf_ptr + dst[:, None] + wn[None, :], nope, mask=mn)
    tl.store(buf_ptr + dst[:, None] + NOPE_WORDS + wr[None, :], rope, mask=mr)


# Launch shape: 4-32 rows per program with 4-8 warps measured within 5 % of each other on
# the H200 (2026-11-29, 8K-128K rows; 64 x 8 up to 12 % slower); 16 x 4 was the fastest
# at 8K and 32K rows.
STORE_BLOCK_ROWS = 16
STORE_NUM_WARPS = 4


def store_mla_rows(kv_buffer: torch.Tensor, rows: Optional[torch.Tensor], locs: torch.Tensor,
                   k_nope: torch.Tensor, k_rope: torch.Tensor) -> None:
    """``kv_buffer[locs[i]] = [k_nope[rows[i]] | k_rope[rows[i]]]`` (bf16/fp16 rows).

    ``kv_buffer``: (slots, 1, nope + rope) of the pool's element type; ``k_nope`` /
    ``k_rope``: (n, [1,] dim) rows, cast to that type first if they differ (as SGLang
    does); ``rows``: int32/int64 row indices or None (every row); ``locs``: int32/int64.
    """
    n = _check_rows(rows, locs, k_nope, k_rope)
    if not kv_buffer.is_floating_point():
        raise ValueError(f"pass the buffer as its element type (a {kv_buffer.dtype} buffer holds packed or "
                         "viewed rows: use store_mla_rows_fp8, or view it as the pool's dtype)")
    if n == 0:
        return
    if k_nope.dtype != kv_buffer.dtype:
        k_nope, k_rope = k_nope.to(kv_buffer.dtype), k_rope.to(kv_buffer.dtype)
    buf, nope, rope = same_word_views(kv_buffer, k_nope, k_rope,
                                      num_rows=(kv_buffer.shape[0], k_nope.shape[0], k_rope.shape[0]))
    if buf.shape[1] != nope.shape[1] + rope.shape[1]:
        raise ValueError(f"buffer rows of {kv_buffer.shape[-1]} values cannot hold "
                         f"{k_nope.shape[-1]} + {k_rope.shape[-1]}")
    _store_mla_rows_kernel[(triton.cdiv(n, STORE_BLOCK_ROWS),)](
        buf, rows if rows is not None else locs, locs, nope, rope, n, nope.stride(0), rope.stride(0),
        NOPE_WORDS=nope.shape[1], ROPE_WORDS=rope.shape[1],
        NOPE_BLOCK=triton.next_power_of_2(nope.shape[1]), ROPE_BLOCK=triton.next_power_of_2(rope.shape[1]),
        HAS_ROWS=rows is not None, BLOCK_ROWS=STORE_BLOCK_ROWS, num_warps=STORE_NUM_WARPS,
    )


def store_mla_rows_reference(kv_buffer, rows, locs, k_nope, k_rope) -> None:
    """Torch reference of :func:`store_mla_rows`."""
    n = _check_rows(rows, locs, k_nope, k_rope)
    if n == 0:
        return
    nope, rope = k_nope.reshape(k_nope.shape[0], -1), k_rope.reshape(k_rope.shape[0], -1)
    if rows is not None:
        nope, rope = nope.index_select(0, rows), rope.index_select(0, rows)
    kv_buffer.view(kv_buffer.shape[0], -1)[locs] = torch.cat([nope, rope], 1).to(kv_buffer.dtype)


# ------------------------------------------------------------------ packed fp8 rows
@triton.jit
def _store_mla_rows_fp8_kernel(
    q_ptr, s_ptr, rope_out_ptr, rows_ptr, locs_ptr, nope_ptr, rope_ptr, n, nope_stride, rope_stride,
    ROW_BYTES: tl.constexpr, NOPE_DIM: tl.constexpr, TILE: tl.constexpr,
    ROPE_WORDS: tl.constexpr, HAS_ROWS: tl.constexpr, BLOCK_ROWS: tl.constexpr,
    FP8_MIN: tl.constexpr, FP8_MAX: tl.constexpr,
):
    TILES: tl.constexpr = NOPE_DIM // TILE
    # nope: BLOCK_ROWS * TILES tiles of TILE values, one tile per line of the block
    t = tl.arange(0, BLOCK_ROWS * TILES)
    i = tl.program_id(0) * BLOCK_ROWS + t // TILES
    tile = t % TILES
    live = i < n
    src = source_rows(rows_ptr, i, live, HAS_ROWS)
    dst = tl.load(locs_ptr + i, mask=live, other=0).to(tl.int64)
    c = tl.arange(0, TILE)
    y = tl.load(nope_ptr + src[:, None] * nope_stride + (tile * TILE)[:, None] + c[None, :],
                mask=live[:, None], other=0.0).to(tl.float32)
    # SGLang's quantiser, operation for operation (the division is div.full.f32 in both)
    y_s = tl.max(tl.abs(y), axis=1) / FP8_MAX
    y_s_inv = 1.0 / y_s
    y_q = tl.clamp(y * y_s_inv[:, None], FP8_MIN, FP8_MAX).to(q_ptr.dtype.element_ty)
    tl.store(q_ptr + dst[:, None] * ROW_BYTES + (tile * TILE)[:, None] + c[None, :], y_q,
             mask=live[:, None])
    tl.store(s_ptr + dst * (ROW_BYTES // 4) + NOPE_DIM // 4 + tile, y_s, mask=live)

    # rope: raw bf16 bytes, moved as words
    r = tl.program_id(0) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    live = r < n
    src = source_rows(rows_ptr, r, live, HAS_ROWS)
    dst = tl.load(locs_ptr + r, mask=live, other=0).to(tl.int64)
    w = tl.arange(0, ROPE_WORDS)
    words = tl.load(rope_ptr + src[:, None] * rope_stride + w[None, :], mask=live[:, None])
    tl.store(rope_out_ptr + dst[:, None] * (ROW_BYTES // 8) + (NOPE_DIM + TILES * 4) // 8 + w[None, :],
             words, mask=live[:, None])


def _check_fp8_operands(kv_buffer, k_nope, k_rope):
    if kv_buffer.dtype != torch.uint8 or kv_buffer.shape[-1] != FP8_ROW_BYTES or not kv_buffer.is_contiguous():
        raise ValueError(f"packed fp8 rows need a contiguous uint8 buffer of {FP8_ROW_BYTES}-byte rows, "
                         f"got {tuple(kv_buffer.shape)} {kv_buffer.dtype}")
    if k_nope.shape[-1] != NOPE_DIM or k_rope.shape[-1] != ROPE_DIM:
        raise ValueError(f"packed fp8 rows need nope {NOPE_DIM} / rope {ROPE_DIM}, "
                         f"got {k_nope.shape[-1]} / {k_rope.shape[-1]}")


def store_mla_rows_fp8(kv_buffer: torch.Tensor, rows: Optional[torch.Tensor], locs: torch.Tensor,
                       k_nope: torch.Tensor, k_rope: torch.Tensor) -> None:
    """Quantise and store rows in SGLang's packed fp8 NSA layout (656-byte rows).

    ``kv_buffer``: (slots, 1, 656) uint8; ``k_nope``: (n, [1,] 512) bf16 (fp16/fp32 are
    read as they are); ``k_rope``: (n, [1,] 64), stored as bf16.
    """
    n = _check_rows(rows, locs, k_nope, k_rope)
    _check_fp8_operands(kv_buffer, k_nope, k_rope)
    if n == 0:
        return
    nope = k_nope.reshape(k_nope.shape[0], NOPE_DIM)
    if nope.stride(1) != 1:
        nope = nope.contiguous()
    # SGLang writes the rope through a bf16 view: other types are converted, then copied.
    rope = k_rope.reshape(k_rope.shape[0], ROPE_DIM).to(torch.bfloat16)
    rope_words = int64_rows(rope)
    flat = kv_buffer.view(-1)
    block_rows = 4  # 16 tiles of 128 values per program
    _store_mla_rows_fp8_kernel[(triton.cdiv(n, block_rows),)](
        flat.view(torch.float8_e4m3fn), flat.view(torch.float32), flat.view(torch.int64),
        rows if rows is not None else locs, locs, nope, rope_words, n, nope.stride(0), rope_words.stride(0),
        ROW_BYTES=FP8_ROW_BYTES, NOPE_DIM=NOPE_DIM, TILE=TILE, ROPE_WORDS=FP8_ROPE_BYTES // 8,
        HAS_ROWS=rows is not None, BLOCK_ROWS=block_rows,
        FP8_MIN=-FP8_MAX, FP8_MAX=FP8_MAX, num_warps=4,
    )


def quantize_mla_fp8_reference(k_nope: torch.Tensor, k_rope: torch.Tensor) -> torch.Tensor:
    """(n, 656) uint8 packed rows of ``k_nope`` (n, 512) / ``k_rope`` (n, 64), torch only."""
    n = k_nope.shape[0]
    tiles = k_nope.reshape(n, NOPE_DIM // TILE, TILE).float()
    # Divide tensor by tensor: torch turns `t / 448.0` into `t * (1 / 448.0)` on CUDA.
    scale = tiles.abs().amax(-1) / torch.full((), FP8_MAX, device=tiles.device)
    q = tiles * torch.reciprocal(scale)[..., None]
    # An all-zero tile gives 0 * inf = NaN; the GPU clamp (min.xorsign.abs, which returns
    # the non-NaN operand) makes it +448, and so does this.
    q = torch.where(q.isnan(), FP8_MAX, q).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    rope = k_rope.reshape(n, ROPE_DIM).to(torch.bfloat16)
    return torch.cat([q.view(torch.uint8).reshape(n, NOPE_DIM), scale.view(torch.uint8).reshape(n, -1),
                      rope.view(torch.uint8).reshape(n, -1)], 1)


def store_mla_rows_fp8_reference(kv_buffer, rows, locs, k_nope, k_rope) -> None:
    """Torch reference of :func:`store_mla_rows_fp8`."""
    n = _check_rows(rows, locs, k_nope, k_rope)
    _check_fp8_operands(kv_buffer, k_nope, k_rope)
    if n == 0:
        return
    nope, rope = k_nope.reshape(k_nope.shape[0], -1), k_rope.reshape(k_rope.shape[0], -1)
    if rows is not None:
        nope, rope = nope.index_select(0, rows), rope.index_select(0, rows)
    kv_buffer.view(kv_buffer.shape[0], -1)[locs] = quantize_mla_fp8_reference(nope, rope)
