"""The e2e tooling (scripts/e2e): inert by default, and it really re-initialises dummy weights
and corrupts only the named rank's view (it runs only where two GPUs are lent)."""

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

CHECK = """
import torch, sglang.srt.model_loader.weight_utils as wu
m = torch.nn.Module(); m.input_layernorm = torch.nn.LayerNorm(8); m.proj = torch.nn.Linear(512, 256)
wu.initialize_dummy_weights(m)
print("NORM", float(m.input_layernorm.weight.mean()), "STD", float(m.proj.weight.std()))
import sglang_cp_shared_kv.forward.materialize as mat
print("WRAPPED", mat.finish_mla_view.__name__ == "finish_mla_view" and mat.finish_mla_view.__module__ != mat.__name__)
"""


def _run(extra_env):
    env = {**os.environ, **extra_env,
           "PYTHONPATH": os.pathsep.join([str(ROOT / "scripts" / "e2e"), str(ROOT / "python")])}
    out = subprocess.run([sys.executable, "-c", CHECK], capture_output=True, text=True, env=env, timeout=180)
    assert out.returncode == 0, out.stderr[-2000:]
    words = " ".join(line for line in out.stdout.splitlines() if line.startswith(("NORM", "WRAPPED"))).split()
    return dict(zip(words[::2], words[1::2]))


def test_e2e_sitecustomize():
    stock = _run({})
    assert abs(float(stock["NORM"])) < 1e-2 and float(stock["STD"]) < 1e-2 and stock["WRAPPED"] == "False"
    e2e = _run({"CPSKV_E2E": "1", "CPSKV_E2E_CORRUPT_RANK": "1"})
    assert float(e2e["NORM"]) == 1.0 and 0.015 < float(e2e["STD"]) < 0.025 and e2e["WRAPPED"] == "True"


def test_the_negative_control_corrupts_the_views_the_forward_hooks_read():
    """CPSKV_E2E_CORRUPT_RANK=1 must reach what the plugin's hooks compute with: the selfcheck
    (the plugin's real forward path on 2 CPU ranks) then finds rank 1's attention differing.
    NOTE: written after the first CP2 server run on one H200 (2026-12-03) left the control
    undetected on every prompt: the switch wrapped ``materialize_mla``, which the forward
    hooks no longer call (they finish every view, prefetched or not, in ``finish_mla_view``)."""
    from sglang_cp_shared_kv_testing.support import selfcheck_with_e2e_switches

    out, verdict = selfcheck_with_e2e_switches(ROOT, {"CPSKV_E2E_CORRUPT_RANK": "1"}, timeout=600)
    assert out.returncode == 1, out.stdout[-3000:] + out.stderr[-2000:]
    assert [line.split()[1:3] for line in verdict if line.startswith("FAIL")] == [["prefill", "bit-exact"]]
    failure = next(line for line in verdict if "bit-exact" in line)
    assert "rank 1:" in failure and "rank 0:" not in failure and "attention output: differs" in failure


FAKE_SGL_KERNEL = {  # the shape of sgl_kernel's package: __init__ binds the names from .top_k
    "__init__.py": "from sgl_kernel.top_k import fast_topk_transform_fused, fast_topk_transform_ragged_fused, "
                   "fast_topk_v2\n",
    "top_k.py": "def fast_topk_v2(*a, **k): return 'stock'\n"
                "def fast_topk_transform_fused(*a, **k): return 'stock'\n"
                "def fast_topk_transform_ragged_fused(*a, **k): return 'stock'\n",
}
CHECK_TOPK = """
import sgl_kernel
from sglang_cp_shared_kv_testing.stable_topk import STAND_INS
print("REPLACED", sum(getattr(sgl_kernel, name) is fn for name, fn in STAND_INS.items()))
"""


