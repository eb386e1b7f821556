"""A deterministic stand-in for SGLang's NSA top-k kernels (test-only: end-to-end comparisons).

Why: past ``index_topk`` keys a prompt's logprobs differ from run to run in stock SGLang
0.5.12.post1, flag on or off. The NSA indexer picks each query's keys with
``sgl_kernel.fast_topk_*`` (a radix select, one CUDA block per query row), and that
kernel writes every selected key to ``index[atomicAdd(&counter, 1)]``: the keys come
back in the order the threads won the atomic, which changes from launch to launch. The
sparse FlashMLA kernels then accumulate attention over the keys in that order, so the
floating-point sum -- and the logprob -- changes with it. (The *set* can vary too: exact
ties at the threshold are resolved by the same atomics, and a threshold bin with more
than 16,384 candidates is clipped in whatever order they arrived.)

This module selects the same keys deterministically and returns them in key order:

    row i, length L_i, start s_i:
      L_i <= topk:  [0, 1, ..., L_i - 1, -1, ...]               (the kernel's own fast path;
                                                                 L_i <= 0: all -1)
      L_i >  topk:  the topk indices j in [0, L_i) of the largest score[i, s_i + j],
                    ties broken by the smaller j, sorted ascending; -1 padding never occurs

then applies the kernel's transform (none; page table of the row's request; ragged
offset), where a negative L_i keeps every position [0, topk) as the kernel's transforms
do (see below). Apart from the order and the tie rule it selects what the kernel selects (the
GPU test compares the sets). The functions have ``sgl_kernel``'s signatures;
``scripts/e2e/sitecustomize.py`` installs them for a server started with
``CPSKV_E2E_STABLE_TOPK=1``. Slow (a full sort per row): for comparison runs only.

SGLang 0.5.23 sends some of these calls to two JIT kernels of its own instead
(``sglang.kernels.ops.attention.dsv4.topk.topk_transform_ragged_v2`` and
``topk_transform_paged_v2``): their stand-ins, their contract and which call goes where are
in the section "SGLang 0.5.23" below (:data:`V2_STAND_INS`).

The kernel's contract on every row it accepts (``sgl-kernel/csrc/elementwise/topk.cu`` of
sglang-kernel 0.4.2.post2; its host checks are in the installed ``common_ops`` library):

* shapes: ``score`` (B, W) with unit column stride; ``lengths``, ``row_starts`` and the
  ragged offsets (B,); a (B, topk) int32 result; the paged transform's table has one row
  per request of ``cu_seqlens_q`` (``prefill_bs = len(cu_seqlens_q) - 1 <= B``). Anything
  else is refused (RuntimeError "Expected ... to be true"); so is it here.
* no bound is checked on a row: the kernel reads score j of row i at ``score``'s data
  pointer + i x its row stride + ``row_starts[i]`` + j, and page-table entry j of request
  b at the table's pointer + b x its row stride + j, whatever W or the table's width.
  SGLang's in-seq split makes such calls: it pads a chunk to a multiple of the CP size
  (``ForwardBatch.prepare_mlp_sync_batch``: padding rows at out_cache_loc 0, whose outputs
  SGLang leaves unused), and the padding rows' top-k calls
  (``Indexer._get_topk_ragged_with_cp``) get lengths up to prefix + padded chunk, past the
  request's page table (prefix + chunk columns: a copy of its ``req_to_token`` row); the
  kernel returns entries read past the table for them. (The stand-in once indexed the
  table there: a CP8 server with it died on a 1,500-token prompt.) The stand-in reads the
  same memory wherever it belongs to the tensor's storage (a view's hidden columns, the
  next row) and writes -1 for a page entry (-inf for a score) beyond it, where the kernel
  reads memory the tensor does not own (no defined value).
* the paged kernel: with no row starts and one request per row (``prefill_bs == B``) row i
  is request i (decode); otherwise row i is the request b with ``cu_seqlens_q[b] <= i <
  cu_seqlens_q[b + 1]`` (SGLang's ``cu_seqlens_q`` is non-decreasing and covers every
  row). A row of no request gets -1 where its length is 0 (the kernel reads no table
  entry); otherwise the kernel reads through a shared pointer it never set, undefined (on
  an H200 such rows of negative length faulted with an illegal memory access,
  2026-12-04), and the stand-in gives it -1.
* -1 stays -1 through both transforms.
* a negative length: ``L <= topk`` is compared signed, so the fast path; there
  ``fast_topk_v2`` compares ``i < L`` with a signed i (all -1), but both transforms loop
  with ``auto i = threadIdx.x`` (unsigned), so L converts to 2^32 + L and every position
  i in [0, topk) is kept: table entries 0 .. topk - 1 of the request, or i + offset
  (seen on an H200, 2026-12-04). SGLang passes no negative length.
"""

