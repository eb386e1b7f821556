"""PD transfer of CP shards, end to end over the real Mooncake engine on 127.0.0.1.

One run of :mod:`sglang_cp_shared_kv_testing.pd_rig` (module fixture) starts six
processes: four prefill processes P0..P3, process P hosting CP rank i of every instance
that has one (shared KV S2/S3/S4 with the plugin's physical pool; replicated R2/R3/R4,
flag off, SGLang's stock CP transfer), one more prefill process L1 whose Mooncake TCP
lane is forced low, and one decode process with a stock full-layout NSA pool. Requests run one after another
through SGLang's own bootstrap server, ``MooncakeKVManager``, ``MooncakeKVSender`` (driven
by the real ``send_kv_chunk``) and ``MooncakeKVReceiver``; decode checks every byte it
received against the request's content. The tests below read that run's results.

Requests (each shared-KV one also sent by R1, a replicated prefill without CP, and, where
SGLang's stock CP split can take it, by R2/R3/R4): one chunk; four chunks (one ending
mid-page); a decode-side prefix hit (7 pages cached on decode); chunks of one page, so all
ranks but one own nothing of them; a 2-page request on N = 3, 4 (ranks that own nothing at
all); 80 pages x 61 layers on N = 2 (2,440 descriptors per rank per write); on N = 2, 3, 4 a
24-page request in two chunks on the pages the plugin's compute-owner allocator hands it
(each rank's pages of a chunk in at most two runs). Failures: decode
preallocates fewer pages than the request has (rejected before enqueueing); on the low lane,
batches sized to it pass, an index write it rejects and a KV write it rejects fail the
request on both sides with the cause; a prompt the prefill refused (stock SGLang sends a
one-token stand-in: decode completes it flag off, fails it flag on); a request the prefill
aborts after bootstrap or before decode registered it (decode waits for its timeout flag
off, fails at once flag on);
prefill rank 3 of S4 SIGKILLs itself after its first
chunk was written (decode fails within its waiting timeout, no hang).

The same run, on the same tests, on SGLang 0.5.23 (``.venv-0.5.23``; the rig's per-release
seam is ``sglang_cp_shared_kv_testing/pd/releases.py``). What 0.5.23 changed leaves three cases out there:
compute-owner pages (interleave CP computes every page on every rank), the refused prompt's
one-token stand-in (0.5.23 retires the prompt at intake, no sender: there the rig refuses it
through 0.5.23's real ``PrefillBootstrapQueue.add`` after decode registered the room and before;
stock decode waits for its timeout, the flag's every rank tells it at once) and the index write the lane rejects on
its own (0.5.23's index page list starts at the decode prefix like the KV list, so the
lane rejects the KV write first); and decode's cached prefix keeps its own index pages
there, which the rig checks stay untouched.
"""

from __future__ import annotations

import math
from dataclasses import asdict

import numpy as np
import pytest

from sglang_cp_shared_kv_testing.support import mooncake_engine_or_skip

mooncake_engine = mooncake_engine_or_skip()

from sglang_cp_shared_kv.cp_shared_kv_layout import CpSharedKVLayout  # noqa: E402
from sglang_cp_shared_kv.pool.kv_geometry import PAGE_SIZE  # noqa: E402
from sglang_cp_shared_kv.releases import installed  # noqa: E402
from sglang_cp_shared_kv_testing import pd_rig as rig  # noqa: E402
from sglang_cp_shared_kv_testing.pd.releases import release  # noqa: E402
from sglang_cp_shared_kv.transfer.pages import DEFAULT_MAX_DESCRIPTORS_PER_BATCH  # noqa: E402

#: what differs between the SGLang releases the rig drives (0.5.12.post1, 0.5.23)
RELEASE = release()

