"""A prefix loaded back from HiCache on a sharded CP prefill, sent to a non-CP decode over the real
Mooncake engine exactly like a freshly computed one (issue 36 item 3): every CP rank sends its own
pages, and decode ends with the bytes the flag-off HiCache run reads back.

Processes (spawn, every wait bounded): N prefill CP ranks on a gloo group, the plugin's hooks
applied as every SGLang process applies them, and one decode. The prefill ranks build SGLang's
real ``HiRadixCache`` with ``--hicache-storage-backend mooncake`` (a real ``mooncake_master`` on
loopback) twice: over a stock replicated pool (flag off) and over the plugin's pool (flag on).
On each, one request per tier makes its round trip (:mod:`.hicache_rig_v0512`):

* ``l2``: device -> host backup, evicted from the device, a host hit, loaded back (``round_trip``);
* ``l3``: device -> host -> the store, evicted from device and host memory, prefetched from the
  store, loaded back (``storage_round_trip``).

Rank 0 writes the flag-off run's pages of each request (every layer, MLA latent and index K+scale)
to a file: what decode must end with. Every rank then sends the flag-on pool's pages of the
request, at the locations its load-back gave, through SGLang's ``MooncakeKVSender`` and the real
``send_kv_chunk`` (:class:`.pd.prefill.PrefillInstance` with ``content="pool"``), and decode
(:class:`.pd.decode.DecodeSide`: a stock pool, SGLang's ``MooncakeKVReceiver``) checks every byte
it received against the file. A third room is the control: the ``l3`` request sent again after CP
rank 1 zeroed the first page it holds of it (layer 0), which decode must find wrong.

Each process writes ``rank{r}.json`` (decode is process N): per room, the prefill's send outcome
and counters (``kv_pages``/``state_pages`` this rank sent, the pages it holds of the request), and
decode's verdict; the ``check_*`` functions are what the tests of every release assert on them.

The release seam: what a prefill rank builds of SGLang's HiCache and how a request makes its
round trip there (:class:`HiCachePrefill0512`; 0.5.23's:
:class:`.hicache_pd_v0523.HiCachePrefill0523`). The rest (the flag-off pages, the rooms, the
sends, decode, the control) is this module's for both releases.
"""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any, Dict, List

import numpy as np
import torch

from sglang_cp_shared_kv.pool.kv_geometry import mla_kv_cache_dim
from sglang_cp_shared_kv_testing.cp_harness import finish_rank
from sglang_cp_shared_kv_testing.hicache_rig_v0512 import (
    INDEX_DIM,
    KV_LORA_RANK,
    PAGE,
    ROPE_DIM,
    STOCK_ACCESS,
    HiCacheRequest,
    build_hicache,
    hicache_on_cpu,
    host_pools,
    page_starts,
    round_trip,
    settle,
    stock_allocator,
    stock_nsa_pool,
    storage_round_trip,
)
from sglang_cp_shared_kv_testing.mooncake_master import close_store_clients
from sglang_cp_shared_kv_testing.support import free_port, gloo_attention_cp_group, run_rank_processes

#: the rooms sent to decode, in order: (name, tier, request seed)
ROOMS = (("l2", "l2", 301), ("l3", "l3", 302), ("control", "l3", 302))
#: the rooms of a tier's load-back, whose bytes decode must end with (every room but the control)
TIER_ROOMS = tuple(name for name, _tier, _seed in ROOMS if name != "control")
#: NOTE: added to the seeds per KV dtype (and 10 times the CP size, :func:`_seed`): the store
#: outlives a group run, and the flag-off keys (the tokens' hashes) name neither the dtype nor the
#: CP size, so two runs of a module must not share a request's tokens
SEED_OFFSET = {"bf16": 0, "fp8_e4m3": 1000}
REQUEST_PAGES = 6
PHYSICAL_PAGES = 8  #: device pages per prefill rank
DEADLINE_S = 120.0  #: each wait of a process (decode's receive, a rank's wait for decode)
#: the gloo group's timeout: a rank stuck in a collective fails the run instead of hanging it
GROUP_TIMEOUT_S = 120
DONE_FILE = "decode-done"


