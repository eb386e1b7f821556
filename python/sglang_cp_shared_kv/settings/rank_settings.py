"""Settings that change which collectives a rank issues must be equal on every CP rank.

``SGLANG_CP_SHARED_KV_PREFETCH`` builds a second communicator and moves every history
gather onto it; ``SGLANG_DEBUG_CP_SHARED_KV`` adds a check that all-gathers each batch's
materialize plan. A rank that read a different environment (one node of a multi-node
prefill exported it, another did not) would issue other collectives than its peers and
hang them all. :func:`check_ranks_agree` turns that into an error at startup on every rank,
naming the setting and each rank's value.
"""

from __future__ import annotations

from typing import Mapping

import torch

from sglang_cp_shared_kv.settings.config import FLAG


class CpSharedKVRankSettingsError(RuntimeError):
    """CP ranks of one prefill server were started with different settings."""


def check_ranks_agree(group, settings: Mapping[str, bool]) -> None:
    """Raise on every rank of ``group`` (a CPU/gloo process group) unless each rank passed
    the same ``settings`` (name -> on). One all-gather of ``len(settings)`` integers.

    NOTE: the names are fixed by the caller's code, so the collective's size is the same
    on every rank whatever the values are.
    """
    names = sorted(settings)
    mine = torch.tensor([int(bool(settings[name])) for name in names], dtype=torch.int64)
    everyone = [torch.empty_like(mine) for _ in range(torch.distributed.get_world_size(group))]
    torch.distributed.all_gather(everyone, mine, group=group)
    problems = []
    for i, name in enumerate(names):
        values = [int(t[i]) for t in everyone]
        if len(set(values)) > 1:
            on = [rank for rank, value in enumerate(values) if value]
            off = [rank for rank, value in enumerate(values) if not value]
            problems.append(f"{name} is set on CP ranks {on} but not on {off}")
    if problems:
        raise CpSharedKVRankSettingsError(
            f"{FLAG}: " + "; ".join(problems) + ". It changes which collectives each rank issues, "
            "so the ranks would hang; export the same value in the environment of every prefill "
            "node (or of none).")


__all__ = ["CpSharedKVRankSettingsError", "check_ranks_agree"]