PAGE = PAGE_SIZE
LAYERS = rig.TEST_GEOMETRY.layers
LANE_LIMIT = 64  # MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER and ..._PENDING_ADMISSIONS_... in L1
KILL_TIMEOUT_S = 6  # decode's SGLANG_DISAGGREGATION_WAITING_TIMEOUT for the killed-rank request
ABORT_TIMEOUT_S = 8  # the same for the aborted requests (stock waits all of it)
MAIN_PROCS = ["P0", "P1", "P2", "P3"]
REFUSED_INSTANCES = ("R1", "R2", "S2", "S3")
#: SGLang 0.5.12.post1: a shared instance's failed rooms are agreed by its ranks (as SGLang's
#: prefill group does) and decode reuses their pages once every rank drained (0.5.23's decode
#: holds them itself: ABORT and its acknowledgement)
DRAIN = {} if installed.INSTALLED.deferred_decode_release else {"agree": True, "drain": True}
SLOW_WRITE_S = 1.5

# (name, seq_len, chunk ends, decode prefix pages, logical page order, decode page order)
SCENARIOS = [
    ("one-chunk", 600, [600], 0, "contiguous", "scattered"),
    ("chunks", 1500, [512, 1000, 1280, 1500], 0, "shuffled", "contiguous"),
    ("decode-prefix", 1300, [704, 1088, 1300], 7, "shuffled", "scattered"),
    ("rank-owns-nothing-in-a-chunk", 1000, [64, 128, 320, 1000], 0, "contiguous", "contiguous"),
    ("rank-owns-nothing-at-all", 100, [100], 0, "contiguous", "scattered"),
]
BIG = ("above-2048-descriptors", 80 * PAGE, [80 * PAGE], 0, "contiguous", "contiguous")
# (name, seq_len, chunk ends): pages from the compute-owner allocator, decode pages in one run
COMPUTE_OWNER = ("compute-owner-pages", 24 * PAGE, [12 * PAGE + 30, 24 * PAGE])


def _pages(seq_len):
    return math.ceil(seq_len / PAGE)