def test_stable_topk_switch_replaces_the_kernels_sglang_imports(tmp_path):
    package = tmp_path / "sgl_kernel"
    package.mkdir()
    for name, text in FAKE_SGL_KERNEL.items():
        (package / name).write_text(text)
    path = os.pathsep.join([str(ROOT / "scripts" / "e2e"), str(ROOT / "python"), str(tmp_path)])

    def replaced(extra_env):
        env = {**os.environ, **extra_env, "PYTHONPATH": path}
        out = subprocess.run([sys.executable, "-c", CHECK_TOPK], capture_output=True, text=True, env=env, timeout=180)
        assert out.returncode == 0, out.stderr[-2000:]
        return out.stdout

    assert "REPLACED 0" in replaced({})
    assert "REPLACED 0" in replaced({"CPSKV_E2E": "1"})
    on = replaced({"CPSKV_E2E": "1", "CPSKV_E2E_STABLE_TOPK": "1"})
    assert "REPLACED 3" in on and "[cpskv-e2e] deterministic NSA top-k" in on


def test_e2e_verdict_demands_bit_equality_with_the_stable_topk():
    from sglang_cp_shared_kv_testing.support import load_script

    e2e = load_script("e2e_cp_logprobs")
    same = {"near_max": 0.0, "far_max": 0.0, "far_mean": 0.0}
    noisy = {"near_max": 0.0, "far_max": 0.03, "far_mean": 0.004}
    slightly = {"near_max": 0.0, "far_max": 1e-6, "far_mean": 1e-7}
    corrupt = {"near_max": 0.2, "far_max": 0.3, "far_mean": 0.1}
    exact = e2e.verdict({"spread": same, "on": same, "corrupt": corrupt}, True, True)
    assert all(exact.values()) and set(exact) == {"repeat_bit_identical", "on_bit_identical", "control_detected"}
    assert not e2e.verdict({"spread": same, "on": slightly, "corrupt": corrupt}, True, True)["on_bit_identical"]
    assert not e2e.verdict({"spread": noisy, "on": same}, False, True)["repeat_bit_identical"]
    # the stock top-k: the far positions only within the flag-off spread
    loose = e2e.verdict({"spread": noisy, "on": slightly, "corrupt": corrupt}, True, False)
    assert all(loose.values()) and "far_within_spread" in loose
    # one GPU, no CP: only the flag-off repeat
    assert e2e.verdict({"spread": same}, True, True) == {"repeat_bit_identical": True}


def test_an_installed_mooncake_engine_that_does_not_import_fails_instead_of_skipping(monkeypatch):
    """The Mooncake tests skip only where no engine is installed: one that is installed but
    broken (a missing libibverbs, say) must fail them, or CI would pass without running them."""
    import importlib
    import importlib.metadata

    import pytest

    from sglang_cp_shared_kv_testing import support

    real_import = importlib.import_module

    def broken(name, *args, **kwargs):
        if name == "mooncake.engine":
            raise ImportError("libibverbs.so.1: cannot open shared object file")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(importlib.metadata, "version", lambda name: "0.3.14")
    monkeypatch.setattr(importlib, "import_module", broken)
    with pytest.raises(pytest.fail.Exception, match="installed but mooncake.engine does not import"):
        support.mooncake_engine_or_skip()

    def not_installed(name):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "version", not_installed)
    with pytest.raises(pytest.skip.Exception, match="needs one of mooncake-transfer-engine-non-cuda"):
        support.mooncake_engine_or_skip()


FAKE_SCHEDULER = '''
import json, os, sys


def run_scheduler_process(server_args, port_args, gpu_id, tp_rank, attn_cp_rank, *rest):
    """Stands in for SGLang's: records what the spawned scheduler process was given."""
    with open(port_args, "w") as f:
        json.dump({"gpu_id": gpu_id, "tp_rank": tp_rank, "attn_cp_rank": attn_cp_rank, "rest": list(rest),
                   "nccl_host_id": os.environ.get("NCCL_HOSTID")}, f)
'''
CHECK_SHARE = """
import json, multiprocessing, pickle, sys, types
import sglang.srt.managers.scheduler as sched
print("SAME_BY_NAME", pickle.loads(pickle.dumps(sched.run_scheduler_process)) is sched.run_scheduler_process)
server_args = types.SimpleNamespace(port=31020)
records = []
for tp_rank, gpu_id in ((0, 0), (3, 3)):  # SGLang's gpu_id = base_gpu_id + tp_rank * gpu_id_step
    path = f"{sys.argv[1]}/rank{tp_rank}.json"
    # SGLang starts each scheduler process like this (0.5.12.post1 entrypoints/engine.py)
    proc = multiprocessing.get_context("spawn").Process(
        target=sched.run_scheduler_process, args=(server_args, path, gpu_id, tp_rank, 0, 0, 0, 0, None, "pipe"))
    proc.start(); proc.join()
    assert proc.exitcode == 0, proc.exitcode
    records.append(json.load(open(path)))
print("RECORDS", json.dumps(records))
"""


