"""SGLang's real Mooncake PD classes on one CPU machine, loopback only.

One *plan* (JSON) describes prefill instances (CP size N, shared or replicated KV),
the processes that host their ranks, one decode, and a list of requests ("rooms") run
one after another. Every process runs this file:

* a prefill process hosts rank r of each instance that lists it (its pool, SGLang's
  ``MooncakeKVManager`` in PREFILL mode, and for rank 0 the instance's
  ``MooncakeKVBootstrapServer``), fills its pool with each room's content, and sends the
  room as SGLang's prefill scheduler does: ``MooncakeKVSender`` + the real
  ``SchedulerDisaggregationPrefillMixin.send_kv_chunk`` per chunk;
* the decode process holds a stock ``NSATokenToKVPool``, preallocates each room's pages as
  ``DecodePreallocQueue`` does (decode prefix first), sends the metadata with
  ``MooncakeKVReceiver``, polls to Success/Failed and checks every byte it received.

Nothing of SGLang is replaced except what has no CPU equivalent: the attention
parallel state (each process reports its own CP rank) and the scheduler/request objects
around ``send_kv_chunk`` (stand-ins with the attributes it reads). Only the plugin's
transfer hooks are applied (the forward-path hook targets import the attention stack, ~4 s
per process, and this harness does not run a forward).

:func:`run_plan` starts the processes and collects their JSON results; the tests and
``scripts/bench_pd_transfer.py`` use it. Every wait has a deadline; processes end with
``os._exit`` (SGLang's manager threads are not daemons).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Dict, List, Optional

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
PAGE = 64
SENTINEL = 0xEE  # decode pages nobody may write
PREFIX_MARK = 0x5A  # decode's own (radix-cached) prefix KV, which prefill must not touch

BASE_ENV = {
    "SGLANG_HOST_IP": "127.0.0.1",
    "SGLANG_DISAGGREGATION_ALL_CP_RANKS_TRANSFER": "1",
    "SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT": "120",
    "SGLANG_DISAGGREGATION_WAITING_TIMEOUT": "120",
    "SGLANG_DISAGGREGATION_HEARTBEAT_INTERVAL": "2",
    "PYTHONUNBUFFERED": "1",
}


# ------------------------------------------------------------------ geometry
@dataclass(frozen=True)
class Geometry:
    """One KV pool's shape: MLA rows of ``kv_cache_dim`` elements, the NSA index pages."""

    layers: int
    kv_lora_rank: int
    qk_rope_head_dim: int
    dtype: str  # "bf16" | "fp8_e4m3"
    kv_cache_dim: int

    @property
    def kv_page_bytes(self) -> int:
        return PAGE * self.kv_cache_dim * (2 if self.dtype == "bf16" else 1)

    @property
    def index_page_bytes(self) -> int:
        return PAGE * (128 + 4)

    def pool_kwargs(self) -> Dict[str, Any]:
        import torch

        dtype = torch.bfloat16 if self.dtype == "bf16" else torch.float8_e4m3fn
        return dict(page_size=PAGE, kv_lora_rank=self.kv_lora_rank, dtype=dtype,
                    qk_rope_head_dim=self.qk_rope_head_dim, layer_num=self.layers, device="cpu",
                    index_head_dim=128, enable_memory_saver=False, kv_cache_dim=self.kv_cache_dim)


#: The layer count of DeepSeek-V3.2 with a narrow latent (bytes do not matter to the
#: transfer path; descriptors do: layers x pages).
TEST_GEOMETRY = Geometry(layers=61, kv_lora_rank=64, qk_rope_head_dim=64, dtype="bf16", kv_cache_dim=128)