def build_plan():
    rng = np.random.default_rng(20240611)
    port = rig.free_port
    instances = {
        # the reference: a replicated prefill without CP, one sender (flag off)
        "R1": dict(cp_size=1, shared=False, bootstrap_port=port(), procs=["P0"], physical_pages=96),
    }
    for n in (2, 3, 4):
        physical = 48 if n == 2 else 16 if n == 3 else 12
        instances[f"S{n}"] = dict(cp_size=n, shared=True, bootstrap_port=port(), procs=MAIN_PROCS[:n],
                                  physical_pages=physical)
        instances[f"R{n}"] = dict(cp_size=n, shared=False, bootstrap_port=port(), procs=MAIN_PROCS[:n],
                                  physical_pages=physical * n)
    # L1 runs Mooncake with a 64-entry lane. LB sizes its batches to it (the default, read
    # from MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER); LA is told to use 1,024-descriptor batches.
    instances["LB"] = dict(cp_size=2, shared=True, bootstrap_port=port(), procs=["P0", "L1"], physical_pages=32)
    instances["LA"] = dict(cp_size=2, shared=True, bootstrap_port=port(), procs=["P0", "L1"], physical_pages=32,
                           max_descriptors=DEFAULT_MAX_DESCRIPTORS_PER_BATCH)
    rooms = []

    def add(name, instance, seq_len, ends, prefix, logical, dst_order, seed, **extra):
        rooms.append(dict(room=10_000 + len(rooms), name=name, instance=instance, seq_len=seq_len,
                          logical_pages=[int(p) for p in logical], chunk_ends=ends, decode_prefix_pages=prefix,
                          dst_order=dst_order, seed=seed, first_token=1000 + len(rooms),
                          aux_slot=len(rooms) % 8, **extra))

    for i, (name, seq_len, ends, prefix, order, dst_order) in enumerate(SCENARIOS + [BIG]):
        count = _pages(seq_len)
        # Shuffled pages stay inside every shared instance's logical range (<= 48).
        logical = (np.arange(1, count + 1) if order == "contiguous"
                   else rng.choice(np.arange(1, 49), size=count, replace=False))
        seed = 100 + i
        add(f"{name}/R1", "R1", seq_len, ends, prefix, logical, dst_order, seed, pair=name)
        for n in (2, 3, 4):
            if (name == "rank-owns-nothing-at-all" and n == 2) or (name == BIG[0] and n != 2):
                continue
            add(f"{name}/S{n}", f"S{n}", seq_len, ends, prefix, logical, dst_order, seed, pair=name)
            # SGLang's stock CP split assumes a request's page ids are contiguous (it drops
            # pages otherwise; see docs/transfer.md), so the flag-off CP runs use those.
            if order == "contiguous":
                add(f"{name}/R{n}", f"R{n}", seq_len, ends, prefix, logical, dst_order, seed, pair=name)
    name, seq_len, ends = COMPUTE_OWNER
    for n in (2, 3, 4) if RELEASE.compute_owner_allocation else ():
        from sglang_cp_shared_kv_testing.allocation import request_pages

        logical, _ = request_pages(n, instances[f"S{n}"]["physical_pages"], ends)
        pair = f"{name}-N{n}"
        add(f"{pair}/R1", "R1", seq_len, ends, 0, logical, "contiguous", 20 + n, pair=pair)
        add(f"{pair}/S{n}", f"S{n}", seq_len, ends, 0, logical, "contiguous", 20 + n, pair=pair)
    add("decode-preallocated-too-few-pages/S2", "S2", 20 * PAGE, [20 * PAGE], 0, np.arange(1, 21), "contiguous",
        8, decode_short_by=2, expect="failed", **DRAIN)
    # Prefill refused the prompt and sent SGLang's one-token stand-in; decode preallocated
    # all 30 pages. Stock (R1, R2) completes it; the flag (S2, S3) fails it on both sides.
    for instance in REFUSED_INSTANCES if RELEASE.stock_sends_refused_prompt_standin else ():
        add(f"prefill-refused-prompt/{instance}", instance, 30 * PAGE, [30 * PAGE], 0, np.arange(1, 31),
            "contiguous", 11, prefill_refused=True, expect="stock" if instance.startswith("R") else "failed",
            **({} if instance.startswith("R") else DRAIN))
    # 0.5.23 retires a prompt its intake refuses and makes no sender: after decode registered
    # the room, or before (decode registers a second later). Stock (R2, after) leaves decode
    # waiting for its waiting timeout; the flag (S2, S3) tells it at once from every rank.
    for when in ("after", "before") if not RELEASE.stock_sends_refused_prompt_standin else ():
        for instance in ("R2", "S2", "S3") if when == "after" else ("S2", "S3"):
            add(f"prefill-refused-at-intake-{when}/{instance}", instance, 30 * PAGE, [30 * PAGE], 0,
                np.arange(1, 31), "contiguous", 14, refused_at_intake=when, expect="failed",
                decode_waiting_timeout=ABORT_TIMEOUT_S, **({"decode_registers_after_s": 1.0} if when == "before" else {}))
    # The prefill aborts the request after bootstrap (SGLang's abort_request: sender.abort()).
    # Stock (R2) leaves decode waiting for its waiting timeout; the flag (S3) tells it at once.
    add("prefill-aborts/R2", "R2", 10 * PAGE, [10 * PAGE], 0, np.arange(1, 11), "contiguous", 12,
        prefill_aborts=True, expect="failed", decode_waiting_timeout=ABORT_TIMEOUT_S)
    add("prefill-aborts/S3", "S3", 10 * PAGE, [10 * PAGE], 0, np.arange(1, 11), "contiguous", 12,
        prefill_aborts=True, expect="failed", decode_waiting_timeout=ABORT_TIMEOUT_S, **DRAIN)
    # ... and before decode registered the room (decode registers a second later)
    for instance in ("R2", "S3"):
        add(f"prefill-aborts-early/{instance}", instance, 10 * PAGE, [10 * PAGE], 0, np.arange(1, 11), "contiguous",
            13, prefill_aborts="before_registration", decode_registers_after_s=1.0, expect="failed",
            decode_waiting_timeout=ABORT_TIMEOUT_S, **({} if instance.startswith("R") else DRAIN))
    # 52 pages, 50 cached on decode: each rank's KV batch is one page x 61 layers (fits the
    # 64-entry lane) and its index batch 26 pages x 61 layers.
    lane_pages = np.arange(1, 53)
    add("lane-low-batches-sized/LB", "LB", 52 * PAGE, [52 * PAGE], 50, lane_pages, "contiguous", 9)
    if not RELEASE.index_pages_from_prefix:  # else the index batch is the KV batch's size (2 pages)
        add("lane-low-index-write-rejected/LA", "LA", 52 * PAGE, [52 * PAGE], 50, lane_pages, "contiguous", 9,
            expect="failed", **DRAIN)
    # No decode prefix: the KV batch itself (26 pages x 61 layers) exceeds the lane.
    # ... and rank 0 (P0) is slow: its write lands well after decode heard of the failure
    add("lane-low-kv-write-rejected/LA", "LA", 52 * PAGE, [52 * PAGE], 0, lane_pages, "contiguous", 9,
        expect="failed", **DRAIN, **({"slow_write": {"proc": "P0", "delay_s": SLOW_WRITE_S}} if DRAIN else {}))
    add("prefill-rank-killed/S4", "S4", 2000, [640, 1280, 2000], 0, np.arange(1, 33), "scattered", 10,
        expect="failed", kill={"proc": "P3", "after_chunks": 1}, decode_waiting_timeout=KILL_TIMEOUT_S)

    lane_env = {"MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER": str(LANE_LIMIT),
                "MC_TCP_MAX_PENDING_ADMISSIONS_PER_PEER": str(LANE_LIMIT)}
    processes = {p: {"role": "prefill"} for p in MAIN_PROCS}
    processes["L1"] = {"role": "prefill", "env": lane_env}
    processes["D"] = {"role": "decode"}
    return dict(geometry=asdict(rig.TEST_GEOMETRY), max_seq_len=8192, instances=instances, processes=processes,
                decode={"proc": "D", "pages": 400}, rooms=rooms)


