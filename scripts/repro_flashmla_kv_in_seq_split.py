#!/usr/bin/env python3
"""Why stock SGLang 0.5.12.post1 crashes with fp8 KV + NSA prefill CP in-seq-split and the
default ``flashmla_kv`` backend ("num_splits must have shape (b+1)"), reproduced at the
kernel level on one Hopper GPU (no CP group needed).

What one CP rank does (read from 0.5.12.post1; docs/troubleshooting.md has the citations):
``NativeSparseAttnBackend.init_forward_metadata`` builds FlashMLA's tile-scheduler metadata
from one cache length per token of the **whole** extend chunk (padded to a multiple of the
CP size; only the round-robin split cuts it to the rank's tokens), while the in-seq split
leaves the rank only its two zigzag blocks, so ``_forward_flashmla_kv`` passes ``q`` with
about chunk / cp_size rows. The sparse fp8 decode kernel checks
``num_splits.shape[0] == q.shape[0] + 1`` and refuses. ``flashmla_sparse`` takes every size
from the local ``q`` and has no such metadata, hence it works.

This script makes the same two calls: metadata for N tokens, then the kernel with N / cp
rows (expected: the RuntimeError), and the control with metadata for N / cp tokens
(expected: runs). JSON to stdout; exit 0 when both outcomes are as expected.

Usage (on the GPU machine, sgl_kernel importable): python scripts/repro_flashmla_kv_in_seq_split.py
"""

from __future__ import annotations

import json
import sys

H_Q, D_QK, D_V, TOPK, PAGE, FP8_ROW_BYTES = 128, 576, 512, 2048, 64, 656  # DeepSeek-V3.2, attention TP 1


def attention(rows: int, metadata_tokens: int, chunk: int):
    """One ``_forward_flashmla_kv`` call: ``rows`` query tokens, metadata built for ``metadata_tokens``."""
    import torch
    from sgl_kernel.flash_mla import flash_mla_with_kvcache, get_mla_metadata

    seqlens = torch.arange(1, metadata_tokens + 1, dtype=torch.int32, device="cuda").clamp(max=TOPK)
    scheduler, num_splits = get_mla_metadata(cache_seqlens=seqlens, num_q_tokens_per_head_k=H_Q, num_heads_k=1,
                                             num_heads_q=H_Q, is_fp8_kvcache=True, topk=TOPK)
    cache = torch.zeros((chunk + PAGE - 1) // PAGE, PAGE, 1, FP8_ROW_BYTES, dtype=torch.uint8, device="cuda")
    q = torch.randn(rows, 1, H_Q, D_QK, dtype=torch.bfloat16, device="cuda")
    indices = torch.full((rows, 1, TOPK), -1, dtype=torch.int32, device="cuda")
    indices[:, 0, 0] = 0
    out, _ = flash_mla_with_kvcache(q=q, k_cache=cache, cache_seqlens=seqlens, head_dim_v=D_V,
                                    tile_scheduler_metadata=scheduler, num_splits=num_splits,
                                    softmax_scale=D_QK ** -0.5, indices=indices,
                                    block_table=torch.empty((rows, 0), dtype=torch.int32, device="cuda"),
                                    is_fp8_kvcache=True)
    torch.cuda.synchronize()
    return tuple(out.shape), int(num_splits.shape[0])


def outcome(**kwargs):
    try:
        shape, splits = attention(**kwargs)
        return {"ran": True, "out_shape": shape, "num_splits_len": splits}
    except RuntimeError as exc:
        return {"ran": False, "error": str(exc).splitlines()[0][:300]}


def main() -> int:
    chunk, cp_size = 4096, 2
    rows = chunk // cp_size
    report = {
        "chunk_tokens": chunk, "cp_size": cp_size, "rank_rows": rows,
        "in_seq_split_rank": outcome(rows=rows, metadata_tokens=chunk, chunk=chunk),  # what stock does
        "control_metadata_for_rank_rows": outcome(rows=rows, metadata_tokens=rows, chunk=chunk),
    }
    crash = report["in_seq_split_rank"]
    report["reproduced"] = (not crash["ran"] and "num_splits must have shape" in crash["error"]
                            and report["control_metadata_for_rank_rows"]["ran"])
    print(json.dumps(report, indent=1))
    return 0 if report["reproduced"] else 1


if __name__ == "__main__":
    sys.exit(main())
