#!/usr/bin/env python3
"""Our CP shared KV vs upstream SGLang 0.5.23's ``--enable-kv-cache-sharding``, side by side.

DeepSeek-V3.2 and GLM-5 (``kv_geometry``'s bundled shapes), CP N = 2, 4, 8, context 32K and 128K,
page 64, bf16 and fp8_e4m3 KV; upstream's real classes run on the 0.5.23 CPU install::

    .venv-0.5.23/bin/python scripts/compare_upstream_kv_sharding.py \\
        --out docs/results/compare_upstream_kv_sharding.json

(``scripts/bootstrap.sh test-0.5.23`` makes ``.venv-0.5.23``; ``.venv`` runs our 0.5.12 allocator.)

Every figure comes from code called here or from a formula whose source lines the JSON cites
(``formulas``, line numbers looked up in the installed files at run time):

* ``capacity``, per CP rank for a KV budget: physical tokens from each side's own sizing (ours
  ``plan_capacity``; upstream ``DefaultPoolConfigurator`` with its required trtllm layout: fp8
  latent rows 576 B raw vs our 656 B FlashMLA rows), the persistent scratch taken from the budget
  first (ours 0; upstream ``compute_page_shard_scratch_bytes``) and the logical tokens the group
  exposes (ours ``logical_tokens_for``; upstream its allocator's ``available_size()``). Ours also
  gives the planner's transient per-layer dense view (freed per layer, outside the KV budget).
* ``gather``, per layer, the last chunk of a ``context``-token prompt (history = context - chunk):
  bytes one rank receives for the history (latent + index; ours ``build_dense_page_map``,
  upstream its ``begin_shard_extend`` with a recording communicator) and for the chunk (upstream:
  interleave CP's gathers; ours: 0.5.12's local-writes page gather, or SGLang's bf16 gathers).
* ``pd``: Mooncake descriptors per prefill rank, whole request (KV per chunk, then the index
  state), into a fresh decode's consecutive pages. Ours ``transfer.pages`` on 0.5.12's
  compute-owner pages (its allocator, run by --ours-0512-python) and on interleaved pages 1..P
  (0.5.23: what ``CpSharedInterleavedPagesAllocator`` hands a request on a fresh pool, SGLang's
  free-list order); upstream ``filter_kv_indices_for_shard_rank``,
  ``_prepare_sharded_dsa_indices`` and ``group_concurrent_contiguous`` on its allocator's pages.
* ``support``: each side's limits, with the line that imposes each.
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import importlib.metadata
import importlib.util
import json
import math
import shlex
import subprocess
import sys
import tempfile
from pathlib import Path
from types import SimpleNamespace as NS

import numpy as np
import torch

from sglang_cp_shared_kv.releases import installed as releases
from sglang_cp_shared_kv.releases import v0523
from sglang_cp_shared_kv.cp_shared_kv_layout import CpSharedKVLayout
from sglang_cp_shared_kv.forward.dense_layout import build_dense_page_map
from sglang_cp_shared_kv.pool.kv_geometry import BUNDLED_CONFIG_DIR, BUNDLED_MODELS, GIB, KV_CACHE_DTYPES, PAGE_SIZE
from sglang_cp_shared_kv.pool.kv_geometry import NsaModelShape
from sglang_cp_shared_kv.pool.planner import plan_capacity
from sglang_cp_shared_kv.transfer.pages import contiguous_runs, filter_chunk, kv_descriptors, own_state_pages
from sglang_cp_shared_kv.transfer.pages import state_pages_to_send

ROOT = Path(__file__).resolve().parents[1]
MODELS, CP_SIZES, CONTEXTS = ("deepseek-v3.2", "glm-5"), (2, 4, 8), (32768, 131072)
SCRATCH_PREFIX_CONTEXTS, SCRATCH_SLOTS = 8, 2  # upstream's constants (formulas() cites them)
UP = "sglang/srt/"


def cite(where: str, snippet: str) -> str:
    """``file:line`` of the first line holding ``snippet``: ``sglang/...`` in the installed SGLang,
    anything else in this repository. Raises when the snippet is gone (a stale cite)."""
    base = Path(importlib.util.find_spec("sglang").origin).parents[1] if where.startswith("sglang/") else ROOT
    for number, line in enumerate((base / where).read_text().splitlines(), 1):
        if snippet in line:
            return f"{where}:{number}"
    raise LookupError(f"{snippet!r} not found in {where}")


def literal(where: str, name: str):
    """The literal this repository's module ``where`` assigns to ``name`` (parsed, not imported)."""
    for node in ast.parse((ROOT / where).read_text()).body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == name for t in node.targets):
            return ast.literal_eval(node.value)
    raise LookupError(f"{name} not assigned in {where}")


