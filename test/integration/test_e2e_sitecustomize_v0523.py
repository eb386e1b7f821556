"""scripts/e2e/sitecustomize.py on SGLang 0.5.23: each switch, in a fresh process started as the
e2e servers start (PYTHONPATH=scripts/e2e:python, CPSKV_E2E=1), is installed on the object
0.5.23's own call path uses -- the name its importers bound, the function its launcher hands
to the spawned process (and that still pickles by name), the kernel its DSA top-k backend
calls (reached through 0.5.23's real ``DSATopKBackend.topk_transform`` on CPU tensors) --
and the negative control reaches the views 0.5.23's forward hooks read (the selfcheck).

CPU only: ``sgl_kernel`` cannot load its CUDA library here, so its package is stood in by an
empty package over the real folder, into which the real ``sgl_kernel/top_k.py`` is imported
(through the switch's import hook) and from which its names are bound as the real
``sgl_kernel/__init__.py`` binds them (that file is read to check it does)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from sglang_cp_shared_kv.releases import installed, v0523

pytestmark = pytest.mark.skipif(installed.INSTALLED is not v0523.RELEASE, reason="sglang 0.5.23's modules")

ROOT = Path(__file__).resolve().parents[2]


def _run(code, extra_env, timeout=300):
    env = {**os.environ, "CPSKV_E2E": "1", **extra_env,
           "PYTHONPATH": os.pathsep.join([str(ROOT / "scripts" / "e2e"), str(ROOT / "python")])}
    for name in ("CPSKV_E2E_STABLE_TOPK", "CPSKV_E2E_SHARE_GPU", "CPSKV_E2E_CORRUPT_RANK"):
        if name not in extra_env:
            env.pop(name, None)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=timeout,
                         cwd=str(ROOT))
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    results = [json.loads(line[len("RESULT "):]) for line in out.stdout.splitlines() if line.startswith("RESULT ")]
    assert len(results) == 1, out.stdout[-3000:]
    return results[0], out.stdout


DUMMY = """
import json, torch
import sglang.srt.model_loader.loader as loader, sglang.srt.model_loader.weight_utils as wu
m = torch.nn.Module(); m.input_layernorm = torch.nn.LayerNorm(8); m.proj = torch.nn.Linear(512, 256)
# the name DummyModelLoader.load_model calls (bound by loader's from-import at its import)
loader.initialize_dummy_weights(m)
print("RESULT " + json.dumps({
    "bound_is_patched": loader.initialize_dummy_weights is wu.initialize_dummy_weights,
    "from_sitecustomize": loader.initialize_dummy_weights.__code__.co_filename.endswith("sitecustomize.py"),
    "loader_calls_it": "initialize_dummy_weights(model)" in __import__("inspect").getsource(loader.DummyModelLoader),
    "norm": float(m.input_layernorm.weight.mean()), "std": float(m.proj.weight.std())}))
"""


def test_dummy_weights_reach_the_name_the_dummy_loader_calls():
    got, out = _run(DUMMY, {})
    assert got["bound_is_patched"] and got["from_sitecustomize"] and got["loader_calls_it"], got
    assert got["norm"] == 1.0 and 0.015 < got["std"] < 0.025, got
    assert "[cpskv-e2e] non-degenerate dummy weights" in out


SHARE_GPU = """
import inspect, json, os, pickle, re
import sglang.srt.managers.scheduler as scheduler
import sglang.srt.entrypoints.engine as engine
import sglang.srt.entrypoints.http_server as http_server
import sglang.srt.managers.data_parallel_controller as dpc
wrapper = scheduler.run_scheduler_process
bound = {
    "engine_class_attribute": engine.Engine.run_scheduler_process_func is wrapper,
    "engine_module": engine.run_scheduler_process is wrapper,
    "http_server_module": http_server.run_scheduler_process is wrapper,
    "http_server_default": inspect.signature(http_server.launch_server).parameters[
        "run_scheduler_process_func"].default is wrapper,
    "dp_controller_module": dpc.run_scheduler_process is wrapper,
}
# mp.Process pickles its target by qualified name (spawn)
pickles = pickle.loads(pickle.dumps(wrapper)) is wrapper
source = re.sub(r"\\s+", " ", inspect.getsource(engine.Engine._launch_scheduler_processes))
launcher_args = "args = ( server_args, port_args, gpu_id, tp_rank, pp_rank, None, writer, )" in source
stock = inspect.signature(wrapper.__wrapped__)
# the wrapper, as the launcher calls it, with the stock function it closes over recorded instead
calls = []
cell = next(c for c in wrapper.__closure__ if c.cell_contents is wrapper.__wrapped__)
cell.cell_contents = lambda *args, **kwargs: calls.append((args, kwargs))
class Args: port = 30123
wrapper(Args(), "port_args", 1, 1, 0, None, "writer")
args, kwargs = calls[0]
# a spawned child, as the launcher starts one (mp.Process(target=run_scheduler_process_func)):
# it unpickles the target by name, through this sitecustomize, and the wrapper runs there
# (then the real function, which stops on these stand-in arguments)
import multiprocessing, types
child = multiprocessing.get_context("spawn").Process(
    target=wrapper, args=(types.SimpleNamespace(port=30124), None, 1, 1, 0, None, None))
