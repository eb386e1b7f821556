"""Settings that change a rank's collectives are checked equal across the CP ranks at startup
(gloo, one process per rank): a rank started with another environment stops every rank with
an error naming the setting, instead of hanging them all at the first forward."""

from __future__ import annotations

import multiprocessing
from datetime import timedelta

import pytest
import torch

from sglang_cp_shared_kv.settings.config import DEBUG_ENV, PREFETCH_ENV
from sglang_cp_shared_kv_testing.support import free_port


def _rank(rank, n, port, settings, results):
    from sglang_cp_shared_kv.settings.rank_settings import check_ranks_agree

    torch.distributed.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                         world_size=n, timeout=timedelta(seconds=60))
    try:
        check_ranks_agree(torch.distributed.group.WORLD, settings[rank])
        results.put((rank, None))
    except Exception as exc:  # reported to the test, which checks every rank's outcome
        results.put((rank, f"{type(exc).__name__}: {exc}"))
    finally:
        torch.distributed.destroy_process_group()


def _run(settings):
    n = len(settings)
    ctx = multiprocessing.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_rank, args=(rank, n, port, settings, results)) for rank in range(n)]
    for proc in procs:
        proc.start()
    outcome = dict(results.get(timeout=120) for _ in procs)
    for proc in procs:
        proc.join(timeout=60)
        assert proc.exitcode == 0
    return [outcome[rank] for rank in range(n)]


@pytest.mark.parametrize("n", [2, 3])
def test_equal_settings_pass(n):
    assert _run([{PREFETCH_ENV: True, DEBUG_ENV: False}] * n) == [None] * n


def test_one_rank_with_another_environment_stops_every_rank():
    settings = [{PREFETCH_ENV: True, DEBUG_ENV: False}, {PREFETCH_ENV: False, DEBUG_ENV: False},
                {PREFETCH_ENV: True, DEBUG_ENV: True}]
    outcomes = _run(settings)
    assert len(set(outcomes)) == 1 and outcomes[0] is not None  # the same error on every rank
    error = outcomes[0]
    assert error.startswith("CpSharedKVRankSettingsError: --enable-nsa-prefill-cp-shared-kv: ")
    assert f"{PREFETCH_ENV} is set on CP ranks [0, 2] but not on [1]" in error
    assert f"{DEBUG_ENV} is set on CP ranks [2] but not on [0, 1]" in error
    assert "export the same value in the environment of every prefill node" in error
