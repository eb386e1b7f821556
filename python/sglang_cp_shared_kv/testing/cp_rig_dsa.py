"""One CP rank's rig on SGLang 0.5.23 (DSA prefill CP, ``--cp-strategy interleave``): the
twin of :mod:`.cp_rig` (0.5.12.post1's in-seq split), with the same requests, comparisons
and scenarios (:mod:`.cp_scenarios`), driven through 0.5.23's hooks
(:mod:`sglang_cp_shared_kv.forward.hooks_dsa`).

Real (SGLang 0.5.23's own code): the runtime context of CP rank ``rank`` of an interleave
prefill server (:class:`.cpu_kv_configurator.CpuDsaRank`), with the attention-CP
``GroupCoordinator`` over gloo; ``DSATokenToKVPool`` (the replicated baseline) beside the
plugin's ``CpSharedDSATokenToKVPool`` and ``CpSharedInterleavedPagesAllocator``;
``ForwardBatch``, ``DSAMetadata`` and the ``ForwardContext`` the indexer reads its pool
from; ``prepare_cp_forward`` (the interleave metadata, with its padding), the interleave
shard of each layer's chunk KV (``shard_hidden_states``, as the model computes its rows) and
its all-gathers (``materialize_full_indexer_k_cache``, ``materialize_full_mla_kv``, over
gloo); ``Indexer._store_index_k_cache`` (its CPU path: ``act_quant`` +
``set_index_k_scale_buffer``). A chunk shorter than the CP group is not split
(``is_cp_active`` answers False) and every rank stores all of it, as SGLang does.

Built by hand as ``init_forward_metadata`` would build them for one request (the backend
needs a model runner): the page tables of ``DSAMetadata``. Attention kernels do not run on
a CPU: :func:`.attention_reference.stock_forward_extend_inputs` stands for the stock
``forward_extend`` (store the chunk, read the cache) and records what its kernel would read.
"""

from __future__ import annotations

import os
from types import SimpleNamespace

import torch

from sglang_cp_shared_kv.config import DEBUG_ENV
from sglang_cp_shared_kv.kv_geometry import NSA_INDEX_HEAD_DIM as INDEX_DIM
from sglang_cp_shared_kv.kv_geometry import NSA_KV_LORA_RANK as KV_LORA_RANK
from sglang_cp_shared_kv.kv_geometry import NSA_QK_ROPE_HEAD_DIM as ROPE_DIM
from sglang_cp_shared_kv.kv_geometry import PAGE_SIZE as PAGE
from sglang_cp_shared_kv.testing.attention_reference import (
    TOPK,
    reference_topk,
    stock_forward_extend_inputs,
    transform_topk,
)
from sglang_cp_shared_kv.testing.cp_rig import (
    DTYPES,
    INDEX_HEADS,
    LAYERS,
    MAX_LEN,
    MAX_REQS,
    Q_HEADS,
    QUERY_STRIDE,
    Rig,
    _cuda_streams_on,
)