@pytest.fixture(scope="module")
def pd_run(tmp_path_factory):
    plan = build_plan()
    run = rig.run_plan(plan, tmp_path_factory.mktemp("mooncake-pd"), deadline_s=420)
    run["plan"] = plan
    run["by_name"] = {room["name"]: room for room in plan["rooms"]}
    return run


def _decode(run, name):
    room = run["by_name"][name]
    return run["results"]["D"]["rooms"][str(room["room"])]


def _ranks(run, name):
    """{cp_rank: the prefill result of that rank} for one room."""
    room = run["by_name"][name]
    procs = run["plan"]["instances"][room["instance"]]["procs"]
    out = {}
    for rank, proc in enumerate(procs):
        result = run["results"].get(proc)
        out[rank] = None if result is None else result["rooms"].get(str(room["room"]))
    return out


def _context(run, name):
    return f"room {name}: decode {_decode(run, name)}\n" + rig.log_tails(run)


def _main_room_names(run):
    return [r["name"] for r in run["plan"]["rooms"] if r.get("expect", "success") == "success"]


def test_every_process_ran_its_rooms(pd_run):
    codes = dict(pd_run["returncodes"])
    assert codes.pop("P3") == -9, rig.log_tails(pd_run)  # killed mid-transfer, by design
    assert all(code == 0 for code in codes.values()), rig.log_tails(pd_run)
    for proc, result in pd_run["results"].items():
        assert result is not None and "error" not in result, rig.log_tails(pd_run)
        assert all(r["status"] != "error" for r in result["rooms"].values()), (proc, result["rooms"])


