"""Byte geometry of an NSA (DeepSeek-V3.2 / GLM-5) KV pool (pure; no SGLang import).

Per token and layer an NSA pool stores
  * one MLA latent row: ``kv_lora_rank + qk_rope_head_dim`` values, either bf16
    (576 x 2 = 1,152 B) or packed fp8 (512 fp8 nope + 4 fp32 scales + 64 bf16 rope = 656 B);
  * one indexer row: ``index_head_dim`` fp8 values + one fp32 scale per 128 values
    (128 + 4 = 132 B), kept per page as ``page_size`` K rows followed by the scales.

Pool buffer sizes follow SGLang 0.5.12's ``NSATokenToKVPool``: the MLA buffer has
``size + page_size`` rows (page 0 is the padding page) and the index buffer has
``(size + page_size + 1) // page_size`` pages, per layer.

This module is the one source of these numbers: the page size, the row sizes (and the
dimensions the kernels are specialised for) are defined here and imported by the planner,
the pool, the kernels (``sgl-kernel/``) and the tests.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

GIB = 1 << 30  # SGLang reports KV sizes in units of 2**30 bytes ("GB" in its logs)
BF16_BYTES = 2
FP32_BYTES = 4
NOPE_FP8_GROUP = 128  # fp8 MLA nope values share one fp32 scale per group
INDEX_QUANT_BLOCK = 128  # index K values share one fp32 scale per block

#: Tokens per KV page. NOTE: SGLang forces 64-token pages for NSA models on CUDA, and its
#: NSA index buffer (and so our layout, kernels and transfer) is built around it.
PAGE_SIZE = 64

#: Pages at the start of every dense view that no sequence page maps to: the dense dummy
#: page, where SGLang's padding rows (location 0) and table entries past the sequence point.
DENSE_DUMMY_PAGES = 1

#: The latent and indexer dimensions of every NSA model we support (DeepSeek-V3.2, GLM-5);
#: the fused store kernels are specialised for them.
NSA_KV_LORA_RANK = 512
NSA_QK_ROPE_HEAD_DIM = 64
NSA_INDEX_HEAD_DIM = 128


def mla_row_bytes(kv_cache_dtype: str, kv_lora_rank: int = NSA_KV_LORA_RANK,
                  qk_rope_head_dim: int = NSA_QK_ROPE_HEAD_DIM) -> int:
    """Bytes of one token's MLA latent row in one layer: bf16 ``[nope | rope]``, or packed
    fp8 ``[fp8 nope | fp32 scale per 128 | bf16 rope]``."""
    if normalize_kv_cache_dtype(kv_cache_dtype) == "bf16":
        return (kv_lora_rank + qk_rope_head_dim) * BF16_BYTES
    return kv_lora_rank + kv_lora_rank // NOPE_FP8_GROUP * FP32_BYTES + qk_rope_head_dim * BF16_BYTES


def mla_kv_cache_dim(kv_cache_dtype: str, kv_lora_rank: int = NSA_KV_LORA_RANK,
                     qk_rope_head_dim: int = NSA_QK_ROPE_HEAD_DIM) -> int:
    """Elements per MLA row as SGLang's pool stores it (``kv_cache_dim``): bf16 values
    (576), or the bytes of a packed fp8 row (656)."""
    if normalize_kv_cache_dtype(kv_cache_dtype) == "bf16":
        return kv_lora_rank + qk_rope_head_dim
    return mla_row_bytes(kv_cache_dtype, kv_lora_rank, qk_rope_head_dim)


def index_row_bytes(index_head_dim: int = NSA_INDEX_HEAD_DIM) -> int:
    """Bytes of one token's indexer K (fp8) + scale (fp32 per 128 values) in one layer (132)."""
    return index_head_dim + index_head_dim // INDEX_QUANT_BLOCK * FP32_BYTES

KV_CACHE_DTYPES = ("bf16", "fp8_e4m3")
_KV_DTYPE_ALIASES = {"bf16": "bf16", "bfloat16": "bf16", "auto": "bf16", "fp8_e4m3": "fp8_e4m3"}

BUNDLED_CONFIG_DIR = Path(__file__).resolve().parents[1] / "model_configs"
BUNDLED_MODELS = {"glm-5": "glm-5.json", "deepseek-v3.2": "deepseek-v3.2.json"}


class ModelConfigError(ValueError):
    """The model configuration is unreadable or is not an NSA MLA model."""


def normalize_kv_cache_dtype(name: str) -> str:
    try:
        return _KV_DTYPE_ALIASES[name]
    except KeyError:
        raise ValueError(
            f"unsupported KV cache dtype {name!r}; use one of {', '.join(KV_CACHE_DTYPES)}"
        ) from None