def model_geometry(config_path: Path, kv_cache_dtype: str, layers: Optional[int] = None) -> Geometry:
    """The pool shape SGLang builds for an NSA model config (fp8: 512 nope + 4 fp32 scales
    + 64 bf16 rope = 656 bytes a row; bf16: 576 values)."""
    config = json.loads(Path(config_path).read_text())
    rank, rope = config["kv_lora_rank"], config["qk_rope_head_dim"]
    dim = rank + rank // 128 * 4 + rope * 2 if kv_cache_dtype == "fp8_e4m3" else rank + rope
    return Geometry(layers=layers or config["num_hidden_layers"], kv_lora_rank=rank,
                    qk_rope_head_dim=rope, dtype=kv_cache_dtype, kv_cache_dim=dim)


def content(seed: int, layer: int, pages: int, page_bytes: int, kind: str) -> np.ndarray:
    """The bytes of ``pages`` request pages of one layer: a pure function of its arguments,
    so every process derives the same replicated KV. Each page is a random row (per seed
    and kind) plus a per-(layer, position) offset, so a page at a wrong position, layer or
    row offset never matches."""
    rng = np.random.Generator(np.random.Philox(key=[seed, 0 if kind == "kv" else 1]))
    base = np.frombuffer(rng.bytes(page_bytes), dtype=np.uint8)
    offsets = ((layer * 131 + np.arange(pages) * 7) % 251 + 1).astype(np.uint8)
    return base[None, :] + offsets[:, None]


def kv_pages(pool, layer: int):
    import torch

    return pool.kv_buffer[layer].view(-1).view(torch.uint8).view(-1, PAGE * pool.kv_buffer[layer].shape[-1]
                                                                  * pool.kv_buffer[layer].element_size())


def index_pages(pool, layer: int):
    return pool.index_k_with_scale_buffer[layer]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# --------------------------------------------------------------- launcher
def run_plan(plan: Dict[str, Any], workdir: Path, deadline_s: float = 300.0) -> Dict[str, Any]:
    """Run every process of ``plan``; return ``{"results": {proc: json}, "returncodes",
    "logs", "wall_s"}``. Processes that outlive the deadline are killed (by pid)."""
    workdir = Path(workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    plan = dict(plan, workdir=str(workdir))
    plan_path = workdir / "plan.json"
    plan_path.write_text(json.dumps(plan))
    finished = workdir / "finished"
    finished.unlink(missing_ok=True)
    env_base = dict(os.environ, **BASE_ENV)
    env_base["PYTHONPATH"] = os.pathsep.join([str(ROOT / "python"), str(ROOT / "test"), env_base.get("PYTHONPATH", "")])
    procs: Dict[str, subprocess.Popen] = {}
    logs: Dict[str, Path] = {}
    start = time.monotonic()
    try:
        for name, spec in plan["processes"].items():
            env = dict(env_base, **spec.get("env", {}))
            logs[name] = workdir / f"{name}.log"
            with open(logs[name], "wb") as log:
                procs[name] = subprocess.Popen(
                    [sys.executable, str(Path(__file__).resolve()), "--plan", str(plan_path), "--proc", name],
                    stdout=log, stderr=subprocess.STDOUT, env=env, cwd=str(ROOT), start_new_session=True)
        decode = procs[plan["decode"]["proc"]]
        try:
            decode.wait(timeout=max(1.0, deadline_s - (time.monotonic() - start)))
        except subprocess.TimeoutExpired:
            pass
        finished.write_text("done")
        for proc in procs.values():
            try:
                proc.wait(timeout=max(1.0, min(30.0, deadline_s + 30 - (time.monotonic() - start))))
            except subprocess.TimeoutExpired:
                pass
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=10)
    results = {}
    for name in procs:
        path = workdir / f"results-{name}.json"
        results[name] = json.loads(path.read_text()) if path.exists() else None
    return {"results": results, "returncodes": {n: p.returncode for n, p in procs.items()},
            "logs": {n: str(p) for n, p in logs.items()}, "wall_s": time.monotonic() - start}


