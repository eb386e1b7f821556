"""Decode's failed-room holds (:mod:`sglang_cp_shared_kv.decode.failed_room_holds`) on N decode
attention-TP ranks (gloo processes): a hold is released on every rank in the same call, only
once every rank finds it ready, whichever rank heard the prefill ranks first or whose clock ran
out first.

Each rank holds rooms 1 and 2 (each waiting for two prefill senders), then runs the rounds of
:data:`ROUNDS`; it reports what each round released (:func:`run_hold_agreement`).
"""

from __future__ import annotations

import tempfile
import traceback
from types import SimpleNamespace
from typing import List

#: (what happens on which ranks before the round, what every rank must release in it):
#: ``heard``: room 1's second prefill rank drained on those ranks; ``late``: those ranks' clocks
#: pass the hold's deadline. "last" is rank N - 1, "all" every rank.
ROUNDS = (
    ("heard", "first", 0),  # rank 0 heard both senders, the others one: nobody releases
    ("heard", "all", 1),  # every rank heard them: room 1 released everywhere
    ("late", "last", 0),  # room 2: one rank's hold ran out, the others' not
    ("late", "all", 1),  # every rank's ran out: room 2 released everywhere
)
HOLD_S = 100.0


def _rank_main(rank: int, n: int, port: int, out_dir: str) -> None:
    from sglang_cp_shared_kv_testing.cp_harness import finish_rank

    result: dict = {}
    try:
        import torch

        from sglang_cp_shared_kv.decode.failed_room_holds import HOLD_REQUEST_ATTR, FailedRoomHolds, HoldRequest
        from sglang_cp_shared_kv.transfer.decode import FailedRoom, RoomDrains
        from sglang_cp_shared_kv_testing.support import gloo_attention_cp_group

        torch.set_num_threads(1)
        group = gloo_attention_cp_group(rank, n, port, local_rank=rank, timeout_s=60).cpu_group
        now = [0.0]
        freed: List[int] = []
        released: List[int] = []
        holds = FailedRoomHolds(freed.append, hold_s=HOLD_S, clock=lambda: now[0])
        drains = RoomDrains()
        for room in (1, 2):
            drains.failed(room, FailedRoom(expected=2, succeeded=frozenset({0})))
            req = SimpleNamespace(bootstrap_room=room, rid=f"r{room}")
            setattr(req, HOLD_REQUEST_ATTR, HoldRequest(holds, drains, metadata_slot=10 + room))
            assert holds.defer(req, lambda room=room: released.append(room))
            assert holds.holds_slot(10 + room)
        per_round = []
        for what, where, _expected in ROUNDS:
            chosen = {"first": rank == 0, "last": rank == n - 1, "all": True}[where]
            if chosen and what == "heard":
                drains.drained(1, 1)
            if chosen and what == "late":
                now[0] = HOLD_S + 1
            per_round.append(holds.release_ready(group))
        result = {"per_round": per_round, "released": released, "freed": freed, "left": len(holds)}
    except BaseException:  # noqa: BLE001 - reported to the parent
        result["fatal"] = traceback.format_exc()[-4000:]
    finish_rank(out_dir, rank, result)


def run_hold_agreement(n: int, *, timeout_s: float = 120.0) -> List[dict]:
    """Each rank's outcome: ``per_round`` (holds released per round of :data:`ROUNDS`),
    ``released`` (rooms, in order), ``freed`` (metadata slots), ``left`` (holds still out)."""
    import torch.multiprocessing as mp

    from sglang_cp_shared_kv_testing.support import free_port, run_rank_processes

    out_dir = tempfile.mkdtemp(prefix=f"decode-holds-{n}-")
    return run_rank_processes(mp.get_context("spawn"), _rank_main, n, out_dir, args=(n, free_port(), out_dir),
                              timeout_s=timeout_s, what="decode failed-room holds")


__all__ = ["HOLD_S", "ROUNDS", "run_hold_agreement"]