child.start(); child.join()
print("RESULT " + json.dumps({"child_exitcode": child.exitcode,
    "bound": bound, "pickles": pickles, "launcher_args": launcher_args,
    "stock_parameters": list(stock.parameters)[:7],
    "passed": [a if isinstance(a, (int, str)) or a is None else "server_args" for a in args],
    "nccl_host_id": os.environ.get("NCCL_HOSTID")}))
"""


def test_share_gpu_wraps_the_scheduler_entry_point_the_launcher_spawns():
    got, out = _run(SHARE_GPU, {"CPSKV_E2E_SHARE_GPU": "1"})
    assert all(got["bound"].values()), got["bound"]
    assert got["pickles"] and got["launcher_args"], got
    assert got["stock_parameters"] == ["server_args", "port_args", "gpu_id", "tp_rank", "pp_rank", "dp_rank",
                                       "pipe_writer"]
    assert got["passed"] == ["server_args", "port_args", 0, 1, 0, None, "writer"]  # gpu 1 -> cuda:0
    from sglang_cp_shared_kv_testing.shared_gpu import SHARED_GPU_LINE, nccl_host_id

    assert got["nccl_host_id"] == nccl_host_id(30123, 1)
    assert out.count(SHARED_GPU_LINE) == 2, out  # here, and in the spawned child
    child_line = f"{SHARED_GPU_LINE} tp rank 1 (gpu 1) on cuda:0, NCCL_HOSTID={nccl_host_id(30124, 1)}"
    assert child_line in out and got["child_exitcode"] != 0, out


def test_shared_gpu_settings_exist_in_sglang_0523():
    """Every argument and variable shared_gpu gives a 0.5.23 server is one 0.5.23 reads."""
    import argparse

    from sglang.srt.environ import envs
    from sglang.srt.server_args import ServerArgs

    from sglang_cp_shared_kv_testing import shared_gpu

    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    options = {o for action in parser._actions for o in action.option_strings}
    assert set(shared_gpu.server_args()) <= options
    assert shared_gpu.server_args() == ["--sleep-on-idle", "--enforce-disable-flashinfer-allreduce-fusion"]
    for name in ("SGLANG_ENABLE_TP_MEMORY_INBALANCE_CHECK", "SGLANG_AUTO_NUMA_BIND"):
        assert hasattr(envs, name) and shared_gpu.env()[name] == "false"
    assert shared_gpu.env()["CPSKV_E2E_SHARE_GPU"] == "1"


STABLE_TOPK = """
import importlib.util, inspect, json, re, sys, types
import torch
from sglang_cp_shared_kv_testing import stable_topk as st

# sgl_kernel's package cannot load its CUDA library on CPU: an empty package over its folder,
# the real top_k.py imported into it, its names bound as sgl_kernel/__init__.py binds them
spec = importlib.util.find_spec("sgl_kernel")
init_source = open(spec.origin).read()
package = types.ModuleType("sgl_kernel")
package.__path__ = list(spec.submodule_search_locations)
sys.modules["sgl_kernel"] = package
import sgl_kernel.top_k as top_k
for name in st.STAND_INS:
    setattr(package, name, getattr(top_k, name))
init_binds = all(re.search(r"from sgl_kernel\\.top_k import \\([^)]*\\b" + name + r"\\b", init_source) is not None
                 for name in st.STAND_INS)

