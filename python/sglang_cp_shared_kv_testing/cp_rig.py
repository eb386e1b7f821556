"""One CP rank's rig, whatever the SGLang release: the plugin's shared-KV pool and allocator
beside a stock replicated pool of the same logical size, the same requests run through both,
every forward driven through the plugin's real hook functions around SGLang's real classes.
:class:`Rig` holds the requests, the forward's steps (:meth:`Rig.run_forward`) and the
comparisons; each release's rig says how its SGLang builds a batch, splits and gathers the
chunk and stores it (:class:`.cp_rig_nsa.InSeqRig`, 0.5.12.post1's in-seq split;
:class:`.cp_rig_dsa.InterleaveRig`, 0.5.23's interleave). The replicated pool stores the
whole chunk, as a stock rank does after SGLang's gathers.

Per layer it compares, bit for bit: the index K/scale the indexer reads (full and
rank-dependent lengths, where the release has them), the top-k of a torch reference
indexer, and the kernel inputs and reference attention output of
:mod:`.attention_reference`; after each forward, the chunk rows this rank owns as its
shard holds them (MLA and index) against the replicated pool's. Mismatches are collected
in ``errors``, never raised, so every rank keeps issuing the same collectives.
"""

from __future__ import annotations

import os
from contextlib import contextmanager
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import List, Sequence, Tuple

import numpy as np
import torch

from sglang_cp_shared_kv.settings.config import DEBUG_ENV
from sglang_cp_shared_kv.pool.kv_geometry import NSA_INDEX_HEAD_DIM as INDEX_DIM
from sglang_cp_shared_kv.pool.kv_geometry import NSA_KV_LORA_RANK as KV_LORA_RANK
from sglang_cp_shared_kv.pool.kv_geometry import NSA_QK_ROPE_HEAD_DIM as ROPE_DIM
from sglang_cp_shared_kv.pool.kv_geometry import PAGE_SIZE as PAGE
from sglang_cp_shared_kv.pool.kv_geometry import mla_kv_cache_dim
from sglang_cp_shared_kv_testing.attention_reference import (
    TOPK,
    as_bytes,
    reference_topk,
    stock_forward_extend_inputs,
    transform_topk,
)

LAYERS = 2
Q_HEADS = 2
INDEX_HEADS = 2
MAX_REQS, MAX_LEN = 64, 4096
# Attention and the reference indexer run for every QUERY_STRIDE-th query token (and the
# last); the KV rows of *every* position of the sequence are compared regardless.
QUERY_STRIDE = 4
DTYPES = {"bf16": (torch.bfloat16, mla_kv_cache_dim("bf16")),
          "fp8_e4m3": (torch.float8_e4m3fn, mla_kv_cache_dim("fp8_e4m3"))}


@contextmanager
def _cuda_streams_on(device: str):
    """On a CPU, ``torch.cuda.current_stream()`` (which SGLang's ``rebuild_cp_kv_cache`` passes
    to its all-gather, unused without pynccl) answers None instead of raising."""
    if device != "cpu":
        yield
        return
    from sglang_cp_shared_kv.scoped import attributes_set

    with attributes_set(torch.cuda, current_stream=lambda *args, **kwargs: None):
        yield


@dataclass
class RigForward:
    """One forward of the rig: the shared pool's batch and backend, the replicated pool's,
    the batch's ``out_cache_loc`` (chunk rows, then SGLang's padding rows, if any), the
    requests this rank's attention tables hold, by row (indices into the batch), and what a
    release's rig keeps besides (``extra``)."""

    fb_s: object
    be_s: object
    fb_r: object
    be_r: object
    out_cache_loc: torch.Tensor
    rows: List[int] = field(default_factory=lambda: [0])
    extra: dict = field(default_factory=dict)


@dataclass
class Request:
    slot: int
    seq_len: int = 0
    pages: List[int] = field(default_factory=list)


@dataclass(frozen=True)
class BatchItem:
    """One request's part of a forward: ``extend_len`` tokens after ``prefix``."""

    req: Request
    prefix: int
    extend_len: int

    @property
    def seq_len(self) -> int:
        return self.prefix + self.extend_len