def _scheduler_records(tmp_path, extra_env):
    package = tmp_path / "fake" / "sglang" / "srt" / "managers"
    package.mkdir(parents=True)
    for folder in (package, package.parent, package.parent.parent):
        (folder / "__init__.py").write_text("")
    (package / "scheduler.py").write_text(FAKE_SCHEDULER)
    env = {**os.environ, **extra_env, "PYTHONPATH": os.pathsep.join(
        [str(ROOT / "scripts" / "e2e"), str(ROOT / "python"), str(tmp_path / "fake")])}
    env.pop("NCCL_HOSTID", None)
    out = subprocess.run([sys.executable, "-c", CHECK_SHARE, str(tmp_path)], capture_output=True, text=True,
                         env=env, timeout=180)
    assert out.returncode == 0, out.stderr[-2000:]
    lines = dict(line.split(" ", 1) for line in out.stdout.splitlines() if line.startswith(("SAME_BY_NAME", "RECORDS")))
    import json

    return lines["SAME_BY_NAME"] == "True", json.loads(lines["RECORDS"]), out.stdout


def test_share_gpu_switch_puts_every_rank_on_gpu_0_with_a_host_id_of_its_own(tmp_path):
    """CPSKV_E2E_SHARE_GPU=1: each scheduler process SGLang spawns gets gpu_id 0 and an
    NCCL_HOSTID unique to its server and TP rank, set before anything else runs in it; the
    wrapper still pickles by the original's name (SGLang's spawn needs that)."""
    from sglang_cp_shared_kv_testing.shared_gpu import SHARED_GPU_LINE, nccl_host_id

    same, stock, _ = _scheduler_records(tmp_path / "stock", {"CPSKV_E2E": "1"})
    assert same and [r["gpu_id"] for r in stock] == [0, 3] and {r["nccl_host_id"] for r in stock} == {None}
    same, shared, out = _scheduler_records(tmp_path / "shared", {"CPSKV_E2E": "1", "CPSKV_E2E_SHARE_GPU": "1"})
    assert same and [r["gpu_id"] for r in shared] == [0, 0]
    assert [r["nccl_host_id"] for r in shared] == [nccl_host_id(31020, 0), nccl_host_id(31020, 3)]
    assert [r["rest"] for r in shared] == [r["rest"] for r in stock]  # every other argument as SGLang gave it
    assert len(set(r["nccl_host_id"] for r in shared)) == 2 and nccl_host_id(31020, 0) != nccl_host_id(31030, 0)
    # the line the e2e scripts count to know every rank took it, printed by each spawned child
    assert out.count(SHARED_GPU_LINE) == 2 and "tp rank 3 (gpu 3) on cuda:0" in out


def test_a_run_whose_ranks_did_not_all_share_the_gpu_fails_its_check(tmp_path):
    from sglang_cp_shared_kv_testing import shared_gpu
    from sglang_cp_shared_kv_testing.server import startup_figures

    log = "\n".join(f"{shared_gpu.SHARED_GPU_LINE} tp rank {r} (gpu {r}) on cuda:0" for r in range(3))
    figures = startup_figures(log)
    assert figures["shared_gpu_processes"] == 3
    assert shared_gpu.problem(figures, "on", Path("on.log"), 3) is None
    assert "3 scheduler process(es) reported it, fewer than its 4 TP rank(s)" in shared_gpu.problem(
        figures, "on", Path("on.log"), 4)