import sglang.kernels.ops.attention.dsv4 as dsv4
import sglang.kernels.ops.attention.dsv4.topk as v2
from sglang.srt.layers.attention.dsa.dsa_topk_backend import DSATopKBackend, TopkTransformMethod

installed = {
    "sgl_kernel.top_k": {n: getattr(top_k, n) is f for n, f in st.STAND_INS.items()},
    "sgl_kernel": {n: getattr(package, n) is f for n, f in st.STAND_INS.items()},
    "dsv4.topk": {n: getattr(v2, n) is f for n, f in st.V2_STAND_INS.items()},
    "dsv4": {n: getattr(dsv4, n) is f for n, f in st.V2_STAND_INS.items()},
}

# which stand-in each of 0.5.23's dispatches reaches: record the calls
called = []
def recording(module, name):
    function = getattr(module, name)
    def record(*args, **kwargs):
        called.append(name)
        return function(*args, **kwargs)
    setattr(module, name, record)
for name in st.STAND_INS:
    recording(package, name)
for name in st.V2_STAND_INS:
    recording(v2, name)

torch.manual_seed(0)
topk, page = 8, 4
rows, width = 5, 40
scores = torch.randn(rows, width)
lengths = torch.tensor([3, 8, 9, 20, 0], dtype=torch.int32)
starts = torch.tensor([0, 4, 2, 10, 0], dtype=torch.int32)
offsets = torch.tensor([100, 200, 300, 400, 500], dtype=torch.int32)
page_table_1 = torch.randperm(rows * width).to(torch.int32).view(rows, width)
real_page_table = torch.randperm(rows * 16).to(torch.int32).view(rows, 16)
meta = types.SimpleNamespace(page_table_1=page_table_1, real_page_table=real_page_table, page_size=page,
                             topk_v2_plan=torch.zeros(rows + 1, 2, dtype=torch.int32), token_to_batch_idx=None,
                             cu_seqlens_k=None)
cu = torch.arange(rows + 1, dtype=torch.int32)
backend = DSATopKBackend.SGL_KERNEL
answers = {}
def run(label, **kwargs):
    del called[:]
    out = backend.topk_transform(scores.clone(), lengths, topk, attn_metadata=meta, **kwargs)
    answers[label] = {"called": list(called), "out": out.tolist()}
# extend, RAGGED (fp8 KV, flashmla_sparse): the v2 ragged kernel
run("ragged_extend", topk_transform_method=TopkTransformMethod.RAGGED, topk_indices_offset=offsets,
    row_starts=starts)
# extend, PAGED (bf16 KV): row starts, so the legacy fused transform
run("paged_extend", topk_transform_method=TopkTransformMethod.PAGED, cu_seqlens_q_topk=cu, row_starts=starts)
# decode, PAGED: one row per request, no row starts: the v2 paged kernel over the real page table
run("paged_decode", topk_transform_method=TopkTransformMethod.PAGED, cu_seqlens_q_topk=cu)
# a prefill-CP style call with batch_idx_list: the legacy ragged transform
run("ragged_batch_idx", topk_transform_method=TopkTransformMethod.RAGGED, topk_indices_offset=offsets,
    row_starts=starts, batch_idx_list=[0, 1, 2, 3, 4])
# unfused (SGLANG_DSA_FUSE_TOPK=0, hisparse decode): fast_topk_v2
run("unfused", topk_transform_method=TopkTransformMethod.PAGED, row_starts=starts, force_unfused_topk=True)
print("RESULT " + json.dumps({"installed": installed, "init_binds": init_binds, "answers": answers,
    "inputs": {"scores": scores.tolist(), "lengths": lengths.tolist(), "starts": starts.tolist(),
               "offsets": offsets.tolist(), "page_table_1": page_table_1.tolist(),
               "real_page_table": real_page_table.tolist(), "topk": topk, "page": page}}))
