"""What the stock NSA kernels would read, and torch references of what they compute.

Attention kernels cannot run on a CPU, so the CP harness compares their inputs: the KV
rows a top-k selects (the sparse kernels' input), the rows ``page_table_1_flattened``
selects (the fp8 RAGGED dequantize input), and the output of a torch reference of sparse
MLA attention over them; and with fp8 RAGGED on a chunk without prefix, the chunk's own
rows (``k``, ``k_rope``), which that path attends over instead of the cache.
:func:`stock_forward_extend_inputs` does what the stock ``forward_extend`` does before its
kernel call (store the chunk, fetch the KV cache) and records those inputs.
"""

from __future__ import annotations

import torch

from sglang_cp_shared_kv.pool.kv_geometry import NSA_KV_LORA_RANK as KV_LORA_RANK

#: Top-k width of the harness's reference indexer (the models use 2,048; 32 keeps the CPU
#: runs small while every sequence is longer than it).
TOPK = 32


def as_bytes(x: torch.Tensor) -> torch.Tensor:
    """The bytes of ``x`` (what a bit-exact comparison compares)."""
    return x.contiguous().view(torch.uint8) if x.dtype != torch.uint8 else x


def stock_forward_extend_inputs(backend, q, k, v, layer, forward_batch, save_kv_cache=True, k_rope=None,
                                topk_indices=None, fp8=False, **_):
    """What the stock ``forward_extend`` does before its kernel call, and what the kernel
    would read: store the chunk (when asked), fetch the KV cache, select rows. The pool is the
    batch's (0.5.12.post1) or the backend's (0.5.23's ``ForwardBatch`` carries none)."""
    pool = getattr(forward_batch, "token_to_kv_pool", None) or backend.token_to_kv_pool
    if save_kv_cache:
        pool.set_mla_kv_buffer(layer, forward_batch.out_cache_loc, k, k_rope)
    kv_cache = pool.get_key_buffer(layer.layer_id)
    kv_rows = kv_cache.view(kv_cache.shape[0], -1)
    rows = as_bytes(kv_rows[topk_indices.clamp(min=0).long()])  # (queries, TOPK, row bytes)
    rows[topk_indices < 0] = 0  # -1 padding selects nothing
    metadata = backend.forward_metadata
    row_lens = metadata.cache_seqlens_int32.tolist()  # the requests the tables hold, row by row
    reachable = torch.cat([metadata.page_table_1[row, :length] for row, length in enumerate(row_lens)])
    out = {
        # every row a kernel could reach through the page table
        "sequence rows": as_bytes(kv_rows[reachable.long()]),
        "topk rows": rows,
        "attention output": reference_sparse_attention(q, rows, topk_indices, fp8),
    }
    flattened = metadata.page_table_1_flattened
    if flattened is not None:  # fp8 RAGGED: dequantize_k_cache_paged reads these rows in order
        out["flattened rows"] = as_bytes(kv_cache.view(kv_cache.shape[0], -1)[flattened.long()])
    ragged = getattr(backend, "get_topk_transform_method", lambda mode=None: None)(forward_batch.forward_mode)
    if getattr(ragged, "name", None) == "RAGGED" and not any(forward_batch.extend_prefix_lens_cpu):
        # fp8 RAGGED without a prefix attends over the chunk's (gathered) bf16 rows themselves
        chunk = sum(forward_batch.extend_seq_lens_cpu)
        out["chunk rows attended"] = as_bytes(torch.cat([k[:chunk].reshape(chunk, -1),
                                                         k_rope[:chunk].reshape(chunk, -1)], dim=-1))
    return out


def dequantize_rows(rows: torch.Tensor, fp8: bool) -> torch.Tensor:
    """(T, K, row bytes) pool rows -> (T, K, 576) float32 latent."""
    if not fp8:
        return rows.view(torch.bfloat16).float()
    nope = rows[..., :KV_LORA_RANK].contiguous().view(torch.float8_e4m3fn).float()
    scales = rows[..., KV_LORA_RANK: KV_LORA_RANK + 16].contiguous().view(torch.float32)
    rope = rows[..., KV_LORA_RANK + 16:].contiguous().view(torch.bfloat16).float()
    nope = (nope.view(*nope.shape[:-1], 4, 128) * scales[..., None]).reshape(nope.shape)
    return torch.cat([nope, rope], dim=-1)


def reference_sparse_attention(q, rows, topk_indices, fp8):
    """softmax(q . kv_sel^T / sqrt(d)) . kv_sel[:, :512] over the selected rows, float32."""
    kv = dequantize_rows(rows, fp8)
    scores = torch.einsum("thd,tkd->thk", q.float(), kv) / (q.shape[-1] ** 0.5)
    scores = scores.masked_fill((topk_indices < 0)[:, None, :], float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    return torch.einsum("thk,tkd->thd", probs, kv[..., :KV_LORA_RANK])


def reference_topk(q, weights, k_index, query_positions):
    """A torch NSA indexer: logits = sum_h w_h relu(q_h . k); causal top-k positions, -1 padded.
    ``query_positions``: the sequence position of each query row."""
    scores = torch.relu(torch.einsum("thd,sd->ths", q.float(), k_index)) * weights[..., None]
    logits = scores.sum(1)  # (T, S)
    s = torch.arange(logits.shape[1], device=logits.device)[None, :]
    logits = logits.masked_fill(s > query_positions[:, None], float("-inf"))
    k = min(TOPK, logits.shape[1])
    values, positions = logits.topk(k, dim=1)
    positions = torch.where(torch.isinf(values), -1, positions)
    if k < TOPK:
        positions = torch.cat([positions, positions.new_full((positions.shape[0], TOPK - k), -1)], dim=1)
    return positions


def transform_topk(positions, page_table_1, row: int = 0):
    """What the fused top-k transform does: sequence positions -> entries of ``page_table_1``'s
    row ``row`` (the query's request), -1 kept."""
    table = page_table_1[row].long()
    return torch.where(positions >= 0, table[positions.clamp(min=0)], -1).to(torch.int32)
