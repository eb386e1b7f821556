"""The decode side of the rig: a stock NSA/DSA pool receiving every room and checking it.

Owns :class:`DecodeSide`: a stock ``NSATokenToKVPool`` (0.5.23: ``DSATokenToKVPool``) filled
with :data:`SENTINEL`,
its ``MooncakeKVManager`` in DECODE mode, preallocating a room's pages as
``DecodePreallocQueue`` does (decode prefix first, marked :data:`PREFIX_MARK`; contiguous
or scattered), sending the metadata with ``MooncakeKVReceiver``, polling to
Success/Failed, verifying every received byte (and the aux metadata) against the room's
deterministic content, or against the pages a file holds (``room["expected_file"]``: what
a replicated prefill's pool holds for the room), and the final check that no page outside
a room was written. Decode runs with the plugin's flag, as a shared-KV deployment's does.

A failed room's pages are quarantined (never reused: a straggler may still write there),
except a room with ``room["drain"]`` (SGLang 0.5.12.post1): there decode waits, as the
flag's decode does, until every prefill sender of the room said it is done
(:class:`sglang_cp_shared_kv.transfer.decode.RoomDrains`), then resets the pages and reuses
them; a write landing after that shows as a later room's wrong bytes or a stray write.
"""

from __future__ import annotations

import hashlib
import time
from typing import Any, Dict, List

import numpy as np

from sglang_cp_shared_kv.pool.kv_geometry import PAGE_SIZE
from sglang_cp_shared_kv_testing.pd.geometry import PREFIX_MARK, SENTINEL, Geometry, content, index_pages, kv_pages
from sglang_cp_shared_kv_testing.pd.releases import release
from sglang_cp_shared_kv_testing.pd.sglang_side import (
    attention_identity,
    kv_args,
    metadata_buffers,
    poll_until,
    server_args,
    wait_for,
)


#: NOTE: how long decode waits for a failed room's drained notices: far above a rank's queued
#: writes here (milliseconds; the slow-write room's delay is 1.5 s), far below the run's deadline
DRAIN_WAIT_S = 20.0


