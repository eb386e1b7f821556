"""Stage timing: what is recorded, when it is read, where it is written, and that it costs
nothing while off."""

import json

import pytest

from sglang_cp_shared_kv.observability import nvtx
from sglang_cp_shared_kv.observability import stage_timer as st
from sglang_cp_shared_kv.settings.config import NVTX_ENV
from sglang_cp_shared_kv.context import CpSharedKVContext
from sglang_cp_shared_kv.cp_shared_kv_layout import CpSharedKVLayout


class FakeEvent:
    """A CUDA event stand-in: complete once ``done`` is set, ``ms`` apart from its start."""

    def __init__(self, at_ms):
        self.at_ms, self.done = at_ms, False

    def query(self):
        return self.done

    def elapsed_time(self, end):
        return end.at_ms - self.at_ms


def test_cpu_spans_accumulate_per_stage_and_are_written_atomically(tmp_path):
    timer = st.StageTimer(cp_rank=3, out_dir=str(tmp_path))
    timer.begin_forward("cpu")
    for _ in range(2):
        with timer.span("owner_write"):
            pass
    with timer.span("batch_state"):
        pass
    assert not (tmp_path / "stage-times-cp3.json").exists()  # read at the next forward
    timer.begin_forward("cpu")
    written = json.loads((tmp_path / "stage-times-cp3.json").read_text())
    # written as the second forward begins: the first forward's stages
    assert written == dict(timer.snapshot(), forwards=1) and timer.forwards == 2
    assert written["clock"] == "perf_counter" and written["pending"] == 0
    assert written["stages"]["owner_write"]["calls"] == 2 and written["stages"]["batch_state"]["calls"] == 1
    assert all(v["total_ms"] >= 0 for v in written["stages"].values())
    assert [p.name for p in tmp_path.iterdir()] == ["stage-times-cp3.json"]  # no temporary file left


def test_device_intervals_are_read_in_order_once_complete():
    timer = st.StageTimer(cp_rank=0)
    first = (FakeEvent(0.0), FakeEvent(2.5))
    second = (FakeEvent(3.0), FakeEvent(7.0))
    timer._keep("materialize:mla:gather", *first)
    timer._keep("prefetch:wait", *second)
    second[1].done = True  # complete, but behind an incomplete one on the same stream
    assert timer.collect() == 0 and timer.snapshot()["pending"] == 2
    first[1].done = True
    assert timer.collect() == 2
    stages = timer.snapshot()["stages"]
    assert stages["materialize:mla:gather"] == {"calls": 1, "total_ms": 2.5}
    assert stages["prefetch:wait"] == {"calls": 1, "total_ms": 4.0}


def test_pending_intervals_are_bounded(monkeypatch):
    monkeypatch.setattr(st, "MAX_PENDING_INTERVALS", 3)
    timer = st.StageTimer(cp_rank=0)
    for i in range(5):
        timer._keep("owner_write", FakeEvent(0.0), FakeEvent(1.0))
    assert timer.snapshot()["pending"] == 3 and timer.dropped == 2


def test_an_unwritable_directory_is_reported_once_and_never_fails_a_forward(tmp_path, caplog):
    blocker = tmp_path / "file"
    blocker.write_text("")
    timer = st.StageTimer(cp_rank=1, out_dir=str(blocker / "sub"))
    for _ in range(3):
        with timer.span("batch_state"):
            pass
        timer.begin_forward("cpu")
    assert caplog.text.count("cannot write stage times") == 1 and timer.out_path is None


def test_marked_times_only_while_nvtx_is_on(monkeypatch):
    timer = st.StageTimer(cp_rank=0)
    monkeypatch.delenv(NVTX_ENV, raising=False)
    assert nvtx.marked("owner_write", timer) is nvtx.marked("x")  # off: the shared no-op, nothing timed
    with nvtx.marked("owner_write", timer):
        pass
    assert timer.collect() == 0
    monkeypatch.setenv(NVTX_ENV, "1")
    with nvtx.marked("owner_write", timer):
        pass
    assert timer.collect() == 1 and timer.snapshot()["stages"]["owner_write"]["calls"] == 1


@pytest.mark.parametrize("on", [False, True])
def test_the_context_holds_a_timer_only_with_the_switch(monkeypatch, tmp_path, on):
    monkeypatch.setenv(st.TIMING_DIR_ENV, str(tmp_path))
    if on:
        monkeypatch.setenv(NVTX_ENV, "1")
    else:
        monkeypatch.delenv(NVTX_ENV, raising=False)
    context = CpSharedKVContext(CpSharedKVLayout(64, 4, 2))
    if on:
        assert context.stage_timer.cp_rank == 2
        assert context.stage_timer.out_path == tmp_path / "stage-times-cp2.json"
    else:
        assert context.stage_timer is None


@pytest.mark.parametrize("run", [-1, 2])
def test_a_history_gather_is_timed_as_pack_then_gather_and_a_run_has_no_pack(monkeypatch, run):
    """gather_region: the pack (absent when this rank's pages are one run of its shard) and
    the all-gather are two leaf stages; the collective is the same call either way."""
    import torch

    from sglang_cp_shared_kv.forward import materialize
    from sglang_cp_shared_kv.kernels import KernelDispatch

    monkeypatch.setenv(NVTX_ENV, "1")
    collectives = []

    def all_gather(out, inp, group=None, async_op=False):
        collectives.append((tuple(out.shape), tuple(inp.shape), group, async_op))
        out.copy_(inp.repeat(out.shape[0] // inp.shape[0], 1))

    monkeypatch.setattr(torch.distributed, "all_gather_into_tensor", all_gather)
    timer = st.StageTimer(cp_rank=0)
    shard = torch.arange(6 * 4, dtype=torch.int64).view(6, 4)
    dense = torch.zeros(5, 4, dtype=torch.int64)
    received, work = materialize.gather_region(
        KernelDispatch(), dense, (1, 5), shard, torch.tensor([2, 3]), "compute", timer=timer, run=run,
        pack_stage=materialize.MLA_STAGES.pack, gather_stage=materialize.MLA_STAGES.gather)
    assert torch.equal(dense[1:3], shard[2:4]) and received == 2 * 4 * 8 and work is None
    assert collectives == [((4, 4), (2, 4), "compute", False)]
    timer.collect()
    calls = {stage: v["calls"] for stage, v in timer.snapshot()["stages"].items()}
    want = {"materialize:mla:gather": 1} if run >= 0 else {"materialize:mla:pack": 1, "materialize:mla:gather": 1}
    assert calls == want
