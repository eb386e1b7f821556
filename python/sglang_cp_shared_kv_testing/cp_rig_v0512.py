"""One CP rank's rig on SGLang 0.5.12.post1 (NSA prefill CP, ``in-seq-split``): the plugin's
shared-KV pool and compute-owner allocator beside a stock replicated ``NSATokenToKVPool``, every
forward driven through the plugin's real hook functions (:mod:`sglang_cp_shared_kv.forward.hooks`)
around SGLang's real classes and functions (``ForwardBatch``, ``NSAMetadata``,
``Indexer._store_index_k_cache``; the in-seq CP metadata, split and all-gathers of
``cp_utils``; ``DeepseekV2AttentionMLA.rebuild_cp_kv_cache``). The requests, the forward's
steps and the comparisons are :class:`.cp_rig.Rig`'s.

Each layer's chunk KV (index key, latent) is drawn whole, the same on every rank; a rank
gets its own rows of it by SGLang's ``cp_split_and_rebuild_data``, as the model computes
them, and hands them to the hooks where SGLang would: the index key through
``Indexer._get_q_k_bf16``'s all-gather, the latent through ``rebuild_cp_kv_cache``. Where
the plugin keeps a chunk's rows local (``forward.local_writes_v0512``) those gathers are left
out; where it does not, SGLang's own gathers run over the gloo group.
"""

from __future__ import annotations

from types import SimpleNamespace

import torch

from sglang_cp_shared_kv.pool.kv_geometry import NSA_KV_LORA_RANK as KV_LORA_RANK
from sglang_cp_shared_kv.pool.kv_geometry import NSA_QK_ROPE_HEAD_DIM as ROPE_DIM
from sglang_cp_shared_kv.pool.kv_geometry import PAGE_SIZE as PAGE
from sglang_cp_shared_kv_testing.cp_rig import Rig, RigForward, _cuda_streams_on