class InterleaveRig(Rig):
    """One rank's pools, allocator and request table on 0.5.23 (module docstring); the
    request bookkeeping and the shard comparisons are :class:`.cp_rig.Rig`'s."""

    def __init__(self, rank: int, n: int, dtype_name: str, group, device: str = "cpu", debug: str = "off",
                 physical_pages: int = 24, prefetch: bool = False):
        """Inside the rank's runtime context (``get_parallel()`` answers CP rank ``rank`` of
        ``n``); ``group``: its attention-CP ``GroupCoordinator``."""
        from sglang.srt.mem_cache.memory_pool import DSATokenToKVPool

        from sglang_cp_shared_kv.allocator import CpSharedInterleavedPagesAllocator
        from sglang_cp_shared_kv.context import CpSharedKVContext
        from sglang_cp_shared_kv.cp_shared_kv_layout import CpSharedKVLayout
        from sglang_cp_shared_kv.pool_dsa import CpSharedDSATokenToKVPool

        self.rank, self.n, self.dtype_name, self.device, self.debug = rank, n, dtype_name, device, debug
        dtype, dim = DTYPES[dtype_name]
        self.fp8 = dtype_name == "fp8_e4m3"
        kwargs = dict(page_size=PAGE, kv_lora_rank=KV_LORA_RANK, dtype=dtype, qk_rope_head_dim=ROPE_DIM,
                      layer_num=LAYERS, device=device, index_head_dim=INDEX_DIM, enable_memory_saver=False,
                      kv_cache_dim=dim)
        logical = physical_pages * PAGE * n
        self.layout = CpSharedKVLayout(PAGE, n, rank)
        self.shared = CpSharedDSATokenToKVPool(logical, context=CpSharedKVContext(self.layout), **kwargs)
        self.replicated = DSATokenToKVPool(logical, **kwargs)
        self.allocator = CpSharedInterleavedPagesAllocator(logical, PAGE, dtype, device, self.shared, True)
        if prefetch:
            from sglang_cp_shared_kv.forward.prefetch import new_prefetch_group

            self.shared.context.prefetch_group = new_prefetch_group(group)
        self.req_to_token = torch.zeros((MAX_REQS, MAX_LEN), dtype=torch.int32, device=device)
        self.free_slots = list(range(MAX_REQS))
        self.indexer = SimpleNamespace(block_size=128, scale_fmt=None)
        self.layers = [SimpleNamespace(layer_id=i) for i in range(LAYERS)]
        self.errors = []
        self.stats = {"forwards": 0, "layers": 0, "topk_rows": 0, "kernel_calls": {}, "split_forwards": 0}
        self._count_writes(self.shared.context.kernels, self.stats["kernel_calls"])
        self.forward_counter = 0
        self.host_syncs = None
        self.shared_forward_extend = stock_forward_extend_inputs

    # ------------------------------------------------------------ forward
    def _batch(self, pool, req, prefix, extend_len, out_cache_loc):
        """0.5.23's ``ForwardBatch`` and the DSA metadata of one request, its backend (the
        pool it holds) and the ``ForwardContext`` SGLang publishes around the forward."""
        from sglang.srt.layers.attention.dsa_backend import DSAMetadata, TopkTransformMethod
        from sglang.srt.model_executor.forward_batch_info import ForwardBatch, ForwardMode
        from sglang.srt.model_executor.forward_context import ForwardContext

        seq_len = prefix + extend_len
        dev = self.device
        page_table = self.req_to_token[req.slot: req.slot + 1, :seq_len]
        seqlens = torch.tensor([seq_len], dtype=torch.int32, device=dev)
        cu_k = torch.tensor([0, seq_len], dtype=torch.int32, device=dev)
        cu_q = torch.tensor([0, extend_len], dtype=torch.int32, device=dev)
        expanded = torch.arange(prefix + 1, seq_len + 1, dtype=torch.int32, device=dev)
        ragged = self.fp8 and prefix > 0  # fp8 + flashmla_sparse reads page_table_1_flattened
        metadata = DSAMetadata(
            page_size=PAGE, cache_seqlens_int32=seqlens, max_seq_len_q=extend_len, max_seq_len_k=seq_len,
            cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, page_table_1=page_table,
            real_page_table=page_table[:, ::PAGE] // PAGE,
            dsa_cache_seqlens_int32=expanded.clamp(max=TOPK), dsa_cu_seqlens_q=cu_q,
            dsa_cu_seqlens_k=cu_k, dsa_extend_seq_lens_list=[extend_len], dsa_seqlens_expanded=expanded,
            seq_lens_sum=seq_len, page_table_1_flattened=page_table[0, :seq_len] if ragged else None,
        )
        fb = ForwardBatch(
            forward_mode=ForwardMode.EXTEND, batch_size=1,
            input_ids=torch.zeros(extend_len, dtype=torch.int64, device=dev),
            req_pool_indices=torch.tensor([req.slot], device=dev), seq_lens=seqlens.long(),
            out_cache_loc=out_cache_loc, seq_lens_sum=seq_len, seq_lens_cpu=torch.tensor([seq_len]),
            extend_prefix_lens_cpu=[prefix], extend_seq_lens_cpu=[extend_len], extend_num_tokens=extend_len,
        )
        # fp8 KV reads through flashmla_sparse's RAGGED top-k transform, bf16 through PAGED, as
        # DeepseekSparseAttnBackend.get_topk_transform_method decides it for those backends
        method = TopkTransformMethod.RAGGED if self.fp8 else TopkTransformMethod.PAGED
        backend = SimpleNamespace(forward_metadata=metadata, token_to_kv_pool=pool,
                                  get_topk_transform_method=lambda mode=None: method)
        return fb, backend, ForwardContext(attn_backend=backend)

    def _split(self, fb) -> bool:
        """SGLang's CP preparation of the batch (``prepare_cp_forward``, where ``is_cp_active``):
        the interleave metadata with its padding; False where SGLang runs the chunk unsplit."""
        from sglang.srt.layers.cp.utils import is_cp_active, prepare_cp_forward

        if not is_cp_active(fb):
            return False
        prepare_cp_forward(fb)
        return True

    def _gathered(self, fb, full: torch.Tensor, gather) -> torch.Tensor:
        """``full`` (one row per chunk row) as ``gather`` (an interleave materialize) returns
        it from this rank's shard of it (``shard_hidden_states``, as the model computes
        its rows); the gather must restore the whole chunk in token order."""
        from sglang.srt.layers.cp.base import get_cp_strategy

        local = get_cp_strategy().shard_hidden_states(full.reshape(full.shape[0], -1), fb)
        with _cuda_streams_on(self.device):
            out = gather(local.view(-1, *full.shape[1:]))
        self._expect_equal("SGLang's interleave all-gather of the chunk", out, full)
        return out

    def run_forward(self, req, prefix, extend_len, locs, full_view_layers, pad_rows):
        """One forward. ``pad_rows`` (0.5.12's in-seq padding rows of ``out_cache_loc``) has no
        counterpart: interleave pads only each rank's local rows, which its gathers drop."""
        from sglang.srt.layers.attention.dsa.dsa_indexer import Indexer
        from sglang.srt.layers.cp.base import get_cp_strategy
        from sglang.srt.model_executor.forward_context import forward_context

        from sglang_cp_shared_kv.forward.hooks_dsa import (
            attach_batch_state,
            forward_extend_on_dense_view,
            store_index_k_owned_and_dense,
        )
        from sglang_cp_shared_kv.testing.torch_standins import act_quant_reference

        seq_len = prefix + extend_len
        debug_on = self.debug == "on" or (self.debug == "alternate" and self.forward_counter % 2 == 1)
        os.environ[DEBUG_ENV] = "1" if debug_on else "0"  # read once per batch, by attach_batch_state
        fb_s, be_s, ctx_s = self._batch(self.shared, req, prefix, extend_len, locs)
        fb_r, be_r, ctx_r = self._batch(self.replicated, req, prefix, extend_len, locs)
        self._phase(None, forward_start=True)
        split = self._split(fb_s)  # the model prepares CP before its layers, after the backend's metadata
        attach_batch_state(None, be_s, fb_s)
        self.stats["split_forwards"] += int(split)
        strategy = get_cp_strategy()
        gen = torch.Generator().manual_seed(1_000_003 * self.forward_counter + 17)  # same on all ranks
        self.forward_counter += 1
        for layer in self.layers:
            lid = layer.layer_id
            self._phase(lid)
            where = f"forward {self.forward_counter} (prefix {prefix}, extend {extend_len}) layer {lid}"
            # ---- indexer: the chunk's keys (gathered where SGLang splits), stored, then read
            key = self._rand(gen, extend_len, INDEX_DIM)
            key_s = self._gathered(fb_s, key, lambda k: strategy.materialize_full_indexer_k_cache(k, fb_s)) \
                if split else key
            with forward_context(ctx_s):
                store_index_k_owned_and_dense(self._counted_sglang_index_store, self.indexer, fb_s, lid, key_s,
                                              act_quant=act_quant_reference)
            with forward_context(ctx_r):
                Indexer._store_index_k_cache(self.indexer, fb_r, lid, key, act_quant=act_quant_reference)
            k_idx = self._compare_index_reads(where, lid, seq_len, prefix, extend_len, be_s, be_r)
            queries = torch.unique(torch.cat([torch.arange(0, extend_len, QUERY_STRIDE),
                                              torch.tensor([extend_len - 1])])).to(self.device)
            positions = reference_topk(self._rand(gen, len(queries), INDEX_HEADS, INDEX_DIM),
                                       self._rand(gen, len(queries), INDEX_HEADS, dtype=torch.float32),
                                       k_idx, prefix + queries)
            topk_s = transform_topk(positions, be_s.forward_metadata.page_table_1)
            topk_r = transform_topk(positions, be_r.forward_metadata.page_table_1)
            # ---- MLA: the chunk's latent (gathered where SGLang splits), stored, read, attended
            k_nope = self._rand(gen, extend_len, 1, KV_LORA_RANK)
            k_rope = self._rand(gen, extend_len, 1, ROPE_DIM)
            q = self._rand(gen, len(queries), Q_HEADS, KV_LORA_RANK + ROPE_DIM)
            if split:
                latent = torch.cat([k_nope, k_rope], dim=-1)
                latent = self._gathered(fb_s, latent, lambda x: torch.cat(strategy.materialize_full_mla_kv(
                    fb_s, layer, x[..., :KV_LORA_RANK], x[..., KV_LORA_RANK:]), dim=-1))
                k_nope_s, k_rope_s = latent[..., :KV_LORA_RANK], latent[..., KV_LORA_RANK:]
            else:
                k_nope_s, k_rope_s = k_nope, k_rope
            save = lid not in full_view_layers
            if not save:  # the chunk was stored earlier by another writer: full-view read
                self.shared.set_mla_kv_buffer(layer, locs, k_nope, k_rope)
                self.replicated.set_mla_kv_buffer(layer, locs, k_nope, k_rope)
            got = forward_extend_on_dense_view(self.shared_forward_extend, be_s, q, k_nope_s, k_nope_s, layer,
                                               fb_s, save_kv_cache=save, k_rope=k_rope_s, topk_indices=topk_s,
                                               fp8=self.fp8)
            want = stock_forward_extend_inputs(be_r, q, k_nope, k_nope, layer, fb_r, save_kv_cache=save,
                                               k_rope=k_rope, topk_indices=topk_r, fp8=self.fp8)
            for name in want:
                self._expect_equal(f"{where}: {name}", got[name], want[name])
            self._phase(None)
            self.stats["layers"] += 1
            self.stats["topk_rows"] += int((positions >= 0).sum())
        self._compare_shard_writes(f"forward {self.forward_counter} (prefix {prefix}, extend {extend_len})", locs)
        self.stats["forwards"] += 1
        self.shared.end_batch()

    def _counted_sglang_index_store(self, *args, **kwargs):
        """0.5.23's ``Indexer._store_index_k_cache`` as the shared pool's hook calls it, counted."""
        from sglang.srt.layers.attention.dsa.dsa_indexer import Indexer

        counts = self.stats["kernel_calls"]
        counts["sglang_index_store"] = counts.get("sglang_index_store", 0) + 1
        return Indexer._store_index_k_cache(*args, **kwargs)

    def _compare_index_reads(self, where, lid, seq_len, prefix, extend_len, be_s, be_r):
        """The index K/scale the indexer kernels read (0.5.23 keeps only the fused K+scale
        read), through each backend's ``real_page_table``."""
        tables = be_s.forward_metadata.real_page_table, be_r.forward_metadata.real_page_table
        lens = torch.tensor([seq_len], dtype=torch.int64, device=self.device)
        got = self.shared.get_index_k_scale_buffer(lid, lens, tables[0], seq_len, seq_len)
        want = self.replicated.get_index_k_scale_buffer(lid, lens, tables[1], seq_len, seq_len)
        for part, g, w in zip(("K", "scale"), got, want):
            self._expect_equal(f"{where}: get_index_k_scale_buffer {part}", g, w)
        return want[0].view(torch.float8_e4m3fn).float() * want[1].view(torch.float32)