def log_tails(run: Dict[str, Any], chars: int = 3000) -> str:
    out = []
    for name, path in run["logs"].items():
        text = Path(path).read_text(errors="replace") if Path(path).exists() else ""
        out.append(f"----- {name} (rc={run['returncodes'].get(name)}) -----\n{text[-chars:]}")
    return "\n".join(out)


# ------------------------------------------------------- in-process helpers
def apply_transfer_hooks() -> None:
    """Register and apply the plugin's PD transfer hooks (the plugin's own table)."""
    from sglang.srt.plugins.hook_registry import HookRegistry

    from sglang_cp_shared_kv import plugin, transfer
    from sglang_cp_shared_kv.hook_check import missing_hooks, register_hooks

    specs = [s for s in plugin.HOOKS if s.hook.__module__ == transfer.__name__]
    register_hooks(specs)
    HookRegistry.apply_hooks()
    problems = missing_hooks(specs)
    if problems:
        raise RuntimeError("transfer hooks not applied: " + "; ".join(problems))


@contextmanager
def attention_identity(cp_rank: int, cp_size: int):
    """What SGLang's connection layer reads from the model-parallel state, for one rank
    (there is no torch.distributed world here)."""
    import sglang.srt.disaggregation.common.conn as common

    from sglang_cp_shared_kv.scoped import attributes_set

    values = dict(get_attention_tp_size=lambda: 1, get_attention_tp_rank=lambda: 0,
                  get_attention_cp_size=lambda: cp_size, get_attention_cp_rank=lambda: cp_rank,
                  get_attention_dp_size=lambda: 1, get_attention_dp_rank=lambda: 0,
                  get_pp_group=lambda: SimpleNamespace(rank_in_group=0, world_size=1))
    with attributes_set(common, **values):
        yield


def server_args(bootstrap_port: int, shared: bool, kv_cache_dtype: str):
    from sglang_cp_shared_kv.config import FLAG_DEST

    return SimpleNamespace(host="127.0.0.1", disaggregation_bootstrap_port=bootstrap_port, dist_init_addr=None,
                           enable_dp_attention=False, dp_size=1, pp_size=1, nnodes=1,
                           kv_cache_dtype=kv_cache_dtype, load_balance_method="follow_bootstrap_room",
                           enable_hisparse=False, chunked_prefill_size=8192, enable_metrics=False,
                           disaggregation_ib_device=None, **{FLAG_DEST: shared})


def kv_args(pool, metadata_buffers):
    from sglang.srt.disaggregation.base.conn import KVArgs
    from sglang.srt.disaggregation.utils import setup_state_kv_args

    args = KVArgs()
    args.engine_rank, args.pp_rank, args.system_dp_rank, args.gpu_id = 0, 0, 0, 0
    args.prefill_start_layer = pool.start_layer
    args.prefill_end_layer = getattr(pool, "end_layer", None)
    args.mla_compression_ratios = None
    args.kv_data_ptrs, args.kv_data_lens, args.kv_item_lens = pool.get_contiguous_buf_infos()
    args.page_size = pool.page_size
    args.aux_data_ptrs, args.aux_data_lens, args.aux_item_lens = metadata_buffers.get_buf_infos()
    args.ib_device = None
    setup_state_kv_args(args, pool, None, pool.layer_num)
    return args


def metadata_buffers(slots: int):
    import torch
    from sglang.srt.disaggregation.utils import MetadataBuffers

    return MetadataBuffers(slots, hidden_size=16, hidden_states_dtype=torch.float32)


def wait_for(predicate, deadline_s: float, what: str, interval: float = 0.005):
    end = time.monotonic() + deadline_s
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > end:
            raise TimeoutError(f"timed out after {deadline_s:.0f}s waiting for {what}")
        time.sleep(interval)