def _geometry(dtype_name: str):
    from sglang_cp_shared_kv_testing.pd.geometry import Geometry

    assert INDEX_DIM == 128  # (Geometry's index pages: NSA_INDEX_HEAD_DIM)
    return Geometry(layers=2, kv_lora_rank=KV_LORA_RANK, qk_rope_head_dim=ROPE_DIM, dtype=dtype_name,
                    kv_cache_dim=mla_kv_cache_dim(dtype_name))


def _wait_for(path: Path, what: str) -> None:
    end = time.monotonic() + DEADLINE_S
    while not path.exists():
        if time.monotonic() > end:
            raise TimeoutError(f"no {what} ({path.name}) within {DEADLINE_S:.0f} s")
        time.sleep(0.05)


def _seed(seed: int, n: int, dtype_name: str) -> int:
    """The request seed of a room's ``seed`` in the run of ``n`` ranks and ``dtype_name``."""
    return seed + SEED_OFFSET[dtype_name] + 10 * n


def _write_atomically(path: Path, write) -> None:
    # NOTE: the temporary name keeps the suffix: np.savez appends ".npz" to a name without it
    tmp = path.with_name(f"{path.stem}.tmp{path.suffix}")
    write(tmp)
    os.replace(tmp, path)


def _pages_of(pool, pages: torch.Tensor) -> Dict[str, np.ndarray]:
    """``pool``'s rows of ``pages`` (a stock pool: logical = physical), every layer, as decode compares them."""
    from sglang_cp_shared_kv_testing.pd.geometry import index_pages, kv_pages

    layers = range(len(pool.kv_buffer))
    return {"kv": np.stack([kv_pages(pool, layer)[pages].numpy() for layer in layers]),
            "index": np.stack([index_pages(pool, layer)[pages].numpy() for layer in layers])}


def _options(cpu_group, extra: dict) -> dict:
    return dict(page_size=PAGE, hicache_ratio=2.0, write_policy="write_through", mem_layout="page_first_direct",
                group=cpu_group, hicache_storage_backend="mooncake",
                hicache_storage_backend_extra_config=json.dumps(extra),
                hicache_storage_prefetch_policy="wait_complete")


def _zero_first_owned_page(pool, pages: torch.Tensor) -> int:
    """The control: zero layer 0's MLA rows of the first page of ``pages`` this rank holds; returns its position."""
    layout = pool.cp_layout
    position = int(layout.owned_pages_mask(pages).nonzero()[0])
    physical = int(layout.logical_pages_to_physical(pages[position:position + 1])[0])
    pool.kv_buffer[0][physical * PAGE:(physical + 1) * PAGE] = 0
    return position