"""


def _naive(scores, length, start, topk):
    if length <= topk:
        return list(range(max(length, 0))) + [-1] * (topk - max(length, 0))
    row = scores[start:start + length]
    return sorted(sorted(range(length), key=lambda j: (-row[j], j))[:topk])


def test_stable_topk_reaches_every_top_k_call_of_the_dsa_backend():
    got, out = _run(STABLE_TOPK, {"CPSKV_E2E_STABLE_TOPK": "1"})
    for where, names in got["installed"].items():
        assert all(names.values()), (where, names)
    assert got["init_binds"]
    assert out.count("[cpskv-e2e] deterministic NSA top-k") == 1  # one line per process
    a, x = got["answers"], got["inputs"]
    topk, page = x["topk"], x["page"]
    sel = {label: [_naive(x["scores"][i], x["lengths"][i], x["starts"][i] if starts else 0, topk)
                   for i in range(len(x["lengths"]))] for label, starts in (("starts", True), ("zero", False))}

    def shifted(rows, by):
        return [[j + by[i] if j >= 0 else -1 for j in row] for i, row in enumerate(rows)]

    assert a["ragged_extend"]["called"] == ["topk_transform_ragged_v2"]
    assert a["ragged_extend"]["out"] == shifted(sel["starts"], x["offsets"])
    assert a["paged_extend"]["called"] == ["fast_topk_transform_fused"]
    assert a["paged_extend"]["out"] == [[x["page_table_1"][i][j] if j >= 0 else -1 for j in row]
                                        for i, row in enumerate(sel["starts"])]
    assert a["paged_decode"]["called"] == ["topk_transform_paged_v2"]
    assert a["paged_decode"]["out"] == [[x["real_page_table"][i][j // page] * page + j % page if j >= 0 else -1
                                         for j in row] for i, row in enumerate(sel["zero"])]
    assert a["ragged_batch_idx"]["called"] == ["fast_topk_transform_ragged_fused"]
    assert a["ragged_batch_idx"]["out"] == shifted(sel["starts"], x["offsets"])
    assert a["unfused"]["called"] == ["fast_topk_v2"]
    assert a["unfused"]["out"] == sel["starts"]


def test_the_switches_are_inert_without_cpskv_e2e():
    code = """
import json
import sglang.srt.managers.scheduler as scheduler, sglang.kernels.ops.attention.dsv4.topk as v2
import sglang.srt.model_loader.weight_utils as wu
print("RESULT " + json.dumps([f.__code__.co_filename for f in (scheduler.run_scheduler_process,
      v2.topk_transform_ragged_v2, v2.topk_transform_paged_v2, wu.initialize_dummy_weights)]))