from __future__ import annotations

import contextlib
import inspect
from dataclasses import dataclass
from typing import Any, Dict, List, Optional

import torch

#: rows x columns sorted at once (bounds the temporaries: ~12 bytes per element)
_SORT_ELEMENTS = 1 << 26


def _require(condition: bool, check: str) -> None:
    """topk.cu's ``TORCH_CHECK(check)``, with its message."""
    if not condition:
        raise RuntimeError(f"Expected {check} to be true, but got false.")


def _storage(t: torch.Tensor):
    """(``t``'s whole storage as a flat tensor, its element count): the memory the kernel can
    read through ``t``'s data pointer and strides."""
    count = t.untyped_storage().nbytes() // t.element_size()
    return t.as_strided((count,), (1,), 0), count


def _read(t: torch.Tensor, positions: torch.Tensor, wanted: torch.Tensor, missing):
    """``t``'s storage at ``positions`` where ``wanted`` and inside it; ``missing`` elsewhere."""
    flat, count = _storage(t)
    inside = wanted & (positions >= 0) & (positions < count)
    if count == 0:
        return torch.full(positions.shape, missing, dtype=t.dtype, device=t.device)
    return torch.where(inside, flat[positions.clamp(0, count - 1)], missing)


def _check_rows(score: torch.Tensor, lengths: torch.Tensor, row_starts: Optional[torch.Tensor]) -> None:
    """topk.cu ``get_params``: the row arguments of every kernel."""
    _require(score.dim() == 2 and score.stride(1) == 1, "score.dim() == 2 && score.stride(1) == 1")
    if row_starts is not None:
        _require(row_starts.dim() == 1, "row_starts.dim() == 1")
        _require(row_starts.shape[0] == score.shape[0], "row_starts.size(0) == B")
    _require(lengths.dim() == 1, "lengths.dim() == 1 && lengths.is_contiguous()")
    _require(lengths.shape[0] == score.shape[0], "lengths.size(0) == B")


