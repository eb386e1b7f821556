"""One CP rank's rig on SGLang 0.5.23 (DSA prefill CP, ``--cp-strategy interleave``): the
twin of :mod:`.cp_rig` (0.5.12.post1's in-seq split), with the same requests, comparisons
and scenarios (:mod:`.cp_scenarios`), driven through 0.5.23's hooks
(:mod:`sglang_cp_shared_kv.forward.hooks_v0523`).

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

Built by hand as ``init_forward_metadata`` would build them (the backend needs a model
runner): the page tables of ``DSAMetadata``, holding the requests SGLang's own
``shard_per_request`` keeps on this rank where the batch is dealt out (those with query
tokens here: a batch's request shorter than the group is absent from some ranks' tables).
Attention kernels do not run on a CPU:
:func:`.attention_reference.stock_forward_extend_inputs` stands for the stock
``forward_extend`` (store the chunk, read the cache) and records what its kernel would read.
"""

from __future__ import annotations

from types import SimpleNamespace

import torch

from sglang_cp_shared_kv.pool.kv_geometry import NSA_KV_LORA_RANK as KV_LORA_RANK
from sglang_cp_shared_kv.pool.kv_geometry import PAGE_SIZE as PAGE
from sglang_cp_shared_kv_testing.cp_rig import Rig, RigForward, _cuda_streams_on
from sglang_cp_shared_kv_testing.torch_standins import act_quant_reference