class Rig:
    """One rank's pools, allocator and request table for one (dtype, debug) config."""

    #: the module of the release's ``Indexer``, whose ``_store_index_k_cache`` the rig drives
    INDEXER_MODULE = ""

    def __init__(self, rank: int, n: int, dtype_name: str, group, device: str, debug: str = "off",
                 physical_pages: int = 24, prefetch: bool = False):
        """``group``: SGLang's attention-CP ``GroupCoordinator``; ``prefetch``: gather each
        layer's MLA history one layer ahead on a second group (``forward.prefetch``)."""
        from sglang_cp_shared_kv.context import CpSharedKVContext
        from sglang_cp_shared_kv.cp_shared_kv_layout import CpSharedKVLayout

        self.rank, self.n, self.dtype_name, self.device, self.debug = rank, n, dtype_name, device, debug
        dtype, dim = DTYPES[dtype_name]
        self.fp8 = dtype_name == "fp8_e4m3"
        kwargs = dict(page_size=PAGE, kv_lora_rank=KV_LORA_RANK, dtype=dtype, qk_rope_head_dim=ROPE_DIM,
                      layer_num=LAYERS, device=device, index_head_dim=INDEX_DIM, enable_memory_saver=False,
                      kv_cache_dim=dim)
        logical = physical_pages * PAGE * n
        self.layout = CpSharedKVLayout(PAGE, n, rank)
        self.shared, self.replicated, self.allocator = self._pools(logical, CpSharedKVContext(self.layout), kwargs)
        if prefetch:
            from sglang_cp_shared_kv.context import new_prefetch_group

            self.shared.context.prefetch_group = new_prefetch_group(group)
        self.req_to_token = torch.zeros((MAX_REQS, MAX_LEN), dtype=torch.int32, device=device)
        self.free_slots = list(range(MAX_REQS))
        self.indexer = SimpleNamespace(block_size=128, scale_fmt=None)
        self.layers = [SimpleNamespace(layer_id=i) for i in range(LAYERS)]
        self.errors: List[str] = []
        self.stats = {"forwards": 0, "layers": 0, "topk_rows": 0, "kernel_calls": {}}
        self._count_writes(self.shared.context.kernels, self.stats["kernel_calls"])
        self.forward_counter = 0
        #: a :class:`..host_syncs.HostSyncCounter` told where each forward is (None: not counted)
        self.host_syncs = None
        #: the stock ``forward_extend`` the shared pool's hook wraps (the harness may slow it down)
        self.shared_forward_extend = stock_forward_extend_inputs

    @staticmethod
    def _count_writes(kernels, counts: dict) -> None:
        """Count the shared pool's row stores and owner copies (``stats["kernel_calls"]``):
        one MLA and one index store per layer says each chunk row is quantised once."""
        for name in ("store_mla_rows", "store_index_rows", "copy_mla_rows", "copy_index_rows"):
            def counted(*args, _method=getattr(kernels, name), _name=name, **kwargs):
                counts[_name] = counts.get(_name, 0) + 1
                return _method(*args, **kwargs)

            setattr(kernels, name, counted)

    # ------------------------------------------------------------ requests
    def new_request(self) -> Request:
        return Request(slot=self.free_slots.pop(0))

    def share_prefix(self, donor: Request, pages: int) -> Request:
        """A radix-cache hit: a new request whose first ``pages`` pages are the donor's."""
        req = self.new_request()
        tokens = pages * PAGE
        self.req_to_token[req.slot, :tokens] = self.req_to_token[donor.slot, :tokens]
        req.seq_len, req.pages = tokens, donor.pages[:pages]
        return req

    def page_locs(self, pages) -> torch.Tensor:
        """Every token location of ``pages`` (page ids, any sequence), page by page."""
        pages = torch.as_tensor(pages, dtype=torch.int64, device=self.device)
        return (pages[:, None] * PAGE + torch.arange(PAGE, device=self.device)).reshape(-1)

    def release(self, req: Request, still_used: set) -> None:
        """Free the pages only ``req`` uses (shared prefix pages stay with their other users)."""
        own = [p for p in dict.fromkeys(req.pages) if p not in still_used]
        if own:
            self.allocator.free(self.page_locs(own))
        self.free_slots.append(req.slot)

    def extend(self, req: Request, extend_len: int, *, full_view_layers=(), pad_rows: int = 0) -> bool:
        """One prefill forward of ``extend_len`` tokens of ``req``; False if out of memory."""
        return self.extend_batch([(req, extend_len)], full_view_layers=full_view_layers, pad_rows=pad_rows)

    def extend_batch(self, items: Sequence[Tuple[Request, int]], *, full_view_layers=(), pad_rows: int = 0) -> bool:
        """One prefill forward of a batch: ``extend_len`` tokens of each ``(req, extend_len)``,
        allocated together as SGLang does; False if out of memory."""
        t = lambda v: torch.tensor(v, dtype=torch.int64, device=self.device)  # noqa: E731
        host = lambda v: torch.tensor(v, dtype=torch.int64)  # noqa: E731 (SGLang's *_cpu arguments)
        prefixes = [req.seq_len for req, _ in items]
        seq_lens = [prefix + extend_len for prefix, (_, extend_len) in zip(prefixes, items)]
        last = [int(self.req_to_token[req.slot, prefix - 1]) if prefix else -1
                for prefix, (req, _) in zip(prefixes, items)]
        locs = self.allocator.alloc_extend(t(prefixes), host(prefixes), t(seq_lens), host(seq_lens), t(last),
                                           sum(extend_len for _, extend_len in items))
        if locs is None:
            return False
        batch, start = [], 0
        for prefix, (req, extend_len) in zip(prefixes, items):
            self.req_to_token[req.slot, prefix: prefix + extend_len] = locs[start: start + extend_len].to(torch.int32)
            start += extend_len
            req.seq_len += extend_len
            req.pages = [int(x) for x in (self.req_to_token[req.slot, : req.seq_len: PAGE] // PAGE).tolist()]
            batch.append(BatchItem(req, prefix, extend_len))
        self.run_forward(batch, locs, full_view_layers, pad_rows)
        return True

    # ------------------------------------------------------------ forward
    def _batch_fields(self, batch: Sequence[BatchItem], out_cache_loc, sparse: str, rows: Sequence[int]):
        """(attention metadata fields, ``ForwardBatch`` fields) of a batch's extend, as the
        sparse-attention backend's ``init_forward_metadata`` builds them, its tables holding
        the requests ``rows`` (indices into ``batch``); ``sparse``: the release's prefix of the
        sparse fields ("nsa" on 0.5.12.post1, "dsa" on 0.5.23)."""
        from sglang.srt.model_executor.forward_batch_info import ForwardMode

        dev = self.device
        held = [batch[i] for i in rows]
        seq_lens, extend_lens = [it.seq_len for it in held], [it.extend_len for it in held]
        page_table = self.req_to_token[torch.tensor([it.req.slot for it in held], device=dev), : max(seq_lens)]
        seqlens = torch.tensor(seq_lens, dtype=torch.int32, device=dev)
        cu_k = torch.tensor([0, *np.cumsum(seq_lens)], dtype=torch.int32, device=dev)
        cu_q = torch.tensor([0, *np.cumsum(extend_lens)], dtype=torch.int32, device=dev)
        expanded = torch.cat([torch.arange(it.prefix + 1, it.seq_len + 1, dtype=torch.int32, device=dev)
                              for it in held])
        # fp8 + flashmla_sparse reads page_table_1_flattened when a request of the batch has a prefix
        ragged = self.fp8 and any(it.prefix for it in batch)
        flattened = torch.cat([page_table[r, :n] for r, n in enumerate(seq_lens)]) if ragged else None
        metadata = {
            "page_size": PAGE, "cache_seqlens_int32": seqlens, "max_seq_len_q": max(extend_lens),
            "max_seq_len_k": max(seq_lens), "cu_seqlens_q": cu_q, "cu_seqlens_k": cu_k, "page_table_1": page_table,
            "real_page_table": page_table[:, ::PAGE] // PAGE, f"{sparse}_cache_seqlens_int32": expanded.clamp(max=TOPK),
            f"{sparse}_cu_seqlens_q": cu_q, f"{sparse}_cu_seqlens_k": cu_k,
            f"{sparse}_extend_seq_lens_list": extend_lens, f"{sparse}_seqlens_expanded": expanded,
            "seq_lens_sum": sum(seq_lens), "page_table_1_flattened": flattened,
        }
        all_seq_lens = [it.seq_len for it in batch]
        fields = dict(
            forward_mode=ForwardMode.EXTEND, batch_size=len(batch),
            input_ids=torch.zeros(out_cache_loc.numel(), dtype=torch.int64, device=dev),
            req_pool_indices=torch.tensor([it.req.slot for it in batch], device=dev),
            seq_lens=torch.tensor(all_seq_lens, dtype=torch.int64, device=dev), out_cache_loc=out_cache_loc,
            seq_lens_sum=sum(all_seq_lens), seq_lens_cpu=torch.tensor(all_seq_lens),
            extend_prefix_lens_cpu=[it.prefix for it in batch], extend_seq_lens_cpu=[it.extend_len for it in batch],
            extend_num_tokens=sum(it.extend_len for it in batch),
        )
        return metadata, fields

    def _phase(self, layer_id, *, forward_start: bool = False) -> None:
        if self.host_syncs is not None:
            self.host_syncs.at_layer(layer_id, forward_start=forward_start)

    def _rand(self, gen, *shape, dtype=torch.bfloat16):
        return torch.randn(*shape, generator=gen).to(dtype).to(self.device)

    # ------------------------------------------------------------ one forward
    # ------------------------------------------------------------ per release (subclasses)
    def _pools(self, logical: int, context, kwargs):
        """(the plugin's shared pool, a stock replicated pool, the plugin's allocator) of
        ``logical`` tokens."""
        raise NotImplementedError

    def _sglang_indexer(self):
        """The release's ``Indexer`` class."""
        import importlib

        return importlib.import_module(self.INDEXER_MODULE).Indexer

    def _counted_sglang_index_store(self, *args, **kwargs):
        """SGLang's ``Indexer._store_index_k_cache`` as the shared pool's hook calls it (where
        the fused kernel does not apply, e.g. on CPU), counted like the kernels."""
        counts = self.stats["kernel_calls"]
        counts["sglang_index_store"] = counts.get("sglang_index_store", 0) + 1
        return self._sglang_indexer()._store_index_k_cache(*args, **kwargs)

    def _begin_forward(self, batch: Sequence[BatchItem], locs, pad_rows) -> "RigForward":
        """The forward's batches and backends, the plugin's ``init_forward_metadata`` hook,
        SGLang's CP preparation."""
        raise NotImplementedError

    def _store_index(self, forward: "RigForward", layer_id: int, key: torch.Tensor) -> None:
        """The layer's index keys (one row per chunk row) into both pools, the shared one
        through the plugin's hook around SGLang's store."""
        raise NotImplementedError

    def _latent(self, fb, layer, k_nope: torch.Tensor, k_rope: torch.Tensor):
        """(k_nope, k_rope) as the backend's ``forward_extend`` receives them on this rank."""
        raise NotImplementedError

    def _forward_extend_hook(self):
        """The plugin's hook around the backend's ``forward_extend``."""
        raise NotImplementedError

    def _end_forward(self) -> None:
        """The release's bookkeeping after a forward's layers."""

    def _compare_index_reads(self, where, lid, item: BatchItem, be_s, be_r, row: int):
        """Compare the index K/scale the indexer kernels read for ``item`` (row ``row`` of each
        backend's tables); return the dequantised keys."""
        raise NotImplementedError

    def run_forward(self, batch: Sequence[BatchItem], locs, full_view_layers, pad_rows):
        debug_on = self.debug == "on" or (self.debug == "alternate" and self.forward_counter % 2 == 1)
        os.environ[DEBUG_ENV] = "1" if debug_on else "0"  # read once per batch, by attach_batch_state
        forward = self._begin_forward(batch, locs, pad_rows)
        fb_s, be_s, fb_r, be_r = forward.fb_s, forward.be_s, forward.fb_r, forward.be_r
        rows = forward.out_cache_loc.numel()
        gen = torch.Generator().manual_seed(1_000_003 * self.forward_counter + 17)  # same on all ranks
        self.forward_counter += 1
        shape = "; ".join(f"prefix {it.prefix}, extend {it.extend_len}" for it in batch)
        for layer in self.layers:
            lid = layer.layer_id
            self._phase(lid)
            where = f"forward {self.forward_counter} ({shape}) layer {lid}"
            # ---- indexer: store, then what its kernels read, request by request of this rank's rows
            self._store_index(forward, lid, self._rand(gen, rows, INDEX_DIM))
            # NOTE: every rank draws every request's numbers, whichever its tables hold, so the
            # generators stay in step and the chunk's rows are the same on every rank
            draws = []
            for item in batch:
                queries = torch.unique(torch.cat([torch.arange(0, item.extend_len, QUERY_STRIDE),
                                                  torch.tensor([item.extend_len - 1])])).to(self.device)
                draws.append((queries, self._rand(gen, len(queries), INDEX_HEADS, INDEX_DIM),
                              self._rand(gen, len(queries), INDEX_HEADS, dtype=torch.float32)))
            topk_s, topk_r = [], []
            for row, index in enumerate(forward.rows):
                item, (queries, q_index, weights) = batch[index], draws[index]
                k_idx = self._compare_index_reads(where, lid, item, be_s, be_r, row)
                positions = reference_topk(q_index, weights, k_idx, item.prefix + queries)
                topk_s.append(transform_topk(positions, be_s.forward_metadata.page_table_1, row))
                topk_r.append(transform_topk(positions, be_r.forward_metadata.page_table_1, row))
                self.stats["topk_rows"] += int((positions >= 0).sum())
            topk_s, topk_r = torch.cat(topk_s), torch.cat(topk_r)
            # ---- MLA: store the chunk, read through the top-k, attend
            k_nope = self._rand(gen, rows, 1, KV_LORA_RANK)
            k_rope = self._rand(gen, rows, 1, ROPE_DIM)
            q_all = self._rand(gen, sum(len(d[0]) for d in draws), Q_HEADS, KV_LORA_RANK + ROPE_DIM)
            starts = np.cumsum([0] + [len(d[0]) for d in draws])
            q = torch.cat([q_all[starts[i]: starts[i + 1]] for i in forward.rows])
            k_nope_s, k_rope_s = self._latent(fb_s, layer, k_nope, k_rope)
            save = lid not in full_view_layers
            if not save:  # the chunk was stored earlier by another writer: full-view read
                self.shared.set_mla_kv_buffer(layer, forward.out_cache_loc, k_nope, k_rope)
                self.replicated.set_mla_kv_buffer(layer, forward.out_cache_loc, k_nope, k_rope)
            got = self._forward_extend_hook()(self.shared_forward_extend, be_s, q, k_nope_s, k_nope_s, layer, fb_s,
                                              save_kv_cache=save, k_rope=k_rope_s, topk_indices=topk_s, fp8=self.fp8)
            want = stock_forward_extend_inputs(be_r, q, k_nope, k_nope, layer, fb_r, save_kv_cache=save,
                                               k_rope=k_rope, topk_indices=topk_r, fp8=self.fp8)
            for name in want:
                self._expect_equal(f"{where}: {name}", got[name], want[name])
            self._phase(None)  # the rig's own bookkeeping below is not the forward's
            self.stats["layers"] += 1
        self._end_forward()
        self._compare_shard_writes(f"forward {self.forward_counter} ({shape})", locs)
        self.stats["forwards"] += 1
        self.end_forward(fb_s)

    def end_forward(self, fb_s) -> None:
        """The forward's agreement point, through the plugin's AFTER hook on
        ``ModelRunner.forward`` as a server reaches it (raises on every rank when any rank
        recorded a problem); the batch ends there."""
        from sglang_cp_shared_kv.forward.hooks import agree_after_forward

        agree_after_forward(None, SimpleNamespace(token_to_kv_pool=self.shared), fb_s)

    def _compare_shard_writes(self, where, locs):
        """The chunk rows this rank owns, as its shard now holds them (MLA and index, every
        layer), against the replicated pool's rows at the same logical locations."""
        from sglang_cp_shared_kv.forward.materialize import index_rows

        owned = self.layout.owned_by_this_rank(locs, validate=False)
        logical = locs[owned]
        physical = self.layout.logical_locs_to_physical(logical, validate=False)
        self.stats["shard_rows_compared"] = self.stats.get("shard_rows_compared", 0) + int(logical.numel())
        for layer in self.layers:
            lid = layer.layer_id
            self._expect_equal(f"{where} layer {lid}: shard MLA rows", self.shared.physical_kv_buffer(lid)[physical],
                               self.replicated.kv_buffer[lid][logical])
            self._expect_equal(f"{where} layer {lid}: shard index rows",
                               index_rows(self.shared.physical_index_buffer(lid), physical, PAGE),
                               index_rows(self.replicated.index_k_with_scale_buffer[lid], logical, PAGE))
        self._compare_whole_shard(where)

    def _compare_whole_shard(self, where):
        """Every page this rank owns (page 0 reserved), as its shard holds it, against the
        replicated pool's page: a write that lands outside its chunk -- on a radix prefix,
        another request's pages -- shows here, not in the chunk's own rows."""
        physical_pages = self.shared.physical_size // PAGE
        owned = torch.arange(1, physical_pages, device=self.device)
        logical = self.layout.physical_pages_to_logical(owned, validate=False)
        for layer in self.layers:
            lid = layer.layer_id
            self._expect_equal(f"{where} layer {lid}: whole shard, MLA",
                               self.shared.physical_kv_buffer(lid)[self.page_locs(owned)],
                               self.replicated.kv_buffer[lid][self.page_locs(logical)])
            self._expect_equal(f"{where} layer {lid}: whole shard, index",
                               self.shared.physical_index_buffer(lid)[owned],
                               self.replicated.index_k_with_scale_buffer[lid][logical])

    def _expect_equal(self, what, got, want):
        same = got.shape == want.shape and torch.equal(as_bytes(got), as_bytes(want))
        if not same:
            self.errors.append(f"{what}: differs (shapes {tuple(got.shape)} vs {tuple(want.shape)})")