def stable_topk_indices(score: torch.Tensor, lengths: torch.Tensor, topk: int,
                        row_starts: Optional[torch.Tensor] = None) -> torch.Tensor:
    """(B, topk) int32: per row, the indices relative to the row's start (see the module
    docstring), -1 where the row has fewer than ``topk`` keys. A long row's window is read
    as the kernel reads it: from the row's start on in ``score``'s storage, past W too."""
    _check_rows(score, lengths, row_starts)
    rows = score.shape[0]
    device = score.device
    lengths = lengths.to(device=device, dtype=torch.int64)
    starts = (torch.zeros(rows, dtype=torch.int64, device=device) if row_starts is None
              else row_starts.to(device=device, dtype=torch.int64))
    out = torch.full((rows, topk), -1, dtype=torch.int32, device=device)
    positions = torch.arange(topk, device=device)
    short = lengths <= topk
    out[short] = torch.where(positions < lengths[short, None], positions, -1).to(torch.int32)
    long_rows = torch.nonzero(~short).flatten()
    if long_rows.numel() == 0:
        return out
    width = int(lengths[long_rows].max())
    block = max(1, _SORT_ELEMENTS // width)
    columns = torch.arange(width, device=device)
    for first in range(0, long_rows.numel(), block):
        sel = long_rows[first:first + block]
        at = score.storage_offset() + sel[:, None] * score.stride(0) + starts[sel, None] + columns
        values = _read(score, at, columns < lengths[sel, None], float("-inf")).float()
        # NOTE: a stable descending sort keeps equal scores in index order; columns past the
        # row's length (-inf, after every column inside it) are never taken: a long row has
        # more than topk columns inside its length, -inf ones (a read past the storage) included
        order = torch.sort(values, dim=1, descending=True, stable=True).indices[:, :topk]
        out[sel] = torch.sort(order, dim=1).values.to(torch.int32)
    return out


def _transform_positions(score: torch.Tensor, lengths: torch.Tensor, topk: int,
                         row_starts: Optional[torch.Tensor]) -> torch.Tensor:
    """The positions the transforms map: :func:`stable_topk_indices`, but every position
    [0, topk) on a row of negative length (the transforms' fast path compares ``i < L``
    with an unsigned i: module docstring)."""
    idx = stable_topk_indices(score, lengths, topk, row_starts)
    negative = lengths.to(device=score.device)[:, None] < 0
    every = torch.arange(topk, device=score.device, dtype=torch.int32)
    return torch.where(negative, every, idx)


def fast_topk_v2(score: torch.Tensor, lengths: torch.Tensor, topk: int,
                 row_starts: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``sgl_kernel.fast_topk_v2``: the indices themselves."""
    return stable_topk_indices(score, lengths, topk, row_starts)


def fast_topk_transform_fused(score: torch.Tensor, lengths: torch.Tensor, page_table_size_1: torch.Tensor,
                              cu_seqlens_q: torch.Tensor, topk: int,
                              row_starts: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``sgl_kernel.fast_topk_transform_fused``: index j of row i becomes entry j of the
    page-table row of request b, read as the kernel reads it (the table's storage at its
    pointer + b x its row stride + j, j past the table's width too; -1 beyond the storage):
    b the request of row i, ``cu_seqlens_q[b] <= i < cu_seqlens_q[b + 1]``, or b = i for
    decode (no row starts, one row per request, where the kernel ignores
    ``cu_seqlens_q``). A row of no request gets -1; a row of negative length entries
    0 .. topk - 1."""
    _check_rows(score, lengths, row_starts)
    _require(page_table_size_1.dim() == 2 and page_table_size_1.stride(1) == 1,
             "src_page_table.dim() == 2 && src_page_table.stride(1) == 1")
    _require(cu_seqlens_q.dim() == 1, "cu_seqlens_q.dim() == 1 && cu_seqlens_q.is_contiguous()")
    requests = cu_seqlens_q.shape[0] - 1
    _require(page_table_size_1.shape[0] == requests, "src_page_table.size(0) == prefill_bs")
    _require(requests <= score.shape[0], "prefill_bs <= B")
    idx = _transform_positions(score, lengths, topk, row_starts)
    rows = torch.arange(score.shape[0], device=score.device)
    if row_starts is None and requests == score.shape[0]:
        request, has_request = rows, torch.ones_like(rows, dtype=torch.bool)
    else:
        cu = cu_seqlens_q.to(device=score.device, dtype=torch.int64)
        request = torch.searchsorted(cu[1:], rows, right=True)  # the first b with i < cu[b + 1]
        has_request = (request < requests) & (cu[request.clamp(max=max(requests - 1, 0))] <= rows)
    table = page_table_size_1.to(score.device)
    at = table.storage_offset() + request[:, None] * table.stride(0) + idx.long()
    return _read(table, at, (idx >= 0) & has_request[:, None], -1).to(torch.int32)


def fast_topk_transform_ragged_fused(score: torch.Tensor, lengths: torch.Tensor, topk_indices_offset: torch.Tensor,
                                     topk: int, row_starts: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``sgl_kernel.fast_topk_transform_ragged_fused``: index j of row i becomes
    ``j + topk_indices_offset[i]`` (every j in [0, topk) on a row of negative length)."""
    _check_rows(score, lengths, row_starts)
    _require(topk_indices_offset.dim() == 1, "topk_indices_offset.dim() == 1")
    _require(topk_indices_offset.shape[0] == score.shape[0], "topk_indices_offset.size(0) == B")
    idx = _transform_positions(score, lengths, topk, row_starts)
    offset = topk_indices_offset.to(device=score.device, dtype=torch.int32)[:, None]
    return torch.where(idx >= 0, idx + offset, -1).to(torch.int32)


#: sgl_kernel name -> stand-in, for the installer in scripts/e2e/sitecustomize.py
STAND_INS = {
    "fast_topk_v2": fast_topk_v2,
    "fast_topk_transform_fused": fast_topk_transform_fused,
    "fast_topk_transform_ragged_fused": fast_topk_transform_ragged_fused,
}


# --- SGLang 0.5.23: the top-k v2 JIT kernels its DSA backend routes to ---------------------------
#
# On 0.5.23 the DSA indexer's top-k goes through ``DSATopKBackend`` (``--dsa-topk-backend``,
# default ``sgl-kernel``; ``layers/attention/dsa/dsa_topk_backend.py``), which imports its
# kernels at each call. With the default ``SGLANG_OPT_USE_TOPK_V2=1`` and fused top-k
# (``SGLANG_DSA_FUSE_TOPK=1``) it sends
#
# * extend, RAGGED transform (fp8 KV with ``flashmla_sparse``; any row split, interleave CP
#   included), to :func:`topk_transform_ragged_v2`;
# * decode, PAGED transform (one row per request, no row starts: the decode server), to
#   :func:`topk_transform_paged_v2`, with the per-forward plan ``plan_topk_v2`` (stock);
# * extend, PAGED transform (bf16 KV: row starts), the prefill-CP ``batch_idx_list`` calls
#   and the chunked-logits calls, to ``sgl_kernel.fast_topk_transform_fused`` /
#   ``fast_topk_transform_ragged_fused`` (sgl-kernel 0.4.10: the same host checks and
#   arguments as 0.4.2.post2's, the stand-ins above);
# * unfused top-k (``SGLANG_DSA_FUSE_TOPK=0``, hisparse decode) to ``sgl_kernel.fast_topk_v2``.
#
# The two v2 kernels live in ``sglang.kernels.ops.attention.dsv4.topk`` (JIT, source
# ``sglang/kernels/jit/csrc/deepseek_v4/topk_v2.cuh``, one CUDA block per row, radix select:
# the order of the selected keys is the kernel's, not the keys'). Their contract on a row
# they accept, as the host function and the kernel read it:
#
# * shapes and dtypes (``TensorMatcher`` / ``RuntimeCheck``, refused otherwise): scores
#   (B, L) float32 with strides (S, 1), S a multiple of 4; ``seq_lens`` (B,) int32; the
#   output (B, K) int32, 0 < K <= 2048; ragged: ``out_offsets`` (B,) int32, ``row_starts``
#   (B,) int32 or None; paged: ``page_tables`` (B, *) int32 with unit column stride or None,
#   ``page_size`` a power of 2, ``metadata`` (B + 1, 2) int32, ``out_raw_indices`` (B, K)
#   int32 only with a page table. The stand-ins check the strides only on dimensions of
#   more than one element (a DLPack view may canonicalise the others).
# * row b, L = ``seq_lens[b]``: L <= K: positions [0, L), then -1 (no score read); L > K:
#   the K positions j in [0, L) of the largest scores, read at the scores' data pointer
#   + b x S + ``row_starts[b]`` (0 without) + j, with no bound on L or the row start (the
#   stand-in reads the scores' storage there, -inf past it, as for the kernels above);
#   equal scores: whichever the radix select keeps (the stand-in: the smaller j).
# * ragged output: j + ``out_offsets[b]``; paged: ``page_tables[b, j >> log2(page_size)] <<
#   log2(page_size) | (j & (page_size - 1))`` (int32), the table read like the scores (the
#   stand-in writes -1 for an entry past the table's storage); no page table: j itself;
#   ``out_raw_indices``: j. -1 stays -1.
# * L < 0 is not a length these kernels take (SGLang clamps padded rows to 0; read as
#   unsigned it is ~4e9 keys: an illegal address): the stand-ins answer -1.
# * the ragged kernel also overwrites, in place, the <= 3 score columns ahead of each row's
#   window (its 16-byte aligned load; the buffer is dead afterwards): the stand-in leaves
#   the scores as they are. The plan (``metadata``) only routes rows to the kernel's
#   cluster path: the stand-in checks its shape and otherwise ignores it.
#
# The stand-ins select like :func:`stable_topk_indices` (ties to the smaller index, key
# order) and write the kernel's output tensors in place, returning None as the kernels do.

#: where SGLang 0.5.23 keeps the v2 kernels (``sitecustomize`` patches it on import)
V2_MODULE = "sglang.kernels.ops.attention.dsv4.topk"


def _require_v2(condition: bool, message: str) -> None:
    """topk_v2.cuh's host checks (``RuntimeCheck`` / ``TensorMatcher``)."""
    if not condition:
        raise RuntimeError(message)


def _check_v2_int32(t: torch.Tensor, shape, name: str) -> None:
    _require_v2(tuple(t.shape) == tuple(shape) and t.dtype == torch.int32,
                f"{name}: expected int32 {tuple(shape)}, got {t.dtype} {tuple(t.shape)}")


def _check_v2_scores(scores: torch.Tensor) -> None:
    _require_v2(scores.dim() == 2 and scores.dtype == torch.float32,
                f"scores: expected float32 (B, L), got {scores.dtype} {tuple(scores.shape)}")
    _require_v2(scores.shape[1] <= 1 or scores.stride(1) == 1, "scores: expected unit column stride")
    _require_v2(scores.shape[0] <= 1 or scores.stride(0) % 4 == 0,
                "score_stride must be a multiple of 4 (16-byte vectorized load)")


def _check_v2_topk(out: torch.Tensor, rows: int, name: str) -> int:
    _require_v2(out.dim() == 2, f"{name}: expected (B, K)")
    topk = out.shape[1]
    _check_v2_int32(out, (rows, topk), name)
    _require_v2(0 < topk <= 2048, "topk must be in (0, 2048]")
    return topk


def _to_int32(values: torch.Tensor) -> torch.Tensor:
    """int64 -> int32 with two's-complement wrap (the kernel's int32 shift and or)."""
    return ((values + (1 << 31)) % (1 << 32) - (1 << 31)).to(torch.int32)


def topk_transform_ragged_v2(scores: torch.Tensor, seq_lens: torch.Tensor, *, out_offsets: torch.Tensor,
                             out_indices: torch.Tensor, row_starts: Optional[torch.Tensor] = None) -> None:
    """``sglang.kernels.ops.attention.dsv4.topk.topk_transform_ragged_v2`` (SGLang 0.5.23):
    into ``out_indices``, row b's selected positions j (relative to ``row_starts[b]``) as
    ``j + out_offsets[b]``, -1 padded (contract above)."""
    _check_v2_scores(scores)
    rows = scores.shape[0]
    _check_v2_int32(seq_lens, (rows,), "seq_lens")
    _check_v2_int32(out_offsets, (rows,), "out_offsets")
    if row_starts is not None:
        _check_v2_int32(row_starts, (rows,), "row_starts")
    topk = _check_v2_topk(out_indices, rows, "topk_indices")
    idx = stable_topk_indices(scores, seq_lens, topk, row_starts)
    offset = out_offsets.to(device=scores.device, dtype=torch.int64)[:, None]
    out_indices.copy_(torch.where(idx >= 0, _to_int32(idx.long() + offset), -1))


def topk_transform_paged_v2(scores: torch.Tensor, seq_lens: torch.Tensor, page_tables: Optional[torch.Tensor],
                            out_page_indices: torch.Tensor, page_size: int, metadata: torch.Tensor,
                            out_raw_indices: Optional[torch.Tensor] = None) -> None:
    """``sglang.kernels.ops.attention.dsv4.topk.topk_transform_paged_v2`` (SGLang 0.5.23):
    into ``out_page_indices``, row b's selected positions j (from column 0 of its score
    row) mapped through row b of ``page_tables`` (page size ``page_size``), or j itself
    without a table; ``out_raw_indices`` (with a table only) gets j. -1 padded (contract
    above)."""
    _check_v2_scores(scores)
    rows = scores.shape[0]
    _check_v2_int32(seq_lens, (rows,), "seq_lens")
    if page_tables is not None:
        _require_v2(page_tables.dim() == 2 and page_tables.shape[0] == rows and page_tables.dtype == torch.int32
                    and (page_tables.shape[1] <= 1 or page_tables.stride(1) == 1),
                    f"page_table: expected int32 ({rows}, *) with unit column stride, got "
                    f"{page_tables.dtype} {tuple(page_tables.shape)}")
    topk = _check_v2_topk(out_page_indices, rows, "page_indices")
    _require_v2(metadata.dim() == 2 and metadata.shape[1] == 2 and metadata.dtype == torch.int32,
                "metadata: expected int32 (N, 2)")
    if out_raw_indices is not None:
        _require_v2(page_tables is not None, "raw_indices requires a page table")
        _check_v2_topk(out_raw_indices, rows, "raw_indices")
    page_size = int(page_size)
    _require_v2(page_size > 0 and page_size & (page_size - 1) == 0, "page_size must be power of 2")
    _require_v2(metadata.shape[0] == rows + 1, "invalid metadata shape")
    idx = stable_topk_indices(scores, seq_lens, topk)
    if page_tables is None:
        out_page_indices.copy_(idx)
        return
    table = page_tables.to(scores.device)
    keys = idx.long()
    at = (table.storage_offset() + torch.arange(rows, device=scores.device)[:, None] * table.stride(0)
          + torch.div(keys, page_size, rounding_mode="floor"))
    _, count = _storage(table)
    inside = (keys >= 0) & (at >= 0) & (at < count)
    entries = _read(table, at, inside, -1).long()
    # NOTE: (entry << bits) | low bits, as the kernel computes it, is entry x page_size + low bits
    out_page_indices.copy_(torch.where(inside, _to_int32(entries * page_size + (keys & (page_size - 1))), -1))
    if out_raw_indices is not None:
        out_raw_indices.copy_(idx)


#: sglang.kernels.ops.attention.dsv4.topk name -> stand-in (SGLang 0.5.23), for the installer in
#: scripts/e2e/sitecustomize.py
V2_STAND_INS = {
    "topk_transform_ragged_v2": topk_transform_ragged_v2,
    "topk_transform_paged_v2": topk_transform_paged_v2,
}


# --- the top-k calls of SGLang 0.5.12.post1's in-seq-split NSA prefill (for the tests) -------------


@dataclass
class TopkCall:
    """One call SGLang made to an ``sgl_kernel`` top-k function, as it made it."""

    rank: int  #: the CP rank
    half: str  #: "prev" or "next": the rank's first or second zigzag segment
    kernel: str  #: the sgl_kernel name called (a key of :data:`STAND_INS`)
    arguments: Dict[str, Any]  #: every argument by name, as the kernel received it
    result: torch.Tensor  #: what the kernel passed in returned
    sequence_len: int  #: prefix + chunk tokens: a row whose length exceeds it is one of SGLang's padding rows


class _TorchOn:
    """``torch`` as an SGLang module sees it, with its ``device="cuda"`` tensors made on
    ``device`` (``cp_utils`` and ``nsa_indexer`` build their length tensors on "cuda"; one of
    them then moves with ``.to(device="cuda")``, which the tensor's own class answers)."""

    def __init__(self, device):
        self._device = torch.device(device)

    def __getattr__(self, name):
        return getattr(torch, name)

    def _on(self, kwargs):
        return {**kwargs, "device": self._device} if "device" in kwargs else kwargs

    def full(self, *args, **kwargs):
        return torch.full(*args, **self._on(kwargs))

    def arange(self, *args, **kwargs):
        return torch.arange(*args, **self._on(kwargs))

    def tensor(self, *args, **kwargs):
        return torch.tensor(*args, **self._on(kwargs)).as_subclass(_MovesTo).with_device(self._device)


class _MovesTo(torch.Tensor):
    """A tensor whose ``.to(device="cuda")`` goes to the device :class:`_TorchOn` stands for."""

    def with_device(self, device):
        self._target = device
        return self

    def to(self, *args, **kwargs):
        if "device" in kwargs:
            kwargs["device"] = getattr(self, "_target", kwargs["device"])
        return torch.Tensor.to(self.as_subclass(torch.Tensor), *args, **kwargs)


_ABSENT = object()


def _restore(module, name, value):
    if value is _ABSENT:
        delattr(module, name)
    else:
        setattr(module, name, value)


def in_seq_split_topk_calls(chunk_len: int, prefix_len: int, cp_size: int, kernels: Dict[str, Any], *,
                            paged: bool = True, fused: bool = True, topk: int = 2048, device="cpu",
                            tied_scores: bool = False, seed: int = 0) -> List[TopkCall]:
    """Every call SGLang 0.5.12.post1 makes to the NSA top-k kernels for one chunk of
    ``chunk_len`` tokens after ``prefix_len`` cached ones, in-seq-split over ``cp_size``
    ranks, with ``kernels`` (sgl_kernel name -> function) as ``sgl_kernel``; [] where SGLang
    does not split the chunk (``can_nsa_cp_split``).

    SGLang's own code makes the calls: the chunk is padded to a multiple of the CP size
    (``nsa.utils.cal_padded_tokens``, the arithmetic of ``ForwardBatch.prepare_mlp_sync_batch``),
    split (``cp_utils.prepare_context_parallel_metadata``), cut in halves as
    ``Indexer.forward_cuda``'s in-seq branch cuts them, and each half goes through the real
    ``Indexer._get_topk_ragged_with_cp`` and ``NSAIndexerMetadata.topk_transform``. Stood in
    for: the index-key pool (zeros), DeepGEMM's ``fp8_mqa_logits`` (random scores of the
    shape it returns, after its shape checks), the server's flags (in-seq split on), and
    the page table, built as ``NativeSparseAttnBackend.init_forward_metadata`` builds it (a
    copy of the request's ``req_to_token`` row, ``prefix_len + chunk_len`` wide). ``paged``:
    the PAGED transform (bf16 KV) or RAGGED (fp8 KV with flashmla_sparse); ``fused=False``:
    ``fast_topk_v2`` (SGLANG_NSA_FUSE_TOPK off)."""
    import sys
    import types

    from sglang.srt.layers import dp_attention
    from sglang.srt.layers.attention.nsa import nsa_indexer
    from sglang.srt.layers.attention.nsa import utils as nsa_utils
    from sglang.srt.layers.attention.nsa_backend import NSAIndexerMetadata, TopkTransformMethod
    from sglang.srt.layers.utils import cp_utils
    from sglang.srt.model_executor.forward_batch_info import ForwardMode

    from sglang_cp_shared_kv.scoped import attributes_set

    device = torch.device(device)
    generator = torch.Generator(device=device).manual_seed(seed)
    sequence_len = prefix_len + chunk_len
    calls: List[TopkCall] = []
    where = {}

    def recording(name, function):
        signature = inspect.signature(STAND_INS[name])

        def record(*args, **kwargs):
            result = function(*args, **kwargs)
            arguments = signature.bind(*args, **kwargs).arguments
            calls.append(TopkCall(where["rank"], where["half"], name, dict(arguments), result, sequence_len))
            return result

        return record

    def fp8_mqa_logits(q, kv, weights, ks, ke, clean_logits=False):
        # DeepGEMM's host checks (deep_gemm/_C.so: "cu_seq_len_k_start.size(0) == seq_len", ...)
        rows = q.shape[0]
        assert weights.shape[0] == rows and ks.shape[0] == rows and ke.shape[0] == rows
        shape = (rows, kv[0].shape[0])
        if tied_scores:  # 7 values: every long row has ties at its threshold
            return torch.randint(0, 7, shape, generator=generator, device=device).float() / 4
        return torch.randn(shape, generator=generator, device=device)

    def index_k(layer_id, kv_len, block_table):
        return torch.zeros(kv_len, 128, dtype=torch.uint8, device=device)

    def index_k_scale(layer_id, kv_len, block_table):
        return torch.zeros(kv_len, 4, dtype=torch.uint8, device=device)

    pool = types.SimpleNamespace(page_size=64, get_index_k_continuous=index_k,
                                 get_index_k_scale_continuous=index_k_scale)
    batch = types.SimpleNamespace(forward_mode=ForwardMode.EXTEND, token_to_kv_pool=pool,
                                  seq_lens_cpu=torch.tensor([sequence_len]), extend_seq_lens_cpu=[chunk_len],
                                  global_num_tokens_cpu=[chunk_len], is_extend_in_batch=True)
    # the request's req_to_token row runs on past its tokens; init_forward_metadata copies the first
    # sequence_len columns (req_to_token[req_pool_indices, :max_seqlen_k], a new tensor)
    req_to_token = torch.randperm(4 * (sequence_len + 256), generator=generator, device=device)
    req_to_token = req_to_token.to(torch.int32).view(4, -1)
    page_table_1 = req_to_token[torch.tensor([1], device=device), :sequence_len]
    attn_metadata = types.SimpleNamespace(page_table_1=page_table_1, real_page_table=page_table_1[:, ::64] // 64,
                                          cu_seqlens_q=None, topk_indices_offset=None, nsa_seqlens_expanded=None)
    metadata = NSAIndexerMetadata(attn_metadata=attn_metadata, force_unfused_topk=not fused,
                                  topk_transform_method=TopkTransformMethod.PAGED if paged
                                  else TopkTransformMethod.RAGGED)
    indexer = types.SimpleNamespace(index_topk=topk, _with_real_sm_count=contextlib.nullcontext)
    fake_sgl_kernel = types.ModuleType("sgl_kernel")
    for name, function in kernels.items():
        setattr(fake_sgl_kernel, name, recording(name, function))
    on_device = {"torch": _TorchOn(device)} if device.type != "cuda" else {}
    flags = dict(is_nsa_prefill_cp_round_robin_split=lambda: False, is_nsa_enable_prefill_cp=lambda: True,
                 can_nsa_prefill_cp_round_robin_split=lambda forward_batch: False,
                 get_attention_cp_size=lambda: cp_size)
    saved_sgl_kernel = sys.modules.get("sgl_kernel")
    sys.modules["sgl_kernel"] = fake_sgl_kernel
    try:
        with contextlib.ExitStack() as stack:
            stack.enter_context(attributes_set(nsa_utils, **flags))
            stack.enter_context(attributes_set(dp_attention, get_attention_dp_size=lambda: 1))
            stack.enter_context(attributes_set(cp_utils, **on_device))
            stack.enter_context(attributes_set(nsa_indexer, **on_device))
            # NOTE: nsa_indexer imports deep_gemm only where CUDA is (no attribute on a CPU machine)
            saved_deep_gemm = nsa_indexer.__dict__.get("deep_gemm", _ABSENT)
            nsa_indexer.deep_gemm = types.SimpleNamespace(fp8_mqa_logits=fp8_mqa_logits)
            stack.callback(_restore, nsa_indexer, "deep_gemm", saved_deep_gemm)
            rows_padded = nsa_utils.cal_padded_tokens(batch)
            if not nsa_utils.can_nsa_cp_split(rows_padded, cp_size, True, batch):
                return []
            for rank in range(cp_size):
                split = cp_utils.prepare_context_parallel_metadata(rows_padded, rank, cp_size, [sequence_len])
                rows = split.per_rank_actual_token[rank]
                # Indexer.forward_cuda, in-seq branch: the rank's rows (padding included) cut in halves
                q_prev, q_next = torch.split(torch.zeros(rows, 1, 1, device=device), (rows + 1) // 2)
                for half, q, kv_len, actual in (("prev", q_prev, split.kv_len_prev, split.actual_seq_q_prev),
                                                ("next", q_next, split.kv_len_next, split.actual_seq_q_next)):
                    where.update(rank=rank, half=half)
                    weights = torch.zeros(q.shape[0], 1, 1, device=device)
                    nsa_indexer.Indexer._get_topk_ragged_with_cp(indexer, batch, 0, q, weights, metadata, kv_len,
                                                                 actual)
    finally:
        if saved_sgl_kernel is None:
            sys.modules.pop("sgl_kernel", None)
        else:
            sys.modules["sgl_kernel"] = saved_sgl_kernel
    return calls


__all__ = ["stable_topk_indices", "fast_topk_v2", "fast_topk_transform_fused", "fast_topk_transform_ragged_fused",
           "STAND_INS", "topk_transform_ragged_v2", "topk_transform_paged_v2", "V2_STAND_INS", "V2_MODULE",
           "TopkCall", "in_seq_split_topk_calls"]
