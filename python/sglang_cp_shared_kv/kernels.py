"""The plugin's hot-path kernels, each with a fallback that needs neither the kernel
package nor a GPU.

Every function here runs the Triton kernel of the optional package
``sglang_cp_shared_kv_kernel`` (``sgl-kernel/``, imported lazily on first use) when

* the package imports,
* the tensors are on a CUDA device, and
* debug mode (``SGLANG_DEBUG_CP_SHARED_KV=1``) is off -- debug runs the checked path;

and its fallback otherwise. A kernel that raises is logged once (one warning per
kernel) and its fallback is used from then on, silently. A missing package on a CUDA
machine is logged once too. Successful runs log nothing.

Fallbacks:

* the two stores (:func:`store_mla_rows`, :func:`store_index_rows`) call ``stock``, the
  caller's own SGLang store of the same rows, so the fallback writes exactly the bytes
  SGLang writes (SGLang's fp8 MLA quantiser divides with Triton's approximate
  ``div.full.f32``, which torch cannot reproduce bit for bit);
* the others are plain torch, written here so they run without the package.

The choice between kernel and fallback never changes which collectives run: none of
these functions communicates, and both paths produce the same bytes. A rank that falls
back alone stays in step with the group.
"""

from __future__ import annotations

import logging
from typing import Callable, Optional, Sequence, Set, Tuple

import torch

from sglang_cp_shared_kv.config import debug_enabled

logger = logging.getLogger(__name__)

PACKAGE = "sglang_cp_shared_kv_kernel"

_UNSET = object()
_package_module = _UNSET
_package_error: Optional[BaseException] = None
_failed: Set[str] = set()  # kernels that raised once: fallback from now on
_warned: Set[str] = set()


def _warn_once(key: str, message: str, *args) -> None:
    if key not in _warned:
        _warned.add(key)
        logger.warning(message, *args)


def _package():
    global _package_module, _package_error
    if _package_module is _UNSET:
        try:
            import sglang_cp_shared_kv_kernel as module
        except Exception as exc:  # ImportError, or a broken install (e.g. no triton)
            module, _package_error = None, exc
        _package_module = module
    return _package_module


def package_available() -> bool:
    """Whether the kernel package imports here (imported once, lazily)."""
    return _package() is not None


def _all_on_cuda(tensors: Sequence[torch.Tensor]) -> bool:
    return all(t.is_cuda for t in tensors)


def _kernel_package(name: str, tensors: Sequence[torch.Tensor]):
    """The package when kernel ``name`` should run on ``tensors``, else None."""
    if name in _failed or debug_enabled() or not _all_on_cuda(tensors):
        return None
    module = _package()
    if module is None:
        _warn_once("package", "CP shared KV: the kernel package %s is not importable (%s); "
                   "using the fallback paths", PACKAGE, _package_error)
    return module


def _run(name: str, tensors: Sequence[torch.Tensor], kernel: Callable, fallback: Callable):
    module = _kernel_package(name, tensors)
    if module is not None:
        try:
            return kernel(module)
        except Exception as exc:
            _failed.add(name)
            _warn_once(name, "CP shared KV: kernel %s failed (%s: %s); using its fallback from now on",
                       name, type(exc).__name__, exc)
    return fallback()


def reset_for_tests() -> None:
    """Forget the imported package, failed kernels and warnings (tests only)."""
    global _package_module, _package_error
    _package_module, _package_error = _UNSET, None
    _failed.clear()
    _warned.clear()


# ------------------------------------------------------------------------- stores
def store_mla_rows(kv_buffer: torch.Tensor, rows: Optional[torch.Tensor], locs: torch.Tensor,
                   k_nope: torch.Tensor, k_rope: torch.Tensor, *, packed_fp8: bool,
                   stock: Callable[[], None]) -> None:
    """Write row ``rows[i]`` of (k_nope | k_rope) to row ``locs[i]`` of one layer's MLA
    buffer (``rows=None``: row i), quantised to SGLang's packed fp8 rows when
    ``packed_fp8`` (the pool's ``nsa_kv_cache_store_fp8``).

    ``kv_buffer``: the layer's buffer as stored (uint8 for packed fp8, else the pool's
    element type); ``stock()``: SGLang's own store of the same rows (the fallback).
    """
    if locs.numel() == 0:
        return

    def kernel(module):
        store = module.store_mla_rows_fp8 if packed_fp8 else module.store_mla_rows
        store(kv_buffer, rows, locs, k_nope, k_rope)

    tensors = (kv_buffer, locs, k_nope, k_rope) + ((rows,) if rows is not None else ())
    _run("store_mla_rows_fp8" if packed_fp8 else "store_mla_rows", tensors, kernel, stock)