def poll_until(poll, states, deadline_s: float, what: str, interval: float = 0.005):
    """Poll a sender/receiver until it reports one of ``states`` (KVPoll.Failed is 0)."""
    end = time.monotonic() + deadline_s
    while True:
        state = poll()
        if state in states:
            return state
        if time.monotonic() > end:
            raise TimeoutError(f"timed out after {deadline_s:.0f}s waiting for {what} (last state {state})")
        time.sleep(interval)


# ---------------------------------------------------------------- prefill
class PrefillInstance:
    """Rank ``cp_rank`` of one prefill instance in this process."""

    def __init__(self, name: str, spec: Dict[str, Any], cp_rank: int, geometry: Geometry, max_seq_len: int):
        import torch
        from sglang.srt.disaggregation.mooncake.conn import MooncakeKVManager
        from sglang.srt.disaggregation.utils import DisaggregationMode
        from sglang.srt.mem_cache.memory_pool import NSATokenToKVPool

        from sglang_cp_shared_kv.cp_shared_kv_layout import CpSharedKVLayout
        from sglang_cp_shared_kv.pool import CpSharedNSATokenToKVPool
        from sglang_cp_shared_kv.transfer import MAX_DESCRIPTORS_ENV

        self.name, self.spec, self.cp_rank, self.geometry = name, spec, cp_rank, geometry
        self.cp_size, self.shared = spec["cp_size"], spec["shared"]
        self.layout = CpSharedKVLayout(PAGE, self.cp_size, cp_rank)
        if self.shared:
            self.pool = CpSharedNSATokenToKVPool(spec["physical_pages"] * PAGE * self.cp_size, layout=self.layout,
                                                 **geometry.pool_kwargs())
        else:
            self.pool = NSATokenToKVPool(spec["physical_pages"] * PAGE, **geometry.pool_kwargs())
        self.metadata = metadata_buffers(8)
        self.req_to_token = torch.zeros((1, max_seq_len), dtype=torch.int32)
        saved = os.environ.get(MAX_DESCRIPTORS_ENV)
        if spec.get("max_descriptors"):
            os.environ[MAX_DESCRIPTORS_ENV] = str(spec["max_descriptors"])
        try:
            with attention_identity(cp_rank, self.cp_size):
                self.kv_mgr = MooncakeKVManager(
                    kv_args(self.pool, self.metadata), DisaggregationMode.PREFILL,
                    server_args(spec["bootstrap_port"], self.shared, geometry.dtype), is_mla_backend=True)
        finally:
            if saved is None:
                os.environ.pop(MAX_DESCRIPTORS_ENV, None)
            else:
                os.environ[MAX_DESCRIPTORS_ENV] = saved

    # The scheduler attributes send_kv_chunk reads.
    @property
    def token_to_kv_pool_allocator(self):
        return SimpleNamespace(page_size=PAGE)

    @property
    def req_to_token_pool(self):
        return SimpleNamespace(req_to_token=self.req_to_token)

    @property
    def disagg_metadata_buffers(self):
        return self.metadata

    @property
    def disagg_prefill_bootstrap_queue(self):
        return SimpleNamespace(kv_manager=self.kv_mgr)

    def fill(self, room: Dict[str, Any]) -> None:
        import torch

        logical = np.asarray(room["logical_pages"], dtype=np.int64)
        positions = np.arange(logical.size)
        if self.shared:
            physical, owned = self.layout.filter_owned_pages_np(logical, positions)
        else:
            physical, owned = logical, positions
        rows = torch.from_numpy(physical)
        g = self.geometry
        for layer in range(g.layers):
            kv = content(room["seed"], layer, logical.size, g.kv_page_bytes, "kv")
            index = content(room["seed"], layer, logical.size, g.index_page_bytes, "index")
            kv_pages(self.pool, layer)[rows] = torch.from_numpy(kv[owned])
            index_pages(self.pool, layer)[rows] = torch.from_numpy(index[owned])
        locs = (logical[:, None] * PAGE + np.arange(PAGE)[None, :]).reshape(-1)[: room["seq_len"]]
        self.req_to_token[0, : room["seq_len"]] = torch.from_numpy(locs.astype(np.int32))

    def send(self, room: Dict[str, Any], my_proc: str) -> Dict[str, Any]:
        from sglang.srt.disaggregation.base.conn import KVPoll
        from sglang.srt.disaggregation.mooncake.conn import MooncakeKVSender
        from sglang.srt.disaggregation.prefill import SchedulerDisaggregationPrefillMixin
        from sglang.srt.mem_cache.common import kv_to_page_num

        from sglang_cp_shared_kv.transfer import transfer_stats

        t0 = time.monotonic()
        self.fill(room)
        fill_s = time.monotonic() - t0
        before = transfer_stats(self.kv_mgr)
        sender = MooncakeKVSender(self.kv_mgr, f"127.0.0.1:{self.spec['bootstrap_port']}", room["room"], [0], 0)
        req = SimpleNamespace(
            rid=f"room-{room['room']}", bootstrap_room=room["room"], origin_input_ids=[1] * room["seq_len"],
            output_ids=[room["first_token"]], req_pool_idx=0, start_send_idx=0, metadata_buffer_index=None,
            disagg_kv_sender=sender, cached_tokens=0, cached_tokens_device=0, cached_tokens_host=0,
            cached_tokens_storage=0, return_logprob=False, hidden_states_tensor=None)
        req.fill_ids = req.origin_input_ids
        status = poll_until(sender.poll, (KVPoll.WaitingForInput, KVPoll.Failed), 100,
                            f"room {room['room']} to leave Bootstrapping")
        started = time.monotonic()
        wait_s = started - t0 - fill_s
        first_send = None
        if status == KVPoll.WaitingForInput:
            # What PrefillBootstrapQueue.pop_bootstrapped does once decode is ready.
            req.start_send_idx = sender.pop_decode_prefix_len()
            num_pages = kv_to_page_num(room["seq_len"] - req.start_send_idx, PAGE)
            req.metadata_buffer_index = room["aux_slot"]
            sender.init(num_pages, req.metadata_buffer_index)
            kill = room.get("kill") or {}
            ends = room["chunk_ends"]
            first_send = time.time()
            for number, end in enumerate(ends, 1):
                last = number == len(ends)
                SchedulerDisaggregationPrefillMixin.send_kv_chunk(self, req, last_chunk=last,
                                                                  end_idx=None if last else end)
                if kill.get("proc") == my_proc and number == kill["after_chunks"]:
                    self._die_after_writes(before)
            status = poll_until(sender.poll, (KVPoll.Success, KVPoll.Failed), 100,
                                f"room {room['room']} to conclude", interval=0.001)
        concluded = time.time()
        elapsed = time.monotonic() - started
        result = {"status": "success" if status == KVPoll.Success else "failed", "elapsed_s": elapsed,
                  "fill_s": fill_s, "wait_s": wait_s}
        if status == KVPoll.Success and first_send is not None:
            result["send_window"] = [first_send, concluded]  # wall clock, comparable across processes
        if status == KVPoll.Failed:
            try:
                sender.failure_exception()
            except Exception as exc:
                result["error"] = str(exc)
        else:
            sender.clear()
        after = transfer_stats(self.kv_mgr)
        if after is not None:
            result["stats"] = {k: after[k] - before[k] for k in after if k != "recent_chunks"}
            result["chunks"] = [c for c in after["recent_chunks"] if c["room"] == room["room"]]
        return result

    def _die_after_writes(self, before) -> None:
        from sglang_cp_shared_kv.transfer import transfer_stats

        wait_for(lambda: transfer_stats(self.kv_mgr)["write_batches"] > before["write_batches"], 30,
                 "the first chunk to be written before the kill")
        print(f"killing myself (pid {os.getpid()}) mid-transfer", flush=True)
        os.kill(os.getpid(), signal.SIGKILL)


