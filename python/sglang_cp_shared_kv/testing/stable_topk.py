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
      L_i <= topk:  [0, 1, ..., L_i - 1, -1, ...]               (the kernel's own fast path)
      L_i >  topk:  the topk indices j in [0, L_i) of the largest score[i, s_i + j],
                    ties broken by the smaller j, sorted ascending; -1 padding never occurs

then applies the kernel's transform (none; page table of the row's request; ragged
offset). Apart from the order and the tie rule it selects what the kernel selects (the
GPU test compares the sets). The functions have ``sgl_kernel``'s signatures;
``scripts/e2e/sitecustomize.py`` installs them for a server started with
``CPSKV_E2E_STABLE_TOPK=1``. Slow (a full sort per row): for comparison runs only.
"""

from __future__ import annotations

from typing import Optional

import torch

#: rows x columns sorted at once (bounds the temporaries: ~12 bytes per element)
_SORT_ELEMENTS = 1 << 26


def stable_topk_indices(score: torch.Tensor, lengths: torch.Tensor, topk: int,
                        row_starts: Optional[torch.Tensor] = None) -> torch.Tensor:
    """(B, topk) int32: per row, the indices relative to the row's start (see the module
    docstring), -1 where the row has fewer than ``topk`` keys."""
    if score.dim() != 2:
        raise ValueError(f"score must be 2-D (rows, keys), got shape {tuple(score.shape)}")
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
        valid = columns < lengths[sel, None]
        where = (starts[sel, None] + columns).clamp_(max=score.shape[1] - 1)
        values = torch.where(valid, score[sel[:, None], where].float(), float("-inf"))
        # NOTE: a stable descending sort keeps equal scores in index order; invalid columns
        # (-inf, after every valid column) can only be taken by a row of -inf scores, and
        # then behind every valid one
        order = torch.sort(values, dim=1, descending=True, stable=True).indices[:, :topk]
        out[sel] = torch.sort(order, dim=1).values.to(torch.int32)
    return out


def fast_topk_v2(score: torch.Tensor, lengths: torch.Tensor, topk: int,
                 row_starts: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``sgl_kernel.fast_topk_v2``: the indices themselves."""
    return stable_topk_indices(score, lengths, topk, row_starts)


def fast_topk_transform_fused(score: torch.Tensor, lengths: torch.Tensor, page_table_size_1: torch.Tensor,
                              cu_seqlens_q: torch.Tensor, topk: int,
                              row_starts: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``sgl_kernel.fast_topk_transform_fused``: index j of row i becomes
    ``page_table_size_1[b, j]``, b the request of row i: ``cu_seqlens_q[b] <= i <
    cu_seqlens_q[b + 1]``, or b = i for decode (no row starts, one row per request, where
    the kernel ignores ``cu_seqlens_q``)."""
    idx = stable_topk_indices(score, lengths, topk, row_starts)
    rows = torch.arange(score.shape[0], device=score.device)
    if row_starts is None and cu_seqlens_q.shape[0] - 1 == score.shape[0]:
        request = rows
    else:
        request = torch.searchsorted(cu_seqlens_q[1:].to(device=score.device, dtype=torch.int64), rows,
                                     right=True)
    table = page_table_size_1.to(score.device)
    picked = table[request[:, None], idx.clamp(min=0).long()]
    return torch.where(idx >= 0, picked, -1).to(torch.int32)


def fast_topk_transform_ragged_fused(score: torch.Tensor, lengths: torch.Tensor, topk_indices_offset: torch.Tensor,
                                     topk: int, row_starts: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``sgl_kernel.fast_topk_transform_ragged_fused``: index j of row i becomes
    ``j + topk_indices_offset[i]``."""
    idx = stable_topk_indices(score, lengths, topk, row_starts)
    offset = topk_indices_offset.to(device=score.device, dtype=torch.int32)[:, None]
    return torch.where(idx >= 0, idx + offset, -1).to(torch.int32)


#: sgl_kernel name -> stand-in, for the installer in scripts/e2e/sitecustomize.py
STAND_INS = {
    "fast_topk_v2": fast_topk_v2,
    "fast_topk_transform_fused": fast_topk_transform_fused,
    "fast_topk_transform_ragged_fused": fast_topk_transform_ragged_fused,
}

__all__ = ["stable_topk_indices", "fast_topk_v2", "fast_topk_transform_fused", "fast_topk_transform_ragged_fused",
           "STAND_INS"]