def store_index_rows(index_buffer: torch.Tensor, rows: Optional[torch.Tensor], locs: torch.Tensor,
                     key: torch.Tensor, *, stock: Callable[[], None], page_size: int = 64) -> None:
    """Quantise index key ``rows[i]`` (``rows=None``: row i) and store its fp8 K and fp32
    scale at token location ``locs[i]`` of a page-major index buffer (pages, P x 132)
    uint8; ``stock()``: SGLang's own index store of the same rows (the fallback)."""
    if locs.numel() == 0:
        return
    tensors = (index_buffer, locs, key) + ((rows,) if rows is not None else ())
    _run("store_index_rows", tensors,
         lambda module: module.store_index_rows(index_buffer, rows, locs, key, page_size), stock)


# --------------------------------------------------------------------- materialize
def pack_pages(page_words: torch.Tensor, send_pages: torch.Tensor,
               out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``out[k] = page_words[send_pages[k]]`` (pages as rows of int64 words); the send
    buffer of a materialize all-gather. Returns ``out`` (allocated when None)."""
    def fallback():
        if out is None:
            return page_words.index_select(0, send_pages)
        return torch.index_select(page_words, 0, send_pages, out=out)

    return _run("pack_pages", (page_words, send_pages),
                lambda module: module.pack_pages(page_words, send_pages, out=out), fallback)


# ---------------------------------------------------------------------- remapping
def build_page_inverse(seq_pages: torch.Tensor, dense_page: torch.Tensor, num_logical_pages: int,
                       out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """(num_logical_pages,) int32 table: ``dense_page[i]`` at logical page
    ``seq_pages[i]`` (distinct, never 0), 0 (the dense dummy page) elsewhere."""
    def fallback():
        table = torch.zeros(num_logical_pages, dtype=torch.int32, device=seq_pages.device) \
            if out is None else out.zero_()
        return table.index_copy_(0, seq_pages.long(), dense_page.to(table.dtype))

    return _run("build_page_inverse", (seq_pages, dense_page),
                lambda module: module.build_page_inverse(seq_pages, dense_page, num_logical_pages, out=out),
                fallback)


def remap_locs(locs: torch.Tensor, page_inverse: torch.Tensor, page_size: int,
               out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Dense locations of logical ``locs`` (any shape; negative entries such as top-k's
    -1 padding kept; ``page_size=1`` remaps page numbers). Pages outside the table map
    to the dense dummy page."""
    def fallback():
        logical = locs.long()
        page = logical // page_size
        known = (logical >= 0) & (page < page_inverse.numel())
        dense = torch.where(known, page_inverse.long()[torch.where(known, page, 0)], 0)
        result = torch.where(logical < 0, logical, dense * page_size + logical % page_size).to(locs.dtype)
        return result if out is None else out.copy_(result)

    return _run("remap_locs", (locs, page_inverse),
                lambda module: module.remap_locs(locs, page_inverse, page_size, out=out), fallback)


# ------------------------------------------------------------------ in-seq re-range
_SEGMENTS_ATTR = "_cp_shared_kv_rerange_segments"


def _metadata_key(metadata) -> Tuple:
    return (tuple(metadata.max_rank_len), tuple(metadata.per_rank_actual_token),
            tuple(metadata.reverse_split_len), tuple(metadata.cp_reverse_index))


def _segments_of(module, metadata, device):
    """(device table, longest segment, total rows) of ``metadata``'s re-order, built once
    per batch and stream (SGLang builds one metadata object per forward) and kept on it.

    One table per stream: the table's host-to-device copy is queued on the stream that
    builds it, and the indexer's key gather may run on a side stream while the latent
    and hidden gathers run on the main one."""
    key = _metadata_key(metadata)
    stream = torch.cuda.current_stream(device).cuda_stream if device.type == "cuda" else None
    cached = getattr(metadata, _SEGMENTS_ATTR, None)
    if cached is None or cached[0] != key:  # the lists changed since: start over
        cached = (key, {})
        setattr(metadata, _SEGMENTS_ATTR, cached)
    tables = cached[1]  # (device, stream) -> entry
    if (device, stream) not in tables:
        segments = module.in_seq_segments(*key)
        tables[device, stream] = (module.segment_table(segments, device),
                                  max((n for _, _, n in segments), default=0), sum(metadata.reverse_split_len))
    return tables[device, stream]


def rerange_in_seq(gathered: torch.Tensor, metadata, out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The in-seq-split all-gather output ``gathered`` (rank r's rows in a block of
    ``max_rank_len[r]`` rows) in sequence order, as SGLang's
    ``cp_all_gather_rerange_output`` re-orders it with split/cat. ``metadata``: the
    batch's ``ContextParallelMetadata``. The fallback is that split/cat re-order."""
    def kernel(module):
        table, longest, total = _segments_of(module, metadata, gathered.device)
        return module.rerange_rows(gathered, table, longest, total, out=out)

    def fallback():
        blocks = gathered.split(list(metadata.max_rank_len))
        compact = torch.cat([block[:rows] for block, rows in zip(blocks, metadata.per_rank_actual_token)])
        pieces = compact.split(list(metadata.reverse_split_len))
        result = torch.cat([pieces[i] for i in metadata.cp_reverse_index])
        return result if out is None else out.copy_(result)

    return _run("rerange_in_seq", (gathered,), kernel, fallback)