def test_logprob_runs_check_capacity_at_every_cp_size():
    """e2e_cp_logprobs: over_rank_pool is over one rank's physical pool and under N of them
    (with room for the scheduler's margin); off_b must refuse it, on must serve it, the
    startup split must be exactly N x POOL, and every rank must have taken both write paths."""
    from sglang_cp_shared_kv_testing.support import load_script

    e2e = load_script("e2e_cp_logprobs")
    for n in (2, 3, 4, 8):
        tokens = e2e.over_rank_pool_tokens(n)
        assert e2e.POOL < tokens <= (n - 0.5) * e2e.POOL and tokens + 1 <= e2e.MODEL["max_position_embeddings"]
        assert len(e2e.prompts(n)["over_rank_pool"][0]) == tokens
    assert e2e.over_rank_pool_tokens(4) >= 3 * e2e.POOL and e2e.over_rank_pool_tokens(8) >= 7 * e2e.POOL
    assert e2e.CHUNK % (2 * 8 * 64) == 0  # full chunks are stored where computed up to CP8
    pd = load_script("e2e_pd_gpu")
    prompts = [(ids, start) for n in (2, 4, 8) for name, (ids, start) in e2e.prompts(n).items()
               if name not in e2e.UNEVEN_PROMPTS]  # (test_logprob_runs_cover_chunks_sglang_pads)
    prompts += [(ids, pd.RADIX_PREFIX if name == "radix_hit" else 0) for name, ids in pd.prompts().items()]
    prompts += [(ids, 0) for ids in pd.small_decode_prompts().values()]
    for ids, start in prompts:  # every chunk splits evenly over the CP ranks up to CP8
        chunks = [min(e2e.CHUNK, len(ids) - at) for at in range(start, len(ids), e2e.CHUNK)]
        assert all(c % e2e.SPLIT_MULTIPLE == 0 for c in chunks), chunks
    short = [c for ids, start in prompts for c in [(len(ids) - start) % e2e.CHUNK] if c]
    assert all(c % (2 * 8 * 64) for c in short)  # ... and every shorter last chunk takes the gathered path at CP8
    for n in (2, 8):
        samples = {}
        for rank in range(n):
            samples[f'{{cp_rank="{rank}",index="local",mla="local"}}'] = 30.0
            samples[f'{{cp_rank="{rank}",index="gathered",mla="gathered"}}'] = 5.0
        answered = [-1.0, -2.0]
        runs = {"off_a": {"logprobs": {"over_rank_pool": answered}},
                "off_b": {"logprobs": {"over_rank_pool": {"refused": "HTTP 400: exceeds the maximum allowed length"}}},
                "on": {"logprobs": {"over_rank_pool": answered}, "write_paths": samples,
                       "startup": {"shared": [(e2e.POOL, n * e2e.POOL)]}}}
        checks = e2e.capacity_checks(runs, n)
        assert len(checks) == 5 and all(checks.values()), checks
        bad = json_copy(runs)
        bad["on"]["startup"]["shared"] = [(e2e.POOL, n * e2e.POOL - 64)]
        assert not all(e2e.capacity_checks(bad, n).values())
        bad = json_copy(runs)
        bad["off_b"]["logprobs"]["over_rank_pool"] = answered  # stock served it: not over its pool
        assert not all(e2e.capacity_checks(bad, n).values())
        bad = json_copy(runs)
        del bad["on"]["write_paths"][f'{{cp_rank="{n - 1}",index="gathered",mla="gathered"}}']
        assert not all(e2e.capacity_checks(bad, n).values())
        assert e2e.write_paths_by_rank(samples)[n - 1] == {"local": 30, "gathered": 5, "mla_local": 30}


def _chunks(ids, start, chunk):
    """(cached tokens before it, tokens) of each chunk SGLang prefills after a cache hit of
    ``start`` tokens (--chunked-prefill-size ``chunk``, a multiple of the page)."""
    return [(at, min(chunk, len(ids) - at)) for at in range(start, len(ids), chunk)]


