"""The multi-process CP harness on SGLang 0.5.23 (DSA prefill CP, ``--cp-strategy
interleave``): is what the stock DSA kernels read with shared KV bit-identical to what they
read on a replicated (flag-off) pool? The twin of :mod:`.cp_harness` (0.5.12.post1's in-seq
split): the same scenarios (:data:`.cp_scenarios.INTERLEAVE_SCENARIOS`), the same merged
outcome, each rank a :class:`.cp_rig_dsa.InterleaveRig`.

Each of the N rank processes builds, as a 0.5.23 scheduler process of an interleave
prefill server with ``--tp N`` does: the gloo world, the attention-CP ``GroupCoordinator``
over it, and its runtime context (``create_context`` for tensor-parallel rank r, from the
server arguments SGLang resolves for ``model_dir``), so ``get_parallel()``, the CP strategy
and its all-gathers answer as on CP rank r. SGLang's Triton kernels are replaced by the
torch stand-ins of :mod:`.torch_standins` (0.5.23's table).
"""

from __future__ import annotations

import contextlib
import dataclasses
import tempfile
import traceback
from datetime import timedelta
from typing import Dict, List

import torch

from sglang_cp_shared_kv_testing.cp_harness import _all_gathers_recorded, finish_rank, job_key, merge_rank_outcomes
from sglang_cp_shared_kv_testing.cp_scenarios import INTERLEAVE_SCENARIOS
from sglang_cp_shared_kv_testing.support import all_gather_through_gloo, free_port, run_rank_processes

TIMEOUT_S = 300  # a rank stuck in a collective fails the run instead of hanging it


def run_interleave_cp_group(n: int, jobs: List[tuple], model_dir: str, *,
                            timeout_s: float = 1200.0) -> Dict[str, dict]:
    """Run ``jobs`` = [(scenario, dtype, debug[, {"prefetch": bool}])] on ``n`` ranks of an
    interleave prefill server of the model in ``model_dir`` (a config directory); return,
    per ``scenario/dtype/debug[/options]`` key, the merged outcome of all ranks."""
    import torch.multiprocessing as mp

    out_dir = tempfile.mkdtemp(prefix=f"cp-harness-interleave-{n}-")
    per_rank = run_rank_processes(mp.get_context("spawn"), _rank_main, n, out_dir,
                                  args=(n, free_port(), out_dir, jobs, model_dir), timeout_s=timeout_s,
                                  what="interleave CP harness")
    return merge_rank_outcomes(per_rank)


def init_interleave_rank(rank: int, n: int, port: int, model_dir: str, stack: contextlib.ExitStack, *,
                         server_args=None, timeout_s: float = TIMEOUT_S):
    """This process as CP rank ``rank`` of an interleave prefill server over ``n`` ranks (the
    runtime context stays active until ``stack`` closes); returns its attention-CP group.
    ``server_args``: the server's (default: ``interleave_prefill_server_args`` of the model)."""
    from sglang.srt.distributed import parallel_state as ps
    from sglang.srt.runtime_context import get_parallel

    from sglang_cp_shared_kv_testing import torch_standins
    from sglang_cp_shared_kv_testing.cpu_kv_configurator import CpuDsaRank, interleave_prefill_server_args

    torch.set_num_threads(1)
    torch_standins.install()
    # NOTE: resolving the server arguments asks the GPU for its compute capability; answer
    # as the H200 (sm90) this runs on in a server
    torch.cuda.get_device_capability = lambda *args, **kwargs: (9, 0)
    if server_args is None:
        server_args = interleave_prefill_server_args(model_dir, tp=n)
    rank_context = CpuDsaRank(server_args, available_bytes=0, tp_rank=rank)
    stack.enter_context(rank_context.active())
    ps.init_distributed_environment(world_size=n, rank=rank, local_rank=rank, backend="gloo",
                                    distributed_init_method=f"tcp://127.0.0.1:{port}", timeout=timeout_s)
    group = ps.GroupCoordinator(
        group_ranks=[list(range(n))], local_rank=rank, torch_distributed_backend="gloo", use_pynccl=False,
        use_mscclpp=False, use_custom_allreduce=False, use_torch_symm_mem_all_reduce=False,
        use_hpu_communicator=False, use_xpu_communicator=False, group_name="attn_cp",
        gloo_timeout=timedelta(seconds=timeout_s))
    all_gather_through_gloo(group)
    stack.enter_context(get_parallel().override(attn_cp_group=group))
    parallel = get_parallel()
    if (parallel.attn_cp_rank, parallel.attn_cp_size) != (rank, n):
        raise RuntimeError(f"the runtime context puts tensor-parallel rank {rank} at attention-CP rank "
                           f"{parallel.attn_cp_rank} of {parallel.attn_cp_size}, not {rank} of {n}")
    return group


def _rank_main(rank, n, port, out_dir, jobs, model_dir):
    from sglang_cp_shared_kv_testing.cp_rig_v0523 import InterleaveRig

    result: dict = {"scenarios": {}}
    try:
        with contextlib.ExitStack() as stack:
            group = init_interleave_rank(rank, n, port, model_dir, stack)
            for name, dtype_name, debug, *more in jobs:
                options = more[0] if more else {}
                rig = InterleaveRig(rank, n, dtype_name, group, debug=debug, prefetch=options.get("prefetch", False))
                with _all_gathers_recorded(rig, group.device_group, rig.shared.context.prefetch_group):
                    INTERLEAVE_SCENARIOS[name](rig)
                rig.stats["allocation"] = dataclasses.asdict(rig.allocator.stats)
                rig.stats["write_paths"] = rig.shared.context.write_path_counts()
                outcome = {"errors": rig.errors[:20], "stats": rig.stats}
                result["scenarios"][job_key(name, dtype_name, debug, options)] = outcome
    except BaseException:  # noqa: BLE001 - reported to the parent
        result["fatal"] = traceback.format_exc()[-4000:]
    finish_rank(out_dir, rank, result)
