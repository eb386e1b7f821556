"""Which path each hot-path kernel takes: the Triton kernel or its torch reference.

The kernels live in ``sgl-kernel/`` (package ``sglang_cp_shared_kv_kernel``, shipped in
the same distribution as the plugin), one module per kernel with its torch reference
beside it. A :class:`KernelDispatch` (one per shared-KV model runner, held by its
:class:`~sglang_cp_shared_kv.context.CpSharedKVContext`) runs the kernel when

* the tensors are on a CUDA device,
* debug mode (``SGLANG_DEBUG_CP_SHARED_KV=1``) is off -- debug runs the checked path, and
* the kernel has not raised before, on this rank since the last agreement point of its CP
  group, or on any rank of the group before that;

and the reference otherwise. A kernel that raises runs its reference instead, on that
rank, for the rest of the forward (:attr:`KernelDispatch.failed_here`, with the cause);
the forward's agreement point (:mod:`.forward.agreement`) then tells the whole CP group,
and from the next forward every rank runs the reference (:attr:`KernelDispatch.failed`),
logged once per kernel with its cause and counted. Successful runs log nothing.

The two stores are the exception: their fallback is ``stock``, the caller's own SGLang
store of the same rows, because SGLang's fp8 MLA quantiser divides with Triton's
approximate ``div.full.f32``, which torch cannot reproduce bit for bit; the fallback must
write exactly the bytes SGLang writes.

The choice between kernel and fallback never changes which collectives run: none of
these functions communicates, and both paths produce the same bytes. A rank that falls
back alone, until its group agrees, stays in step with the group.
"""

from __future__ import annotations

import logging
from typing import Callable, Dict, Optional, Sequence, Set, Tuple

import torch

from sglang_cp_shared_kv.settings.config import debug_enabled
from sglang_cp_shared_kv.pool.kv_geometry import PAGE_SIZE

logger = logging.getLogger(__name__)

PACKAGE = "sglang_cp_shared_kv_kernel"


class KernelPackageMissing(ImportError):
    """The kernel package (and with it every kernel's reference) does not import."""


def kernel_package():
    """The kernel package; raises :class:`KernelPackageMissing` naming the fix."""
    try:
        import sglang_cp_shared_kv_kernel as package
    except Exception as exc:  # ImportError, or a broken install (e.g. no triton)
        raise KernelPackageMissing(
            f"the kernel package {PACKAGE} does not import ({type(exc).__name__}: {exc}); it ships "
            "with sglang-cp-shared-kv: reinstall the plugin (pip install sglang-cp-shared-kv, or "
            "scripts/bootstrap.sh from a checkout)") from exc
    return package


def _all_on_cuda(tensors: Sequence[torch.Tensor]) -> bool:
    return all(t.is_cuda for t in tensors)


#: Every kernel a :class:`KernelDispatch` runs, by the name it records a failure under (the
#: agreement point, ``forward.agreement``, falls back on these names for the whole group).
KERNEL_NAMES: Tuple[str, ...] = (
    "store_mla_rows", "store_mla_rows_fp8", "store_index_rows", "copy_mla_rows", "copy_index_rows",
    "pack_pages", "build_page_inverse", "remap_locs", "rerange_in_seq",
)