def test_logprob_runs_cover_chunks_sglang_pads():
    """e2e_cp_logprobs's UNEVEN_PROMPTS, after the original prompts (unchanged): chunks of no
    multiple of 16 tokens that SGLang 0.5.12.post1 pads with rows of its own at CP2, CP4
    and CP8 (its padding, split and indexer code: ``stable_topk.in_seq_split_topk_calls``,
    the padding rows being those whose top-k lengths run past the request's tokens), the
    1,500-token chunk of the CP8 repro, last chunks of 13 tokens and of 1 (too short to
    split), and a radix prefix that ends mid-page, posted right after the prompt it shares,
    whose cache hit the run checks."""
    import torch

    from sglang_cp_shared_kv_testing.stable_topk import STAND_INS, in_seq_split_topk_calls
    from sglang_cp_shared_kv_testing.support import load_script

    e2e = load_script("e2e_cp_logprobs")

    def shapes_only(score, *args, **kwargs):  # what the kernel is handed is the point, not its answer
        return torch.full((score.shape[0], e2e.INDEX_TOPK), -1, dtype=torch.int32)

    for n in (2, 4, 8):
        prompts = e2e.prompts(n)
        original = {name: (len(ids), start) for name, (ids, start) in list(prompts.items())[:5]}
        assert original == {"1.5k_single_chunk": (1504, 0), "3k_chunked": (3008, 0),
                            "radix_hit_3k_prefix": (3056, e2e.RADIX_PREFIX), "6k_chunked": (6016, 0),
                            "over_rank_pool": (e2e.over_rank_pool_tokens(n), 0)}
        assert tuple(prompts)[5:] == e2e.UNEVEN_PROMPTS
        padded = {}
        for name in e2e.UNEVEN_PROMPTS:
            ids, start = prompts[name]
            chunks = _chunks(ids, start, e2e.CHUNK)
            assert any(tokens % e2e.SPLIT_MULTIPLE for _, tokens in chunks), name
            for prefix, tokens in chunks:
                calls = in_seq_split_topk_calls(tokens, prefix, n, dict.fromkeys(STAND_INS, shapes_only))
                rows = sum(int((c.arguments["lengths"] > c.sequence_len).sum()) for c in calls)
                assert rows == (-tokens % n if calls else 0), (name, prefix, tokens)
                padded[name] = padded.get(name, 0) + rows
        assert padded == {"1.5k_uneven_1500": 4 if n == 8 else 0, "1.5k_uneven_1501": {2: 1, 4: 3, 8: 3}[n],
                          "4k_last_chunk_13": {2: 1, 4: 3, 8: 3}[n], "radix_mid_page": {2: 1, 4: 1, 8: 5}[n],
                          "4k_last_chunk_1": 0, "5k_uneven_907": {2: 1, 4: 1, 8: 5}[n]}, n
        last_chunks = {name: _chunks(*prompts[name], e2e.CHUNK)[-1] for name in ("4k_last_chunk_13", "4k_last_chunk_1")}
        assert last_chunks == {"4k_last_chunk_13": (2 * e2e.CHUNK, 13), "4k_last_chunk_1": (2 * e2e.CHUNK, 1)}
        assert in_seq_split_topk_calls(1, 2 * e2e.CHUNK, n, dict.fromkeys(STAND_INS, shapes_only)) == []
        # the radix prompts: posted right after the prompt they share (no flush between), start = the hit
        order = list(prompts)
        for name, source in (("radix_hit_3k_prefix", "3k_chunked"), ("radix_mid_page", "4k_last_chunk_13")):
            assert order.index(name) == order.index(source) + 1
            ids, start = prompts[name]
            shared = next(i for i, (a, b) in enumerate(zip(ids, prompts[source][0] + [None])) if a != b)
            assert start == e2e.RADIX_HITS[name] == shared // e2e.PAGE * e2e.PAGE
        assert e2e.MID_PAGE_SHARED % e2e.PAGE and prompts["radix_mid_page"][1] == e2e.MID_PAGE_HIT == 1984
        assert all(start == 0 for name, (_, start) in prompts.items() if name not in e2e.RADIX_HITS)
    hits = {"cached_tokens": {"radix_hit_3k_prefix": e2e.RADIX_PREFIX, "radix_mid_page": e2e.MID_PAGE_HIT}}
    assert all(e2e.radix_checks({"on": hits}).values()) and len(e2e.radix_checks({"on": hits})) == 2
    short = {"cached_tokens": {**hits["cached_tokens"], "radix_mid_page": e2e.MID_PAGE_HIT - e2e.PAGE}}
    assert not e2e.radix_checks({"on": short})["on: radix_mid_page found its 1984 tokens cached"]