class HiCachePrefill0512:
    """What a prefill CP rank builds of SGLang 0.5.12.post1's ``HiRadixCache`` (with the Mooncake
    store) and how a request makes its round trip there (:mod:`.hicache_rig_v0512`): the release
    seam of :func:`_prefill_rank`."""

    def join_group(self, rank: int, n: int, port: int, workdir: Path, extra: dict, stack: contextlib.ExitStack):
        """This process as CP rank ``rank`` of ``n`` (gloo), HiCache runnable on a CPU until
        ``stack`` closes; returns the group's CPU group."""
        from sglang.srt.distributed import parallel_state as ps

        from sglang_cp_shared_kv_testing.pd.releases import release

        group = gloo_attention_cp_group(rank, n, port, local_rank=rank, timeout_s=GROUP_TIMEOUT_S)
        ps._TP = group  # NOTE: in-seq CP's TP group is its attention-CP group (the storage config reads TP)
        release().setup_process(str(workdir), "prefill")
        stack.enter_context(hicache_on_cpu())
        return group.cpu_group

    def stock_cache(self, n: int, dtype_name: str, cpu_group, extra: dict):
        """(a stock replicated pool of the group's logical size, the flag-off HiCache over it)."""
        pool = stock_nsa_pool(PHYSICAL_PAGES * PAGE * n, dtype_name=dtype_name)
        return pool, build_hicache(pool, stock_allocator(pool), **_options(cpu_group, extra))

    def shared_cache(self, rank: int, n: int, dtype_name: str, cpu_group, extra: dict):
        """(this rank's shared-KV pool, the flag-on HiCache over it)."""
        from sglang_cp_shared_kv_testing.hicache_cp_v0512 import shared_pool

        pool, allocator = shared_pool(rank, n, dtype_name, PHYSICAL_PAGES)
        return pool, build_hicache(pool, allocator, **_options(cpu_group, extra))

    def trip(self, cache, tier: str, seed: int, access, req_id: str):
        """The round trip of the request of ``seed`` through ``tier``, on a cache emptied of
        earlier requests first (device and host), so the trip's evictions take its own request:
        (its device locations after the load-back, the tokens found in host memory: for ``l3``
        after the prefetch from the store)."""
        from sglang.srt.mem_cache.base_prefix_cache import EvictParams

        settle(cache, lambda: not cache.ongoing_backup, what="the earlier backups to storage")
        cache.evict(EvictParams(num_tokens=cache.kv_cache.size))
        cache.evict_host(host_pools(cache)[0].size)
        request = HiCacheRequest.seeded(cache.kv_cache, pages=REQUEST_PAGES, seed=seed)
        if tier == "l2":
            trip = round_trip(cache, request, access=access)
        else:
            pages = getattr(host_pools(cache)[0], "prefetch_pages", None)
            trip = storage_round_trip(cache, request, access=access, req_id=req_id,
                                      released=(lambda: len(pages) == 0) if pages is not None else (lambda: True))
        return trip.new_locs, trip.host_hit_length


def _prefill_rank(rank: int, n: int, port: int, bootstrap_port: int, workdir: Path, dtype_name: str,
                  extra: dict, rig) -> Dict[str, Any]:
    from sglang_cp_shared_kv_testing.hicache_cp_v0512 import ShardedAccess

    result: Dict[str, Any] = {"role": "prefill", "rooms": {}}
    # NOTE: the rank's SGLang state stays until decode is done (on 0.5.23 its runtime context, which
    # the manager's transfer thread reads)
    with contextlib.ExitStack() as stack:
        cpu_group = rig.join_group(rank, n, port, workdir, extra, stack)
        from sglang.srt.plugins import load_plugins

        load_plugins()  # every hook of the plugin (the transfer hooks among them), as a server process
        # flag off: the pages decode must end with (the replicated run's, read where its load-back put them)
        stock_pool, stock = rig.stock_cache(n, dtype_name, cpu_group, extra)
        expected = {}
        for name, tier, seed in ROOMS[:2]:
            new_locs, _hit = rig.trip(stock, tier, _seed(seed, n, dtype_name), STOCK_ACCESS, f"stock-{name}")
            expected[name] = _pages_of(stock_pool, page_starts(new_locs))
        stores = [store_client(stock)]
        stock.detach_storage_backend()
        # flag on
        pool, cache = rig.shared_cache(rank, n, dtype_name, cpu_group, extra)
        stores.append(store_client(cache))
        prefill, _bootstrap_server = _prefill_instance(rank, n, bootstrap_port, dtype_name, pool)
        access, pages = ShardedAccess(cpu_group), None
        for number, (name, tier, seed) in enumerate(ROOMS):
            if name == "control":
                result["control_position"] = _zero_first_owned_page(pool, pages) if rank == 1 else None
                expected[name] = expected["l3"]
            else:
                new_locs, hit = rig.trip(cache, tier, _seed(seed, n, dtype_name), access, f"on-{name}")
                pages = page_starts(new_locs)
                result["host_hit_length"] = {**result.get("host_hit_length", {}), name: hit}
            room = _room(number, name, pages, workdir)
            if rank == 0:  # (the expected bytes first: decode starts on the room file)
                _write_atomically(Path(room["expected_file"]), lambda p, e=expected[name]: np.savez(p, **e))
                _write_atomically(workdir / f"room{number}.json", lambda p, r=room: p.write_text(json.dumps(r)))
            outcome = prefill.send(room, f"P{rank}")
            outcome["pages_held"] = int(pool.cp_layout.owned_pages_mask(pages).sum())
            outcome.pop("chunks", None)
            result["rooms"][name] = outcome
            torch.distributed.barrier(group=cpu_group)  # (every rank's transfer concluded before the pool moves on)
        cache.detach_storage_backend()
        _wait_for(workdir / DONE_FILE, "end of decode")
        close_store_clients(stores, cpu_group)
    return result


