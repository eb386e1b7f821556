"""The in-seq CP all-gather hook (``forward.hooks.all_gather_in_seq_order``, its work in
``forward.in_seq_rerange_v0512``) against SGLang's own ``cp_all_gather_rerange_output``.

* Multi-process (N = 2, 3, 4, 8 ranks over gloo, SGLang's attention-CP
  ``GroupCoordinator`` built as the CP harness builds it): SGLang's metadata builder
  (``prepare_context_parallel_metadata``) and SGLang's split of the sequence
  (``cp_split_and_rebuild_data``) give each rank its rows; the hook's output equals
  SGLang's bit for bit (and both equal the sequence), for latent-, index-key- and
  hidden-like rows and lengths that are tiny or not multiples of 2N. The hook issues
  exactly SGLang's collective (same group, buffer shape, dtype, stream, symmetric-memory
  arguments); ranks that take different paths stay in step; round-robin split and a
  stock pool run SGLang's function. On CPU the kernel cannot run, so the plugin path
  is forced there and ``KernelDispatch.rerange_in_seq`` takes its reference after the all-gather;
  the group's all-gather skips a custom op that has no CPU kernel
  (``testing.support.all_gather_through_gloo``). Rank processes are forked from a forkserver that
  imported SGLang once, which keeps N = 8 fast on two cores.
* In process: the pre-collective decision (flag, metadata, split mode, input rank,
  device, debug mode; never a per-rank kernel failure).
* A fresh interpreter: after the registry applies the hook, the name that
  ``nsa_indexer`` (imported before) and ``deepseek_v2`` / ``deepseek_nextn`` (imported
  after) call is the hook.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import subprocess
import sys
import tempfile
import textwrap
import traceback
from contextlib import contextmanager
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from sglang_cp_shared_kv.pool.kv_geometry import PAGE_SIZE as PAGE
from sglang_cp_shared_kv_testing.support import (
    all_gather_through_gloo,
    free_port,
    gloo_attention_cp_group,
    in_seq_cp_server_args,
    run_rank_processes,
)

REPO = Path(__file__).resolve().parents[2]
WIDTHS = {"latent": 576, "index_key": 128, "hidden": 7168}  # bf16 rows as the model gathers them
PRELOAD = ["sglang.srt.layers.utils.cp_utils", "sglang.srt.layers.attention.nsa.utils", "sglang_cp_shared_kv.pool.kv_pool_v0512"]


def lengths(n: int):
    """Extend lengths: tiny (fewer rows than blocks, one row per block), not multiples of 2N,
    multiples of 2N, longer."""
    return sorted({1, n, 2 * n - 1, 2 * n, 2 * n + 1, 4 * n + 3, 64 * n, 333, 1000 + n})


server_args = in_seq_cp_server_args


class _TensorsOnCpu:
    """``torch`` as cp_utils sees it while it builds metadata: its ``device="cuda"``
    tensors are made on the CPU."""

    def __getattr__(self, name):
        return getattr(torch, name)

    @staticmethod
    def tensor(*args, device=None, **kwargs):
        return torch.tensor(*args, **kwargs)


def build_metadata(total: int, cp_rank: int, cp_size: int):
    """SGLang's own in-seq-split metadata builder (the model's forward calls it)."""
    from sglang.srt.layers.utils import cp_utils

    from sglang_cp_shared_kv.scoped import attributes_set

    with attributes_set(cp_utils, torch=_TensorsOnCpu()):
        return cp_utils.prepare_context_parallel_metadata(total, cp_rank, cp_size, [total])


def shared_pool(n: int, rank: int):
    from sglang_cp_shared_kv.context import CpSharedKVContext
    from sglang_cp_shared_kv.cp_shared_kv_layout import CpSharedKVLayout
    from sglang_cp_shared_kv.pool.kv_pool_v0512 import CpSharedNSATokenToKVPool

    return CpSharedNSATokenToKVPool(
        2 * PAGE * n, context=CpSharedKVContext(CpSharedKVLayout(PAGE, n, rank)), page_size=PAGE, kv_lora_rank=512,
        dtype=torch.bfloat16, qk_rope_head_dim=64, layer_num=1, device="cpu", index_head_dim=128,
        enable_memory_saver=False, kv_cache_dim=576)


def sequence(total: int, width: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(7919 * total + width)  # the same sequence on every rank
    return torch.randn(total, width, generator=g).bfloat16()


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


# ============================================================ rank side
class Recorder:
    """Records every collective and symmetric-memory allocation context SGLang's helpers
    see on this rank, and which path the hook took."""

    def __init__(self, group):
        from sglang.srt.layers.utils import cp_utils

        from sglang_cp_shared_kv.forward import in_seq_rerange_v0512 as in_seq_rerange

        self.calls = []
        self.paths = []
        real_async, real_sync = group.cp_all_gather_into_tensor_async, group.all_gather_into_tensor
        real_symm, real_ours = cp_utils.use_symmetric_memory, in_seq_rerange.gather_in_seq_order

        def gather_async(output, input_, stream):
            self.calls.append(("cp_all_gather_into_tensor_async", tuple(output.shape), str(output.dtype),
                               tuple(input_.shape), repr(stream)))
            return real_async(output, input_, stream)

        def gather_sync(output, input_):
            self.calls.append(("all_gather_into_tensor", tuple(output.shape), str(output.dtype), tuple(input_.shape)))
            return real_sync(output, input_)

        def symmetric(group_coordinator, disabled=False):
            self.calls.append(("use_symmetric_memory", group_coordinator is group, disabled))
            return real_symm(group_coordinator, disabled=disabled)

        def ours(*args, **kwargs):
            self.paths.append("plugin")
            return real_ours(*args, **kwargs)

        group.cp_all_gather_into_tensor_async, group.all_gather_into_tensor = gather_async, gather_sync
        cp_utils.use_symmetric_memory = symmetric
        in_seq_rerange.gather_in_seq_order = ours

    @contextmanager
    def recording(self):
        self.calls, self.paths = [], []
        yield self


class RankRun:
    """One rank: SGLang's function vs the hook, mismatches collected (never raised), so
    every rank keeps issuing the same collectives."""

    def __init__(self, rank: int, n: int, group):
        from sglang.srt.layers.utils import cp_utils

        from sglang_cp_shared_kv.forward import hooks, in_seq_rerange_v0512 as in_seq_rerange

        self.rank, self.n, self.group = rank, n, group
        self.cp_utils, self.hook_module, self.hooks = cp_utils, in_seq_rerange, hooks
        self.recorder = Recorder(group)
        self.pool = shared_pool(n, rank)
        self.errors, self.checks = [], 0

    def check(self, ok: bool, what: str) -> None:
        self.checks += 1
        if not ok:
            self.errors.append(what)

    def original(self, *args):
        self.recorder.paths.append("sglang")
        return self.cp_utils.cp_all_gather_rerange_output(*args)

    def run(self, rows, fb, plugin_path: bool):
        """(output, collectives, paths) of the hook, its kernel decision forced."""
        with self.recorder.recording() as rec:
            saved = self.hook_module.kernel_can_run
            self.hook_module.kernel_can_run = lambda t: plugin_path
            try:
                out = self.hooks.all_gather_in_seq_order(self.original, rows, self.n, fb, None)
            finally:
                self.hook_module.kernel_can_run = saved
            return out, rec.calls, rec.paths

    def stock(self, rows, fb):
        with self.recorder.recording() as rec:
            out = self.cp_utils.cp_all_gather_rerange_output(rows, self.n, fb, None)
            return out, rec.calls

    def same(self, ours, theirs) -> bool:
        return (ours.shape == theirs.shape and ours.dtype == theirs.dtype
                and torch.equal(as_bytes(ours), as_bytes(theirs)))

    # ------------------------------------------------------------ scenarios
    def in_seq(self):
        for total in lengths(self.n):
            metadata = build_metadata(total, self.rank, self.n)
            fb = SimpleNamespace(token_to_kv_pool=self.pool, attn_cp_metadata=metadata)
            for name, width in WIDTHS.items():
                if name == "hidden" and total > 400:
                    continue  # the wide rows: short sequences keep the test fast
                where = f"N={self.n} rank {self.rank} total={total} {name}"
                full = sequence(total, width)
                rows = self.cp_utils.cp_split_and_rebuild_data(fb, full)  # this rank's zigzag blocks
                theirs, their_calls = self.stock(rows, fb)
                ours, our_calls, paths = self.run(rows, fb, plugin_path=True)
                self.check(paths == ["plugin"], f"{where}: paths {paths}")
                self.check(self.same(ours, theirs), f"{where}: output differs from SGLang's")
                self.check(self.same(theirs, full), f"{where}: SGLang's output is not the sequence")
                gathers = [c for c in their_calls if c[0] == "cp_all_gather_into_tensor_async"]
                self.check(our_calls == their_calls and len(gathers) == 1,
                           f"{where}: collectives {our_calls} != SGLang's {their_calls}")

    def mixed_paths(self):
        """Rank 0 runs SGLang's function, the others the plugin path: the same all-gather,
        so no rank waits on a collective the others never issue."""
        for total in (2 * self.n + 1, 1000 + self.n):
            metadata = build_metadata(total, self.rank, self.n)
            fb = SimpleNamespace(token_to_kv_pool=self.pool, attn_cp_metadata=metadata)
            full = sequence(total, WIDTHS["latent"])
            rows = self.cp_utils.cp_split_and_rebuild_data(fb, full)
            out, _, paths = self.run(rows, fb, plugin_path=self.rank != 0)
            where = f"N={self.n} rank {self.rank} mixed total={total}"
            self.check(paths == (["sglang"] if self.rank == 0 else ["plugin"]), f"{where}: paths {paths}")
            self.check(self.same(out, full), f"{where}: output is not the sequence")

    def falls_through(self):
        """Round-robin split, a stock pool, no metadata: SGLang's function, whole."""
        from sglang.srt import server_args as sa

        total = 8 * self.n + self.n  # round-robin needs a multiple of N
        full = sequence(total, WIDTHS["index_key"])
        stock_pool = object()
        cases = [("stock pool", stock_pool, "in-seq-split"), ("round-robin", self.pool, "round-robin-split")]
        for what, pool, mode in cases:
            sa._global_server_args = server_args(mode)
            metadata = build_metadata(total, self.rank, self.n)
            fb = SimpleNamespace(token_to_kv_pool=pool, attn_cp_metadata=metadata)
            rows = self.cp_utils.cp_split_and_rebuild_data(fb, full)
            theirs, their_calls = self.stock(rows, fb)
            ours, our_calls, paths = self.run(rows, fb, plugin_path=True)
            where = f"N={self.n} rank {self.rank} {what}"
            self.check(paths == ["sglang"], f"{where}: paths {paths}")
            self.check(self.same(ours, theirs) and self.same(theirs, full), f"{where}: output differs")
            self.check(our_calls == their_calls, f"{where}: collectives {our_calls} != {their_calls}")
        sa._global_server_args = server_args()
        fb = SimpleNamespace(token_to_kv_pool=self.pool, attn_cp_metadata=None)
        _, _, paths = self.run_expecting_original(fb)
        self.check(paths == ["sglang"], f"N={self.n} rank {self.rank} no metadata: paths {paths}")

    def run_expecting_original(self, fb):
        with self.recorder.recording() as rec:
            sentinel = object()
            out = self.hooks.all_gather_in_seq_order(
                lambda *a: (rec.paths.append("sglang"), sentinel)[1], torch.zeros(3, 4), self.n, fb, None)
            self.check(out is sentinel, "no metadata: the hook did not return SGLang's result")
            return out, rec.calls, rec.paths


