"""Viewing rows of bytes as wide words, so copies move 8 bytes per element (or 16 per
vectorised access) instead of 1 or 2: uint8 scatters ran at 0.7 TB/s on the H200, the
same bytes as int64 at 2.8 TB/s."""

from __future__ import annotations

import torch

_WORDS = (torch.int64, torch.int32, torch.int16, torch.uint8)


def rows_as_words(t: torch.Tensor, num_rows: int) -> torch.Tensor:
    """``t`` as a 2-D (num_rows, words) view of the widest integer word its rows allow.

    Each row must be a contiguous run of bytes; rows may be strided (a column slice of a
    wider tensor, e.g. ``k_nope`` cut from the latent cache). Copies only when no view
    exists.
    """
    rows = t.reshape(num_rows, -1)
    if rows.stride(-1) != 1 and rows.shape[-1] > 1:
        rows = rows.contiguous()
    row_bytes = rows.shape[-1] * rows.element_size()
    for word in _WORDS:
        size = torch.empty((), dtype=word).element_size()
        if row_bytes % size:
            continue
        try:
            return rows.view(word)
        except RuntimeError:  # an unaligned storage offset or row stride
            continue
    return rows.contiguous().view(torch.uint8)


def int64_rows(rows: torch.Tensor) -> torch.Tensor:
    """2-D ``rows`` (row bytes a multiple of 8) as int64 words; copies only when unaligned."""
    try:
        return rows.view(torch.int64)
    except RuntimeError:
        return rows.contiguous().view(torch.int64)


def same_word_views(*tensors: torch.Tensor, num_rows) -> tuple:
    """Word views of several row tensors, all of one word type (the widest all allow)."""
    views = [rows_as_words(t, n) for t, n in zip(tensors, num_rows)]
    narrowest = min(v.element_size() for v in views)
    return tuple(v if v.element_size() == narrowest else
                 v.view(torch.uint8).view(_word_of_size(narrowest)) for v in views)


def _word_of_size(size: int) -> torch.dtype:
    return {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.uint8}[size]