def test_decode_receives_what_a_replicated_prefill_sends(pd_run):
    """Every byte decode received (MLA KV after the decode prefix, NSA index over the
    whole sequence, aux) equals the request's content, and the shard transfer's bytes
    equal SGLang's stock replicated CP transfer of the same request, for N = 2, 3, 4."""
    digests = {}
    for name in _main_room_names(pd_run):
        decode = _decode(pd_run, name)
        assert decode["status"] == "success", _context(pd_run, name)
        assert decode["verified"], (name, decode["problems"])
        room = pd_run["by_name"][name]
        if "pair" in room:
            digests.setdefault(room["pair"], {})[room["instance"]] = decode["digest"]
    compute_owner = [f"{COMPUTE_OWNER[0]}-N{n}" for n in (2, 3, 4)] if RELEASE.compute_owner_allocation else []
    assert sorted(digests) == sorted([s[0] for s in SCENARIOS + [BIG]] + compute_owner)
    for scenario, by_instance in digests.items():
        assert "R1" in by_instance and any(i.startswith("S") for i in by_instance), scenario
        reference = by_instance.pop("R1")
        assert all(d == reference for d in by_instance.values()), (
            f"{scenario}: these instances delivered other bytes than the replicated prefill: "
            f"{sorted(i for i, d in by_instance.items() if d != reference)}")


def test_each_rank_sends_exactly_the_pages_it_owns(pd_run):
    for name in _main_room_names(pd_run):
        room = pd_run["by_name"][name]
        instance = pd_run["plan"]["instances"][room["instance"]]
        if not instance["shared"]:
            continue
        n = instance["cp_size"]
        logical = np.asarray(room["logical_pages"])
        prefix = room["decode_prefix_pages"]
        index_from = prefix if RELEASE.index_pages_from_prefix else 0  # decode's index page list starts there
        kv_total = state_total = 0
        for rank, result in _ranks(pd_run, name).items():
            assert result is not None and result["status"] == "success", _context(pd_run, name)
            owned = CpSharedKVLayout(PAGE, n, rank).owned_pages_mask_np(logical)
            stats = result["stats"]
            assert stats["kv_pages"] == int(owned[prefix:].sum()), (name, rank, stats)
            assert stats["state_pages"] == int(owned[index_from:].sum()), (name, rank, stats)
            assert stats["rejected_requests"] == stats["failed_writes"] == 0
            # a rank that owns nothing of the request still completed it (aux), as decode saw
            assert result["chunks"] and result["chunks"][-1]["last"], (name, rank)
            kv_total += stats["kv_pages"]
            state_total += stats["state_pages"]
            # pages owned by one rank are never contiguous on decode: one descriptor per page and layer
            assert stats["kv_descriptors"] <= stats["kv_pages"] * LAYERS
        assert kv_total == len(logical) - prefix and state_total == len(logical) - index_from, name


def test_a_rank_that_owns_nothing_still_completes(pd_run):
    for n in (2, 3, 4):
        name = f"rank-owns-nothing-in-a-chunk/S{n}"
        ranks = _ranks(pd_run, name)
        first_chunk = {rank: r["chunks"][0] for rank, r in ranks.items()}
        assert sorted(c["owned_pages"] for c in first_chunk.values()) == [0] * (n - 1) + [1], first_chunk
        assert all(r["status"] == "success" for r in ranks.values())
    for n in (3, 4):
        ranks = _ranks(pd_run, f"rank-owns-nothing-at-all/S{n}")
        idle = [r for r in ranks.values() if r["stats"]["kv_pages"] == 0 and r["stats"]["state_pages"] == 0]
        assert len(idle) == n - 2 and all(r["status"] == "success" for r in ranks.values())


@pytest.mark.skipif(not RELEASE.compute_owner_allocation, reason="no compute-owner allocation with interleave CP")
def test_compute_owner_pages_go_in_two_runs_per_chunk(pd_run):
    """On the compute-owner allocator's pages every rank sends each chunk as at most two
    runs per layer (its two zigzag segments), byte-exact (the digest test above)."""
    for n in (2, 3, 4):
        name = f"{COMPUTE_OWNER[0]}-N{n}/S{n}"
        for rank, result in _ranks(pd_run, name).items():
            assert result["status"] == "success", _context(pd_run, name)
            for chunk in result["chunks"]:
                assert chunk["owned_pages"] > 0 and chunk["descriptors"] <= 2 * LAYERS, (name, rank, chunk)