def _init_group(rank: int, n: int, port: int):
    """gloo world + SGLang's attention-CP GroupCoordinator over it (as the CP harness)."""
    from sglang.srt import server_args as sa

    group = gloo_attention_cp_group(rank, n, port, local_rank=rank, timeout_s=120)
    all_gather_through_gloo(group)
    sa._global_server_args = server_args()
    return group


def _rank_main(rank: int, n: int, port: int, out_dir: str):
    result = {}
    try:
        torch.set_num_threads(1)
        group = _init_group(rank, n, port)
        run = RankRun(rank, n, group)
        run.in_seq()
        run.mixed_paths()
        run.falls_through()
        result = {"errors": run.errors[:20], "checks": run.checks}
    except BaseException:  # noqa: BLE001 - reported to the parent
        tb = traceback.format_exc()
        result = {"fatal": tb if len(tb) < 4000 else tb[:1500] + " ... " + tb[-1500:]}
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(result))
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(1 if "fatal" in result else 0)  # a failed rank makes the parent stop the others


# ============================================================ parent side
@pytest.fixture(scope="module")
def fork_context():
    """Rank processes forked from one server that imported SGLang once (a spawned process
    per rank would import it 17 times)."""
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    yield ctx


def run_ranks(ctx, n: int, timeout_s: float = 120.0):
    out_dir = tempfile.mkdtemp(prefix=f"in-seq-rerange-{n}-")
    port = free_port()
    return run_rank_processes(ctx, _rank_main, n, out_dir, args=(n, port, out_dir), timeout_s=timeout_s,
                              what="in-seq re-range")