# --------------------------------------------------------------- formulas (cited in formulas())
def ceil_align(value: int, unit: int) -> int:
    return -(-value // unit) * unit


def upstream_scratch_bytes(context_len: int, cp_size: int, page: int, chunk: int, row_bytes: int) -> int:
    """Upstream's persistent scratch: 2 slots of [8 aligned contexts | chunk | trash page] rows."""
    rows = SCRATCH_PREFIX_CONTEXTS * ceil_align(context_len, cp_size * page) + ceil_align(chunk, page) + page
    return SCRATCH_SLOTS * rows * row_bytes


def chunk_gather_bytes(shape: NsaModelShape, chunk: int, latent_value_bytes: int) -> int:
    """All-gather output, per layer, of a chunk's latent (1 B per value: trtllm's packed fp8;
    2: bf16) and its bf16 index key."""
    return chunk * ((shape.kv_lora_rank + shape.qk_rope_head_dim) * latent_value_bytes + shape.index_head_dim * 2)


def received(out_bytes: int, n: int) -> int:
    """Bytes one rank receives of a regular all-gather's output (every rank sends one block)."""
    return out_bytes * (n - 1) // n


def formulas() -> dict:
    pi, il, mc = UP + "mem_cache/page_interleave.py", UP + "layers/cp/interleave.py", UP + "disaggregation/mooncake/conn.py"
    return {
        "upstream_scratch_bytes (checked equal to compute_page_shard_scratch_bytes in every row)": [
            cite(pi, "_KV_SHARD_SCRATCH_PREFIX_CONTEXTS = 8"), cite(pi, "* ceil_align(kvc.model_config.context_len"),
            cite(pi, "return self.max_prefix_tokens + self.chunk_tokens + self.page_size"),
            cite(pi, "scratch_bytes = 2 * spec.scratch_rows * _page_shard_row_bytes(kvc)")],
        "chunk_gather_bytes, upstream fp8 (trtllm packed fp8 latent + bf16 index key)": [
            cite(UP + "layers/attention/dsa_backend.py", "k, k_rope = get_cp_strategy().all_gather_dsa_trtllm_fp8_kv("),
            cite(il, "kv = torch.cat((k, k_rope), dim=-1).view(torch.uint8)"),
            cite(il, "def materialize_full_indexer_k_cache")],
        "chunk_gather_bytes, bf16 latent + bf16 index key (upstream bf16; ours 0.5.23)": [
            cite(il, "latent_cache = torch.cat([k_nope, k_rope], dim=-1).squeeze(1)"),
            cite(il, "def materialize_full_indexer_k_cache")],
        "chunk_gather_bytes, ours 0.5.12 phase 3 (SGLang's bf16 in-seq gathers)": [
            cite("docs/performance.md", "in-seq all-gathers of its **bf16** KV")],
        "received = (N-1)/N of the all-gather output": [
            cite(UP + "mem_cache/page_interleave_pool.py", "scratch[: self.shard_size * block], send")],
        "upstream descriptors = contiguous (src, dst) groups x layer entries": [
            cite(mc, "prefill_kv_blocks, dst_kv_blocks = group_concurrent_contiguous("),
            cite(mc, "transfer_blocks.append((src_addr, dst_addr, length))"),
            cite(mc, "for src_ptr, dst_ptr, item_len in layers_params:")],
    }


# -------------------------------------------------------------------------------------- ours
def ours_capacity(shape: NsaModelShape, n: int, dtype: str, budget_gib: float, context: int) -> dict:
    plan = plan_capacity(shape, n, dtype, kv_gb_per_rank=budget_gib, context_len=context)
    req = plan.request
    return {"row_bytes": plan.mla_row_bytes + plan.index_row_bytes, "physical_tokens": plan.physical_tokens_per_rank,
            "persistent_scratch_bytes": 0, "logical_tokens": plan.logical_tokens,
            "transient_view_bytes_per_layer": req.scratch_mla_bytes_per_layer + req.scratch_index_bytes_per_layer,
            "transient_view_bytes_with_prefetch": req.scratch_mla_bytes_with_prefetch + req.scratch_index_bytes_per_layer}


def ours_gather(shape: NsaModelShape, n: int, dtype: str, pages, history_pages: int, chunk: int) -> dict:
    view = build_dense_page_map(CpSharedKVLayout(PAGE_SIZE, n, 0), torch.tensor(pages), history_pages)
    page_bytes = PAGE_SIZE * (shape.mla_row_bytes(dtype) + shape.index_row_bytes)
    return {"history_block_pages": view.history_pad, "history_recv": received(n * view.history_pad * page_bytes, n),
            "chunk_recv_local_writes": received(n * view.current_pad * page_bytes, n),
            "chunk_recv_sglang_bf16": received(chunk_gather_bytes(shape, chunk, 2), n)}


def ours_pd(shape: NsaModelShape, n: int, pages, page_ends) -> list:
    pages, dst, out = np.asarray(pages, dtype=np.int64), np.arange(1, len(pages) + 1), []
    for rank in range(n):
        layout, kv, start = CpSharedKVLayout(PAGE_SIZE, n, rank), 0, 0
        for end in page_ends:
            physical, positions = filter_chunk(layout, pages[start:end], slice(start, end))
            kv, start = kv + kv_descriptors(physical, positions, dst, shape.num_layers), end
        entry, problem = own_state_pages(layout, pages, int(layout.logical_pages_to_physical_np(pages).max()) + 1)
        assert problem is None, problem
        src, dst_pages, _ = state_pages_to_send(entry, dst)
        index = contiguous_runs(src.astype(np.int64), dst_pages.astype(np.int64)) * shape.num_layers
        out.append({"pages": len(entry), "kv": kv, "index": index})
    return out


def compute_owner_pages(jobs: list) -> list:
    """The pages 0.5.12's allocator hands each job's request, chunk by chunk (needs SGLang 0.5.12)."""
    from sglang_cp_shared_kv_testing.allocation import request_pages
    return [request_pages(n, physical_pages, ends)[0] for n, physical_pages, ends in jobs]


# ---------------------------------------------------------------------------------- upstream
class Upstream:
    """Upstream's sizing, allocator, gather plan and PD filters on CPU, under a test config
    (``override_server_args``: trtllm DSA backends, PD prefill, the chunk size) and, while sharded,
    a parallel override whose attention-CP group is a stand-in of N ranks seen from rank 0."""

    def __init__(self, chunk: int):
        from sglang.srt.runtime_context import get_context
        self.chunk, self.configs, self.tmp = chunk, {}, tempfile.TemporaryDirectory()
        self.override = get_context().override_server_args(
            dsa_prefill_backend="trtllm", dsa_decode_backend="trtllm", disaggregation_mode="prefill",
            disaggregation_transfer_backend="mooncake", chunked_prefill_size=chunk, page_size=PAGE_SIZE)
        self.server_args = self.override.install()

    def close(self) -> None:
        self.override.restore()
        self.tmp.cleanup()

    def kvc(self, model: str, shape: NsaModelShape, context: int, dtype: str) -> NS:
        """What upstream's sizing reads of a ``KVCacheConfigurator``, on a real ``ModelConfig``."""
        from sglang.srt.configs.model_config import ModelConfig
        from sglang.srt.speculative.spec_info import SpeculativeAlgorithm
        if (model, context) not in self.configs:
            folder = Path(self.tmp.name) / f"{model}-{context}"
            folder.mkdir()
            (folder / "config.json").write_text((BUNDLED_CONFIG_DIR / BUNDLED_MODELS[model]).read_text())
            self.configs[model, context] = ModelConfig(str(folder), context_length=context)
        return NS(model_config=self.configs[model, context], kv_cache_dtype_str=dtype, page_size=PAGE_SIZE,
                  kv_cache_dtype=torch.float8_e4m3fn if dtype == "fp8_e4m3" else torch.bfloat16, use_mla_backend=True,
                  is_draft_worker=False, spec_algorithm=SpeculativeAlgorithm.NONE, spec_aux_config=None, pp_size=1,
                  server_args=self.server_args, mambaish_config=None, fused_entry_bytes=lambda kind: None,
                  layer_info=NS(num_effective_layers=shape.num_layers, start_layer=0, end_layer=shape.num_layers))

    def capacity(self, kvc: NS, n: int, budget: int):
        from sglang.srt.mem_cache import page_interleave as pi
        from sglang.srt.mem_cache.allocator.page_interleave import PageInterleavePoolAllocator
        from sglang.srt.model_executor.pool_configurator import DefaultPoolConfigurator
        from sglang.srt.runtime_context import get_parallel
        unsharded = DefaultPoolConfigurator(kvc).calculate_pool_sizes(budget, PAGE_SIZE).max_total_num_tokens
        with get_parallel().override(tp_size=n, attn_cp_size=n, attn_tp_size=1, attn_dp_size=1, moe_ep_size=1,
                                     moe_dp_size=1, moe_tp_size=n, enable_kv_cache_sharding=True,
                                     attn_cp_group=NS(world_size=n, rank_in_group=0)):
            sizing = DefaultPoolConfigurator(kvc)
            spec, row_bytes, scratch = pi.make_page_shard_spec(kvc), pi._page_shard_row_bytes(kvc), \
                pi.compute_page_shard_scratch_bytes(kvc)
            physical = sizing.calculate_pool_sizes(budget, PAGE_SIZE).max_total_num_tokens
        allocator = PageInterleavePoolAllocator(physical, PAGE_SIZE, n, torch.int64, "cpu", None, True)
        formula = upstream_scratch_bytes(kvc.model_config.context_len, n, PAGE_SIZE, self.chunk, row_bytes)
        return {"row_bytes": row_bytes, "cell_bytes_all_layers": sizing._cell_size,
                "physical_tokens_unsharded": unsharded, "persistent_scratch_bytes": scratch,
                "scratch_rows_per_slot": spec.scratch_rows, "physical_tokens": physical,
                "logical_tokens": allocator.available_size(), "scratch_formula_matches": formula == scratch,
                "refused": kvc.kv_cache_dtype_str != "fp8_e4m3"}, spec, allocator

    @staticmethod
    def request_slots(allocator, token_ends) -> torch.Tensor:
        """The token slots its allocator gives one new request, chunk by chunk (one rotation base)."""
        slots, base, prefix = [], [None], 0
        t = lambda v: torch.tensor([v], dtype=torch.int64)  # noqa: E731
        for end in token_ends:
            last = slots[-1][-1:] if slots else t(-1)
            slots.append(allocator.alloc_extend(t(prefix), t(prefix), t(end), t(end), last, end - prefix,
                                                rotation_bases=base))
            prefix = end
        return torch.cat(slots)

    @staticmethod
    def history_gather(spec, latent_row_bytes: int, slots: torch.Tensor, history: int, seq_len: int) -> int:
        """Bytes of the all-gathers (latent rows + index pages) ``begin_shard_extend`` starts for a layer, on a
        stand-in pool (just large enough for the request's local pages) whose communicator records them."""
        from sglang.srt.mem_cache.page_interleave_pool import PageInterleaveDSATokenToKVPool, _ScratchSlot
        recorded, ps, n, rows = [], spec.page_size, spec.shard_size, spec.scratch_rows
        nothing = contextlib.nullcontext
        device = NS(Event=lambda: NS(record=lambda stream: None), current_stream=lambda: None, stream=lambda s: nothing())
        size = (int(slots.max()) // (n * ps) + 2) * ps
        latent = lambda count: torch.empty((count, 1, latent_row_bytes), dtype=torch.uint8)  # noqa: E731
        index = lambda count: torch.empty((count, ps * 132), dtype=torch.uint8)  # noqa: E731
        slot = _ScratchSlot({"kv": latent(rows), "index_k": index(rows // ps)}, device)
        pool = object.__new__(PageInterleaveDSATokenToKVPool)
        pool.__dict__.update(
            shard_spec=spec, shard_rank=spec.shard_rank, shard_size=n, device="cpu", page_size=ps, size=size,
            start_layer=0, layer_num=1, layer_transfer_counter=None, _debug_plan_checks=False, _translate_cache={},
            _epoch=0, _chunk_base=spec.max_prefix_tokens, _trash_base=spec.max_prefix_tokens + spec.chunk_tokens,
            _local_page_stride=size // ps + 2, device_module=device, _slots=[slot, slot],
            kv_gather_comm=NS(change_state=lambda enable: nothing(),
                              all_gather=lambda out, inp: recorded.append(out.numel() * out.element_size())),
            kv_gather_stream=NS(wait_stream=lambda stream: None), kv_buffer=[latent(size + ps)],
            index_key_cache=NS(buffer=[index(size // ps + 1)]),
            _page_pos=torch.full((n * (size // ps + 2),), (spec.max_prefix_tokens + spec.chunk_tokens) // ps,
                                 dtype=torch.int32))
        pool.begin_shard_extend(slots[None, :], torch.tensor([0]), [history], [seq_len])
        return sum(recorded)

    @staticmethod
    def pd(layers: int, n: int, pages: np.ndarray, page_ends) -> list:
        from sglang.srt.disaggregation.common.utils import group_concurrent_contiguous
        from sglang.srt.disaggregation.mooncake.conn import MooncakeKVManager
        from sglang.srt.disaggregation.utils import filter_kv_indices_for_shard_rank
        dst, out = np.arange(1, len(pages) + 1, dtype=np.int32), []
        groups = lambda s, d: len(group_concurrent_contiguous(np.asarray(s, np.int32), np.asarray(d, np.int32))[0])  # noqa
        for rank in range(n):
            kv, start = 0, 0
            for end in page_ends:
                local, positions = filter_kv_indices_for_shard_rank(
                    kv_indices=pages[start:end], index_slice=slice(start, end), shard_rank=rank, shard_size=n)
                kv, start = kv + groups(local, dst[positions]) * layers, end
            src, dst_state = MooncakeKVManager._prepare_sharded_dsa_indices(
                NS(kv_shard_rank=rank, kv_shard_size=n), list(pages), list(dst))
            out.append({"pages": len(src), "kv": kv, "index": groups(src, dst_state) * layers})
        return out


# ----------------------------------------------------------------------------------- support
def support() -> list:
    """Each side's limits, with the lines that impose them."""
    hook, sa, dsa = UP + "arg_groups/kv_shard_hook.py", "python/sglang_cp_shared_kv/settings/server_args.py", \
        "python/sglang_cp_shared_kv/settings/server_args_v0523.py"
    conn = UP + "disaggregation/common/conn.py"
    rows = [
        ("CP strategy", "interleave only (DSA)", [cite(hook, 'or cfg.cp_strategy != "interleave"')],
         f"0.5.12: in-seq-split (0.5.23 'zigzag') only; 0.5.23: {literal(dsa, 'CP_STRATEGY')}",
         [cite(sa, 'nsa_prefill_cp_mode != "in-seq-split":'), cite(dsa, "CP_STRATEGY = ")]),
        ("attention backends", "trtllm for DSA prefill and decode", [cite(hook, 'cfg.dsa_prefill_backend != "trtllm"')],
         f"prefill {', '.join(literal(sa, 'SUPPORTED_NSA_PREFILL_BACKENDS'))}; trtllm refused (own fp8 layout)",
         [cite(sa, "SUPPORTED_NSA_PREFILL_BACKENDS = "), cite(dsa, "SUPPORTED_DSA_PREFILL_BACKENDS = ")]),
        ("KV dtypes", "fp8_e4m3 only", [cite(hook, 'or cfg.kv_cache_dtype != "fp8_e4m3"')],
         f"{' and '.join(KV_CACHE_DTYPES)} (fp8 on 0.5.12 with {literal(sa, 'FP8_IN_SEQ_SPLIT_BACKEND')})",
         [cite("python/sglang_cp_shared_kv/pool/kv_geometry.py", "KV_CACHE_DTYPES = "), cite(sa, "FP8_IN_SEQ_SPLIT_BACKEND = ")]),
        ("Hopper / Blackwell", "trtllm is SGLang's Blackwell DSA backend (Hopper fp8 defaults to flashmla_kv): "
         "Blackwell in practice (inferred from the gate, not run)",
         [cite(UP + "arg_groups/overrides.py", "flashmla_kv on Hopper, trtllm on Blackwell")],
         "Hopper: end to end on H200s (0.5.12); Blackwell not run",
         [cite("README.md", "Real-server end to end (CP prefill, PD decode)")]),
        ("decode guard", "prefill-only; decode is stock (refuses a prompt longer than its pool)",
         [cite(hook, 'if cfg.disaggregation_mode != "prefill":'), cite(UP + "disaggregation/decode.py", "if input_len > capacity:")],
         "the flag on decode refuses at once a request it can never hold (prompt + reserved decode tokens)",
         [cite("python/sglang_cp_shared_kv/decode/admission.py", "tokens_needed(P) = P + reserved_decode_tokens")]),
        ("abort / transfer failure", "stock 0.5.23: the status frames carry the failure reason",
         [cite(conn, "def conclude_transfer("), cite(conn, "def abort(self):")],
         "0.5.12 and 0.5.23: the cause reaches decode before Failed (abort, late registration, index write; "
         "0.5.23: ahead of conclude_transfer)",
         [cite("python/sglang_cp_shared_kv/transfer/failure_cause.py", "def encode_failure_cause("),
          cite("python/sglang_cp_shared_kv/transfer/hooks_v0523.py", "def report_failure_cause_to_decode("),
          cite("docs/design.md", "abort (scheduler thread)")]),
        ("PD transfer backends", "mooncake or nixl; DSA: Mooncake only",
         [cite(hook, 'not in ("mooncake", "nixl"):'), cite(hook, 'cfg.disaggregation_transfer_backend != "mooncake"')],
         "Mooncake only", [cite(sa, 'disaggregation_transfer_backend != "mooncake":')]),
        ("persistent scratch", "2 slots, charged to the KV budget before sizing",
         [cite(UP + "model_executor/pool_configurator.py", "self._fixed_overhead_bytes = compute_page_shard_scratch_bytes(")],
         "none: one transient dense view per layer (MLA: two with the prefetch)",
         [cite("docs/design.md", "Scratch lifetime: one layer's MLA and index views")]),
        ("on SGLang 0.5.23", "shipped", [cite(hook, "def handle_kv_cache_sharding(")],
         f"serves on {', '.join(r.version for r in releases.SUPPORTED)} "
         f"(for_version({v0523.RELEASE.version!r}) is v0523.RELEASE: {releases.for_version(v0523.RELEASE.version) is v0523.RELEASE}); "
         "on 0.5.23 bit-exact in the CPU rigs on its real classes, not run on a GPU (startup says so)",
         [cite(dsa, "NOT_GPU_VERIFIED = ("), cite("python/sglang_cp_shared_kv/releases/installed.py", "SUPPORTED: Tuple[Release, ...] = ")]),
    ]
    return [dict(zip(("item", "upstream", "upstream_where", "ours", "ours_where"), row)) for row in rows]


# -------------------------------------------------------------------------------------- main
def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--kv-budget-gib", type=float, default=40.0, help="KV bytes per GPU, GiB")
    parser.add_argument("--chunked-prefill-size", type=int, default=8192,
                        help="chunk tokens (0.5.23's H200 default, arg_groups/memory_hook.py)")
    parser.add_argument("--ours-0512-python", default=str(ROOT / ".venv" / "bin" / "python"),
                        help="a Python with SGLang 0.5.12.post1 and the plugin, for the compute-owner pages ('': skip)")
    parser.add_argument("--compute-owner-pages", help=argparse.SUPPRESS)  # worker mode: JSON jobs in, page lists out
    parser.add_argument("--out", type=Path, help="write the JSON here (default: stdout)")
    return parser.parse_args(argv)


def main(argv=None) -> dict:
    args = parse_args(argv)
    if args.compute_owner_pages:
        print(json.dumps(compute_owner_pages(json.loads(args.compute_owner_pages))))
        return {}
    chunk, budget, cases = args.chunked_prefill_size, int(args.kv_budget_gib * GIB), [(n, c) for n in CP_SIZES for c in CONTEXTS]
    ends = {c: list(range(chunk, c + 1, chunk)) for c in CONTEXTS}
    compute_owner = {}
    if args.ours_0512_python and Path(args.ours_0512_python).exists():
        # pool pages per rank as scripts/bench_pd_transfer.py's request_layout sizes them
        jobs = [(n, math.ceil(c // PAGE_SIZE / n) + len(ends[c]), ends[c]) for n, c in cases]
        proc = subprocess.run([args.ours_0512_python, __file__, "--compute-owner-pages", json.dumps(jobs)],
                              capture_output=True, text=True, check=True)
        compute_owner = dict(zip(cases, json.loads(proc.stdout.splitlines()[-1])))
    up, capacity, gather, pd = Upstream(chunk), [], [], []
    for model in MODELS:
        shape = NsaModelShape.load(model)
        for n, ctx in cases:
            key, history = {"model": model, "cp_size": n, "context": ctx}, ctx - chunk
            page_ends, interleaved = [e // PAGE_SIZE for e in ends[ctx]], list(range(1, ctx // PAGE_SIZE + 1))
            for dtype in KV_CACHE_DTYPES:
                ours = ours_capacity(shape, n, dtype, args.kv_budget_gib, ctx)
                theirs, spec, allocator = up.capacity(up.kvc(model, shape, ctx, dtype), n, budget)
                capacity.append({**key, "kv_cache_dtype": dtype, "ours": ours, "upstream": theirs,
                                 "logical_ratio_ours_over_upstream": round(ours["logical_tokens"] / theirs["logical_tokens"], 4)})
                slots = up.request_slots(allocator, ends[ctx])
                history_out = up.history_gather(spec, theirs["row_bytes"] - shape.index_row_bytes, slots, history, ctx)
                row = {**key, "kv_cache_dtype": dtype, "history_tokens": history, "chunk_tokens": chunk,
                       "upstream": {"history_out": history_out, "history_recv": received(history_out, n), "chunk_recv": received(
                                        chunk_gather_bytes(shape, chunk, 1 if dtype == "fp8_e4m3" else 2), n)},
                       "ours_0523_interleaved_pages": ours_gather(shape, n, dtype, interleaved, history // PAGE_SIZE, chunk)}
                if (n, ctx) in compute_owner:
                    row["ours_0512_compute_owner_pages"] = ours_gather(shape, n, dtype, compute_owner[n, ctx],
                                                                       history // PAGE_SIZE, chunk)
                gather.append(row)
            row = {**key, "chunk_tokens": chunk, "layers": shape.num_layers,
                   "upstream": Upstream.pd(shape.num_layers, n, (slots[::PAGE_SIZE] // PAGE_SIZE).numpy(), page_ends),
                   "ours_0523_interleaved_pages": ours_pd(shape, n, interleaved, page_ends)}
            if (n, ctx) in compute_owner:
                row["ours_0512_compute_owner_pages"] = ours_pd(shape, n, compute_owner[n, ctx], page_ends)
            pd.append(row)
    report = {
        "command": "PYTHONPATH=python " + shlex.join([sys.executable, "scripts/compare_upstream_kv_sharding.py",
                                                     *(sys.argv[1:] if argv is None else argv)]),
        "sglang_version": importlib.metadata.version("sglang"), "torch_version": torch.__version__,
        "parameters": {"kv_budget_gib": args.kv_budget_gib, "page_size": PAGE_SIZE, "chunked_prefill_size": chunk,
                       "cp_sizes": CP_SIZES, "contexts": CONTEXTS, "kv_cache_dtypes": KV_CACHE_DTYPES,
                       "ours_0512_compute_owner_pages_from": args.ours_0512_python if compute_owner else None},
        "formulas": formulas(),
        "checks": {"upstream_scratch_formula_matches_compute_page_shard_scratch_bytes":
                   all(r["upstream"]["scratch_formula_matches"] for r in capacity)},
        "capacity": capacity, "gather": gather, "pd": pd, "support": support(),
    }
    up.close()
    text = json.dumps(report, indent=1)
    args.out.write_text(text + "\n") if args.out else print(text)
    return report


if __name__ == "__main__":
    main()