def json_copy(value):
    import json

    return json.loads(json.dumps(value))


def test_a_prompt_off_b_refuses_is_judged_against_off_a_alone():
    from sglang_cp_shared_kv_testing.support import load_script

    e2e = load_script("e2e_cp_logprobs")
    same = {"near_max": 0.0, "far_max": 0.0, "far_mean": 0.0}
    corrupt = {"near_max": 0.0, "far_max": 0.3, "far_mean": 0.1}
    checks = e2e.verdict({"on": same, "corrupt": corrupt}, True, True)
    assert checks == {"on_bit_identical": True, "control_detected": True}
    assert not e2e.verdict({"on": {**same, "far_max": 1e-7}, "corrupt": corrupt}, True, True)["on_bit_identical"]


STALL_CHECK = """
import time
from types import SimpleNamespace
from sglang_cp_shared_kv.cp_shared_kv_layout import CpSharedKVLayout
from sglang_cp_shared_kv.transfer.prefill import PrefillShardTransfer
PrefillShardTransfer.write.__defaults__  # the class as patched (or not)
for rank in (0, 1):
    me = SimpleNamespace(layout=CpSharedKVLayout(cp_size=2, cp_rank=rank, page_size=64), max_descriptors_per_batch=8,
                         stats=SimpleNamespace(add=lambda **k: None), write_failures=None, who="test")
    for call in range(2):
        t0 = time.monotonic()
        ret = PrefillShardTransfer.write(me, lambda mgr, session, batch: 0, None, "s", [(0, 0, 8)])
        print("WRITE", rank, call, ret, round(time.monotonic() - t0, 1))
"""


def test_stall_switch_holds_only_the_named_ranks_first_write():
    env = {**os.environ, "CPSKV_E2E": "1", "CPSKV_E2E_STALL_WRITE_RANK": "1", "CPSKV_E2E_STALL_WRITE_S": "1.5",
           "PYTHONPATH": os.pathsep.join([str(ROOT / "scripts" / "e2e"), str(ROOT / "python")])}
    out = subprocess.run([sys.executable, "-c", STALL_CHECK], capture_output=True, text=True, env=env, timeout=180)
    assert out.returncode == 0, out.stderr[-2000:]
    writes = [line.split()[1:] for line in out.stdout.splitlines() if line.startswith("WRITE")]
    held = {(rank, call) for rank, call, ret, seconds in writes if float(seconds) >= 1.5}
    assert held == {("1", "0")} and all(ret == "0" for _, _, ret, _ in writes)  # the write still goes ahead
    from sglang_cp_shared_kv_testing.server import STALLED_WRITE_LINE

    assert out.stdout.count(STALLED_WRITE_LINE) == 1