@pytest.mark.parametrize("n", [2, 3, 4, 8])
def test_hook_equals_sglang_on_gloo_ranks(fork_context, n):
    results = run_ranks(fork_context, n)
    errors = [e for x in results for e in x["errors"]]
    assert not errors, errors
    cases = sum(len(WIDTHS) - (total > 400) for total in lengths(n))  # (length, width) pairs
    assert all(x["checks"] == 4 * cases + 2 * 2 + 2 * 3 + 2 for x in results), results


# ============================================================ in process
@pytest.fixture
def decision(monkeypatch):
    """The hook's pre-collective decision in this process: SGLang's server arguments for
    in-seq split, debug off."""
    from sglang.srt import server_args as sa

    from sglang_cp_shared_kv.forward import hooks, in_seq_rerange_v0512 as in_seq_rerange

    monkeypatch.setattr(sa, "_global_server_args", server_args())
    monkeypatch.delenv("SGLANG_DEBUG_CP_SHARED_KV", raising=False)
    return in_seq_rerange, hooks


def _cuda_like(ndim=2):
    return SimpleNamespace(is_cuda=True, dim=lambda: ndim)


def test_decision_uses_rank_identical_facts_only(decision, monkeypatch):
    hook_module, _ = decision
    pool = shared_pool(2, 0)
    fb = SimpleNamespace(token_to_kv_pool=pool, attn_cp_metadata=build_metadata(9, 0, 2))
    assert hook_module.takes_plugin_path(_cuda_like(), fb, True)
    pool.context.kernels.failed.add("rerange_in_seq")  # raised once on this rank only
    assert hook_module.takes_plugin_path(_cuda_like(), fb, True), "a per-rank kernel failure changed the path"
    assert not hook_module.takes_plugin_path(_cuda_like(), fb, False)  # not a shared-KV pool
    assert not hook_module.takes_plugin_path(_cuda_like(ndim=3), fb, True)  # SGLang's function refuses it
    assert not hook_module.takes_plugin_path(torch.zeros(4, 2), fb, True)  # CPU: no kernel
    monkeypatch.setenv("SGLANG_DEBUG_CP_SHARED_KV", "1")
    assert not hook_module.takes_plugin_path(_cuda_like(), fb, True)