def test_request_above_the_lane_limit_is_sent_in_bounded_batches(pd_run):
    name = "above-2048-descriptors/S2"
    for rank, result in _ranks(pd_run, name).items():
        stats = result["stats"]
        assert result["status"] == "success", _context(pd_run, name)
        assert stats["kv_descriptors"] > 2048 and stats["state_descriptors"] > 2048, stats
        assert stats["write_descriptors"] >= stats["kv_descriptors"] + stats["state_descriptors"]
        assert stats["write_batches"] >= 6  # each of the two writes split into >= 3 batches
        assert stats["write_descriptors"] <= stats["write_batches"] * DEFAULT_MAX_DESCRIPTORS_PER_BATCH


def test_flag_off_keeps_the_stock_cp_transfer(pd_run):
    """Replicated instances run with the plugin's hooks installed and the flag off: the
    hooks pass through (no shard state is created) and SGLang's contiguous per-rank split
    delivers the request."""
    flag_off = [n for n in _main_room_names(pd_run)
                if not pd_run["plan"]["instances"][pd_run["by_name"][n]["instance"]]["shared"]]
    assert {pd_run["by_name"][n]["instance"] for n in flag_off} == {"R1", "R2", "R3", "R4"}
    for name in flag_off:
        for rank, result in _ranks(pd_run, name).items():
            assert result["status"] == "success", _context(pd_run, name)
            assert "stats" not in result, "a flag-off manager grew shard-transfer state"


def test_positions_outside_decode_pages_are_rejected_before_enqueueing(pd_run):
    name = "decode-preallocated-too-few-pages/S2"
    decode = _decode(pd_run, name)
    assert decode["status"] == "failed" and decode["elapsed_s"] < 10, _context(pd_run, name)
    assert "outside the 18 pages decode" in decode["error"], decode
    for rank, result in _ranks(pd_run, name).items():
        assert result["status"] == "failed" and "rejected room" in result["error"], result
        assert result["stats"]["rejected_requests"] == 1 and result["stats"]["write_batches"] <= 1


@pytest.mark.skipif(not RELEASE.stock_sends_refused_prompt_standin, reason="the release retires it at intake")
def test_stock_decode_answers_a_prompt_its_prefill_refused(pd_run):
    """The stock bug, reproduced with SGLang's own classes (flag off, with and without CP):
    the prefill's one-token stand-in concludes as Success on decode, which then holds 29
    of the prompt's 30 pages as it preallocated them -- never written."""
    for instance in ("R1", "R2"):
        name = f"prefill-refused-prompt/{instance}"
        decode = _decode(pd_run, name)
        assert decode["status"] == "success" and not decode["verified"], _context(pd_run, name)
        assert all(r["status"] == "success" for r in _ranks(pd_run, name).values())


@pytest.mark.skipif(not RELEASE.stock_sends_refused_prompt_standin, reason="the release retires it at intake")
def test_flag_fails_a_prompt_its_prefill_refused_on_both_sides(pd_run):
    """With the flag every rank rejects the stand-in's last chunk (it ends at page 1, decode
    preallocated 30): decode fails promptly, naming the cause, and nothing was written."""
    for instance in ("S2", "S3"):
        name = f"prefill-refused-prompt/{instance}"
        decode = _decode(pd_run, name)
        assert decode["status"] == "failed" and decode["elapsed_s"] < 10, _context(pd_run, name)
        assert "the request ends at page 1 on prefill but decode" in decode["error"], decode
        assert "preallocated 30 pages" in decode["error"], decode
        for rank, result in _ranks(pd_run, name).items():
            assert result["status"] == "failed" and "rejected room" in result["error"], (rank, result)
            assert result["stats"]["rejected_requests"] == 1 and result["stats"]["kv_descriptors"] == 0, result


@pytest.mark.skipif(RELEASE.stock_sends_refused_prompt_standin, reason="the release sends a one-token stand-in")
def test_stock_decode_waits_its_timeout_for_a_prompt_refused_at_intake(pd_run):
    """0.5.23, flag off: the prefill retires a prompt its intake refuses and makes no sender, so
    decode, registered with every rank, hears nothing and fails it only at its waiting timeout."""
    name = "prefill-refused-at-intake-after/R2"
    decode = _decode(pd_run, name)
    assert decode["status"] == "failed" and "timed out after" in decode["error"], _context(pd_run, name)
    assert decode["elapsed_s"] >= ABORT_TIMEOUT_S
    assert all(r["status"] == "refused" and r["retired"] for r in _ranks(pd_run, name).values())