# ------------------------------------------------------------------ decode
class DecodeSide:
    def __init__(self, plan: Dict[str, Any], geometry: Geometry):
        import torch
        from sglang.srt.disaggregation.mooncake.conn import MooncakeKVManager
        from sglang.srt.disaggregation.utils import DisaggregationMode
        from sglang.srt.mem_cache.memory_pool import NSATokenToKVPool

        spec = plan["decode"]
        self.geometry = geometry
        self.pool = NSATokenToKVPool(spec["pages"] * PAGE, **geometry.pool_kwargs())
        for layer in range(geometry.layers):
            kv_pages(self.pool, layer).fill_(SENTINEL)
            index_pages(self.pool, layer).fill_(SENTINEL)
        self.free_pages = list(range(1, spec["pages"] + 1))
        self.quarantined: List[int] = []
        self.metadata = metadata_buffers(8)
        self.req_to_token = torch.zeros((1, plan["max_seq_len"]), dtype=torch.int32)
        with attention_identity(0, 1):
            self.kv_mgr = MooncakeKVManager(kv_args(self.pool, self.metadata), DisaggregationMode.DECODE,
                                            server_args(0, False, geometry.dtype), is_mla_backend=True)

    def connect(self, bootstrap_port: int) -> None:
        address = f"127.0.0.1:{bootstrap_port}"
        wait_for(lambda: self.kv_mgr.try_ensure_parallel_info(address), 120,
                 f"every prefill rank to register at {address}", interval=0.2)

    def receive(self, room: Dict[str, Any], bootstrap_port: int) -> Dict[str, Any]:
        import torch
        from sglang.srt.disaggregation.base.conn import KVPoll
        from sglang.srt.disaggregation.mooncake.conn import MooncakeKVReceiver
        from sglang.srt.mem_cache.common import kv_to_page_indices

        total = len(room["logical_pages"])
        prefix = room["decode_prefix_pages"]
        rng = np.random.default_rng(room["seed"])
        if total > len(self.free_pages):
            raise RuntimeError(f"decode pool too small: room {room['room']} needs {total} pages, "
                               f"{len(self.free_pages)} free")
        if room["dst_order"] == "scattered":
            picks = sorted(rng.choice(len(self.free_pages), size=total, replace=False).tolist())
            pages = [self.free_pages[i] for i in picks]
            rng.shuffle(pages)
        else:
            pages = self.free_pages[:total]
        taken = set(pages)
        self.free_pages = [p for p in self.free_pages if p not in taken]
        pages_t = torch.tensor(pages, dtype=torch.int64)
        g = self.geometry
        for layer in range(g.layers):
            kv_pages(self.pool, layer)[pages_t[:prefix]] = PREFIX_MARK
        seq_len = room["seq_len"]
        locs = (np.asarray(pages)[:, None] * PAGE + np.arange(PAGE)[None, :]).reshape(-1)[:seq_len]
        self.req_to_token[0, :seq_len] = torch.from_numpy(locs.astype(np.int32))

        # What DecodePreallocQueue sends: pages after the (page-aligned) decode prefix,
        # and the NSA state pages over the whole sequence.
        prefix_len = prefix * PAGE
        dst = kv_to_page_indices(self.req_to_token[0, prefix_len:seq_len].numpy(), PAGE)
        if room.get("decode_short_by"):
            dst = dst[: len(dst) - room["decode_short_by"]]
        state = [kv_to_page_indices(self.req_to_token[0, :seq_len].numpy(), PAGE)]
        saved_timeout = self.kv_mgr.waiting_timeout
        if room.get("decode_waiting_timeout"):
            self.kv_mgr.waiting_timeout = room["decode_waiting_timeout"]
        started = time.monotonic()
        try:
            receiver = MooncakeKVReceiver(self.kv_mgr, f"127.0.0.1:{bootstrap_port}", room["room"])
            receiver.init(prefill_dp_rank=0)
            started = time.monotonic()
            receiver.send_metadata(dst, room["aux_slot"], state, decode_prefix_len=prefix_len)
            status = poll_until(receiver.poll, (KVPoll.Success, KVPoll.Failed), 150,
                                f"room {room['room']} on decode")
        except BaseException:
            self.quarantined.extend(pages)
            raise
        finally:
            self.kv_mgr.waiting_timeout = saved_timeout
        result: Dict[str, Any] = {"status": "success" if status == KVPoll.Success else "failed",
                                  "elapsed_s": time.monotonic() - started}
        if status == KVPoll.Failed:
            try:
                receiver.failure_exception()
            except Exception as exc:
                result["error"] = str(exc)
            self.quarantined.extend(pages)  # a straggler may still write there
            return result
        receiver.clear()
        t0 = time.monotonic()
        result.update(self._verify(room, pages_t, prefix))
        result["verify_s"] = time.monotonic() - t0
        for layer in range(g.layers):
            kv_pages(self.pool, layer)[pages_t] = SENTINEL
            index_pages(self.pool, layer)[pages_t] = SENTINEL
        self.free_pages = sorted(self.free_pages + pages)  # "contiguous" rooms take the lowest run
        return result

    def _verify(self, room, pages_t, prefix) -> Dict[str, Any]:
        g = self.geometry
        total = pages_t.numel()
        problems: List[str] = []
        digest = hashlib.sha256()
        for layer in range(g.layers):
            kv_expected = content(room["seed"], layer, total, g.kv_page_bytes, "kv")
            index_expected = content(room["seed"], layer, total, g.index_page_bytes, "index")
            kv_got = kv_pages(self.pool, layer)[pages_t].numpy()
            index_got = index_pages(self.pool, layer)[pages_t].numpy()
            digest.update(kv_got[prefix:].tobytes())
            digest.update(index_got.tobytes())
            wrong_kv = np.nonzero((kv_got[prefix:] != kv_expected[prefix:]).any(axis=1))[0] + prefix
            wrong_prefix = np.nonzero((kv_got[:prefix] != PREFIX_MARK).any(axis=1))[0]
            wrong_index = np.nonzero((index_got != index_expected).any(axis=1))[0]
            for kind, where in (("kv", wrong_kv), ("decode-prefix kv overwritten", wrong_prefix), ("index", wrong_index)):
                if where.size and len(problems) < 20:
                    problems.append(f"layer {layer}: {kind} wrong at positions {where[:8].tolist()}")
        aux_ok = (int(self.metadata.output_ids[room["aux_slot"], 0]) == room["first_token"]
                  and int(self.metadata.bootstrap_room[room["aux_slot"], 0]) == room["room"])
        if not aux_ok:
            problems.append("aux metadata (first token / bootstrap room) not received")
        return {"verified": not problems, "problems": problems, "digest": digest.hexdigest()}

    def stray_writes(self) -> List[str]:
        """Pages outside every room that do not hold the sentinel any more."""
        import torch

        check = torch.tensor(sorted(set(range(self.pool.size // PAGE + 1)) - set(self.quarantined)))
        problems = []
        for layer in range(self.geometry.layers):
            for kind, view in (("kv", kv_pages(self.pool, layer)), ("index", index_pages(self.pool, layer))):
                rows = view[check]
                bad = check[(rows != SENTINEL).any(dim=1)]
                if bad.numel():
                    problems.append(f"layer {layer} {kind}: stray bytes in pages {bad[:8].tolist()}")
        return problems


# -------------------------------------------------------------- process main
def _write_results(plan: Dict[str, Any], proc: str, results: Dict[str, Any]) -> None:
    # After every room, so a process killed on purpose still reports its earlier rooms.
    path = Path(plan["workdir"]) / f"results-{proc}.json"
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(results))
    os.replace(tmp, path)


def _serve(plan: Dict[str, Any], proc: str) -> Dict[str, Any]:
    spec = plan["processes"][proc]
    logging.basicConfig(level=getattr(logging, spec.get("log_level", "INFO")),
                        format=f"%(asctime)s {proc} %(name)s %(levelname)s %(message)s")
    import torch
    from sglang.srt.distributed.device_communicators.mooncake_transfer_engine import init_mooncake_transfer_engine

    # Small copies with torch's intra-op pool cost ~7 ms each on a 2-core box (vs 10 us).
    torch.set_num_threads(1)
    apply_transfer_hooks()
    init_mooncake_transfer_engine(hostname="127.0.0.1", gpu_id=0, ib_device=None)
    geometry = Geometry(**plan["geometry"])
    instances = plan["instances"]
    results: Dict[str, Any] = {"rooms": {}}
    if spec["role"] == "decode":
        decode = DecodeSide(plan, geometry)
        for spec_i in instances.values():
            decode.connect(spec_i["bootstrap_port"])
        for room in plan["rooms"]:
            try:
                outcome = decode.receive(room, instances[room["instance"]]["bootstrap_port"])
            except Exception as exc:
                logging.getLogger(__name__).exception("room %s failed in the rig", room["room"])
                outcome = {"status": "error", "error": f"{type(exc).__name__}: {exc}", "elapsed_s": -1}
            results["rooms"][str(room["room"])] = outcome
            print(f"{time.strftime('%H:%M:%S')} room {room['room']} ({room['name']}): {outcome['status']} "
                  f"in {outcome['elapsed_s']:.2f}s {outcome.get('error', '')}", flush=True)
        results["stray_writes"] = decode.stray_writes()
        return results

    from sglang.srt.disaggregation.mooncake.conn import MooncakeKVBootstrapServer

    mine = {name: s["procs"].index(proc) for name, s in instances.items() if proc in s["procs"]}
    servers = [MooncakeKVBootstrapServer(host="127.0.0.1", port=instances[name]["bootstrap_port"])
               for name, rank in mine.items() if rank == 0]
    hosted = {name: PrefillInstance(name, instances[name], rank, geometry, plan["max_seq_len"])
              for name, rank in mine.items()}
    for room in plan["rooms"]:
        instance = hosted.get(room["instance"])
        if instance is None:
            continue
        try:
            outcome = instance.send(room, proc)
        except Exception as exc:  # keep going: later rooms and decode must not hang on this one
            logging.getLogger(__name__).exception("room %s failed in the rig", room["room"])
            outcome = {"status": "error", "error": f"{type(exc).__name__}: {exc}"}
        results["rooms"][str(room["room"])] = outcome
        _write_results(plan, proc, results)
        print(f"{time.strftime('%H:%M:%S')} room {room['room']} ({room['name']}) rank {instance.cp_rank}: {outcome['status']} "
              f"{outcome.get('error', '')}", flush=True)
    results["bootstrap_servers"] = len(servers)
    return results


def main(argv=None) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--plan", required=True)
    parser.add_argument("--proc", required=True)
    args = parser.parse_args(argv)
    plan = json.loads(Path(args.plan).read_text())
    workdir = Path(plan["workdir"])
    code = 0
    try:
        results = _serve(plan, args.proc)
    except BaseException as exc:  # report, then leave without waiting for SGLang's threads
        import traceback

        traceback.print_exc()
        results = {"error": f"{type(exc).__name__}: {exc}"}
        code = 1
    _write_results(plan, args.proc, results)
    print("DONE", flush=True)
    if plan["processes"][args.proc]["role"] != "decode":
        # Stay up (bootstrap servers, managers) until decode is through with every room.
        end = time.monotonic() + 600
        while not (workdir / "finished").exists() and time.monotonic() < end:
            time.sleep(0.1)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    main()