def test_inert_unless_shared_kv_in_seq_batch(decision, monkeypatch):
    from sglang.srt import server_args as sa

    hook_module, hooks = decision
    metadata = build_metadata(9, 0, 2)

    def gather_must_not_run(*args, **kwargs):
        raise AssertionError("the plugin path ran")

    monkeypatch.setattr(hook_module, "gather_in_seq_order", gather_must_not_run)
    calls = []

    def original(*args):
        calls.append(args)
        return "sglang's result"

    rows, stream = _cuda_like(), object()
    cases = {"flag off": SimpleNamespace(token_to_kv_pool=object(), attn_cp_metadata=metadata),
             "no pool": SimpleNamespace(attn_cp_metadata=metadata),
             "no metadata": SimpleNamespace(token_to_kv_pool=shared_pool(2, 0), attn_cp_metadata=None)}
    for what, fb in cases.items():
        assert hooks.all_gather_in_seq_order(original, rows, 2, fb, stream) == "sglang's result", what
        assert calls.pop() == (rows, 2, fb, stream), what
    monkeypatch.setattr(sa, "_global_server_args", server_args("round-robin-split"))
    fb = SimpleNamespace(token_to_kv_pool=shared_pool(2, 0), attn_cp_metadata=metadata)
    assert hooks.all_gather_in_seq_order(original, rows, 2, fb, stream) == "sglang's result"