@pytest.mark.skipif(RELEASE.stock_sends_refused_prompt_standin, reason="the release sends a one-token stand-in")
@pytest.mark.parametrize("when", ["after", "before"])
@pytest.mark.parametrize("instance", ["S2", "S3"])
def test_flag_fails_a_prompt_refused_at_intake_on_decode_at_once(pd_run, when, instance):
    """0.5.23 with the flag, the same refusal after decode registered the room or before it did:
    every CP rank tells decode (the cause, then SGLang's Failed status) at once or as soon as
    decode registers, and forgets the room; decode fails it within a fraction of its waiting
    timeout, naming the prefill's refusal."""
    name = f"prefill-refused-at-intake-{when}/{instance}"
    decode = _decode(pd_run, name)
    assert decode["status"] == "failed" and decode["elapsed_s"] < ABORT_TIMEOUT_S / 4, _context(pd_run, name)
    assert "timed out" not in decode["error"], decode
    assert "; cause: prefill CP rank" in decode["error"], decode
    assert "ends unsent: the prefill refused the request at intake: Input length" in decode["error"], decode
    ranks = _ranks(pd_run, name)
    assert len(ranks) == int(instance[1:]), ranks
    for rank, result in ranks.items():
        assert result["status"] == "refused" and result["retired"], (rank, result)
        assert result["decode_told"] and result["room_forgotten"], (rank, result)
        assert result["stats"]["refused_requests"] == 1 and result["stats"]["write_batches"] == 0, (rank, result)
        if when == "before":  # refused while decode still waited its second to register
            assert result["refused_at"] < decode["failed_at"] - 0.5, (rank, result, decode)


@pytest.mark.parametrize("case", ["prefill-aborts", "prefill-aborts-early"])
def test_an_aborted_prefill_fails_on_decode_at_once(pd_run, case):
    """SGLang's prefill aborts a request (MooncakeKVSender.abort) after decode registered it,
    or before (early). Stock: decode hears nothing and fails only at its waiting timeout,
    holding its pages until then. With the flag every rank tells decode at once (early: as
    soon as decode registers), with the cause."""
    stock = _decode(pd_run, f"{case}/R2")
    assert stock["status"] == "failed" and "timed out after" in stock["error"], _context(pd_run, f"{case}/R2")
    assert stock["elapsed_s"] >= ABORT_TIMEOUT_S
    name = f"{case}/S3"
    decode = _decode(pd_run, name)
    assert decode["status"] == "failed" and decode["elapsed_s"] < ABORT_TIMEOUT_S / 2, _context(pd_run, name)
    assert "cause: prefill CP rank" in decode["error"], decode
    for rank, result in _ranks(pd_run, name).items():
        assert result["status"] == "failed" and "Aborted by AbortReq" in result["error"], (rank, result)
        assert result["stats"]["aborted_requests"] == 1 and result["stats"]["write_batches"] == 0, result


def test_lane_limit_sized_batches_pass(pd_run):
    name = "lane-low-batches-sized/LB"
    assert _decode(pd_run, name)["status"] == "success", _context(pd_run, name)
    assert _decode(pd_run, name)["verified"]
    lane_rank = _ranks(pd_run, name)[1]["stats"]
    assert lane_rank["write_descriptors"] <= lane_rank["write_batches"] * LANE_LIMIT


@pytest.mark.skipif(RELEASE.index_pages_from_prefix,
                    reason="the index list is the KV list's length: the lane rejects the KV write first")
