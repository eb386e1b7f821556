"""Test data and helpers shared by the rigs, the tests and the benchmarks (not fixtures)."""

import importlib.util
import json
import os
import random
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Dict, List, Optional, Tuple

# A tiny DeepSeek-V3.2 (NSA, MLA) config: the shapes of the real model, two dense layers.
TINY_DSV32 = {
    "architectures": ["DeepseekV32ForCausalLM"], "model_type": "deepseek_v32",
    "num_hidden_layers": 2, "hidden_size": 1024, "intermediate_size": 2048,
    "moe_intermediate_size": 256, "first_k_dense_replace": 2, "n_routed_experts": 8,
    "n_shared_experts": 1, "num_experts_per_tok": 2, "n_group": 1, "topk_group": 1,
    "num_attention_heads": 128, "num_key_value_heads": 128, "q_lora_rank": 1536,
    "kv_lora_rank": 512, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128,
    "index_head_dim": 128, "index_n_heads": 64, "index_topk": 2048, "vocab_size": 8192,
    "max_position_embeddings": 8192, "torch_dtype": "bfloat16", "rms_norm_eps": 1e-6,
    "rope_theta": 10000, "hidden_act": "silu", "tie_word_embeddings": False,
    "bos_token_id": 0, "eos_token_id": 1,
}
# DeepSeek-V3 (MLA without the NSA indexer): shared KV must refuse it.
TINY_DSV3 = {k: v for k, v in TINY_DSV32.items() if not k.startswith("index_")}
TINY_DSV3.update(architectures=["DeepseekV3ForCausalLM"], model_type="deepseek_v3")



def shared_kv_kwargs(model_path, **overrides):
    """ServerArgs keywords of a valid shared-KV prefill server (CP2 in-seq-split)."""
    kwargs = dict(
        model_path=model_path, skip_tokenizer_init=True, device="cuda", tp_size=2,
        enable_nsa_prefill_context_parallel=True, nsa_prefill_cp_mode="in-seq-split",
        disaggregation_mode="prefill", disaggregation_transfer_backend="mooncake",
        enable_nsa_prefill_cp_shared_kv=True,
    )
    kwargs.update(overrides)
    return kwargs


def decode_guard_kwargs(model_path, **overrides):
    """ServerArgs keywords of a valid decode server of a shared-KV deployment (flag on)."""
    kwargs = dict(model_path=model_path, skip_tokenizer_init=True, device="cuda", tp_size=1,
                  disaggregation_mode="decode", disaggregation_transfer_backend="mooncake",
                  enable_nsa_prefill_cp_shared_kv=True)
    kwargs.update(overrides)
    return kwargs


#: The Mooncake engine distributions (the CPU build the tests use, the CUDA 13 build serving uses).
MOONCAKE_DISTRIBUTIONS = ("mooncake-transfer-engine-non-cuda", "mooncake-transfer-engine-cuda13")


def mooncake_engine_or_skip():
    """``mooncake.engine`` for the tests that drive the real engine. Skips the calling module
    only when no Mooncake distribution is installed; an installed engine that does not
    import (a missing system library, a CUDA build beside a CPU torch) fails instead of
    skipping, so CI (``scripts/bootstrap.sh test`` installs the engine) cannot pass without
    running these tests."""
    import importlib.metadata

    import pytest

    installed = []
    for name in MOONCAKE_DISTRIBUTIONS:
        try:
            installed.append(f"{name} {importlib.metadata.version(name)}")
        except importlib.metadata.PackageNotFoundError:
            pass
    if not installed:
        pytest.skip(f"needs one of {', '.join(MOONCAKE_DISTRIBUTIONS)} (scripts/bootstrap.sh test installs it)",
                    allow_module_level=True)
    try:
        return importlib.import_module("mooncake.engine")
    except ImportError as exc:
        pytest.fail(f"{', '.join(installed)} is installed but mooncake.engine does not import: {exc} "
                    "(the CPU engine links libibverbs1: scripts/bootstrap.sh test installs it)", pytrace=False)