class KernelDispatch:
    """Kernel or reference, per call; remembers the kernels that raised (per instance, so
    two engines in one process, or two test configurations, do not share it)."""

    def __init__(self) -> None:
        #: kernels the CP group runs as their reference, decided at an agreement point
        self.failed: Set[str] = set()
        #: kernels that raised on this rank since the last agreement point -> the cause
        self.failed_here: Dict[str, str] = {}

    def fall_back(self, name: str) -> None:
        """From now on ``name`` runs its reference (the group decided it)."""
        if name not in KERNEL_NAMES:
            raise ValueError(f"unknown kernel {name!r}")
        self.failed.add(name)

    def _run(self, name: str, tensors: Sequence[torch.Tensor], kernel: Callable, fallback: Callable):
        package = kernel_package()
        if (name not in self.failed and name not in self.failed_here and not debug_enabled()
                and _all_on_cuda(tensors)):
            try:
                return kernel(package)
            except Exception as exc:
                self.failed_here[name] = f"{type(exc).__name__}: {exc}"
                logger.warning("CP shared KV: kernel %s raised (%s); its reference runs instead on this rank, and "
                               "the CP group decides at this forward's agreement point", name, self.failed_here[name])
        return fallback(package)

    # ---------------------------------------------------------------------- stores
    def store_mla_rows(self, kv_buffer: torch.Tensor, rows: Optional[torch.Tensor], locs: torch.Tensor,
                       k_nope: torch.Tensor, k_rope: torch.Tensor, *, packed_fp8: bool,
                       stock: Callable[[], None]) -> None:
        """Write row ``rows[i]`` of (k_nope | k_rope) to row ``locs[i]`` of one layer's MLA
        buffer (``rows=None``: row i), quantised to SGLang's packed fp8 rows when
        ``packed_fp8`` (the pool's ``stores_packed_fp8``).

        ``kv_buffer``: the layer's buffer as stored (uint8 for packed fp8, else the pool's
        element type); ``stock()``: SGLang's own store of the same rows (the fallback).
        """
        if locs.numel() == 0:
            return
        name = "store_mla_rows_fp8" if packed_fp8 else "store_mla_rows"
        tensors = (kv_buffer, locs, k_nope, k_rope) + ((rows,) if rows is not None else ())
        self._run(name, tensors, lambda package: getattr(package, name)(kv_buffer, rows, locs, k_nope, k_rope),
                  lambda package: stock())

    def store_index_rows(self, index_buffer: torch.Tensor, rows: Optional[torch.Tensor], locs: torch.Tensor,
                         key: torch.Tensor, *, stock: Callable[[], None], page_size: int = PAGE_SIZE) -> None:
        """Quantise index key ``rows[i]`` (``rows=None``: row i) and store its fp8 K and fp32
        scale at token location ``locs[i]`` of a page-major index buffer (pages, P x 132)
        uint8; ``stock()``: SGLang's own index store of the same rows (the fallback)."""
        if locs.numel() == 0:
            return
        tensors = (index_buffer, locs, key) + ((rows,) if rows is not None else ())
        self._run("store_index_rows", tensors,
                  lambda package: package.store_index_rows(index_buffer, rows, locs, key, page_size),
                  lambda package: stock())

    def copy_mla_rows(self, dst: torch.Tensor, dst_locs: torch.Tensor, src: torch.Tensor,
                      src_locs: torch.Tensor) -> None:
        """``dst[dst_locs[i]] = src[src_locs[i]]``, whole MLA rows (any of the pool's row
        formats): the owned chunk rows from the dense view into the shard."""
        if dst_locs.numel():
            self._run("copy_mla_rows", (dst, dst_locs, src, src_locs),
                      lambda package: package.copy_mla_rows(dst, dst_locs, src, src_locs),
                      lambda package: package.copy_mla_rows_reference(dst, dst_locs, src, src_locs))

    def copy_index_rows(self, dst: torch.Tensor, dst_locs: torch.Tensor, src: torch.Tensor,
                        src_locs: torch.Tensor, page_size: int = PAGE_SIZE) -> None:
        """The fp8 K and fp32 scale of index token ``src_locs[i]`` of ``src`` to token
        ``dst_locs[i]`` of ``dst`` (page-major index buffers)."""
        if dst_locs.numel():
            self._run("copy_index_rows", (dst, dst_locs, src, src_locs),
                      lambda package: package.copy_index_rows(dst, dst_locs, src, src_locs, page_size),
                      lambda package: package.copy_index_rows_reference(dst, dst_locs, src, src_locs, page_size))

    # ----------------------------------------------------------------- materialize
    def pack_pages(self, page_words: torch.Tensor, send_pages: torch.Tensor,
                   out: Optional[torch.Tensor] = None) -> torch.Tensor:
        """``out[k] = page_words[send_pages[k]]`` (pages as rows of int64 words); the send
        buffer of a materialize all-gather. Returns ``out`` (allocated when None)."""
        return self._run("pack_pages", (page_words, send_pages),
                         lambda package: package.pack_pages(page_words, send_pages, out=out),
                         lambda package: package.pack_pages_reference(page_words, send_pages, out=out))

    # ------------------------------------------------------------------ remapping
    def build_page_inverse(self, seq_pages: torch.Tensor, dense_page: torch.Tensor, num_logical_pages: int,
                           out: Optional[torch.Tensor] = None) -> torch.Tensor:
        """(num_logical_pages,) int32 table: ``dense_page[i]`` at logical page
        ``seq_pages[i]`` (never 0; a page listed twice with one dense page), 0 (the dense dummy
        page) elsewhere."""
        args = (seq_pages, dense_page, num_logical_pages)
        return self._run("build_page_inverse", (seq_pages, dense_page),
                         lambda package: package.build_page_inverse(*args, out=out),
                         lambda package: package.build_page_inverse_reference(*args, out=out))

    def remap_locs(self, locs: torch.Tensor, page_inverse: torch.Tensor, page_size: int,
                   out: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Dense locations of logical ``locs`` (any shape; negative entries such as top-k's
        -1 padding kept; ``page_size=1`` remaps page numbers). Pages outside the table map
        to the dense dummy page."""
        return self._run("remap_locs", (locs, page_inverse),
                         lambda package: package.remap_locs(locs, page_inverse, page_size, out=out),
                         lambda package: package.remap_locs_reference(locs, page_inverse, page_size, out=out))

    # -------------------------------------------------------------- in-seq re-range
    def rerange_in_seq(self, gathered: torch.Tensor, metadata, out: Optional[torch.Tensor] = None) -> torch.Tensor:
        """The in-seq-split all-gather output ``gathered`` (rank r's rows in a block of
        ``max_rank_len[r]`` rows) in sequence order, as SGLang's
        ``cp_all_gather_rerange_output`` re-orders it. ``metadata``: the batch's
        ``ContextParallelMetadata``."""
        def kernel(package):
            table, longest, total = _segments_of(package, metadata, gathered.device)
            return package.rerange_rows(gathered, table, longest, total, out=out)

        return self._run("rerange_in_seq", (gathered,), kernel,
                         lambda package: package.rerange_in_seq_reference(gathered, *_metadata_key(metadata), out=out))


# ------------------------------------------------------------------ in-seq re-range
_SEGMENTS_ATTR = "_cp_shared_kv_rerange_segments"


def _metadata_key(metadata) -> Tuple:
    return (tuple(metadata.max_rank_len), tuple(metadata.per_rank_actual_token),
            tuple(metadata.reverse_split_len), tuple(metadata.cp_reverse_index))


def _segments_of(package, metadata, device):
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
        segments = package.in_seq_segments(*key)
        tables[device, stream] = (package.segment_table(segments, device),
                                  max((n for _, _, n in segments), default=0), sum(metadata.reverse_split_len))
    return tables[device, stream]