def test_index_write_rejected_by_the_lane_fails_the_request_on_both_sides(pd_run):
    """SGLang ignores maybe_send_extra's result; under the flag the failed index write
    fails the request promptly, with the cause, on prefill and decode."""
    name = "lane-low-index-write-rejected/LA"
    decode = _decode(pd_run, name)
    assert decode["status"] == "failed" and decode["elapsed_s"] < 10, _context(pd_run, name)
    assert "writing the NSA index state" in decode["error"], decode
    assert "batch_transfer_sync_write returned" in decode["error"], decode
    lane_rank = _ranks(pd_run, name)[1]
    assert lane_rank["status"] == "failed", lane_rank
    assert "writing the NSA index state" in lane_rank["error"] and "returned -1" in lane_rank["error"]
    assert lane_rank["stats"]["failed_state_writes"] == 1


def test_kv_write_failure_names_its_cause_on_both_sides(pd_run):
    """A KV batch the lane rejects fails on SGLang's own path (which reports it); the
    plugin adds the cause to both sides' messages."""
    name = "lane-low-kv-write-rejected/LA"
    decode = _decode(pd_run, name)
    assert decode["status"] == "failed" and decode["elapsed_s"] < 10, _context(pd_run, name)
    lane_rank = _ranks(pd_run, name)[1]
    assert lane_rank["status"] == "failed", lane_rank
    assert "Failed to send kv chunk" in lane_rank["error"] and "batch_transfer_sync_write" in lane_rank["error"]
    assert "batch_transfer_sync_write" in decode["error"], decode


def test_a_killed_prefill_rank_fails_the_request_within_the_timeout(pd_run):
    name = "prefill-rank-killed/S4"
    decode = _decode(pd_run, name)
    assert decode["status"] == "failed", _context(pd_run, name)
    assert "timed out after" in decode["error"] and "WaitingForInput" in decode["error"], decode
    assert KILL_TIMEOUT_S <= decode["elapsed_s"] < KILL_TIMEOUT_S + 10, decode
    survivors = _ranks(pd_run, name)
    assert survivors.pop(3) is None  # the killed process left no result
    assert all(r["status"] == "success" for r in survivors.values()), survivors


@pytest.mark.skipif(not DRAIN, reason="0.5.23's decode holds a failed room's pages itself (ABORT, acknowledgement)")
def test_decode_reuses_a_failed_rooms_pages_once_every_prefill_rank_drained(pd_run):
    """Every failed room of a shared instance: each prefill rank's drained notice (or its
    Success before the failure) reached decode, which then reset the pages and handed them to
    the rooms after it, whose bytes were verified (and no stray write was found: below)."""
    drained = [room["name"] for room in pd_run["plan"]["rooms"] if room.get("drain")]
    assert len(drained) >= 6, drained
    for name in drained:
        decode = _decode(pd_run, name)
        cp_size = pd_run["plan"]["instances"][pd_run["by_name"][name]["instance"]]["cp_size"]
        assert decode["status"] == "failed" and decode["drained"]["complete"], _context(pd_run, name)
        assert decode["drained"]["ranks"] == list(range(cp_size)) == list(range(decode["drained"]["expected"]))
        assert all(r["agreed"] == "failed" for r in _ranks(pd_run, name).values()), _ranks(pd_run, name)


@pytest.mark.skipif(not DRAIN, reason="0.5.23's decode holds a failed room's pages itself (ABORT, acknowledgement)")
def test_a_slow_ranks_late_write_lands_before_decode_reuses_the_pages(pd_run):
    """The xPyD window of stock 0.5.12.post1: decode frees a room's pages on the first rank's
    Failed, while another rank still writes there. Here rank 1's KV write fails at once and
    rank 0's lands SLOW_WRITE_S later, after decode heard of the failure; decode reused the
    pages only after it."""
    name = "lane-low-kv-write-rejected/LA"
    decode = _decode(pd_run, name)
    slow_rank = _ranks(pd_run, name)[0]
    landed = slow_rank["slow_write_landed_at"]
    assert decode["failed_at"] < landed <= decode["drained"]["released_at"], (decode, slow_rank)


def test_nothing_outside_the_requests_pages_was_written(pd_run):
    assert pd_run["results"]["D"]["stray_writes"] == []