def store_client(cache):
    """The ``MooncakeDistributedStore`` client behind ``cache``'s storage backend (the plugin's
    sharded storage wraps SGLang's backend)."""
    storage = cache.cache_controller.storage_backend
    return getattr(storage, "backend", storage).store


def _prefill_instance(rank: int, n: int, bootstrap_port: int, dtype_name: str, pool):
    """CP rank ``rank`` of the prefill instance, sending from ``pool``, and the bootstrap server rank 0
    hosts (None elsewhere; kept by the caller while decode may connect). The process's SGLang
    state is the rig's (:meth:`HiCachePrefill0512.join_group`)."""
    from sglang.srt.disaggregation.mooncake.conn import MooncakeKVBootstrapServer
    from sglang.srt.distributed.device_communicators.mooncake_transfer_engine import init_mooncake_transfer_engine

    from sglang_cp_shared_kv_testing.pd.prefill import PrefillInstance

    init_mooncake_transfer_engine(hostname="127.0.0.1", gpu_id=0, ib_device=None)
    server = MooncakeKVBootstrapServer(host="127.0.0.1", port=bootstrap_port) if rank == 0 else None
    spec = dict(cp_size=n, shared=True, bootstrap_port=bootstrap_port, physical_pages=PHYSICAL_PAGES)
    return (PrefillInstance("hicache", spec, rank, _geometry(dtype_name), REQUEST_PAGES * PAGE + PAGE, pool=pool),
            server)


def _room(number: int, name: str, pages: torch.Tensor, workdir: Path) -> Dict[str, Any]:
    """The request as the PD rig sends it: the pool's own bytes at ``pages``, one chunk."""
    seq_len = REQUEST_PAGES * PAGE
    return dict(room=4_200 + number, name=name, instance="hicache", seq_len=seq_len,
                logical_pages=[int(p) for p in pages], chunk_ends=[seq_len], decode_prefix_pages=0,
                dst_order="contiguous", seed=number, first_token=11 + number, aux_slot=number % 8,
                content="pool", expected_file=str(workdir / f"expected-{name}.npz"))


def _decode(bootstrap_port: int, workdir: Path, dtype_name: str) -> Dict[str, Any]:
    from sglang.srt.distributed.device_communicators.mooncake_transfer_engine import init_mooncake_transfer_engine

    from sglang_cp_shared_kv_testing.pd.decode import DecodeSide
    from sglang_cp_shared_kv_testing.pd.releases import release
    from sglang_cp_shared_kv_testing.pd.sglang_side import apply_transfer_hooks

    result: Dict[str, Any] = {"role": "decode", "rooms": {}}
    release().setup_process(str(workdir), "decode")
    apply_transfer_hooks()
    init_mooncake_transfer_engine(hostname="127.0.0.1", gpu_id=0, ib_device=None)
    decode = DecodeSide({"decode": {"pages": 2 * REQUEST_PAGES}, "max_seq_len": REQUEST_PAGES * PAGE + PAGE},
                        _geometry(dtype_name))
    try:
        connected = False
        for number, (name, _tier, _seed) in enumerate(ROOMS):
            room_file = workdir / f"room{number}.json"
            _wait_for(room_file, f"room {name} from CP rank 0")
            if not connected:  # (every rank registered its manager before rank 0 announced the first room)
                decode.connect(bootstrap_port)
                connected = True
            room = json.loads(room_file.read_text())
            result["rooms"][name] = decode.receive(room, bootstrap_port)
        result["stray_writes"] = decode.stray_writes()
    finally:
        Path(workdir, DONE_FILE).write_text("done")
    return result