class InterleaveRig(Rig):
    """One rank's pools, allocator and request table on 0.5.23 (module docstring); the
    request bookkeeping and the shard comparisons are :class:`.cp_rig.Rig`'s."""

    INDEXER_MODULE = "sglang.srt.layers.attention.dsa.dsa_indexer"

    def __init__(self, rank: int, n: int, dtype_name: str, group, device: str = "cpu", debug: str = "off",
                 physical_pages: int = 24, prefetch: bool = False):
        """Inside the rank's runtime context (``get_parallel()`` answers CP rank ``rank`` of
        ``n``); ``group``: its attention-CP ``GroupCoordinator``."""
        super().__init__(rank, n, dtype_name, group, device, debug=debug, physical_pages=physical_pages,
                         prefetch=prefetch)
        self.stats["split_forwards"] = 0  # forwards SGLang dealt out (the rest ran unsplit)
        self.stats["requests_without_rows"] = 0  # requests of a batch absent from this rank's tables
        self.stats["pages_listed_twice"] = 0  # a radix prefix shared by requests of one batch

    def _pools(self, logical: int, context, kwargs):
        """0.5.23's DSA pool beside the plugin's, and the plugin's interleave allocator."""
        from sglang.srt.mem_cache.memory_pool import DSATokenToKVPool

        from sglang_cp_shared_kv.pool.allocator import CpSharedInterleavedPagesAllocator
        from sglang_cp_shared_kv.pool.kv_pool_v0523 import CpSharedDSATokenToKVPool

        shared = CpSharedDSATokenToKVPool(logical, context=context, **kwargs)
        allocator = CpSharedInterleavedPagesAllocator(logical, PAGE, kwargs["dtype"], self.device, shared, True)
        return shared, DSATokenToKVPool(logical, **kwargs), allocator

    # ------------------------------------------------------------ forward
    def _batch(self, pool, batch, out_cache_loc, rows):
        """0.5.23's ``ForwardBatch`` and the DSA metadata of ``batch`` (its tables holding the
        requests ``rows``), its backend (the pool and request table it holds) and the
        ``ForwardContext`` SGLang publishes around the forward."""
        from sglang.srt.layers.attention.dsa_backend import DSAMetadata, TopkTransformMethod
        from sglang.srt.model_executor.forward_batch_info import ForwardBatch
        from sglang.srt.model_executor.forward_context import ForwardContext

        metadata_fields, batch_fields = self._batch_fields(batch, out_cache_loc, "dsa", rows)
        metadata = DSAMetadata(**metadata_fields)
        fb = ForwardBatch(**batch_fields)
        # fp8 KV reads through flashmla_sparse's RAGGED top-k transform, bf16 through PAGED, as
        # DeepseekSparseAttnBackend.get_topk_transform_method decides it for those backends
        method = TopkTransformMethod.RAGGED if self.fp8 else TopkTransformMethod.PAGED
        backend = SimpleNamespace(forward_metadata=metadata, token_to_kv_pool=pool,
                                  req_to_token_pool=SimpleNamespace(req_to_token=self.req_to_token),
                                  get_topk_transform_method=lambda mode=None: method)
        return fb, backend, ForwardContext(attn_backend=backend)

    def _rows_on_this_rank(self, batch) -> list:
        """The requests ``init_forward_metadata`` keeps in this rank's tables: where the batch
        is dealt out, those with query tokens here (SGLang's ``shard_per_request``; its device
        half, a Triton kernel, is not run: the tables need only its host list), else all."""
        import sglang.kernels.ops.attention.dsa.cp_split as cp_split
        from sglang.srt.layers.attention.dsa.utils import can_dsa_prefill_cp_interleave
        from sglang.srt.layers.cp.base import get_cp_strategy
        from sglang.srt.model_executor.forward_batch_info import ForwardMode

        from sglang_cp_shared_kv.scoped import attributes_set

        extend_lens = [it.extend_len for it in batch]
        probe = SimpleNamespace(forward_mode=ForwardMode.EXTEND, extend_seq_lens_cpu=extend_lens)
        if not can_dsa_prefill_cp_interleave(probe):
            return list(range(len(batch)))
        with attributes_set(cp_split, dsa_cp_interleave_q_seqs=lambda *args: (None, None)):
            _, _, rows, _ = get_cp_strategy().shard_per_request(extend_lens, torch.tensor(extend_lens))
        return list(rows)

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

    def _begin_forward(self, batch, locs, pad_rows) -> RigForward:
        """The batches, the plugin's ``init_forward_metadata`` hook, SGLang's CP preparation.
        ``pad_rows`` (0.5.12's in-seq padding rows of ``out_cache_loc``) has no counterpart:
        interleave pads only each rank's local rows, which its gathers drop. Both pools'
        tables hold this rank's requests, as a stock rank's would."""
        from sglang_cp_shared_kv.forward.hooks_v0523 import attach_batch_state

        rows = self._rows_on_this_rank(batch)
        fb_s, be_s, ctx_s = self._batch(self.shared, batch, locs, rows)
        fb_r, be_r, ctx_r = self._batch(self.replicated, batch, locs, rows)
        self._phase(None, forward_start=True)
        split = self._split(fb_s)  # the model prepares CP before its layers, after the backend's metadata
        attach_batch_state(None, be_s, fb_s)
        self.stats["split_forwards"] += int(split)
        self.stats["requests_without_rows"] += len(batch) - len(rows)
        listed = self.shared.in_flight.batch_state.seq_pages
        self.stats["pages_listed_twice"] += int(listed.numel() - torch.unique(listed).numel())
        return RigForward(fb_s, be_s, fb_r, be_r, locs, rows=rows, extra=dict(ctx_s=ctx_s, ctx_r=ctx_r, split=split))

    def _store_index(self, forward: RigForward, layer_id: int, key: torch.Tensor) -> None:
        """The chunk's index keys (gathered by interleave where SGLang splits) through the
        plugin's hook around 0.5.23's store, each pool's store inside its forward context."""
        from sglang.srt.layers.cp.base import get_cp_strategy
        from sglang.srt.model_executor.forward_context import forward_context

        from sglang_cp_shared_kv.forward.hooks_v0523 import store_index_k_owned_and_dense

        fb_s = forward.fb_s
        if forward.extra["split"]:
            key_s = self._gathered(fb_s, key, lambda k: get_cp_strategy().materialize_full_indexer_k_cache(k, fb_s))
        else:
            key_s = key
        with forward_context(forward.extra["ctx_s"]):
            store_index_k_owned_and_dense(self._counted_sglang_index_store, self.indexer, fb_s, layer_id, key_s,
                                          act_quant=act_quant_reference)
        with forward_context(forward.extra["ctx_r"]):
            self._sglang_indexer()._store_index_k_cache(self.indexer, forward.fb_r, layer_id, key,
                                                        act_quant=act_quant_reference)

    def _latent(self, fb, layer, k_nope: torch.Tensor, k_rope: torch.Tensor):
        """(k_nope, k_rope) as ``forward_extend`` receives them: gathered by interleave's
        ``materialize_full_mla_kv`` from this rank's rows where SGLang splits the chunk."""
        from sglang.srt.layers.cp.base import get_cp_strategy

        if fb.attn_cp_metadata is None:
            return k_nope, k_rope
        gathered = self._gathered(fb, torch.cat([k_nope, k_rope], dim=-1), lambda x: torch.cat(
            get_cp_strategy().materialize_full_mla_kv(fb, layer, x[..., :KV_LORA_RANK], x[..., KV_LORA_RANK:]),
            dim=-1))
        return gathered[..., :KV_LORA_RANK], gathered[..., KV_LORA_RANK:]

    def _forward_extend_hook(self):
        from sglang_cp_shared_kv.forward.hooks_v0523 import forward_extend_on_dense_view

        return forward_extend_on_dense_view

    def _end_forward(self) -> None:
        """Nothing to count: the pool's context counts every interleave forward as gathered."""

    def _compare_index_reads(self, where, lid, item, be_s, be_r, row):
        """The index K/scale the indexer kernels read (0.5.23 keeps only the fused K+scale
        read), through row ``row`` of each backend's ``real_page_table``."""
        seq_len = item.seq_len
        tables = (be_s.forward_metadata.real_page_table[row: row + 1],
                  be_r.forward_metadata.real_page_table[row: row + 1])
        lens = torch.tensor([seq_len], dtype=torch.int64, device=self.device)
        got = self.shared.get_index_k_scale_buffer(lid, lens, tables[0], seq_len, seq_len)
        want = self.replicated.get_index_k_scale_buffer(lid, lens, tables[1], seq_len, seq_len)
        for part, g, w in zip(("K", "scale"), got, want):
            self._expect_equal(f"{where}: get_index_k_scale_buffer {part}", g, w)
        return want[0].view(torch.float8_e4m3fn).float() * want[1].view(torch.float32)