"""
    got, _ = _run(code, {"CPSKV_E2E": "0", "CPSKV_E2E_STABLE_TOPK": "1", "CPSKV_E2E_SHARE_GPU": "1"})
    assert not any(f.endswith("sitecustomize.py") or "stable_topk" in f for f in got), got


CORRUPT = """
import inspect, json
import sglang_cp_shared_kv.forward.materialize as materialize
import sglang_cp_shared_kv.forward.steps as steps
import sglang_cp_shared_kv.forward.hooks_v0523 as hooks
print("RESULT " + json.dumps({
    "wrapped": materialize.finish_mla_view.__code__.co_filename.endswith("sitecustomize.py"),
    "steps_calls_through_module": "materialize.finish_mla_view(" in inspect.getsource(steps.attend_on_dense_view),
    "hook_goes_through_steps": "steps.attend_on_dense_view(" in inspect.getsource(hooks.forward_extend_on_dense_view),
}))
"""


def test_corrupt_rank_wraps_the_function_the_0523_forward_hook_finishes_views_in():
    got, _ = _run(CORRUPT, {"CPSKV_E2E_CORRUPT_RANK": "1"})
    assert all(got.values()), got


def test_a_patch_whose_target_is_missing_does_not_break_the_import(tmp_path):
    """A release without a patched name: the module imports, the switch says it did nothing."""
    package = tmp_path / "sglang" / "srt" / "managers"
    package.mkdir(parents=True)
    for folder in (tmp_path / "sglang", tmp_path / "sglang" / "srt", package):
        (folder / "__init__.py").write_text("")
    (package / "scheduler.py").write_text("VALUE = 1\n")
    env = {**os.environ, "CPSKV_E2E": "1", "CPSKV_E2E_SHARE_GPU": "1",
           "PYTHONPATH": os.pathsep.join([str(ROOT / "scripts" / "e2e"), str(tmp_path), str(ROOT / "python")])}
    out = subprocess.run([sys.executable, "-c", "import sglang.srt.managers.scheduler as s; print('VALUE', s.VALUE)"],
                         capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "VALUE 1" in out.stdout and "[cpskv-e2e] NOT patched: sglang.srt.managers.scheduler" in out.stdout


@pytest.mark.slow
def test_the_negative_control_corrupts_the_views_the_0523_forward_hooks_read():
    """CPSKV_E2E_CORRUPT_RANK=1 under the selfcheck on 0.5.23 (its interleave CP, the plugin's
    real forward path on 2 CPU ranks): rank 1's attention differs, rank 0's does not."""
    from sglang_cp_shared_kv_testing.support import selfcheck_with_e2e_switches

    out, verdict = selfcheck_with_e2e_switches(ROOT, {"CPSKV_E2E_CORRUPT_RANK": "1"}, timeout=900)
    assert out.returncode == 1, out.stdout[-3000:] + out.stderr[-2000:]
    failure = next(line for line in verdict if line.startswith("FAIL") and "bit-exact" in line)
    assert "rank 1:" in failure and "rank 0:" not in failure and "attention output: differs" in failure


def test_the_load_back_control_corrupts_only_the_named_ranks_load_backs_on_0523(tiny_nsa_model):
    """CPSKV_E2E_CORRUPT_LOAD_RANK=1 on 0.5.23's HiCache rig (its real UnifiedRadixCache,
    controller, L2 transfer and host pools; 2 CPU ranks): the bytes read back over the group
    differ from stock's in one page, the request's second (logical page 1: rank 1's first), MLA
    rows only, on both layers -- what the same control gives on 0.5.12.post1's rig."""
    script = ("import json, sys\n"
              "from sglang_cp_shared_kv_testing.hicache_cp_v0523 import CASES, run_hicache_group\n"
              "ranks = run_hicache_group(2, sys.argv[1], cases=(CASES[0],))\n"
              "print('ERRORS', json.dumps([r[CASES[0].name]['errors'] for r in ranks]))\n")
    env = {**os.environ, "CPSKV_E2E": "1", "CPSKV_E2E_CORRUPT_LOAD_RANK": "1",
           "PYTHONPATH": os.pathsep.join([str(ROOT / "scripts" / "e2e"), str(ROOT / "python")])}
    out = subprocess.run([sys.executable, "-c", script, tiny_nsa_model], capture_output=True, text=True, env=env,
                         timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    errors = json.loads(next(line for line in out.stdout.splitlines() if line.startswith("ERRORS"))[len("ERRORS"):])
    assert errors[0] == errors[1] == [f"mla layer {layer}: rows {list(range(64, 72))}... differ" for layer in (0, 1)], errors
    from sglang_cp_shared_kv_testing.server import CORRUPTING_LOADS_LINE

    assert out.stdout.count(CORRUPTING_LOADS_LINE) >= 2  # each rank process said so


PD_SWITCHES = """
import inspect, json
import sglang.srt.disaggregation.prefill as prefill, sglang.srt.disaggregation.decode as decode
import sglang_cp_shared_kv.transfer.prefill as transfer
import sglang_cp_shared_kv.transfer.hooks as hooks
def ours(f):
    return f.__code__.co_filename.endswith("sitecustomize.py")
print("RESULT " + json.dumps({
    "dump_prefill": ours(prefill.SchedulerDisaggregationPrefillMixin.send_kv_chunk),
    "dump_decode": ours(decode.DecodeTransferQueue._commit_transfer_to_req),
    "corrupt_send": ours(transfer.PrefillShardTransfer.owned_pages),
    "stall_write": ours(transfer.PrefillShardTransfer.write),
    # the shared transfer hooks reach both through the context's class
    "hooks_call_them": "context.owned_pages(" in inspect.getsource(hooks.filter_owned_pages)
                       and "context.write(" in inspect.getsource(hooks.write_in_bounded_batches),
}))
"""


def test_the_pd_switches_install_on_0523s_targets(tmp_path):
    """CORRUPT_SEND_RANK, STALL_WRITE_RANK and DUMP_PAGES (later PD runs): the import works and
    each wraps its target (the first two's effect on 0.5.23's PD path: the selfcheck tests below)."""
    got, out = _run(PD_SWITCHES, {"CPSKV_E2E_CORRUPT_SEND_RANK": "1", "CPSKV_E2E_STALL_WRITE_RANK": "0",
                                  "CPSKV_E2E_DUMP_PAGES": str(tmp_path)})
    assert all(got.values()), got
    assert "NOT patched" not in out


# ------------------------------------------------------------------ the PD switches on 0.5.23's PD path
def _selfcheck_json(switches, timeout=900):
    """The selfcheck (``--json``) on 0.5.23 with ``switches``: 2 CPU prefill ranks through the
    plugin's real forward path, each sending its shard through SGLang 0.5.23's Mooncake classes
    (the plugin's hooks applied) to a decode pool. (report, its process log folder)."""
    env = {**os.environ, "CPSKV_E2E": "1", **switches,
           "PYTHONPATH": os.pathsep.join([str(ROOT / "scripts" / "e2e"), str(ROOT / "python")])}
    out = subprocess.run([sys.executable, "-m", "sglang_cp_shared_kv", "selfcheck", "--json"], capture_output=True,
                         text=True, env=env, timeout=timeout)
    assert out.stdout.strip().startswith("{"), out.stdout[-2000:] + out.stderr[-3000:]
    report = json.loads(out.stdout)
    return report, Path(report["logs"])


@pytest.mark.slow
def test_the_pd_send_control_reaches_decode_through_0523s_pd_classes():
    """CPSKV_E2E_CORRUPT_SEND_RANK=1 (e2e_pd_gpu.py's on_corrupt): the prefill stays bit-exact and
    each rank sends as many pages as it stores, but decode's KV is wrong exactly at pages CP rank 1
    owns (a chunk's second owned page carries its first one's rows), its index pages untouched --
    the switch reaches 0.5.23's send path (``filter_kv_indices_for_cp_rank`` -> the plugin's
    ``filter_owned_pages`` -> ``PrefillShardTransfer.owned_pages``)."""
    import re

    import numpy as np

    from sglang_cp_shared_kv.cp_shared_kv_layout import CpSharedKVLayout

    report, logs = _selfcheck_json({"CPSKV_E2E_CORRUPT_SEND_RANK": "1"})
    assert report["verdict"] == "FAIL" and report["sglang_version"] == v0523.RELEASE.version
    failed = {c["name"]: c["detail"] for c in report["checks"] if not c["passed"]}
    assert list(failed) == ["decode pool"], failed
    detail = failed["decode pool"]
    assert "index" not in detail and "kv wrong at positions" in detail, detail
    positions = sorted({int(p) for group in re.findall(r"kv wrong at positions \[([\d, ]+)\]", detail)
                        for p in group.split(",")})
    assert positions, detail
    logical = np.asarray(json.loads((logs / "pages.json").read_text()))  # the request's pages, by position
    owners = CpSharedKVLayout(cp_size=2, cp_rank=0, page_size=64).owner_for_logical_pages_np(logical[positions])
    assert owners.tolist() == [1] * len(positions), (positions, owners)
    from sglang_cp_shared_kv_testing.server import CORRUPTING_SENDS_LINE

    assert CORRUPTING_SENDS_LINE in (logs / "rank1.log").read_text()


@pytest.mark.slow
def test_the_stall_switch_holds_only_rank_1s_first_write_on_0523s_pd_path():
    """CPSKV_E2E_STALL_WRITE_RANK=1 (e2e_pd_gpu.py's on_abort): CP rank 1's first Mooncake write,
    reached through 0.5.23's ``MooncakeKVManager._transfer_data`` (the plugin's
    ``write_in_bounded_batches`` -> ``PrefillShardTransfer.write``), is held once, in rank 1's
    process only, and then goes ahead: decode's bytes are still exact."""
    from sglang_cp_shared_kv_testing.server import STALLED_WRITE_LINE

    report, logs = _selfcheck_json({"CPSKV_E2E_STALL_WRITE_RANK": "1", "CPSKV_E2E_STALL_WRITE_S": "2"})
    assert report["verdict"] == "PASS", [c for c in report["checks"] if not c["passed"]]
    held = {name: (logs / f"{name}.log").read_text().count(STALLED_WRITE_LINE) for name in ("rank0", "rank1", "decode")}
    assert held == {"rank0": 0, "rank1": 1, "decode": 0}, held
