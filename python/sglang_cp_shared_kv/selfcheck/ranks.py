"""What the selfcheck's processes run: N prefill CP ranks and one decode.

A **rank** (:func:`rank_main`) joins a gloo CP group (SGLang's attention-CP
``GroupCoordinator`` over it), builds the plugin's shared-KV pool and allocator beside a
replicated pool -- the rig of the installed release's prefill CP (:data:`PREFILL_RIGS`:
0.5.12.post1's in-seq split, :class:`~sglang_cp_shared_kv_testing.cp_rig_v0512.InSeqRig`;
0.5.23's interleave, :class:`~sglang_cp_shared_kv_testing.cp_rig_v0523.InterleaveRig`, in the
runtime context of CP rank r of an interleave prefill server) --, prefills a donor
request (the radix-cache prefix), then the request that hits it, chunk by chunk, every
forward through the plugin's hooks, comparing the stock kernels' inputs and a reference
attention with the replicated pool's. Rank 0 writes what the replicated pool holds for
the request (every page, every layer), which is what decode must end with. Then every
rank sends its shard over Mooncake through SGLang's PD classes
(:class:`~sglang_cp_shared_kv_testing.pd.prefill.PrefillInstance`), rank 0 hosting the
bootstrap server, and stays up until decode is done.

**Decode** (:func:`decode_main`) holds the release's stock pool, preallocates the
request's pages, receives every rank's shard and compares every byte with rank 0's file.

Each process writes one JSON result into the work folder and reports progress on a queue.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import sys
import time
import traceback
from pathlib import Path
from typing import Any, Dict

import numpy as np

from sglang_cp_shared_kv.releases import installed
from sglang_cp_shared_kv.pool.kv_geometry import NSA_KV_LORA_RANK, NSA_QK_ROPE_HEAD_DIM, PAGE_SIZE, mla_kv_cache_dim
from sglang_cp_shared_kv.selfcheck.options import SelfcheckOptions

ROOM = 31_337
EXPECTED_FILE = "expected.npz"  # the replicated pool's pages of the request (rank 0 writes it)
PAGES_FILE = "pages.json"  # the request's logical pages (rank 0 writes it after EXPECTED_FILE)
DONE_FILE = "decode-done"


def geometry(options: SelfcheckOptions):
    from sglang_cp_shared_kv_testing.cp_rig import LAYERS
    from sglang_cp_shared_kv_testing.pd.geometry import Geometry

    return Geometry(layers=LAYERS, kv_lora_rank=NSA_KV_LORA_RANK, qk_rope_head_dim=NSA_QK_ROPE_HEAD_DIM,
                    dtype=options.kv_cache_dtype, kv_cache_dim=mla_kv_cache_dim(options.kv_cache_dtype))


def physical_pages(options: SelfcheckOptions) -> int:
    """Pages per rank: the donor and the request together, spread over N, with room for the
    compute-owner allocator's per-chunk rounding."""
    pages = -(-options.context_len // PAGE_SIZE) + -(-options.prefix_len // PAGE_SIZE)
    return -(-pages // options.cp_size) + 2 * (options.chunks + 2)


def room(options: SelfcheckOptions, logical_pages, workdir: Path) -> Dict[str, Any]:
    """The request as the PD rig sends it (the pool's own bytes, not generated content)."""
    return dict(room=ROOM, name="selfcheck", instance="X", seq_len=options.context_len,
                logical_pages=[int(p) for p in logical_pages], chunk_ends=options.chunk_ends,
                decode_prefix_pages=0, dst_order="contiguous", seed=1, first_token=7, aux_slot=0,
                content="pool", expected_file=str(workdir / EXPECTED_FILE))


def _log_to(workdir: Path, name: str) -> None:
    """This process's output (SGLang's and Mooncake's logs included) into ``<name>.log``."""
    log = os.open(str(workdir / f"{name}.log"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(log, 1)
    os.dup2(log, 2)


def _finish(workdir: Path, name: str, result: Dict[str, Any]) -> None:
    Path(workdir, f"{name}.json").write_text(json.dumps(result, default=int))
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(1 if "fatal" in result else 0)  # SGLang's manager threads are not daemons


# ------------------------------------------------------------------------- ranks
def _in_seq_rig(rank: int, options: SelfcheckOptions, port: int, workdir: Path, stack: contextlib.ExitStack):
    """In-seq split (0.5.12.post1): the gloo CP group and SGLang's in-seq split settings, the in-seq rig."""
    from sglang_cp_shared_kv_testing.cp_harness import init_rank_process
    from sglang_cp_shared_kv_testing.cp_rig_v0512 import InSeqRig

    group = init_rank_process(rank, options.cp_size, port, options.device)
    return InSeqRig(rank, options.cp_size, options.kv_cache_dtype, group, options.device, debug="off",
                    physical_pages=physical_pages(options))


def _interleave_rig(rank: int, options: SelfcheckOptions, port: int, workdir: Path, stack: contextlib.ExitStack):
    """Interleave (0.5.23): CP rank ``rank`` of an interleave prefill server (its runtime context, active
    until ``stack`` closes, and its attention-CP group over gloo), the interleave rig."""
    from sglang_cp_shared_kv_testing.cp_harness_v0523 import init_interleave_rank
    from sglang_cp_shared_kv_testing.cp_rig_v0523 import InterleaveRig
    from sglang_cp_shared_kv_testing.pd.releases import write_tiny_dsv32

    group = init_interleave_rank(rank, options.cp_size, port, str(write_tiny_dsv32(workdir)), stack)
    return InterleaveRig(rank, options.cp_size, options.kv_cache_dtype, group, options.device, debug="off",
                         physical_pages=physical_pages(options))


#: the rig of each prefill CP strategy (``Release.cp_strategy``; its rank process set up as
#: that release's scheduler)
PREFILL_RIGS = {"in-seq-split": _in_seq_rig, "interleave": _interleave_rig}


def rank_main(rank: int, options: SelfcheckOptions, workdir: str, port: int, bootstrap_port: int, events) -> None:
    workdir = Path(workdir)
    _log_to(workdir, f"rank{rank}")
    result: Dict[str, Any] = {"rank": rank}
    try:
        with contextlib.ExitStack() as stack:
            rig = PREFILL_RIGS[installed.INSTALLED.cp_strategy](rank, options, port, workdir, stack)
            result["capacity"] = _capacity(rig)
            events.put(("ready", rank))
            request = _prefill(rig, options, events)
            result["prefill"] = {"errors": rig.errors[:20], "forwards": rig.stats["forwards"],
                                 "write_paths": rig.shared.context.write_path_counts(),
                                 "allocation": dataclasses.asdict(rig.allocator.stats),
                                 "request_pages": request.pages}
            result["stored"] = _stored(rig, request.pages)
            result["materialized_bytes_per_layer"] = _materialized_per_layer(rig, options, request.pages)
            if rank == 0:
                _write_expected(rig, request.pages, workdir)
        # NOTE: the CP rank's runtime context (0.5.23) ends with its prefill: the PD side
        # publishes the prefill server's own (_send)
        result["transfer"] = _send(rig, rank, options, request.pages, workdir, bootstrap_port)
        events.put(("sent", rank))
        _wait_for(workdir / DONE_FILE, options.timeout_s)
    except BaseException:  # noqa: BLE001 - reported to the parent
        result["fatal"] = traceback.format_exc()[-4000:]
        events.put(("failed", rank))
    _finish(workdir, f"rank{rank}", result)


def _capacity(rig) -> Dict[str, Any]:
    """What the capacity split gives this rank, beside a stock pool of the physical size."""
    from sglang_cp_shared_kv_testing.cp_rig import LAYERS

    pool = rig.shared
    stock = type(rig.replicated)(pool.physical_size, page_size=PAGE_SIZE, kv_lora_rank=NSA_KV_LORA_RANK,
                             dtype=pool.dtype, qk_rope_head_dim=NSA_QK_ROPE_HEAD_DIM, layer_num=LAYERS,
                             device="cpu", index_head_dim=128, enable_memory_saver=False,
                             kv_cache_dim=pool.kv_buffer[0].shape[-1])
    return {"physical_tokens": pool.physical_size, "logical_tokens": pool.size,
            "allocator_tokens": rig.allocator.size, "kv_bytes": pool.get_kv_size_bytes(),
            "stock_kv_bytes_same_physical": stock.get_kv_size_bytes(),
            "layout_logical_tokens": rig.layout.logical_tokens(pool.physical_size)}


def _prefill(rig, options: SelfcheckOptions, events):
    """The donor (the radix-cache prefix), then the request hitting it, chunk by chunk."""
    corrupt = options.inject == "corrupt-shard" and rig.rank == 1
    skip_writes = options.inject == "skip-write" and rig.rank == 1
    if skip_writes:  # rank 1 drops its MLA and index writes into its shard (owner copies, local stores)
        from sglang_cp_shared_kv.forward import materialize, writes

        def dropped(*args, **kwargs):
            return None

        sys.modules[type(rig.shared).__module__].store_owned_mla_rows = dropped  # the release's pool module
        materialize.copy_owned_mla_rows = materialize.copy_owned_index_rows = dropped
        writes.store_local_mla_rows = writes.store_local_index_rows = dropped
    prefix_pages = options.prefix_len // PAGE_SIZE
    if prefix_pages:
        donor = rig.new_request()
        rig.extend(donor, options.prefix_len)
        events.put(("forward", rig.rank))
        if corrupt:  # rank 1 zeroes the first prefix page it owns, layer 0
            _zero_an_owned_page(rig, donor.pages[:prefix_pages])
        request = rig.share_prefix(donor, prefix_pages)
    else:
        request = rig.new_request()
        events.put(("forward", rig.rank))
    start = options.prefix_len
    for number, end in enumerate(options.chunk_ends):
        if not rig.extend(request, end - start):
            raise RuntimeError(f"the pool ran out of pages at chunk {number + 1} (allocator bug)")
        if corrupt and not prefix_pages and number == 0:
            _zero_an_owned_page(rig, request.pages)
        start = end
        events.put(("forward", rig.rank))
    return request


def _zero_an_owned_page(rig, pages) -> None:
    import torch

    owners = rig.layout.owner_for_logical_pages_np(pages)
    mine = [p for p, owner in zip(pages, owners) if owner == rig.rank]
    if not mine:
        raise RuntimeError("--inject corrupt-shard: rank 1 owns no page of the request yet")
    physical = int(rig.layout.logical_pages_to_physical_np([mine[0]])[0])
    with torch.no_grad():
        rig.shared.kv_buffer[0][physical * PAGE_SIZE: (physical + 1) * PAGE_SIZE] = 0


def _page_bytes(pool) -> Dict[str, int]:
    kv = pool.kv_buffer[0]
    return {"kv": PAGE_SIZE * kv.shape[-1] * kv.element_size(),
            "index": pool.index_k_with_scale_buffer[0].shape[1] * pool.index_k_with_scale_buffer[0].element_size()}


def _stored(rig, pages) -> Dict[str, int]:
    """Pages and bytes of the request this rank's shard holds (all layers)."""
    owned = int(rig.layout.owned_pages_mask_np(np.asarray(pages)).sum())
    sizes = _page_bytes(rig.shared)
    return {"pages": owned, "bytes": owned * (sizes["kv"] + sizes["index"]) * len(rig.shared.kv_buffer)}


def _materialized_per_layer(rig, options: SelfcheckOptions, pages) -> Dict[str, int]:
    """Bytes this rank received per layer to build the last chunk's dense view (history pages
    of the other ranks, MLA + index), from the plugin's own dense placement."""
    import torch

    from sglang_cp_shared_kv.forward.dense_layout import build_dense_page_map

    history = -(-options.chunk_ends[-2] // PAGE_SIZE) if options.chunks > 1 else -(-options.prefix_len // PAGE_SIZE)
    page_map = build_dense_page_map(rig.layout, torch.tensor(pages), history)
    received_pages = (options.cp_size - 1) * page_map.history_pad
    sizes = _page_bytes(rig.shared)
    return {"history_pages": history, "received_pages": received_pages,
            "bytes": received_pages * (sizes["kv"] + sizes["index"])}


def _write_expected(rig, pages, workdir: Path) -> None:
    """The replicated pool's pages of the request, every layer: what decode must end with."""
    import torch

    from sglang_cp_shared_kv_testing.pd.geometry import index_pages, kv_pages

    rows = torch.tensor(pages)
    layers = range(len(rig.replicated.kv_buffer))
    kv = np.stack([kv_pages(rig.replicated, layer)[rows].cpu().numpy() for layer in layers])
    index = np.stack([index_pages(rig.replicated, layer)[rows].cpu().numpy() for layer in layers])
    tmp = workdir / "expected.tmp.npz"
    np.savez(tmp, kv=kv, index=index)
    os.replace(tmp, workdir / EXPECTED_FILE)


def _announce_pages(pages, workdir: Path) -> None:
    """Tell decode the request's pages (rank 0, once its bootstrap server is up)."""
    Path(workdir, "pages.tmp").write_text(json.dumps([int(p) for p in pages]))
    os.replace(workdir / "pages.tmp", workdir / PAGES_FILE)


def _host_pool(pool):
    """The shard as a CPU pool (byte copy) for the loopback transfer when the forward ran on CUDA."""
    if pool.kv_buffer[0].device.type == "cpu":
        return pool
    kv = pool.kv_buffer[0]
    host = type(pool)(pool.size, PAGE_SIZE, kv_lora_rank=NSA_KV_LORA_RANK, dtype=pool.dtype,
                                    qk_rope_head_dim=NSA_QK_ROPE_HEAD_DIM, layer_num=len(pool.kv_buffer),
                                    device="cpu", index_head_dim=128, enable_memory_saver=False,
                                    kv_cache_dim=kv.shape[-1], context=pool.context)
    for dst, src in zip(host.kv_buffer + host.index_k_with_scale_buffer,
                        pool.kv_buffer + pool.index_k_with_scale_buffer):
        dst.copy_(src.cpu())
    return host


def _send(rig, rank: int, options: SelfcheckOptions, pages, workdir: Path, bootstrap_port: int) -> Dict[str, Any]:
    from sglang.srt.disaggregation.mooncake.conn import MooncakeKVBootstrapServer
    from sglang.srt.distributed.device_communicators.mooncake_transfer_engine import init_mooncake_transfer_engine

    from sglang_cp_shared_kv_testing.pd.prefill import PrefillInstance
    from sglang_cp_shared_kv_testing.pd.releases import release
    from sglang_cp_shared_kv_testing.pd.sglang_side import apply_transfer_hooks

    release().setup_process(str(workdir), "prefill")
    apply_transfer_hooks()
    init_mooncake_transfer_engine(hostname="127.0.0.1", gpu_id=0, ib_device=None)
    if rank == 0:
        rig.bootstrap_server = MooncakeKVBootstrapServer(host="127.0.0.1", port=bootstrap_port)
        _announce_pages(pages, workdir)
    spec = dict(cp_size=options.cp_size, shared=True, bootstrap_port=bootstrap_port,
                physical_pages=physical_pages(options))
    prefill = PrefillInstance("selfcheck", spec, rank, geometry(options), options.context_len + PAGE_SIZE,
                              pool=_host_pool(rig.shared))
    if options.inject == "drop-batch" and rank == 1:  # rank 1 loses its first Mooncake batch silently
        real = prefill.kv_mgr._transfer_data
        dropped = []

        def lose_the_first(session_id, blocks):
            if not dropped:
                dropped.append(len(blocks))
                return 0
            return real(session_id, blocks)

        prefill.kv_mgr._transfer_data = lose_the_first
    return prefill.send(room(options, pages, workdir), f"P{rank}")


def _wait_for(path: Path, timeout_s: float) -> None:
    end = time.monotonic() + timeout_s
    while not path.exists() and time.monotonic() < end:
        time.sleep(0.1)


# ------------------------------------------------------------------------ decode
def decode_main(options: SelfcheckOptions, workdir: str, bootstrap_port: int, events) -> None:
    workdir = Path(workdir)
    _log_to(workdir, "decode")
    result: Dict[str, Any] = {}
    try:
        from sglang.srt.distributed.device_communicators.mooncake_transfer_engine import (
            init_mooncake_transfer_engine,
        )

        from sglang_cp_shared_kv_testing.pd.decode import DecodeSide
        from sglang_cp_shared_kv_testing.pd.releases import release
        from sglang_cp_shared_kv_testing.pd.sglang_side import apply_transfer_hooks

        release().setup_process(str(workdir), "decode")
        apply_transfer_hooks()
        init_mooncake_transfer_engine(hostname="127.0.0.1", gpu_id=0, ib_device=None)
        pages_needed = -(-options.context_len // PAGE_SIZE)
        decode = DecodeSide({"decode": {"pages": pages_needed + 8}, "max_seq_len": options.context_len + PAGE_SIZE},
                            geometry(options))
        events.put(("ready", "decode"))
        pages_file = workdir / PAGES_FILE
        _wait_for(pages_file, options.timeout_s)  # rank 0's page list, after the expected bytes
        if not pages_file.exists():
            raise TimeoutError(f"rank 0 wrote no page list within {options.timeout_s:.0f} s")
        decode.connect(bootstrap_port)
        pages = json.loads(pages_file.read_text())
        result["receive"] = decode.receive(room(options, pages, workdir), bootstrap_port)
        result["stray_writes"] = decode.stray_writes()
        events.put(("received", "decode"))
    except BaseException:  # noqa: BLE001 - reported to the parent
        result["fatal"] = traceback.format_exc()[-4000:]
        events.put(("failed", "decode"))
    Path(workdir, DONE_FILE).write_text("done")
    _finish(workdir, "decode", result)