class DecodeSide:
    """The decode process: one pool, one manager, the rooms received one after another."""

    def __init__(self, plan: Dict[str, Any], geometry: Geometry):
        import torch
        from sglang.srt.disaggregation.mooncake.conn import MooncakeKVManager
        from sglang.srt.disaggregation.utils import DisaggregationMode

        spec = plan["decode"]
        self.geometry = geometry
        self.release = release()
        stock_pool, _ = self.release.pool_classes()
        self.pool = stock_pool(spec["pages"] * PAGE_SIZE, **geometry.pool_kwargs())
        for layer in range(geometry.layers):
            kv_pages(self.pool, layer).fill_(SENTINEL)
            index_pages(self.pool, layer).fill_(SENTINEL)
        self.free_pages = list(range(1, spec["pages"] + 1))
        self.quarantined: List[int] = []
        self.metadata = metadata_buffers(8)
        self.req_to_token = torch.zeros((1, plan["max_seq_len"]), dtype=torch.int32)
        args = server_args(0, True, geometry.dtype)
        args.disaggregation_mode = "decode"  # (the flag on a decode server: guards_decode)
        with attention_identity(0, 1):
            self.kv_mgr = MooncakeKVManager(kv_args(self.pool, self.metadata), DisaggregationMode.DECODE,
                                            args, is_mla_backend=True)

    def connect(self, bootstrap_port: int) -> None:
        address = f"127.0.0.1:{bootstrap_port}"
        wait_for(lambda: self.kv_mgr.try_ensure_parallel_info(address), 120,
                 f"every prefill rank to register at {address}", interval=0.2)

    def receive(self, room: Dict[str, Any], bootstrap_port: int) -> Dict[str, Any]:
        import torch
        from sglang.srt.disaggregation.base.conn import KVPoll
        from sglang.srt.disaggregation.mooncake.conn import MooncakeKVReceiver

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
            if self.release.index_pages_from_prefix:  # decode keeps its cached prefix's index pages too
                index_pages(self.pool, layer)[pages_t[:prefix]] = PREFIX_MARK
        seq_len = room["seq_len"]
        locs = (np.asarray(pages)[:, None] * PAGE_SIZE + np.arange(PAGE_SIZE)[None, :]).reshape(-1)[:seq_len]
        self.req_to_token[0, :seq_len] = torch.from_numpy(locs.astype(np.int32))

        # What DecodePreallocQueue sends: pages after the (page-aligned) decode prefix,
        # and the index pages (over the whole sequence, or after the prefix: per release).
        prefix_len = prefix * PAGE_SIZE
        dst = self.release.page_list(self.req_to_token[0], prefix_len, seq_len, PAGE_SIZE)
        if room.get("decode_short_by"):
            dst = dst[: len(dst) - room["decode_short_by"]]
        state = [self.release.decode_index_pages(self.req_to_token[0], prefix_len, seq_len, PAGE_SIZE)]
        saved_timeout = self.kv_mgr.waiting_timeout
        if room.get("decode_waiting_timeout"):
            self.kv_mgr.waiting_timeout = room["decode_waiting_timeout"]
        if room.get("decode_registers_after_s"):
            time.sleep(room["decode_registers_after_s"])  # the prefill acts before decode registers
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
            result["failed_at"] = time.time()  # (wall clock, comparable with the prefill's)
            try:
                receiver.failure_exception()
            except Exception as exc:
                result["error"] = str(exc)
            if room.get("drain"):
                result["drained"] = self._reuse_once_drained(room["room"], pages)
                if result["drained"]["complete"]:
                    return result
            self.quarantined.extend(pages)  # a straggler may still write there
            return result
        receiver.clear()
        t0 = time.monotonic()
        result.update(self._verify(room, pages_t, prefix))
        result["verify_s"] = time.monotonic() - t0
        self._give_back(pages_t, pages)
        return result

    def _give_back(self, pages_t, pages: List[int]) -> None:
        """Reset a room's pages to :data:`SENTINEL` and return them to the free list."""
        for layer in range(self.geometry.layers):
            kv_pages(self.pool, layer)[pages_t] = SENTINEL
            index_pages(self.pool, layer)[pages_t] = SENTINEL
        self.free_pages = sorted(self.free_pages + pages)  # "contiguous" rooms take the lowest run

    def _reuse_once_drained(self, room: int, pages: List[int]) -> Dict[str, Any]:
        """Wait until every prefill sender of failed ``room`` is done with it (Success before the
        failure, or a drained notice), then reset its pages and give them back; the outcome."""
        import torch

        from sglang_cp_shared_kv.transfer.decode import room_drains

        drains = room_drains(self.kv_mgr)
        failure = drains.failure(room) if drains is not None else None
        if failure is None or failure.expected is None:
            return {"complete": False, "why": "no record of the failed room (flag off, or 0.5.23)"}
        try:
            wait_for(lambda: len(drains.heard(room)) >= failure.expected, DRAIN_WAIT_S,
                     f"every prefill sender of room {room} to drain", interval=0.01)
        except TimeoutError:
            return {"complete": False, "ranks": sorted(drains.heard(room)), "expected": failure.expected}
        outcome = {"complete": True, "ranks": sorted(drains.heard(room)), "expected": failure.expected,
                   "released_at": time.time()}
        self._give_back(torch.tensor(pages, dtype=torch.int64), pages)
        drains.forget(room)
        return outcome

    def _verify(self, room, pages_t, prefix) -> Dict[str, Any]:
        g = self.geometry
        total = pages_t.numel()
        problems: List[str] = []
        digest = hashlib.sha256()
        expected = np.load(room["expected_file"]) if room.get("expected_file") else None
        for layer in range(g.layers):
            if expected is not None:  # (layers, pages, page bytes) arrays "kv" and "index"
                kv_expected, index_expected = expected["kv"][layer], expected["index"][layer]
            else:
                kv_expected = content(room["seed"], layer, total, g.kv_page_bytes, "kv")
                index_expected = content(room["seed"], layer, total, g.index_page_bytes, "index")
            kv_got = kv_pages(self.pool, layer)[pages_t].numpy()
            index_got = index_pages(self.pool, layer)[pages_t].numpy()
            digest.update(kv_got[prefix:].tobytes())
            digest.update(index_got.tobytes())
            wrong_kv = np.nonzero((kv_got[prefix:] != kv_expected[prefix:]).any(axis=1))[0] + prefix
            wrong_prefix = np.nonzero((kv_got[:prefix] != PREFIX_MARK).any(axis=1))[0]
            index_from = prefix if self.release.index_pages_from_prefix else 0
            wrong_index = np.nonzero((index_got[index_from:] != index_expected[index_from:]).any(axis=1))[0]
            wrong_index_prefix = np.nonzero((index_got[:index_from] != PREFIX_MARK).any(axis=1))[0]
            wrong = (("kv", wrong_kv), ("decode-prefix kv overwritten", wrong_prefix),
                     ("index", wrong_index + index_from), ("decode-prefix index overwritten", wrong_index_prefix))
            for kind, where in wrong:
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

        check = torch.tensor(sorted(set(range(self.pool.size // PAGE_SIZE + 1)) - set(self.quarantined)))
        problems = []
        for layer in range(self.geometry.layers):
            for kind, view in (("kv", kv_pages(self.pool, layer)), ("index", index_pages(self.pool, layer))):
                rows = view[check]
                bad = check[(rows != SENTINEL).any(dim=1)]
                if bad.numel():
                    problems.append(f"layer {layer} {kind}: stray bytes in pages {bad[:8].tolist()}")
        return problems
