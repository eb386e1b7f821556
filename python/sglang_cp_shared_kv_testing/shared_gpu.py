"""Several ranks of real SGLang servers on one GPU: the end-to-end scripts' ``--share-gpu``.

Correctness runs only. Every collective of such a server goes through host memory and
every rank shares one GPU's compute, so no time, bandwidth or latency measured this way
says anything about a deployment; the scripts record ``share_gpu: true`` beside every
figure they write.

What it takes (SGLang 0.5.12.post1, torch 2.11.0+cu130, NCCL 2.28.9; measured on one H200):

* every scheduler process on ``cuda:0``: SGLang computes ``gpu_id = base_gpu_id + tp_rank *
  gpu_id_step`` and asserts ``gpu_id_step >= 1``, so no server argument can say it.
  ``scripts/e2e/sitecustomize.py`` (``CPSKV_E2E_SHARE_GPU=1``) wraps
  ``sglang.srt.managers.scheduler.run_scheduler_process`` to pass ``gpu_id`` 0;
* a distinct ``NCCL_HOSTID`` per rank (:func:`nccl_host_id`, set by the same wrapper before
  the rank's first NCCL group): NCCL refuses two ranks of one communicator on one GPU
  ("Duplicate GPU detected") unless each believes it is a host of its own, and then uses
  its socket transport over ``lo`` (``NCCL_SOCKET_IFNAME=lo NCCL_IB_DISABLE=1``);
* ``SGLANG_ENABLE_TP_MEMORY_INBALANCE_CHECK=false``: SGLang refuses to start TP ranks whose
  free memory differs by 10 %, which ranks sharing a GPU measure at different moments;
* ``--disable-custom-all-reduce`` (CUDA IPC between ranks that are one device), which the
  scripts' CP servers take anyway;
* every server's pool fixed by ``--max-total-tokens`` and a memory fraction of
  :data:`MEM_FRACTION_STATIC` (why: its note);
* ``--sleep-on-idle``: an idle scheduler otherwise spins a core, and a CP8 server has eight.

SGLang 0.5.23 (read from its wheel; not yet run this way on a GPU) takes the same, plus:

* the same wrapper: ``run_scheduler_process(server_args, port_args, gpu_id, tp_rank, pp_rank,
  dp_rank, pipe_writer, ...)`` still receives the gpu id from the launcher
  (``Engine._launch_scheduler_processes``: ``base_gpu_id + tp_rank x gpu_id_step``, spawned
  by ``mp.Process(target=run_scheduler_process_func)``, the name bound at import) and
  publishes it (``runtime_context.SpawnRanks``) for ``get_device().gpu_id``;
  ``SGLANG_ENABLE_TP_MEMORY_INBALANCE_CHECK`` still gates the 10 % check
  (``distributed/bootstrap._check_tp_memory_balance``);
* ``--enforce-disable-flashinfer-allreduce-fusion``: 0.5.23 turns FlashInfer's all-reduce
  fusion on by itself for DeepSeek-V3.2 with TP > 1 on SM90 / SM100
  (``arg_groups/overrides._flashinfer_allreduce_fusion_auto_enable``), a kernel over CUDA
  IPC / multicast buffers whose ranks spin on each other's flags: not for ranks that are
  one device (the reason for ``--disable-custom-all-reduce`` above);
* ``SGLANG_AUTO_NUMA_BIND=false``: the launcher (parent process) asks NVML for the NUMA
  node of GPU ``base_gpu_id + tp_rank`` before the wrapper moves the rank to cuda:0
  (``numa_utils.configure_subprocess``, on a host with several NUMA nodes and numactl):
  on a one-GPU machine that GPU does not exist.
"""

from __future__ import annotations

from typing import Dict, List

#: what ``scripts/e2e/sitecustomize.py`` prints in each scheduler process it moves to cuda:0
SHARED_GPU_LINE = "[cpskv-e2e] shared GPU:"

#: NOTE: SGLang sizes the pool from ``free after the model load - free before it x (1 -
#: fraction)``, free memory measured on a GPU whose other ranks and servers load at the
#: same time. With every server's pool fixed by ``--max-total-tokens`` (megabytes for the
#: tiny model), a high fraction only keeps that difference positive whatever the others
#: allocate between the two readings; the pool never grows past the cap.
MEM_FRACTION_STATIC = 0.8

ENV = {
    "CPSKV_E2E_SHARE_GPU": "1",
    "NCCL_SOCKET_IFNAME": "lo",
    "NCCL_IB_DISABLE": "1",
    "SGLANG_ENABLE_TP_MEMORY_INBALANCE_CHECK": "false",
}


def nccl_host_id(server_port: int, tp_rank: int) -> str:
    """The ``NCCL_HOSTID`` of TP rank ``tp_rank`` of the server on ``server_port``: distinct
    for every rank of every server on the machine."""
    return f"cpskv-{int(server_port)}-tp{int(tp_rank)}"


#: what SGLang 0.5.23 needs besides (module docstring): arguments, environment
SERVER_ARGS_V0523 = ["--enforce-disable-flashinfer-allreduce-fusion"]
ENV_V0523 = {"SGLANG_AUTO_NUMA_BIND": "false"}


def _on_v0523() -> bool:
    from sglang_cp_shared_kv.releases import installed, v0523

    return installed.INSTALLED is v0523.RELEASE


def server_args() -> List[str]:
    """SGLang arguments every server on the shared GPU takes besides its memory fraction
    and pool (the module docstring), for the installed SGLang."""
    return ["--sleep-on-idle"] + (list(SERVER_ARGS_V0523) if _on_v0523() else [])


def env() -> Dict[str, str]:
    """Environment of every server on the shared GPU, for the installed SGLang."""
    return {**ENV, **(ENV_V0523 if _on_v0523() else {})}


def problem(figures: Dict, name: str, log_path, tp_size: int):
    """Why a ``--share-gpu`` server's run cannot count: fewer of its scheduler processes
    than its TP ranks reported moving to cuda:0 (``startup_figures``); None when all did."""
    seen = figures.get("shared_gpu_processes", 0)
    if seen >= tp_size:
        return None
    return (f"{name}: started to share one GPU, but {seen} scheduler process(es) reported it, fewer than "
            f"its {tp_size} TP rank(s) (scripts/e2e on PYTHONPATH?); see {log_path}")


__all__ = ["SHARED_GPU_LINE", "MEM_FRACTION_STATIC", "ENV", "SERVER_ARGS_V0523", "ENV_V0523", "nccl_host_id",
           "server_args", "env", "problem"]
