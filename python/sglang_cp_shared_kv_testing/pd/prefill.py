"""The prefill side of the rig: one CP rank of one prefill instance in this process.

Owns :class:`PrefillInstance`: its pool (the plugin's physical pool with shared KV, a
stock ``NSATokenToKVPool`` / ``DSATokenToKVPool`` otherwise), its ``MooncakeKVManager`` in PREFILL mode, the
scheduler attributes SGLang's ``send_kv_chunk`` reads, filling the pool with a room's
content (only the pages this rank owns, with shared KV; or sending what a given pool
already holds, ``room["content"] == "pool"``), and sending a room the way
SGLang's prefill scheduler does (``MooncakeKVSender`` + the real
``SchedulerDisaggregationPrefillMixin.send_kv_chunk`` per chunk), optionally killing
this process mid-transfer, sending what stock SGLang sends for a prompt its prefill
refused (``room["prefill_refused"]``), refusing it at intake as SGLang 0.5.23 does, no sender
made (``room["refused_at_intake"]``: ``"after"`` or ``"before"`` decode registered it; SGLang's
real ``PrefillBootstrapQueue.add``) or aborting the request after bootstrap
(``room["prefill_aborts"]``; ``"before_registration"``: before decode registered it) when
the plan asks. With ``room["agree"]`` the instance's ranks agree on the room's status before
concluding it, as SGLang's prefill group does (the MIN of their polls, here through files in
the plan's workdir): every rank of a room that failed anywhere calls ``failure_exception``.
``room["slow_write"]`` (``{"proc", "delay_s"}``) holds that process's first write of the room
back by ``delay_s`` (a slow rank), and reports when it landed.
"""

from __future__ import annotations

import os
import signal
import time
from types import SimpleNamespace
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Dict, Iterator, Optional

import numpy as np

from sglang_cp_shared_kv.pool.kv_geometry import PAGE_SIZE
from sglang_cp_shared_kv_testing.pd.geometry import Geometry, content, index_pages, kv_pages
from sglang_cp_shared_kv_testing.pd.releases import release
from sglang_cp_shared_kv_testing.pd.sglang_side import (
    attention_identity,
    kv_args,
    metadata_buffers,
    poll_until,
    server_args,
    wait_for,
)


