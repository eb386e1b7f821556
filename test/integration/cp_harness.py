"""Multi-process CP harness: is what the stock NSA kernels read with shared KV bit-identical
to what they read on a replicated (flag-off) pool?

N rank processes over ``torch.distributed`` gloo, each with SGLang's attention-CP
``GroupCoordinator`` set up as in a server, hold

* the plugin's ``CpSharedNSATokenToKVPool`` (this rank's shard) and allocator, and
* a stock ``NSATokenToKVPool`` of the same logical size: the replicated baseline,

and run the same requests through both. For each forward the harness builds SGLang's
real ``ForwardBatch`` and ``NSAMetadata`` (as ``init_forward_metadata`` builds them for
one in-seq-split request) and drives the plugin's real hook functions:

* ``batch_state.attach_batch_state`` (the ``init_forward_metadata`` AFTER hook),
* ``writes.store_index_k_owned_and_dense`` around SGLang's real
  ``Indexer._store_index_k_cache`` (on CPU its fallback path: ``act_quant`` +
  ``set_index_k_scale_buffer``; on CUDA its fused JIT store),
* ``materialize.forward_extend_on_dense_view`` around :func:`stock_forward_extend_inputs`,
  which does what the stock ``forward_extend`` does before its kernel call (store the
  chunk, fetch the KV cache) and records what the kernel would receive.

Attention kernels cannot run on a CPU, so the harness compares what they would read:
the index K/scale the indexer reads (full and rank-dependent lengths, the fused
K+scale read too), the top-k positions of a torch reference indexer, the KV rows each
top-k index selects (the sparse kernels' input), the rows ``page_table_1_flattened``
selects (the fp8 RAGGED dequantize input), and the output of a torch reference of
sparse MLA attention over them. Everything must match bit for bit.

Mismatches are collected, never raised mid-scenario, so every rank keeps issuing the
same collectives; the parent process enforces a deadline and kills stragglers.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Callable, Dict, List

import numpy as np
import torch
from testing_support import free_port, gloo_attention_cp_group, run_rank_processes

PAGE = 64
KV_LORA_RANK, ROPE_DIM, INDEX_DIM = 512, 64, 128
LAYERS = 2
TOPK = 32
Q_HEADS = 2
INDEX_HEADS = 2
MAX_REQS, MAX_LEN = 64, 4096
# Attention and the reference indexer run for every QUERY_STRIDE-th query token (and the
# last); the KV rows of *every* position of the sequence are compared regardless.
QUERY_STRIDE = 4
DTYPES = {"bf16": (torch.bfloat16, 576), "fp8_e4m3": (torch.float8_e4m3fn, 656)}
DEBUG_ENV = "SGLANG_DEBUG_CP_SHARED_KV"

REPO = Path(__file__).resolve().parents[2]


# ============================================================ parent side
def run_cp_group(n: int, jobs: List[tuple], *, device: str = "cpu",
                 timeout_s: float = 1200.0) -> Dict[str, dict]:
    """Run ``jobs`` = [(scenario, dtype, debug)] on ``n`` ranks, debug being "on", "off" or
    "alternate" (per forward); return, per ``scenario/dtype/debug`` key, the merged
    outcome of all ranks."""
    import torch.multiprocessing as mp

    out_dir = tempfile.mkdtemp(prefix=f"cp-harness-{n}-")
    ctx = mp.get_context("spawn")
    port = free_port()
    per_rank = run_rank_processes(ctx, _rank_main, n, out_dir, args=(n, port, out_dir, jobs, device),
                                  timeout_s=timeout_s, what="CP harness")
    merged: Dict[str, dict] = {}
    for r, result in enumerate(per_rank):
        for key, outcome in result["scenarios"].items():
            entry = merged.setdefault(key, {"errors": [], "stats": outcome["stats"]})
            entry["errors"] += [f"rank {r}: {e}" for e in outcome["errors"]]
    return merged


# ============================================================== rank side
def _rank_main(rank, n, port, out_dir, jobs, device):
    for path in (REPO / "test", REPO / "python"):
        sys.path.insert(0, str(path))
    result: dict = {"scenarios": {}}
    try:
        group = _init_process(rank, n, port, device)
        for name, dtype_name, debug in jobs:
            rig = Rig(rank, n, dtype_name, group, device, debug=debug)
            SCENARIOS[name](rig)
            result["scenarios"][f"{name}/{dtype_name}/debug={debug}"] = {
                "errors": rig.errors[:20], "stats": rig.stats}
    except BaseException:  # noqa: BLE001 - reported to the parent
        result["fatal"] = traceback.format_exc()[-4000:]
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(result))
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(1 if "fatal" in result else 0)  # a failed rank makes the parent stop the others


def _init_process(rank: int, n: int, port: int, device: str):
    """gloo world + SGLang's attention-CP GroupCoordinator over it, as SGLang sets them up."""
    torch.set_num_threads(1)
    if device == "cuda":
        torch.cuda.set_device(0)  # several ranks share one GPU over gloo
    else:
        import torch_standins

        torch_standins.install()
    local_rank = 0 if device == "cuda" else rank  # on CUDA all ranks share GPU 0
    return gloo_attention_cp_group(rank, n, port, local_rank=local_rank, timeout_s=300)