@dataclass(frozen=True)
class NsaModelShape:
    """The fields of an NSA MLA model config that decide its KV footprint."""

    name: str
    num_layers: int
    kv_lora_rank: int
    qk_rope_head_dim: int
    index_head_dim: int
    index_topk: int
    max_context_len: int

    @classmethod
    def from_hf_config(cls, config: Mapping[str, Any], name: str) -> "NsaModelShape":
        mla_fields = ("kv_lora_rank", "qk_rope_head_dim")
        nsa_fields = ("index_topk", "index_head_dim")
        missing_mla = [f for f in mla_fields if config.get(f) is None]
        missing_nsa = [f for f in nsa_fields if config.get(f) is None]
        if missing_mla:
            raise ModelConfigError(
                f"{name} is not an MLA model (config lacks {', '.join(missing_mla)}); "
                "CP shared KV supports NSA MLA models such as DeepSeek-V3.2 and GLM-5"
            )
        if missing_nsa:
            raise ModelConfigError(
                f"{name} is not an NSA model (config lacks {', '.join(missing_nsa)}); "
                "CP shared KV supports NSA MLA models such as DeepSeek-V3.2 and GLM-5"
            )
        values = {}
        for field in ("num_hidden_layers", *mla_fields, *nsa_fields):
            value = config.get(field)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ModelConfigError(f"{name}: {field} must be a positive integer, got {value!r}")
            values[field] = value
        if values["index_head_dim"] % INDEX_QUANT_BLOCK:
            raise ModelConfigError(
                f"{name}: index_head_dim={values['index_head_dim']} is not a multiple of "
                f"{INDEX_QUANT_BLOCK}"
            )
        return cls(
            name=name,
            num_layers=values["num_hidden_layers"],
            kv_lora_rank=values["kv_lora_rank"],
            qk_rope_head_dim=values["qk_rope_head_dim"],
            index_head_dim=values["index_head_dim"],
            index_topk=values["index_topk"],
            max_context_len=int(config.get("max_position_embeddings") or 0),
        )

    @classmethod
    def load(cls, name_or_path: str) -> "NsaModelShape":
        """Load a bundled model (``glm-5``, ``deepseek-v3.2``) or a ``config.json`` path."""
        if name_or_path in BUNDLED_MODELS:
            path = BUNDLED_CONFIG_DIR / BUNDLED_MODELS[name_or_path]
        else:
            path = Path(name_or_path)
            if path.is_dir():
                path = path / "config.json"
            if not path.is_file():
                raise ModelConfigError(
                    f"unknown model config {name_or_path!r}: use "
                    f"{' or '.join(BUNDLED_MODELS)} or a path to a config.json"
                )
        try:
            config = json.loads(path.read_text())
        except (OSError, ValueError) as exc:
            raise ModelConfigError(f"cannot read model config {str(path)!r}: {exc}") from None
        if not isinstance(config, dict):
            raise ModelConfigError(f"model config {str(path)!r} is not a JSON object")
        # Multimodal wrappers keep the language model under text_config.
        if "kv_lora_rank" not in config and isinstance(config.get("text_config"), dict):
            config = config["text_config"]
        return cls.from_hf_config(config, name_or_path)

    # ----------------------------------------------------------------- row bytes
    def mla_row_bytes(self, kv_cache_dtype: str) -> int:
        """Bytes of one token's MLA latent row in one layer."""
        return mla_row_bytes(kv_cache_dtype, self.kv_lora_rank, self.qk_rope_head_dim)

    @property
    def index_row_bytes(self) -> int:
        """Bytes of one token's indexer K + scale in one layer."""
        return index_row_bytes(self.index_head_dim)

    def token_bytes_all_layers(self, kv_cache_dtype: str) -> int:
        return (self.mla_row_bytes(kv_cache_dtype) + self.index_row_bytes) * self.num_layers

    # ---------------------------------------------------------------- pool bytes
    def pool_bytes(self, pool_tokens: int, kv_cache_dtype: str, page_size: int) -> tuple[int, int]:
        """(MLA bytes, index bytes) of an ``NSATokenToKVPool`` of ``pool_tokens``, all layers."""
        mla_rows = pool_tokens + page_size
        index_pages = (pool_tokens + page_size + 1) // page_size
        mla = mla_rows * self.mla_row_bytes(kv_cache_dtype) * self.num_layers
        index = index_pages * page_size * self.index_row_bytes * self.num_layers
        return mla, index

    def max_pool_tokens(self, budget_bytes: int, kv_cache_dtype: str, page_size: int) -> int:
        """Largest page-aligned pool whose buffers fit in ``budget_bytes``."""
        per_token = self.token_bytes_all_layers(kv_cache_dtype)
        tokens = max(0, budget_bytes // per_token // page_size * page_size)
        while tokens > 0 and sum(self.pool_bytes(tokens, kv_cache_dtype, page_size)) > budget_bytes:
            tokens -= page_size
        return tokens
