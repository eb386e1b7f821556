"""The rig's KV pool shape and the page content every process derives from a seed.

Owns :class:`Geometry` (one NSA pool's shape, as plan JSON and as
``NSATokenToKVPool`` kwargs), :data:`TEST_GEOMETRY`, :func:`model_geometry` (the shape
SGLang builds for a shipped model config), :func:`content` (a room's bytes, a pure
function of its arguments), the uint8 page views :func:`kv_pages` / :func:`index_pages`
of a pool, and the marker bytes decode fills its pages with. Sizes come from
:mod:`sglang_cp_shared_kv.pool.kv_geometry`. numpy only; torch inside the functions that take
or build tensors.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, Optional

import numpy as np

from sglang_cp_shared_kv.pool.kv_geometry import (
    BF16_BYTES,
    NSA_INDEX_HEAD_DIM,
    PAGE_SIZE,
    index_row_bytes,
    mla_kv_cache_dim,
)

SENTINEL = 0xEE  # decode pages nobody may write
PREFIX_MARK = 0x5A  # decode's own (radix-cached) prefix KV, which prefill must not touch


@dataclass(frozen=True)
class Geometry:
    """One KV pool's shape: MLA rows of ``kv_cache_dim`` elements, the NSA index pages."""

    layers: int
    kv_lora_rank: int
    qk_rope_head_dim: int
    dtype: str  # "bf16" | "fp8_e4m3"
    kv_cache_dim: int

    @property
    def kv_page_bytes(self) -> int:
        return PAGE_SIZE * self.kv_cache_dim * (BF16_BYTES if self.dtype == "bf16" else 1)

    @property
    def index_page_bytes(self) -> int:
        return PAGE_SIZE * index_row_bytes(NSA_INDEX_HEAD_DIM)

    def pool_kwargs(self) -> Dict[str, Any]:
        import torch

        dtype = torch.bfloat16 if self.dtype == "bf16" else torch.float8_e4m3fn
        return dict(page_size=PAGE_SIZE, kv_lora_rank=self.kv_lora_rank, dtype=dtype,
                    qk_rope_head_dim=self.qk_rope_head_dim, layer_num=self.layers, device="cpu",
                    index_head_dim=NSA_INDEX_HEAD_DIM, enable_memory_saver=False,
                    kv_cache_dim=self.kv_cache_dim)


#: The layer count of DeepSeek-V3.2 with a narrow latent (bytes do not matter to the
#: transfer path; descriptors do: layers x pages).
TEST_GEOMETRY = Geometry(layers=61, kv_lora_rank=64, qk_rope_head_dim=64, dtype="bf16", kv_cache_dim=128)


def model_geometry(config_path: Path, kv_cache_dtype: str, layers: Optional[int] = None) -> Geometry:
    """The pool shape SGLang builds for an NSA model config (``kv_cache_dim``: the bytes of
    a packed fp8 row, or the bf16 values of a row; see :func:`.pool.kv_geometry.mla_kv_cache_dim`)."""
    config = json.loads(Path(config_path).read_text())
    rank, rope = config["kv_lora_rank"], config["qk_rope_head_dim"]
    return Geometry(layers=layers or config["num_hidden_layers"], kv_lora_rank=rank, qk_rope_head_dim=rope,
                    dtype=kv_cache_dtype, kv_cache_dim=mla_kv_cache_dim(kv_cache_dtype, rank, rope))


def content(seed: int, layer: int, pages: int, page_bytes: int, kind: str) -> np.ndarray:
    """The bytes of ``pages`` request pages of one layer: a pure function of its arguments,
    so every process derives the same replicated KV. Each page is a random row (per seed
    and kind) plus a per-(layer, position) offset, so a page at a wrong position, layer or
    row offset never matches."""
    rng = np.random.Generator(np.random.Philox(key=[seed, 0 if kind == "kv" else 1]))
    base = np.frombuffer(rng.bytes(page_bytes), dtype=np.uint8)
    offsets = ((layer * 131 + np.arange(pages) * 7) % 251 + 1).astype(np.uint8)
    return base[None, :] + offsets[:, None]


def kv_pages(pool, layer: int):
    """One layer's MLA buffer of ``pool`` as uint8 rows, one row a page."""
    import torch

    buffer = pool.kv_buffer[layer]
    return buffer.view(-1).view(torch.uint8).view(-1, PAGE_SIZE * buffer.shape[-1] * buffer.element_size())


def index_pages(pool, layer: int):
    """One layer's NSA index buffer of ``pool`` (already uint8 rows, one row a page)."""
    return pool.index_k_with_scale_buffer[layer]
