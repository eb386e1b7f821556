"""Triton kernels for sglang-cp-shared-kv.

One module per kernel, each with its torch reference beside it:

* :mod:`.mla_store` -- fused owner store of MLA latent rows (bf16/fp16, packed fp8);
* :mod:`.index_store` -- fused owner store of NSA indexer keys (fp8 K + fp32 scale pages);
* :mod:`.row_copy` -- owned token rows (MLA, index) copied from the dense view to the shard;
* :mod:`.page_pack` -- gather of a rank's send pages into the all-gather buffer;
* :mod:`.page_remap` -- logical -> dense page-inverse table and location remap;
* :mod:`.rerange` -- the in-seq CP all-gather re-order as one copy.

The plugin imports this package lazily (:mod:`sglang_cp_shared_kv.kernels`): without
this package, without a GPU, in debug mode, or when a kernel raises, it takes its
fallback path (one warning, then silent).
"""

from sglang_cp_shared_kv_kernel.index_store import store_index_rows, store_index_rows_reference
from sglang_cp_shared_kv_kernel.mla_store import (
    store_mla_rows,
    store_mla_rows_fp8,
    store_mla_rows_fp8_reference,
    store_mla_rows_reference,
)
from sglang_cp_shared_kv_kernel.page_pack import pack_pages, pack_pages_reference
from sglang_cp_shared_kv_kernel.page_remap import (
    build_page_inverse,
    build_page_inverse_reference,
    remap_locs,
    remap_locs_reference,
)
from sglang_cp_shared_kv_kernel.rerange import (
    in_seq_segments,
    rerange_in_seq,
    rerange_in_seq_reference,
    rerange_rows,
    segment_table,
)
from sglang_cp_shared_kv_kernel.row_copy import (
    copy_index_rows,
    copy_index_rows_reference,
    copy_mla_rows,
    copy_mla_rows_reference,
)

__all__ = [
    "build_page_inverse", "copy_index_rows", "copy_index_rows_reference", "copy_mla_rows",
    "copy_mla_rows_reference", "build_page_inverse_reference", "in_seq_segments", "pack_pages",
    "pack_pages_reference", "remap_locs", "remap_locs_reference", "rerange_in_seq",
    "rerange_in_seq_reference", "rerange_rows", "segment_table", "store_index_rows",
    "store_index_rows_reference", "store_mla_rows", "store_mla_rows_fp8", "store_mla_rows_fp8_reference",
    "store_mla_rows_reference", "triton_usable",
]


def triton_usable() -> bool:
    """Whether Triton kernels can run here (Triton importable and a CUDA device present)."""
    try:
        import torch
        import triton  # noqa: F401
    except ImportError:
        return False
    return torch.cuda.is_available()