class InSeqRig(Rig):
    """One rank's rig on 0.5.12.post1 (module docstring)."""

    INDEXER_MODULE = "sglang.srt.layers.attention.nsa.nsa_indexer"

    def _pools(self, logical: int, context, kwargs):
        """(the plugin's shared pool, a stock replicated pool, the plugin's allocator) of
        ``logical`` tokens: 0.5.12.post1's NSA classes and the compute-owner allocator."""
        from sglang.srt.mem_cache.memory_pool import NSATokenToKVPool

        from sglang_cp_shared_kv.pool.allocator import CpSharedPagedTokenToKVPoolAllocator
        from sglang_cp_shared_kv.pool.kv_pool_v0512 import CpSharedNSATokenToKVPool

        shared = CpSharedNSATokenToKVPool(logical, context=context, **kwargs)
        allocator = CpSharedPagedTokenToKVPoolAllocator(logical, PAGE, kwargs["dtype"], self.device, shared, True)
        return shared, NSATokenToKVPool(logical, **kwargs), allocator

    def _batch(self, pool, batch, out_cache_loc):
        from sglang.srt.layers.attention.nsa_backend import NSAMetadata, TopkTransformMethod
        from sglang.srt.model_executor.forward_batch_info import ForwardBatch

        metadata_fields, batch_fields = self._batch_fields(batch, out_cache_loc, "nsa", rows=[0])
        metadata = NSAMetadata(**metadata_fields)
        fb = ForwardBatch(**batch_fields, token_to_kv_pool=pool)
        # fp8 KV reads through flashmla_sparse's RAGGED top-k transform (the plugin's choice for
        # fp8 + in-seq split), bf16 through PAGED -- as NativeSparseAttnBackend decides it
        method = TopkTransformMethod.RAGGED if self.fp8 else TopkTransformMethod.PAGED
        backend = SimpleNamespace(forward_metadata=metadata, get_topk_transform_method=lambda mode=None: method)
        fb.attn_backend = backend
        return fb, backend

    def _cp_metadata(self, fb, rows: int, seq_len: int):
        """SGLang's in-seq-split metadata of a chunk of ``rows`` (padding included), as the
        model's forward builds it; None where SGLang does not split the chunk."""
        from sglang.srt.layers.attention.nsa.utils import can_nsa_cp_split
        from sglang.srt.layers.utils import cp_utils

        from sglang_cp_shared_kv.scoped import attributes_set
        from sglang_cp_shared_kv_testing.support import TorchOnCpu

        if not can_nsa_cp_split(rows, self.n, True, fb):
            return None
        on_cpu = {"torch": TorchOnCpu()} if self.device == "cpu" else {}  # its "cuda" length tensors
        with attributes_set(cp_utils, **on_cpu):
            return cp_utils.prepare_context_parallel_metadata(rows, self.rank, self.n, [seq_len])

    def _local(self, fb, full: torch.Tensor) -> torch.Tensor:
        """This rank's rows of ``full`` (one row per chunk row, padding included), as SGLang's
        in-seq split lays them out; all of them when SGLang does not split the chunk."""
        from sglang.srt.layers.utils import cp_utils

        if fb.attn_cp_metadata is None:
            return full
        return cp_utils.cp_split_and_rebuild_data(fb, full.reshape(full.shape[0], -1)).view(-1, *full.shape[1:])

    def _sglang_gather(self, what: str):
        """SGLang's ``cp_all_gather_rerange_output`` behind the plugin's hook on it (as the hook
        registry rebinds the name), counted in ``stats["sglang_gathers"]``."""
        from sglang.srt.layers.utils import cp_utils

        from sglang_cp_shared_kv.forward.hooks import all_gather_in_seq_order

        def gather(input_tensor, cp_size, forward_batch, stream):
            def sglang(*args):
                counts = self.stats.setdefault("sglang_gathers", {})
                counts[what] = counts.get(what, 0) + 1
                return cp_utils.cp_all_gather_rerange_output(*args)

            return all_gather_in_seq_order(sglang, input_tensor, cp_size, forward_batch, stream)

        return gather

    def _index_key(self, fb, key: torch.Tensor) -> torch.Tensor:
        """The index keys ``Indexer._get_q_k_bf16`` hands the index store: this rank's keys,
        all-gathered over the CP group by SGLang (unless the plugin keeps them local)."""
        from sglang_cp_shared_kv.forward.hooks import index_key_kept_local

        local, gather = self._local(fb, key), self._sglang_gather("index key")

        def get_q_k_bf16(indexer, q_lora, x, positions, enable_dual_stream, forward_batch):
            # how SGLang's _get_q_k_bf16 ends (the rig's keys come ready-made): the in-seq gather
            if forward_batch.attn_cp_metadata is None:
                return None, local
            return None, gather(local.contiguous(), self.n, forward_batch, None)

        return index_key_kept_local(get_q_k_bf16, self.indexer, None, None, None, False, fb)[1]

    def _latent(self, fb, layer, k_nope: torch.Tensor, k_rope: torch.Tensor):
        """(k_nope, k_rope) as ``forward_extend`` receives them: this rank's rows through
        SGLang's real ``DeepseekV2AttentionMLA.rebuild_cp_kv_cache`` (its latent all-gather),
        behind the plugin's hook on it."""
        from sglang.srt.models import deepseek_v2

        from sglang_cp_shared_kv.forward.hooks import latent_kept_local
        from sglang_cp_shared_kv.scoped import attributes_set

        if fb.attn_cp_metadata is None:  # SGLang does not split: every rank computed every row
            return k_nope, k_rope
        nope, rope = self._local(fb, k_nope), self._local(fb, k_rope)
        latent_cache = torch.empty(nope.shape[0], KV_LORA_RANK + ROPE_DIM, dtype=nope.dtype, device=nope.device)
        attention = SimpleNamespace(kv_lora_rank=KV_LORA_RANK, cp_size=self.n, attn_mqa=layer)
        swaps = {"cp_all_gather_rerange_output": self._sglang_gather("latent")}
        with attributes_set(deepseek_v2, **swaps), _cuda_streams_on(self.device):
            return latent_kept_local(deepseek_v2.DeepseekV2AttentionMLA.rebuild_cp_kv_cache, attention,
                                     latent_cache, fb, nope, rope)

    def _begin_forward(self, batch, locs, pad_rows) -> "RigForward":
        """The forward's batches and backends (the shared pool's through the plugin's
        ``init_forward_metadata`` hook), then SGLang's in-seq CP metadata, as the model builds
        it after the backend's. SGLang pads the CP chunk with ``pad_rows`` location-0 rows.
        One request per batch, as the in-seq split takes."""
        from sglang_cp_shared_kv.forward.hooks import attach_batch_state

        (item,) = batch
        out_cache_loc = torch.cat([locs, torch.zeros(pad_rows, dtype=torch.int64, device=self.device)])
        fb_s, be_s = self._batch(self.shared, batch, out_cache_loc)
        fb_r, be_r = self._batch(self.replicated, batch, out_cache_loc)
        self._phase(None, forward_start=True)
        attach_batch_state(None, be_s, fb_s)
        fb_s.attn_cp_metadata = self._cp_metadata(fb_s, item.extend_len + pad_rows, item.seq_len)
        return RigForward(fb_s, be_s, fb_r, be_r, out_cache_loc)

    def _store_index(self, forward: "RigForward", layer_id: int, key: torch.Tensor) -> None:
        """The layer's index keys into both pools: the shared one through the plugin's hook
        around SGLang's store (the keys as SGLang's all-gather hands them over), the
        replicated one by SGLang's store of the whole chunk."""
        from sglang.srt.layers.attention.nsa.triton_kernel import act_quant

        from sglang_cp_shared_kv.forward.hooks import store_index_k_owned_and_dense

        store_index_k_owned_and_dense(self._counted_sglang_index_store, self.indexer, forward.fb_s, layer_id,
                                      self._index_key(forward.fb_s, key), act_quant=act_quant)
        self._sglang_indexer()._store_index_k_cache(self.indexer, forward.fb_r, layer_id, key, act_quant=act_quant)

    def _forward_extend_hook(self):
        """The plugin's hook around the backend's ``forward_extend`` (0.5.12.post1's)."""
        from sglang_cp_shared_kv.forward.hooks import forward_extend_on_dense_view

        return forward_extend_on_dense_view

    def _end_forward(self) -> None:
        """How the forward's chunk reached the shards (the local-writes decision), counted."""
        kept = self.shared.in_flight.local_writes
        plan = kept[1] if kept is not None else None
        if plan is not None:
            paths = self.stats.setdefault("write_paths", {})
            key = f"index={'local' if plan.index else 'gathered'},mla={'local' if plan.mla else 'gathered'}"
            paths[key] = paths.get(key, 0) + 1

    def _compare_index_reads(self, where, lid, item, be_s, be_r, row):
        """The index K/scale the indexer kernels read, at the lengths the CP segments read."""
        tables = be_s.forward_metadata.real_page_table, be_r.forward_metadata.real_page_table
        seq_len = item.seq_len
        split = item.prefix + (self.rank + 1) * item.extend_len // (self.n + 1)  # a rank-dependent kv_len
        for kv_len in sorted({seq_len, max(split, 1)}):
            for name in ("get_index_k_continuous", "get_index_k_scale_continuous"):
                got = getattr(self.shared, name)(lid, kv_len, tables[0][row])
                want = getattr(self.replicated, name)(lid, kv_len, tables[1][row])
                self._expect_equal(f"{where}: {name}({kv_len})", got, want)
        lens = torch.tensor([seq_len], dtype=torch.int64, device=self.device)
        got = self.shared.get_index_k_scale_buffer(lid, lens, tables[0][row: row + 1], seq_len, seq_len)
        want = self.replicated.get_index_k_scale_buffer(lid, lens, tables[1][row: row + 1], seq_len, seq_len)
        for part, g, w in zip(("K", "scale"), got, want):
            self._expect_equal(f"{where}: get_index_k_scale_buffer {part}", g, w)
        k = want[0].view(torch.float8_e4m3fn).float() * want[1].view(torch.float32)
        return k