def test_hicache_runs_evict_the_prefix_to_host_and_judge_it_from_their_records():
    """scripts/e2e_hicache_logprobs.py: every HiCache run posts more filler tokens than its
    logical device pool holds while its host tier holds the prefix and every filler; the checks
    read a run's record as it comes back from its JSON file (cp ranks as strings: the first
    GPU run, 2026-12-06, judged every rank's page counts false on int keys) and fail on a
    probe off by one bit, a host hit missing, or a rank that copied nothing."""
    import copy
    import json

    from sglang_cp_shared_kv_testing.support import load_script

    hc = load_script("e2e_hicache_logprobs")
    for n in (2, 3, 4, 8):
        for name, spec in hc.RUNS.items():
            assert hc.host_holds_the_prefix(name, n)
            if spec.hicache:
                assert hc.filler_count(name, n) * hc.FILLER > hc.logical_pool(name, n)
            if spec.storage:  # the fillers push the prefix out of host memory too
                assert hc.filler_count(name, n) * hc.FILLER > (1 + spec.hicache_ratio) * hc.logical_pool(name, n)
        probe = hc.prompts("on_hicache", n)[-1]
        assert probe[0] == "probe" and probe[2] == hc.PREFIX and hc.PREFIX % hc.PAGE == 0
    lp = [-1.5, -2.25, -0.125]

    def run(host, pages):
        details = {"device": hc.PREFIX - host, "host": host}
        return json.loads(json.dumps({
            "answers": {"prefix": {"logprobs": [-3.0]}, "probe": {"logprobs": list(lp), "cached_tokens": hc.PREFIX,
                                                                 "cached_tokens_details": details}},
            "hicache_pages": pages, "problems": [],
            "startup": {"host_gb": [0.06], "shared_host_tokens": [[24640, 2 * 24640]]}}))

    pages = {0: {"backed_up": 210, "loaded_back": 23}, 1: {"backed_up": 224, "loaded_back": 24}}
    runs = {"device": run(0, {}), "off_hicache": run(hc.PREFIX, {}), "on_hicache": run(hc.PREFIX, pages)}
    assert all(hc.hicache_checks("on_hicache", runs, 2).values())
    off_by_a_bit = copy.deepcopy(runs)
    off_by_a_bit["on_hicache"]["answers"]["probe"]["logprobs"][1] = -2.2500002
    missed_host = copy.deepcopy(runs)
    missed_host["on_hicache"]["answers"]["probe"]["cached_tokens_details"] = {"device": hc.PREFIX, "host": 0}
    idle_rank = copy.deepcopy(runs)
    idle_rank["on_hicache"]["hicache_pages"]["1"]["loaded_back"] = 0
    for bad in (off_by_a_bit, missed_host, idle_rank):
        assert not all(hc.hicache_checks("on_hicache", bad, 2).values())


def test_storage_runs_judge_a_prefix_fetched_from_the_store():
    """scripts/e2e_hicache_logprobs.py's storage runs (HiCache L3 with a Mooncake store): pass
    only when the probe equals device's at every position, its prefix came from the store
    (``cached_tokens_details["storage"]``) and every CP rank stored and fetched pages; their
    server options name the store started for the run."""
    import copy
    import json
    from types import SimpleNamespace

    from sglang_cp_shared_kv_testing.support import load_script

    hc = load_script("e2e_hicache_logprobs")
    assert "on_storage" not in hc.DEFAULT_RUNS and hc.RUNS["on_storage"].storage
    master = SimpleNamespace(extra_config=lambda **kw: {"master_server_address": "127.0.0.1:1", **kw})
    options = hc.storage_args(master)
    assert options[options.index("--hicache-storage-backend") + 1] == "mooncake"
    assert json.loads(options[options.index("--hicache-storage-backend-extra-config") + 1])["master_server_address"]
    lp = [-1.5, -2.25, -0.125]

    def run(details, pages):
        return json.loads(json.dumps({
            "answers": {"prefix": {"logprobs": [-3.0]}, "probe": {"logprobs": list(lp), "cached_tokens": hc.PREFIX,
                                                                 "cached_tokens_details": details}},
            "hicache_pages": pages, "problems": []}))

    pages = {0: {"stored": 300, "fetched": 23}, 1: {"stored": 310, "fetched": 24}}
    stored = {"device": 0, "host": 0, "storage": hc.PREFIX, "storage_backend": "mooncake"}
    runs = {"device": run({"device": hc.PREFIX, "host": 0}, {}), "on_storage": run(stored, pages)}
    assert all(hc.storage_checks("on_storage", runs, 2).values())
    from_host = copy.deepcopy(runs)
    from_host["on_storage"]["answers"]["probe"]["cached_tokens_details"] = {"device": 0, "host": hc.PREFIX,
                                                                            "storage": 0}
    idle_rank = copy.deepcopy(runs)
    idle_rank["on_storage"]["hicache_pages"]["1"]["fetched"] = 0
    off_by_a_bit = copy.deepcopy(runs)
    off_by_a_bit["on_storage"]["answers"]["probe"]["logprobs"][0] = -1.5000001
    for bad in (from_host, idle_rank, off_by_a_bit):
        assert not all(hc.storage_checks("on_storage", bad, 2).values())