def _process_main(index: int, n: int, port: int, bootstrap_port: int, workdir: str, dtype_name: str,
                  extra: dict, rig) -> None:
    workdir = Path(workdir)
    log = os.open(str(workdir / f"process{index}.log"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(log, 1)
    os.dup2(log, 2)
    result: Dict[str, Any] = {}
    try:
        torch.set_num_threads(1)
        os.environ.update({"SGLANG_HOST_IP": "127.0.0.1", "SGLANG_DISAGGREGATION_ALL_CP_RANKS_TRANSFER": "1",
                           "SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT": "60",
                           "SGLANG_DISAGGREGATION_WAITING_TIMEOUT": "60"})
        if index == n:
            result = _decode(bootstrap_port, workdir, dtype_name)
        else:
            result = _prefill_rank(index, n, port, bootstrap_port, workdir, dtype_name, extra, rig)
    except BaseException:  # noqa: BLE001 - reported to the parent
        result["fatal"] = traceback.format_exc()[-4000:]
        Path(workdir, DONE_FILE).write_text("failed")  # (no process waits for a decode that is gone)
    finish_rank(str(workdir), index, result)


def run_hicache_pd(n: int, dtype_name: str, extra: dict, *, rig=None,
                   timeout_s: float = 300.0) -> List[Dict[str, Any]]:
    """N prefill CP ranks and a decode (module docstring): each process's result, decode's last
    (``[n]``). ``extra``: the Mooncake store configuration
    (:meth:`.mooncake_master.MooncakeMaster.extra_config`); ``rig``: the release seam (default
    :class:`HiCachePrefill0512`)."""
    import torch.multiprocessing as mp

    rig = rig if rig is not None else HiCachePrefill0512()
    workdir = tempfile.mkdtemp(prefix=f"hicache-pd-{n}-")
    return run_rank_processes(mp.get_context("spawn"), _process_main, n + 1, workdir,
                              args=(n, free_port(), free_port(), workdir, dtype_name, extra, rig), timeout_s=timeout_s,
                              what=f"HiCache + PD ({dtype_name}, workdir {workdir})")


# ---------------------------------------------------------------- what the tests of every release assert
def check_decode_got_the_flag_off_bytes(n: int, processes: List[Dict[str, Any]], name: str) -> None:
    """Decode received room ``name`` and every byte of it (MLA latent and index K+scale, every
    layer) equals the flag-off run's; no page outside a room was written."""
    decode = processes[n]["rooms"][name]
    assert decode["status"] == "success", decode
    assert decode["verified"], decode["problems"]
    assert processes[n]["stray_writes"] == []


def check_every_rank_sent_the_pages_it_holds(n: int, processes: List[Dict[str, Any]], name: str) -> None:
    """The whole request came back from host memory (``l2``) or the store (``l3``) on every rank,
    and each rank sent exactly the pages it holds of it, KV and index (state) pages alike, every
    rank some."""
    sent = []
    for rank in range(n):
        assert processes[rank]["host_hit_length"][name] == REQUEST_PAGES * PAGE, rank
        outcome = processes[rank]["rooms"][name]
        assert outcome["status"] == "success", (rank, outcome)
        assert outcome["stats"]["kv_pages"] == outcome["stats"]["state_pages"] == outcome["pages_held"], (rank, outcome)
        sent.append(outcome["pages_held"])
    assert sum(sent) == REQUEST_PAGES and min(sent) > 0, sent


def check_the_control_is_caught_on_rank_1(n: int, processes: List[Dict[str, Any]]) -> None:
    """The control (rank 1 zeroed layer 0 of the first page it holds before sending): decode
    received it whole and found exactly that page wrong."""
    decode = processes[n]["rooms"]["control"]
    position = processes[1]["control_position"]
    assert decode["status"] == "success" and not decode["verified"], decode
    assert decode["problems"] == [f"layer 0: kv wrong at positions [{position}]"], decode["problems"]


__all__ = ["ROOMS", "REQUEST_PAGES", "TIER_ROOMS", "HiCachePrefill0512", "check_decode_got_the_flag_off_bytes",
           "check_every_rank_sent_the_pages_it_holds", "check_the_control_is_caught_on_rank_1", "run_hicache_pd"]