# ================================================================== the rig
@dataclass
class Request:
    slot: int
    seq_len: int = 0
    pages: List[int] = field(default_factory=list)


class Rig:
    """One rank's pools, allocator and request table for one (dtype, debug) config."""

    def __init__(self, rank: int, n: int, dtype_name: str, group, device: str, debug: str = "off",
                 physical_pages: int = 24):
        from sglang_cp_shared_kv.allocator import CpSharedPagedTokenToKVPoolAllocator
        from sglang_cp_shared_kv.cp_shared_kv_layout import CpSharedKVLayout
        from sglang_cp_shared_kv.pool import CpSharedNSATokenToKVPool
        from sglang.srt.mem_cache.memory_pool import NSATokenToKVPool

        self.rank, self.n, self.dtype_name, self.device, self.debug = rank, n, dtype_name, device, debug
        dtype, dim = DTYPES[dtype_name]
        self.fp8 = dtype_name == "fp8_e4m3"
        kwargs = dict(page_size=PAGE, kv_lora_rank=KV_LORA_RANK, dtype=dtype, qk_rope_head_dim=ROPE_DIM,
                      layer_num=LAYERS, device=device, index_head_dim=INDEX_DIM, enable_memory_saver=False,
                      kv_cache_dim=dim)
        logical = physical_pages * PAGE * n
        self.layout = CpSharedKVLayout(PAGE, n, rank)
        self.shared = CpSharedNSATokenToKVPool(logical, layout=self.layout, **kwargs)
        self.replicated = NSATokenToKVPool(logical, **kwargs)
        self.allocator = CpSharedPagedTokenToKVPoolAllocator(logical, PAGE, dtype, device, self.shared, True)
        self.req_to_token = torch.zeros((MAX_REQS, MAX_LEN), dtype=torch.int32, device=device)
        self.free_slots = list(range(MAX_REQS))
        self.indexer = SimpleNamespace(block_size=128, scale_fmt=None)
        self.layers = [SimpleNamespace(layer_id=i) for i in range(LAYERS)]
        self.errors: List[str] = []
        self.stats = {"forwards": 0, "layers": 0, "topk_rows": 0}
        self.forward_counter = 0

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

    def release(self, req: Request, still_used: set) -> None:
        """Free the pages only ``req`` uses (shared prefix pages stay with their other users)."""
        own = [p for p in dict.fromkeys(req.pages) if p not in still_used]
        if own:
            locs = (torch.tensor(own, dtype=torch.int64, device=self.device)[:, None] * PAGE
                    + torch.arange(PAGE, device=self.device)).reshape(-1)
            self.allocator.free(locs)
        self.free_slots.append(req.slot)

    def extend(self, req: Request, extend_len: int, *, full_view_layers=(), pad_rows: int = 0) -> bool:
        """One prefill forward of ``extend_len`` tokens of ``req``; False if out of memory."""
        t = lambda v: torch.tensor([v], dtype=torch.int64, device=self.device)  # noqa: E731
        host = lambda v: torch.tensor([v], dtype=torch.int64)  # noqa: E731 (SGLang's *_cpu arguments)
        prefix = req.seq_len
        last = int(self.req_to_token[req.slot, prefix - 1]) if prefix else -1
        locs = self.allocator.alloc_extend(t(prefix), host(prefix), t(prefix + extend_len),
                                           host(prefix + extend_len), t(last), extend_len)
        if locs is None:
            return False
        self.req_to_token[req.slot, prefix: prefix + extend_len] = locs.to(torch.int32)
        req.seq_len += extend_len
        req.pages = [int(x) for x in (self.req_to_token[req.slot, : req.seq_len: PAGE] // PAGE).tolist()]
        self.run_forward(req, prefix, extend_len, locs, full_view_layers, pad_rows)
        return True

    # ------------------------------------------------------------ forward
    def _batch(self, pool, req, prefix, extend_len, out_cache_loc):
        from sglang.srt.layers.attention.nsa_backend import NSAMetadata
        from sglang.srt.model_executor.forward_batch_info import ForwardBatch, ForwardMode

        seq_len = prefix + extend_len
        dev = self.device
        page_table = self.req_to_token[req.slot: req.slot + 1, :seq_len]
        seqlens = torch.tensor([seq_len], dtype=torch.int32, device=dev)
        cu_k = torch.tensor([0, seq_len], dtype=torch.int32, device=dev)
        cu_q = torch.tensor([0, extend_len], dtype=torch.int32, device=dev)
        expanded = torch.arange(prefix + 1, seq_len + 1, dtype=torch.int32, device=dev)
        ragged = self.fp8 and prefix > 0  # fp8 + flashmla_sparse reads page_table_1_flattened
        metadata = NSAMetadata(
            page_size=PAGE, cache_seqlens_int32=seqlens, max_seq_len_q=extend_len, max_seq_len_k=seq_len,
            cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, page_table_1=page_table,
            real_page_table=page_table[:, ::PAGE] // PAGE,
            nsa_cache_seqlens_int32=expanded.clamp(max=TOPK), nsa_cu_seqlens_q=cu_q,
            nsa_cu_seqlens_k=cu_k, nsa_extend_seq_lens_list=[extend_len], nsa_seqlens_expanded=expanded,
            seq_lens_sum=seq_len, page_table_1_flattened=page_table[0, :seq_len] if ragged else None,
        )
        fb = ForwardBatch(
            forward_mode=ForwardMode.EXTEND, batch_size=1,
            input_ids=torch.zeros(out_cache_loc.numel(), dtype=torch.int64, device=dev),
            req_pool_indices=torch.tensor([req.slot], device=dev), seq_lens=seqlens.long(),
            out_cache_loc=out_cache_loc, seq_lens_sum=seq_len, seq_lens_cpu=torch.tensor([seq_len]),
            extend_prefix_lens_cpu=[prefix], extend_seq_lens_cpu=[extend_len],
            extend_num_tokens=extend_len, token_to_kv_pool=pool,
        )
        backend = SimpleNamespace(forward_metadata=metadata)
        fb.attn_backend = backend
        return fb, backend

    def _rand(self, gen, *shape, dtype=torch.bfloat16):
        return torch.randn(*shape, generator=gen).to(dtype).to(self.device)

    def run_forward(self, req, prefix, extend_len, locs, full_view_layers, pad_rows):
        from sglang.srt.layers.attention.nsa.nsa_indexer import Indexer
        from sglang.srt.layers.attention.nsa.triton_kernel import act_quant

        from sglang_cp_shared_kv.batch_state import attach_batch_state
        from sglang_cp_shared_kv.materialize import forward_extend_on_dense_view
        from sglang_cp_shared_kv.writes import store_index_k_owned_and_dense

        seq_len = prefix + extend_len
        debug_on = self.debug == "on" or (self.debug == "alternate" and self.forward_counter % 2 == 1)
        os.environ[DEBUG_ENV] = "1" if debug_on else "0"  # read once per batch, by attach_batch_state
        rows = extend_len + pad_rows  # SGLang pads the CP chunk with location-0 rows
        out_cache_loc = torch.cat([locs, torch.zeros(pad_rows, dtype=torch.int64, device=self.device)])
        fb_s, be_s = self._batch(self.shared, req, prefix, extend_len, out_cache_loc)
        fb_r, be_r = self._batch(self.replicated, req, prefix, extend_len, out_cache_loc)
        attach_batch_state(None, be_s, fb_s)
        gen = torch.Generator().manual_seed(1_000_003 * self.forward_counter + 17)  # same on all ranks
        self.forward_counter += 1
        for layer in self.layers:
            lid = layer.layer_id
            where = f"forward {self.forward_counter} (prefix {prefix}, extend {extend_len}) layer {lid}"
            # ---- indexer: store, then what its kernels read
            key = self._rand(gen, rows, INDEX_DIM)
            store_index_k_owned_and_dense(Indexer._store_index_k_cache, self.indexer, fb_s, lid, key,
                                          act_quant=act_quant)
            Indexer._store_index_k_cache(self.indexer, fb_r, lid, key, act_quant=act_quant)
            k_idx = self._compare_index_reads(where, lid, seq_len, prefix, extend_len, be_s, be_r)
            queries = torch.unique(torch.cat([torch.arange(0, extend_len, QUERY_STRIDE),
                                              torch.tensor([extend_len - 1])])).to(self.device)
            positions = reference_topk(self._rand(gen, len(queries), INDEX_HEADS, INDEX_DIM),
                                       self._rand(gen, len(queries), INDEX_HEADS, dtype=torch.float32),
                                       k_idx, prefix + queries)
            topk_s = transform_topk(positions, be_s.forward_metadata.page_table_1)
            topk_r = transform_topk(positions, be_r.forward_metadata.page_table_1)
            # ---- MLA: store the chunk, read through the top-k, attend
            k_nope = self._rand(gen, rows, 1, KV_LORA_RANK)
            k_rope = self._rand(gen, rows, 1, ROPE_DIM)
            q = self._rand(gen, len(queries), Q_HEADS, KV_LORA_RANK + ROPE_DIM)
            save = lid not in full_view_layers
            if not save:  # the chunk was stored earlier by another writer: full-view read
                self.shared.set_mla_kv_buffer(layer, out_cache_loc, k_nope, k_rope)
                self.replicated.set_mla_kv_buffer(layer, out_cache_loc, k_nope, k_rope)
            got = forward_extend_on_dense_view(stock_forward_extend_inputs, be_s, q, k_nope, k_nope, layer,
                                               fb_s, save_kv_cache=save, k_rope=k_rope, topk_indices=topk_s,
                                               fp8=self.fp8)
            want = stock_forward_extend_inputs(be_r, q, k_nope, k_nope, layer, fb_r, save_kv_cache=save,
                                               k_rope=k_rope, topk_indices=topk_r, fp8=self.fp8)
            for name in want:
                self._expect_equal(f"{where}: {name}", got[name], want[name])
            self.stats["layers"] += 1
            self.stats["topk_rows"] += int((positions >= 0).sum())
        self.stats["forwards"] += 1
        self.shared.end_batch()

    def _compare_index_reads(self, where, lid, seq_len, prefix, extend_len, be_s, be_r):
        """The index K/scale the indexer kernels read, at the lengths the CP segments read."""
        tables = be_s.forward_metadata.real_page_table, be_r.forward_metadata.real_page_table
        split = prefix + (self.rank + 1) * extend_len // (self.n + 1)  # a rank-dependent kv_len
        for kv_len in sorted({seq_len, max(split, 1)}):
            for name in ("get_index_k_continuous", "get_index_k_scale_continuous"):
                got = getattr(self.shared, name)(lid, kv_len, tables[0][0])
                want = getattr(self.replicated, name)(lid, kv_len, tables[1][0])
                self._expect_equal(f"{where}: {name}({kv_len})", got, want)
        lens = torch.tensor([seq_len], dtype=torch.int64, device=self.device)
        got = self.shared.get_index_k_scale_buffer(lid, lens, tables[0], seq_len, seq_len)
        want = self.replicated.get_index_k_scale_buffer(lid, lens, tables[1], seq_len, seq_len)
        for part, g, w in zip(("K", "scale"), got, want):
            self._expect_equal(f"{where}: get_index_k_scale_buffer {part}", g, w)
        k = want[0].view(torch.float8_e4m3fn).float() * want[1].view(torch.float32)
        return k

    def _expect_equal(self, what, got, want):
        same = got.shape == want.shape and torch.equal(_bytes(got), _bytes(want))
        if not same:
            self.errors.append(f"{what}: differs (shapes {tuple(got.shape)} vs {tuple(want.shape)})")


def _bytes(x: torch.Tensor) -> torch.Tensor:
    return x.contiguous().view(torch.uint8) if x.dtype != torch.uint8 else x


# ================================================= kernel-input recorders
def stock_forward_extend_inputs(backend, q, k, v, layer, forward_batch, save_kv_cache=True, k_rope=None,
                                topk_indices=None, fp8=False, **_):
    """What the stock ``forward_extend`` does before its kernel call, and what the kernel
    would read: store the chunk (when asked), fetch the KV cache, select rows."""
    pool = forward_batch.token_to_kv_pool
    if save_kv_cache:
        pool.set_mla_kv_buffer(layer, forward_batch.out_cache_loc, k, k_rope)
    kv_cache = pool.get_key_buffer(layer.layer_id)
    kv_rows = kv_cache.view(kv_cache.shape[0], -1)
    rows = _bytes(kv_rows[topk_indices.clamp(min=0).long()])  # (queries, TOPK, row bytes)
    rows[topk_indices < 0] = 0  # -1 padding selects nothing
    metadata = backend.forward_metadata
    seq_len = int(forward_batch.seq_lens_cpu[0])
    out = {
        # every row a kernel could reach through the page table
        "sequence rows": _bytes(kv_rows[metadata.page_table_1[0, :seq_len].long()]),
        "topk rows": rows,
        "attention output": reference_sparse_attention(q, rows, topk_indices, fp8),
    }
    flattened = metadata.page_table_1_flattened
    if flattened is not None:  # fp8 RAGGED: dequantize_k_cache_paged reads these rows in order
        out["flattened rows"] = _bytes(kv_cache.view(kv_cache.shape[0], -1)[flattened.long()])
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


def transform_topk(positions, page_table_1):
    """What the fused top-k transform does: sequence positions -> page_table_1 entries, -1 kept."""
    table = page_table_1[0].long()
    return torch.where(positions >= 0, table[positions.clamp(min=0)], -1).to(torch.int32)


# ================================================================ scenarios
def single_chunk(rig: Rig):
    req = rig.new_request()
    rig.extend(req, 437, pad_rows=3)


def chunked_prefill(rig: Rig):
    req = rig.new_request()
    for chunk in (200, 130, 256, 77):  # boundaries mid-page (200, 330, 663) and page-aligned
        rig.extend(req, chunk, pad_rows=chunk % 3)


def radix_prefix_hit(rig: Rig):
    donor = rig.new_request()
    rig.extend(donor, 500)
    hit = rig.share_prefix(donor, pages=5)
    rig.extend(hit, 300)


def prefix_mid_page(rig: Rig):
    req = rig.new_request()
    rig.extend(req, 100)  # the prefix ends in the middle of page 2
    rig.extend(req, 90)  # the next chunk starts on the shared page and ends mid-page too
    rig.extend(req, 1)


def fewer_pages_than_ranks(rig: Rig):
    req = rig.new_request()
    rig.extend(req, 70)  # two pages: with N > 2 some ranks own nothing
    rig.extend(req, 5)
    short = rig.new_request()
    rig.extend(short, 10)


def full_view_fallback(rig: Rig):
    """The chunk was written earlier (save_kv_cache=False): the current region is gathered."""
    req = rig.new_request()
    rig.extend(req, 300, full_view_layers=(0, 1))
    rig.extend(req, 150, full_view_layers=(1,))


def corrupted_shard_is_detected(rig: Rig):
    """Negative control: one rank corrupts one history page; the comparison must catch it."""
    req = rig.new_request()
    rig.extend(req, 256)
    history_page = req.pages[1]
    if rig.layout.owner_for_logical_pages_np([history_page])[0] == rig.rank:
        physical = int(rig.layout.logical_pages_to_physical_np([history_page])[0])
        rig.shared.kv_buffer[0][physical * PAGE: (physical + 1) * PAGE] = 0
    before = len(rig.errors)
    rig.extend(req, 64)
    rig.stats["detected"] = len(rig.errors) > before
    rig.errors.clear()


def soak(rig: Rig, mixes: int = 200, seed: int = 20261129):
    """Random request mixes: fresh and chunked requests, radix prefix hits, frees and page
    reuse (so ownership of a sequence's pages gets uneven), padding rows."""
    rng = np.random.default_rng(seed)
    live: List[Request] = []

    def users(exclude):
        return {p for r in live if r is not exclude for p in r.pages}

    for mix in range(mixes):
        if live and (len(live) > 5 or rng.random() < 0.3):
            victim = live.pop(int(rng.integers(len(live))))
            rig.release(victim, users(victim))
        donor = live[int(rng.integers(len(live)))] if live and rng.random() < 0.35 else None
        if donor is not None and len(donor.pages) > 1:
            req = rig.share_prefix(donor, int(rng.integers(1, len(donor.pages))))
        else:
            req = rig.new_request()
        total = int(rng.integers(1, 400))
        cuts = sorted(set(rng.integers(1, total, size=int(rng.integers(0, 3))).tolist())) if total > 1 else []
        chunks = np.diff([0, *cuts, total]).tolist()
        ok = True
        for chunk in chunks:
            full_view = (0,) if rng.random() < 0.1 else ()
            if not rig.extend(req, int(chunk), full_view_layers=full_view, pad_rows=int(rng.integers(0, 2 * rig.n))):
                ok = False
                break
        if ok:
            live.append(req)
        else:  # out of memory: give everything back and go on
            rig.release(req, users(req))
            while live:
                victim = live.pop()
                rig.release(victim, users(victim))
    rig.stats["mixes"] = mixes


SCENARIOS: Dict[str, Callable[[Rig], None]] = {
    f.__name__: f for f in (single_chunk, chunked_prefill, radix_prefix_hit, prefix_mid_page,
                            fewer_pages_than_ranks, full_view_fallback, corrupted_shard_is_detected, soak)
}