#: The repository's ``scripts/`` (tests load benchmark scripts from it as modules).
SCRIPTS = Path(__file__).resolve().parents[2] / "scripts"


def load_script(name: str):
    """``scripts/<name>.py`` as a module (its ``main`` not run), for tests of its parts."""
    spec = importlib.util.spec_from_file_location(name, SCRIPTS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


#: NOTE: where the rigs' listening ports come from: below Linux's ephemeral range (32768-60999 by
#: default), where the kernel gives any process's outgoing connection a port, and above Mooncake's
#: own (its TCP transport and RPC listen in 12000-17000) and the GPU scripts' defaults (22000-27999).
#: A port the kernel handed out (bind to 0) is in the ephemeral range: the CI of bd53885 lost a PD
#: rig's bootstrap server that way ("address already in use" on a port another connection took
#: between the pick and the bind; every rank then timed out registering).
FREE_PORTS = range(28000, 32768)
_handed_out: set = set()
_picker = random.SystemRandom()  # (not the global generator, which tests seed)


def free_port() -> int:
    """A port of :data:`FREE_PORTS` nothing listens on now, not handed out before in this process."""
    for _ in range(200):
        port = _picker.choice(FREE_PORTS)
        if port in _handed_out:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        _handed_out.add(port)
        return port
    raise RuntimeError(f"no free port in {FREE_PORTS.start}-{FREE_PORTS.stop - 1} after 200 tries")


def supervise(procs, *, timeout_s: float, grace_s: float = 0.0, on_tick=None, what: str = "rank") -> Optional[str]:
    """Wait for started ``procs`` until all exit, one fails (then give the others
    ``grace_s`` to finish: a process waiting on a collective its failed peer never issues
    would wait forever) or ``timeout_s`` passes; kill what is left. Returns what went
    wrong, or None. ``on_tick()`` runs every 50 ms (e.g. to read progress)."""
    deadline, first_failure, problem = time.monotonic() + timeout_s, None, None
    try:
        while any(p.is_alive() for p in procs):
            if on_tick is not None:
                on_tick()
            dead = [i for i, p in enumerate(procs) if not p.is_alive() and p.exitcode not in (0, None)]
            if dead and first_failure is None:
                first_failure = time.monotonic()
            if first_failure is not None and time.monotonic() >= first_failure + grace_s:
                problem = f"{what}(s) {dead} exited with {[procs[i].exitcode for i in dead]}"
                break
            if time.monotonic() > deadline:
                problem = f"deadline of {timeout_s:.0f}s passed (a {what} waiting on a collective?)"
                break
            time.sleep(0.05)
        if on_tick is not None:
            on_tick()
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
            p.join(10)
    return problem


def run_rank_processes(ctx, target, n: int, out_dir: str, *, args=(), timeout_s: float,
                       what: str) -> list:
    """Start ``target(rank, *args)`` in ``n`` processes of context ``ctx``, wait for all of
    them (stopping early when one dies or the deadline passes: a rank stuck in a
    collective must fail the test, not hang it) and return each rank's
    ``out_dir/rank{r}.json``. Raises when a rank failed or reported ``fatal``."""
    procs = [ctx.Process(target=target, args=(r, *args), daemon=True) for r in range(n)]
    for p in procs:
        p.start()
    failed = supervise(procs, timeout_s=timeout_s)
    results = []
    for r in range(n):
        path = Path(out_dir, f"rank{r}.json")
        results.append(json.loads(path.read_text()) if path.exists() else {"fatal": "no result file"})
    fatal = [(r, x["fatal"]) for r, x in enumerate(results) if "fatal" in x]
    if failed or fatal:
        raise RuntimeError(f"{what} N={n} failed: {failed or ''} {fatal}")
    return results


def gloo_attention_cp_group(rank: int, n: int, port: int, *, local_rank: int, timeout_s: int):
    """A gloo world of ``n`` processes and SGLang's attention-CP ``GroupCoordinator`` over
    it (installed where SGLang's ``get_attention_cp_group`` finds it)."""
    from datetime import timedelta

    from sglang.srt.distributed import parallel_state as ps

    ps.init_distributed_environment(world_size=n, rank=rank, local_rank=local_rank, backend="gloo",
                                    distributed_init_method=f"tcp://127.0.0.1:{port}", timeout=timeout_s)
    ps._ATTN_CP = ps.GroupCoordinator(
        group_ranks=[list(range(n))], local_rank=local_rank, torch_distributed_backend="gloo",
        use_pynccl=False, use_pymscclpp=False, use_custom_allreduce=False,
        use_torch_symm_mem_all_reduce=False, use_hpu_communicator=False, use_xpu_communicator=False,
        use_npu_communicator=False, group_name="attn_cp", gloo_timeout=timedelta(seconds=timeout_s),
    )
    return ps._ATTN_CP


def in_seq_cp_server_args(mode: str = "in-seq-split"):
    """What SGLang's NSA CP helpers read from the global server arguments of an in-seq-split
    (or ``mode``) prefill server (``sglang.srt.server_args._global_server_args``)."""
    from types import SimpleNamespace

    return SimpleNamespace(enable_nsa_prefill_context_parallel=True, nsa_prefill_cp_mode=mode,
                           enable_symm_mem=False)


def all_gather_through_gloo(group) -> None:
    """The one stand-in SGLang's in-seq all-gathers need on a gloo group:
    ``GroupCoordinator.all_gather_into_tensor`` (which ``cp_all_gather_into_tensor_async``
    calls without pynccl) dispatches to a registered custom op that has no CPU kernel; call
    the method that op wraps, ``_all_gather_into_tensor`` (``torch.distributed.
    all_gather_into_tensor`` on the gloo group), directly. Everything above it is SGLang's
    code."""
    group.all_gather_into_tensor = group._all_gather_into_tensor


class TorchOnCpu:
    """``torch`` as a module of SGLang sees it, with ``device="cuda"`` tensors made on the
    CPU (``prepare_context_parallel_metadata`` builds its length tensors on "cuda")."""

    def __getattr__(self, name):
        import torch

        return getattr(torch, name)

    @staticmethod
    def tensor(*args, device=None, **kwargs):
        import torch

        return torch.tensor(*args, **kwargs)


def sglang_cp_utils_on_cpu(monkeypatch):
    """SGLang's ``cp_utils`` as an in-seq-split NSA CP server runs it, on the CPU: in-seq
    split on, round-robin off, its "cuda" tensors on the CPU. ``monkeypatch``: pytest's,
    which undoes all of it after the test."""
    from sglang.srt.layers.attention.nsa import utils as nsa_utils
    from sglang.srt.layers.utils import cp_utils

    monkeypatch.setattr(nsa_utils, "is_nsa_prefill_cp_round_robin_split", lambda: False)
    monkeypatch.setattr(nsa_utils, "is_nsa_enable_prefill_cp", lambda: True)
    monkeypatch.setattr(cp_utils, "torch", TorchOnCpu())
    return cp_utils


def selfcheck_with_e2e_switches(root: Path, switches: Dict[str, str],
                                timeout: float) -> Tuple[subprocess.CompletedProcess, List[str]]:
    """``python -m sglang_cp_shared_kv selfcheck`` in a fresh process with ``scripts/e2e``'s
    sitecustomize on (CPSKV_E2E=1) and ``switches``, from checkout ``root``: (the finished
    process, its verdict lines, those starting FAIL or PASS)."""
    env = {**os.environ, "CPSKV_E2E": "1", **switches,
           "PYTHONPATH": os.pathsep.join([str(root / "scripts" / "e2e"), str(root / "python")])}
    out = subprocess.run([sys.executable, "-m", "sglang_cp_shared_kv", "selfcheck"], capture_output=True, text=True,
                         env=env, timeout=timeout)
    return out, [line for line in out.stdout.splitlines() if line.startswith(("FAIL", "PASS"))]