def test_registered_for_hook_check():
    from sglang_cp_shared_kv import plugin
    from sglang_cp_shared_kv.forward import hooks

    spec = next(s for s in plugin.HOOKS if s.hook is hooks.all_gather_in_seq_order)
    assert (spec.target, spec.hook_type) == ("sglang.srt.layers.utils.cp_utils.cp_all_gather_rerange_output",
                                             "around")


PROPAGATION = textwrap.dedent("""
    import sys
    import sglang.srt.layers.attention.nsa.nsa_indexer as nsa_indexer  # imported before the hooks apply
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType
    from sglang_cp_shared_kv import plugin
    from sglang_cp_shared_kv.forward import hooks, in_seq_rerange_v0512 as in_seq_rerange
    from sglang_cp_shared_kv.hook_check import _wraps_hook, missing_hooks

    spec = next(s for s in plugin.HOOKS if s.hook is hooks.all_gather_in_seq_order)
    HookRegistry.register(spec.target, spec.hook, HookType(spec.hook_type))
    HookRegistry.apply_hooks()
    assert missing_hooks([spec]) == [], missing_hooks([spec])
    import sglang.srt.models.deepseek_nextn as deepseek_nextn  # imported after
    import sglang.srt.models.deepseek_v2 as deepseek_v2
    from sglang.srt.layers.utils import cp_utils

    class Reached(Exception):
        pass

    def reached(*args):
        raise Reached
    in_seq_rerange.takes_plugin_path = reached
    for module in (nsa_indexer, deepseek_v2, deepseek_nextn):
        name = module.cp_all_gather_rerange_output
        assert name is cp_utils.cp_all_gather_rerange_output and _wraps_hook(name, spec.hook), module.__name__
        try:
            name("rows", 2, "forward batch", None)
        except Reached:
            print("reached", module.__name__.rsplit(".", 1)[1])
""")


def test_models_call_the_hook_after_the_registry_applies_it():
    """HookRegistry rebinds ``from cp_utils import cp_all_gather_rerange_output`` copies in
    modules loaded before it applies the hook; modules loaded later import the wrapper."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO / "python"), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, "-c", PROPAGATION], capture_output=True, text=True, timeout=120,
                          env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.split() == ["reached", "nsa_indexer", "reached", "deepseek_v2", "reached", "deepseek_nextn"]