class PrefillInstance:
    """Rank ``cp_rank`` of one prefill instance in this process."""

    def __init__(self, name: str, spec: Dict[str, Any], cp_rank: int, geometry: Geometry, max_seq_len: int,
                 pool=None, workdir: Optional[str] = None):
        """``pool``: send from this pool (e.g. one a CP forward filled) instead of a new one;
        ``workdir``: where the instance's ranks agree on a room's status (``room["agree"]``)."""
        import torch
        from sglang.srt.disaggregation.mooncake.conn import MooncakeKVManager
        from sglang.srt.disaggregation.utils import DisaggregationMode

        from sglang_cp_shared_kv.context import CpSharedKVContext
        from sglang_cp_shared_kv.cp_shared_kv_layout import CpSharedKVLayout
        from sglang_cp_shared_kv.transfer.hooks import check_transfer_matches_pool
        from sglang_cp_shared_kv.transfer.pages import MAX_DESCRIPTORS_ENV

        self.name, self.spec, self.cp_rank, self.geometry = name, spec, cp_rank, geometry
        self.workdir = workdir
        self.cp_size, self.shared = spec["cp_size"], spec["shared"]
        self.layout = CpSharedKVLayout(PAGE_SIZE, self.cp_size, cp_rank)
        self.release = release()
        stock_pool, shared_pool = self.release.pool_classes()
        if pool is not None:
            self.pool = pool
        elif self.shared:
            self.pool = shared_pool(spec["physical_pages"] * PAGE_SIZE * self.cp_size,
                                    context=CpSharedKVContext(self.layout), **geometry.pool_kwargs())
        else:
            self.pool = stock_pool(spec["physical_pages"] * PAGE_SIZE, **geometry.pool_kwargs())
        for name, value in self.release.scheduler_extras().items():  # what send_kv_chunk reads besides
            setattr(self, name, value)
        self.metadata = metadata_buffers(8)
        self.req_to_token = torch.zeros((1, max_seq_len), dtype=torch.int32)
        saved = os.environ.get(MAX_DESCRIPTORS_ENV)
        if spec.get("max_descriptors"):
            os.environ[MAX_DESCRIPTORS_ENV] = str(spec["max_descriptors"])
        try:
            with attention_identity(cp_rank, self.cp_size, spec["bootstrap_port"]):
                self.kv_mgr = MooncakeKVManager(
                    kv_args(self.pool, self.metadata), DisaggregationMode.PREFILL,
                    server_args(spec["bootstrap_port"], self.shared, geometry.dtype), is_mla_backend=True)
        finally:
            if saved is None:
                os.environ.pop(MAX_DESCRIPTORS_ENV, None)
            else:
                os.environ[MAX_DESCRIPTORS_ENV] = saved
        # What the hook on PrefillBootstrapQueue._init_kv_manager checks once the manager exists.
        check_transfer_matches_pool(self.kv_mgr, SimpleNamespace(token_to_kv_pool=self.pool))

    # The scheduler attributes send_kv_chunk reads.
    @property
    def token_to_kv_pool_allocator(self):
        # NOTE: no unified memory: the transfer ids are the page table's (SGLang's identity there)
        return SimpleNamespace(page_size=PAGE_SIZE, translate_kv_indices_for_transfer=lambda indices: indices,
                               get_kvcache=lambda: self.pool)

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
        locs = (logical[:, None] * PAGE_SIZE + np.arange(PAGE_SIZE)[None, :]).reshape(-1)[: room["seq_len"]]
        self.req_to_token[0, : room["seq_len"]] = torch.from_numpy(locs.astype(np.int32))
        if room.get("content") == "pool":
            return  # send what the pool holds
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

    def send(self, room: Dict[str, Any], my_proc: str) -> Dict[str, Any]:
        from sglang.srt.disaggregation.base.conn import KVPoll
        from sglang.srt.mem_cache.common import kv_to_page_num

        from sglang_cp_shared_kv.transfer.prefill import transfer_stats

        if room.get("refused_at_intake"):
            return self._refuse_at_intake(room)
        t0 = time.monotonic()
        self.fill(room)
        fill_s = time.monotonic() - t0
        before = transfer_stats(self.kv_mgr)
        sender = self.release.sender(self.kv_mgr, f"127.0.0.1:{self.spec['bootstrap_port']}", room["room"])
        req = self.release.request(room["room"], sender, room["seq_len"], room["first_token"])
        ends = room["chunk_ends"]
        if room.get("prefill_refused"):
            # What stock SGLang's prefill makes of a prompt it refuses (over max_req_input_len):
            # Req.set_finish_with_abort keeps the request but replaces its prompt by one token
            # (schedule_batch.py, "set it to one token to skip the long prefill"), which is
            # then prefilled and sent to decode as a complete request.
            req.origin_input_ids, req.return_logprob, req.extend_end, ends = [0], False, 1, [1]
        req.fill_ids = req.origin_input_ids
        if room.get("prefill_aborts") == "before_registration":
            # SGLang's abort_request on a request in the bootstrap queue before decode has
            # registered it with this rank (decode registers late: decode_registers_after_s)
            sender.abort()
        status = poll_until(sender.poll, (KVPoll.WaitingForInput, KVPoll.Failed), 100,
                            f"room {room['room']} to leave Bootstrapping")
        started = time.monotonic()
        wait_s = started - t0 - fill_s
        first_send, slow = None, {}
        if status == KVPoll.WaitingForInput:
            # What PrefillBootstrapQueue.pop_bootstrapped does once decode is ready.
            self.release.bootstrapped(req, sender.pop_decode_prefix_len())
            num_pages = kv_to_page_num(len(req.origin_input_ids) - req.start_send_idx, PAGE_SIZE)
            req.metadata_buffer_index = room["aux_slot"]
            sender.init(num_pages, req.metadata_buffer_index)
            kill = room.get("kill") or {}
            first_send = time.time()
            if room.get("prefill_aborts"):
                # What SGLang's abort_request does to a request in its bootstrap or in-flight
                # queue: MooncakeKVSender.abort(); no chunk is sent.
                sender.abort()
                ends = []
            with self._slow_first_write(room, my_proc) as slow:
                for number, end in enumerate(ends, 1):
                    last = number == len(ends)
                    self.release.send_kv_chunk(self, req, last, None if last else end)
                    if kill.get("proc") == my_proc and number == kill["after_chunks"]:
                        self._die_after_writes(before)
                status = poll_until(sender.poll, (KVPoll.Success, KVPoll.Failed), 100,
                                    f"room {room['room']} to conclude", interval=0.001)
        concluded = time.time()
        elapsed = time.monotonic() - started
        result = {"status": "success" if status == KVPoll.Success else "failed", "elapsed_s": elapsed,
                  "fill_s": fill_s, "wait_s": wait_s}
        if slow.get("landed_at"):
            result["slow_write_landed_at"] = slow["landed_at"]  # wall clock
        if status == KVPoll.Success and first_send is not None:
            result["send_window"] = [first_send, concluded]  # wall clock, comparable across processes
        if room.get("agree"):
            agreed = self._agree(room, status)
            result["agreed"] = "success" if agreed == KVPoll.Success else "failed"
            status = agreed
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

    def _refuse_at_intake(self, room: Dict[str, Any]) -> Dict[str, Any]:
        """SGLang 0.5.23's intake refuses the prompt (``validate_input_length`` ->
        ``Req.set_finish_with_abort``; ``PrefillBootstrapQueue.add`` retires it, no sender):
        after decode registered the room with this rank (``"after"``) or at once (``"before"``;
        decode registers later). With the flag, waits (bounded) until every decode target of
        the room was told (``decode_told``)."""
        from sglang.srt.disaggregation.base.conn import KVPoll

        from sglang_cp_shared_kv.transfer.prefill import built_prefill_transfer, transfer_stats

        number = room["room"]
        before = transfer_stats(self.kv_mgr)
        if room["refused_at_intake"] == "after":
            wait_for(lambda: self.kv_mgr.request_status.get(number) == KVPoll.WaitingForInput, 60,
                     f"decode to register room {number}")
        refused_at = time.time()
        retired = self.release.refuse_at_intake(
            self.kv_mgr, number, f"Input length ({room['seq_len']}) exceeds the maximum allowed length")
        result: Dict[str, Any] = {"status": "refused", "retired": retired, "refused_at": refused_at}
        context = built_prefill_transfer(self.kv_mgr)
        if context is not None:
            def forgotten():  # (SGLang's entries go right after the last target was told)
                return number not in self.kv_mgr.request_status and number not in self.kv_mgr.transfer_infos

            for key, done, what in (("decode_told", lambda: context._refused_unregistered.get(number) is None,
                                     "decode's targets told"), ("room_forgotten", forgotten, "SGLang's entries dropped")):
                try:
                    result[key] = wait_for(done, 30, f"room {number}: {what}")
                except TimeoutError:
                    result[key] = False
            after = transfer_stats(self.kv_mgr)
            result["stats"] = {k: after[k] - before[k] for k in after if k != "recent_chunks"}
        return result

    def _agree(self, room: Dict[str, Any], status):
        """The MIN of every rank's status for ``room`` (SGLang's prefill poll is MIN-all-reduced
        over the group): each rank writes its own, then reads all of them."""
        if self.workdir is None:
            raise RuntimeError(f"room {room['room']} asks the ranks to agree, and this instance has no workdir")
        folder = Path(self.workdir, f"agree-{room['room']}")
        folder.mkdir(exist_ok=True)
        mine = folder / f"rank{self.cp_rank}"
        mine.with_suffix(".tmp").write_text(str(int(status)))
        os.replace(mine.with_suffix(".tmp"), mine)
        paths = [folder / f"rank{rank}" for rank in range(self.cp_size)]
        wait_for(lambda: all(p.exists() for p in paths), 60, f"every rank's status for room {room['room']}",
                 interval=0.01)
        return min(int(p.read_text()) for p in paths)  # (KVPoll's values are plain ints)

    @contextmanager
    def _slow_first_write(self, room: Dict[str, Any], my_proc: str) -> Iterator[Dict[str, float]]:
        """Within the block, this rank's first write of ``room`` waits ``room["slow_write"]["delay_s"]``
        when the plan names this process; the dict gets ``landed_at`` (wall clock) once it is done."""
        slow = room.get("slow_write") or {}
        landed: Dict[str, float] = {}
        if slow.get("proc") != my_proc:
            yield landed
            return
        from sglang_cp_shared_kv.transfer.prefill import prefill_transfer

        context = prefill_transfer(self.kv_mgr)
        write = context.write

        def slow_write(*args, **kwargs):
            if landed:
                return write(*args, **kwargs)
            time.sleep(slow["delay_s"])
            try:
                return write(*args, **kwargs)
            finally:
                landed["landed_at"] = time.time()

        context.write = slow_write  # (the transfer hook calls the context's write: this one, for now)
        try:
            yield landed
        finally:
            del context.write

    def _die_after_writes(self, before) -> None:
        from sglang_cp_shared_kv.transfer.prefill import transfer_stats

        wait_for(lambda: transfer_stats(self.kv_mgr)["write_batches"] > before["write_batches"], 30,
                 "the first chunk to be written before the kill")
        print(f"killing myself (pid {os.getpid()}) mid-transfer", flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
