"""scripts/e2e_pd_gpu.py on sglang 0.5.23 (interleave CP): the PD pair's commands and what the
script judges there.

* both servers' exact commands of the flag-off and flag-on runs (prefill CP2 and CP4, decode TP1;
  bf16 and fp8 KV; --share-gpu, as the GPU run takes them), built by the script's own
  ``server_commands`` with the environment of its ``run_env``, go through 0.5.23's real parser
  (every option spelled in full, none unknown), ``ServerArgs``, its resolution pipeline and
  ``check_server_args`` with the plugin loaded the way SGLang loads it; the flag on either server
  reports no configuration problem (the prefill's checks, and decode's, as its scheduler runs
  them); the flag-off commands are the flag-on ones minus the flag. Every other run's pair (the
  small decode, the abort, every CP rank sending with the flag off) passes the same. A CPU machine
  cannot run all of 0.5.23's resolution: its model step asks the GPU for its compute capability
  (answered "Hopper" here, as test_settings_v0523.py does), and the device is named (``--device
  cuda``; the GPU machine detects it);
* the parts of the script that differ on 0.5.23 and need no SGLang: the run list, the over_logical
  check (the prefill retires a refused prompt at intake, and the flag's ranks tell decode: judged
  as on 0.5.12.post1, "fails on decode at once, naming the cause"), the report's ``cp_strategy``,
  the runs' own tag.
"""

import argparse
import json
import sys
import types
from pathlib import Path

import pytest

from sglang_cp_shared_kv.releases import installed, v0523
from sglang_cp_shared_kv_testing.support import load_script

INTERLEAVE = "interleave"
ON_V0523 = installed.INSTALLED is v0523.RELEASE
needs_v0523 = pytest.mark.skipif(not ON_V0523, reason=f"needs sglang {v0523.RELEASE.version}")
DTYPES = ("bfloat16", "fp8_e4m3")


def each_pair(test):
    """``test`` for prefill CP2 and CP4, flag off and on, bf16 and fp8 (0.5.23 only)."""
    for mark in (pytest.mark.parametrize("dtype", DTYPES), pytest.mark.parametrize("cp_size", [2, 4]),
                 pytest.mark.parametrize("run", ["off", "on"]), needs_v0523):
        test = mark(test)
    return test
EVERY_RANK = "SGLANG_DISAGGREGATION_ALL_CP_RANKS_TRANSFER"


@pytest.fixture(scope="module")
def pd():
    return load_script("e2e_pd_gpu")


def _args(cp_size, dtype, model="MODEL", share_gpu=True):
    return types.SimpleNamespace(model=Path(str(model)), kv_cache_dtype=dtype, cp_size=cp_size, stock_topk=False,
                                 share_gpu=share_gpu, port=22000)


def _pair(pd, run, cp_size, dtype, model="MODEL"):
    """(prefill cmd, decode cmd, env) of ``run`` as the script builds them on 0.5.23."""
    args = _args(cp_size, dtype, model)
    ports = pd.run_ports(args, run)
    prefill, decode = pd.server_commands(args, pd.RUNS[run], ports, cp_strategy=INTERLEAVE)
    return prefill, decode, pd.run_env(args, pd.RUNS[run], cp_strategy=INTERLEAVE)


def _added_env(env):
    import os

    return {k: v for k, v in env.items() if os.environ.get(k) != v and k != "PYTHONPATH"}


# ------------------------------------------------------------------ the commands on 0.5.23's parser
@pytest.fixture
def hopper(monkeypatch, plugin_loaded):
    import torch

    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a, **k: (9, 0))
    monkeypatch.delenv(EVERY_RANK, raising=False)  # the run's environment says it


def _resolve(cmd, env, monkeypatch):
    """``cmd`` through 0.5.23's parser, record, resolution and stock checks (with the plugin's
    hooks) in ``env``: the resolved ``ServerArgs``."""
    import argparse

    from sglang.srt.server_args import ServerArgs, prepare_server_args

    assert cmd[1:3] == ["-m", "sglang.launch_server"]
    for name, value in _added_env(env).items():  # the server's environment, as far as SGLang reads it here
        monkeypatch.setenv(name, value)
    if EVERY_RANK not in env:
        monkeypatch.delenv(EVERY_RANK, raising=False)
    argv = cmd[3:]
    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    known = {s for action in parser._actions for s in action.option_strings}
    assert [a for a in argv if a.startswith("--") and a not in known] == []  # no abbreviation, none unknown
    server_args = prepare_server_args(argv + ["--device", "cuda"])
    server_args.resolve_once()
    server_args.check_server_args()  # stock checks, and the plugin's when the flag is on: no exception
    return server_args


def _graphs_off_and_no_autotune(cfg):
    from sglang_cp_shared_kv import sglang_api as sg

    graphs = sg.cuda_graph_config
    assert cfg.cuda_graph_config.prefill.backend == graphs.Backend.DISABLED
    assert cfg.cuda_graph_config.decode.backend == graphs.Backend.DISABLED
    assert cfg.disable_flashinfer_autotune


@each_pair
def test_the_prefill_command_parses_resolves_and_passes_the_checks(pd, hopper, tmp_path, monkeypatch, run, cp_size,
                                                                   dtype):
    from sglang_cp_shared_kv import sglang_api as sg
    from sglang_cp_shared_kv.settings.config import FLAG_DEST
    from sglang_cp_shared_kv.settings.server_args_v0523 import configuration_problems
    from sglang_cp_shared_kv_testing import shared_gpu
    from sglang_cp_shared_kv_testing.server import write_model

    model = write_model(tmp_path / "model", pd.MODEL)
    prefill, _, env = _pair(pd, run, cp_size, dtype, model)
    server_args = _resolve(prefill, env, monkeypatch)
    flag_on = pd.RUNS[run].flag_on
    assert getattr(server_args, FLAG_DEST) is flag_on
    if flag_on:
        assert configuration_problems(server_args) == []
    cfg = sg.resolved_view(server_args)
    assert (cfg.enable_prefill_cp, cfg.cp_strategy, cfg.attn_cp_size, cfg.tp_size) == (True, INTERLEAVE, cp_size,
                                                                                       cp_size)
    assert (cfg.dsa_prefill_backend, cfg.dsa_decode_backend) == ("flashmla_sparse", "flashmla_sparse")
    _graphs_off_and_no_autotune(cfg)
    graphs = sg.cuda_graph_config
    assert (graphs.Phase.PREFILL, "backend") in server_args._cuda_graph_config_locked  # chosen: no WARNING
    assert (cfg.disaggregation_mode, cfg.disaggregation_transfer_backend) == ("prefill", "mooncake")
    assert cfg.disaggregation_bootstrap_port == pd.run_ports(_args(cp_size, dtype), run)["bootstrap"]
    assert (cfg.kv_cache_dtype, cfg.page_size, cfg.chunked_prefill_size) == (dtype, 64, pd.CHUNK)
    assert cfg.max_total_tokens == pd.POOL and cfg.mem_fraction_static == shared_gpu.MEM_FRACTION_STATIC
    assert cfg.disable_custom_all_reduce and cfg.enable_metrics and cfg.sleep_on_idle
    # the PD warm-up stays (a prefill-only request through SGLang's fake sender), as in 0.5.12.post1's pair;
    # the radix cache too (radix_hit, radix_again and chunked_again read it)
    assert not cfg.skip_server_warmup and not cfg.disable_radix_cache
    assert env[pd.pd_servers.DSA_DENSE_THRESHOLD_ENV] == "0" and env["CPSKV_E2E_STABLE_TOPK"] == "1"
    assert (env.get(EVERY_RANK) == "1") is flag_on  # stock's default transfer for the flag-off runs


@each_pair
def test_the_decode_command_parses_resolves_and_passes_the_checks(pd, hopper, tmp_path, monkeypatch, run, cp_size,
                                                                  dtype):
    """Decode TP1: DSA backends a bf16 or fp8 decode runs on the lent GPUs (no FlashAttention 3
    there; fp8 reads through flashmla_kv), the flag's decode checks as its scheduler runs them."""
    from sglang_cp_shared_kv import sglang_api as sg
    from sglang_cp_shared_kv.settings.config import FLAG_DEST, guards_decode
    from sglang_cp_shared_kv.settings.server_args_v0523 import configuration_problems, validate_in_scheduler
    from sglang_cp_shared_kv_testing import shared_gpu
    from sglang_cp_shared_kv_testing.server import write_model

    model = write_model(tmp_path / "model", pd.MODEL)
    _, decode, env = _pair(pd, run, cp_size, dtype, model)
    server_args = _resolve(decode, env, monkeypatch)
    flag_on = pd.RUNS[run].decode_flag
    assert getattr(server_args, FLAG_DEST) is flag_on and guards_decode(server_args) is flag_on
    if flag_on:
        assert configuration_problems(server_args) == []
        validate_in_scheduler(server_args)  # decode/server_v0523.check_decode_server's check
    cfg = sg.resolved_view(server_args)
    assert (cfg.tp_size, cfg.attn_cp_size or 1, cfg.enable_prefill_cp) == (1, 1, False)
    backend = {"bfloat16": "flashmla_sparse", "fp8_e4m3": "flashmla_kv"}[dtype]
    assert (cfg.dsa_prefill_backend, cfg.dsa_decode_backend) == (backend, backend)
    _graphs_off_and_no_autotune(cfg)
    assert (cfg.disaggregation_mode, cfg.disaggregation_transfer_backend) == ("decode", "mooncake")
    assert (cfg.kv_cache_dtype, cfg.page_size, cfg.base_gpu_id) == (dtype, 64, 0)
    assert cfg.max_total_tokens == pd.BIG_POOL and cfg.mem_fraction_static == shared_gpu.MEM_FRACTION_STATIC
    assert cfg.sleep_on_idle and not cfg.skip_server_warmup
    assert cfg.num_reserved_decode_tokens == pd.DEFAULT_RESERVED_DECODE_TOKENS  # the small-decode probe's bound


@needs_v0523
@pytest.mark.parametrize("run", ["off_big", "on_corrupt", "off_small_decode", "guarded_small_decode",
                                 "on_small_decode", "on_abort", "off_all_ranks"])
def test_every_other_runs_pair_passes_the_checks(pd, hopper, tmp_path, monkeypatch, run):
    """The other runs' pairs (CP2, bf16): their pools, the decode guard alone on decode
    (guarded_small_decode: a stock prefill with every CP rank sending), the switches' variables."""
    from sglang_cp_shared_kv import sglang_api as sg
    from sglang_cp_shared_kv.settings.config import is_enabled
    from sglang_cp_shared_kv.settings.server_args_v0523 import configuration_problems
    from sglang_cp_shared_kv_testing.server import write_model

    model = write_model(tmp_path / "model", pd.MODEL)
    spec = pd.RUNS[run]
    prefill, decode, env = _pair(pd, run, 2, "bfloat16", model)
    p, d = _resolve(prefill, env, monkeypatch), _resolve(decode, env, monkeypatch)
    assert (is_enabled(p), is_enabled(d)) == (spec.flag_on, spec.decode_flag)
    for side in (p, d):
        if is_enabled(side):
            assert configuration_problems(side) == []
    assert sg.resolved_view(p).max_total_tokens == spec.prefill_pool
    assert sg.resolved_view(d).max_total_tokens == (spec.decode_pool or pd.BIG_POOL)
    assert (env.get(EVERY_RANK) == "1") is spec.every_cp_rank_sends
    assert ("CPSKV_E2E_CORRUPT_SEND_RANK" in env) is (run == "on_corrupt")
    assert ("CPSKV_E2E_STALL_WRITE_RANK" in env) is (run == "on_abort")


@needs_v0523
@pytest.mark.parametrize("side", ["prefill", "decode"])
def test_the_flag_refuses_either_server_without_every_cp_rank_sending(pd, hopper, tmp_path, monkeypatch, side):
    """SGLANG_DISAGGREGATION_ALL_CP_RANKS_TRANSFER still decides on 0.5.23 who sends (CP ranks but
    0 are dummy senders without it, decode pulls from CP rank 0 alone): the flag-on runs set it
    on both servers, and without it either server is refused, naming it."""
    from sglang.srt.server_args import prepare_server_args

    from sglang_cp_shared_kv.settings.server_args_v0523 import configuration_problems
    from sglang_cp_shared_kv_testing.server import write_model

    prefill, decode, env = _pair(pd, "on", 2, "bfloat16", write_model(tmp_path / "model", pd.MODEL))
    assert env[EVERY_RANK] == "1"
    for name, value in _added_env(env).items():
        monkeypatch.setenv(name, value)
    monkeypatch.delenv(EVERY_RANK, raising=False)
    cmd = prefill if side == "prefill" else decode
    server_args = prepare_server_args(cmd[3:] + ["--device", "cuda"])
    server_args.resolve_once()
    assert [p.split(" ")[0] for p in configuration_problems(server_args)] == [EVERY_RANK]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("cp_size", [1, 2, 4, 8])
def test_flag_off_commands_are_the_flag_on_ones_minus_the_flag(pd, dtype, cp_size):
    from sglang_cp_shared_kv.settings.config import FLAG_ALIAS

    args = _args(cp_size, dtype)
    ports = pd.run_ports(args, "on")
    off, on = pd.Run(False, pd.POOL), pd.Run(cp_size > 1, pd.POOL, decode_flag=True)  # one GPU: decode's flag only
    (off_p, off_d), (on_p, on_d) = (pd.server_commands(args, run, ports, cp_strategy=INTERLEAVE) for run in (off, on))
    off_env, on_env = (pd.run_env(args, run, cp_strategy=INTERLEAVE) for run in (off, on))
    assert on_p.count(FLAG_ALIAS) == int(cp_size > 1) and [a for a in on_p if a != FLAG_ALIAS] == off_p
    assert on_d.count(FLAG_ALIAS) == 1 and [a for a in on_d if a != FLAG_ALIAS] == off_d
    assert _added_env(on_env) == {**_added_env(off_env), EVERY_RANK: "1"}
    # none of in-seq-split's option names is left; interleave only where there is CP
    for cmd in (on_p, on_d):
        assert not [a for a in cmd if "nsa" in a or a in ("--tp", "--disable-cuda-graph",
                                                           "--disable-piecewise-cuda-graph")]
        assert "--disable-flashinfer-autotune" in cmd and "--disable-decode-cuda-graph" in cmd
    assert ("--enable-prefill-cp" in on_p) is (cp_size > 1) and "--enable-prefill-cp" not in on_d
    assert off_env[pd.pd_servers.DSA_DENSE_THRESHOLD_ENV] == "0"
    assert "SGLANG_NSA_PREFILL_DENSE_ATTN_KV_LEN_THRESHOLD" not in _added_env(off_env)


def test_the_dsa_names_are_the_logprobs_scripts():
    """The two scripts name 0.5.23's variable and flag spelling alike."""
    e2e = load_script("e2e_cp_logprobs")
    from sglang_cp_shared_kv_testing import pd_servers

    assert pd_servers.DSA_DENSE_THRESHOLD_ENV == e2e.DSA_DENSE_THRESHOLD_ENV
    assert pd_servers.INTERLEAVE == e2e.INTERLEAVE and pd_servers.CP_STRATEGY == e2e.CP_STRATEGY


# ------------------------------------------------------------------ what the script judges on 0.5.23
def test_every_run_applies_under_both_cp_strategies(pd):
    assert pd.runs_for(2) == list(pd.RUNS) and pd.runs_for(1) == pd.RUNS_WITHOUT_CP


def _records(pd):
    def answer(value):
        return {"decode": {"status": "ok", "ids": [1, 2], "logprobs": [value, -1.0], "elapsed_s": 1.0},
                "prefill": {"status": "ok", "cached_tokens": pd.RADIX_PREFIX}}

    def unanswered(elapsed):  # stock: the prefill refused it at intake, decode failed it at its waiting timeout
        return {"decode": {"status": "http_error", "error": "Request 7 timed out after 60.0s", "elapsed_s": elapsed},
                "prefill": {"status": "http_error", "error": "exceeds the maximum number of tokens"}}

    def refused(elapsed):  # the flag: every prefill rank told decode of the refusal at once
        error = ("Failed due to an unknown reason from another rank; cause: prefill CP rank 0 of 2: room 7 ends "
                 "unsent: the prefill refused the request at intake: Input length (20480) exceeds the maximum")
        return {"decode": {"status": "http_error", "error": error, "elapsed_s": elapsed},
                "prefill": {"status": "http_error", "error": "Input length (20480) exceeds the maximum"}}

    base = {name: answer(-0.5) for name in pd.prompts()}
    runs = {name: {"prompts": dict(base)} for name in ("off", "off_b", "off_big")}
    runs["on"] = {"prompts": {**base, "over_logical": refused(0.11)},
                  "pages_sent": {"0": {"kv": 60, "state": 60}, "1": {"kv": 58, "state": 58}}}
    runs["on_corrupt"] = {"prompts": {**{n: answer(-0.7) for n in base}, "over_logical": refused(0.12)}}
    for name in ("off", "off_b"):
        runs[name]["prompts"]["over_pool"] = unanswered(60.1)
        runs[name]["prompts"]["over_logical"] = unanswered(60.3)
    return runs


def test_over_logical_at_cp2_is_judged_as_on_0512(pd):
    """Interleave, N = 2: the flag's prefill refuses over_logical at intake and every rank tells
    decode, so 0.5.12.post1's check applies: decode fails it at once, naming the prefill's cause.
    A decode that waited for its timeout (stock 0.5.23), answered it, or failed it without the
    cause fails the check."""
    check = "on fails over_logical on decode at once"
    checks = pd.verdict(_records(pd), 2)
    assert checks[check] and not any("within its waiting timeout" in name for name in checks)
    assert all(checks.values()), {k: v for k, v in checks.items() if not v}
    for change in (
        lambda e: e.update(decode={"status": "ok", "ids": [1], "logprobs": [-1.0], "elapsed_s": 0.5}),  # answered
        lambda e: e["decode"].update(error="Request 7 timed out after 60.0s", elapsed_s=60.4),  # stock 0.5.23
        lambda e: e["decode"].update(error="Failed due to an unknown reason from another rank"),  # no cause
    ):
        runs = _records(pd)
        change(runs["on"]["prompts"]["over_logical"])
        assert not pd.verdict(runs, 2)[check]
    # from N = 3 the ranks hold it (on = off_big)
    assert check not in pd.verdict(_records(pd), 4)


def test_the_interleave_report_names_its_strategy_what_does_not_apply_and_keeps_its_own_runs(pd, tmp_path,
                                                                                             monkeypatch):
    records = _records(pd)
    started = []

    def run_servers(name, args, work, room_base):
        started.append(name)
        return {**records.get(name, records["off"]), "startup": {}, "stable_topk_problems": [],
                "share_gpu_problems": []}

    monkeypatch.setattr(pd, "CP_STRATEGY", INTERLEAVE)  # this module object's global: as on 0.5.23
    monkeypatch.setattr(pd, "run_servers", run_servers)
    work = tmp_path / "work"
    work.mkdir()
    (work / "off_b.cp2.bfloat16.share-gpu.json").write_text("{}")  # 0.5.12.post1's run in the same folder
    monkeypatch.setattr(sys, "argv", ["e2e_pd_gpu.py", "--runs", "off,off_big,on,on_corrupt", "--share-gpu",
                                      "--workdir", str(work), "--logdir", str(tmp_path / "logs"),
                                      "--out", str(tmp_path / "pd.json")])
    assert pd.main() == 1  # not every run is there
    report = json.loads((tmp_path / "pd.json").read_text())
    assert started == ["off", "off_big", "on", "on_corrupt"]
    assert report["runs"] == ["off", "off_big", "on", "on_corrupt"]  # the other release's off_b left alone
    assert sorted(p.name for p in work.glob("*.interleave.json")) == [
        f"{name}.cp2.bfloat16.share-gpu.interleave.json" for name in ("off", "off_big", "on", "on_corrupt")]
    assert report["cp_strategy"] == INTERLEAVE and "not_applicable" not in report
    assert report["checks"]["on fails over_logical on decode at once"]
    assert not report["pass"]


def test_the_in_seq_split_report_keeps_its_keys(pd, tmp_path, monkeypatch):
    monkeypatch.setattr(pd, "CP_STRATEGY", "in-seq-split")
    monkeypatch.setattr(pd, "run_servers", lambda name, args, work, room_base: {
        **_records(pd)["off"], "startup": {}, "stable_topk_problems": []})
    monkeypatch.setattr(sys, "argv", ["e2e_pd_gpu.py", "--runs", "off", "--workdir", str(tmp_path / "w"),
                                      "--out", str(tmp_path / "pd.json")])
    pd.main()
    report = json.loads((tmp_path / "pd.json").read_text())
    assert "cp_strategy" not in report
    assert (tmp_path / "w" / "off.cp2.bfloat16.json").exists()


def test_the_0512_commands_are_not_touched_by_the_interleave_ones(pd):
    """The installed-release switch: in-seq-split's pair is what it was (test_e2e_pd_script.py pins
    it); the interleave pair differs in every option the releases renamed."""
    args = argparse.Namespace(model=Path("/m"), kv_cache_dtype="bfloat16", cp_size=2, stock_topk=False,
                              share_gpu=False, port=22000)
    ports = pd.run_ports(args, "on")
    old = pd.server_commands(args, pd.RUNS["on"], ports, cp_strategy="in-seq-split")
    new = pd.server_commands(args, pd.RUNS["on"], ports, cp_strategy=INTERLEAVE)
    assert "--enable-nsa-prefill-context-parallel" in old[0] and "--enable-prefill-cp" in new[0]
    assert "--tp" in old[1] and "--tp-size" in new[1]


# ------------------------------------------------------------------ scripts/soak_pd.py on 0.5.23
@needs_v0523
@pytest.mark.parametrize("phase,dtype,cp_size", [("on", "bfloat16", 2), ("off", "fp8_e4m3", 2),
                                                 ("fault", "bfloat16", 4), ("on", "fp8_e4m3", 4)])
def test_the_soaks_pair_passes_0523s_checks(hopper, tmp_path, monkeypatch, phase, dtype, cp_size):
    """The soak's phases build 0.5.23's interleave pair (``pd_servers``, as the e2e script), both
    servers with ``--enable-metrics`` (its idle pool audit is read there), and pass 0.5.23's
    parser, resolution, stock checks and the flag's."""
    from sglang_cp_shared_kv import sglang_api as sg
    from sglang_cp_shared_kv.settings.config import FLAG_DEST
    from sglang_cp_shared_kv.settings.server_args_v0523 import configuration_problems
    from sglang_cp_shared_kv_testing.server import write_model

    soak = load_script("soak_pd")
    args = argparse.Namespace(model=write_model(tmp_path / "model", soak.MODEL), kv_cache_dtype=dtype,
                              cp_size=cp_size, stock_topk=False, share_gpu=True, port=23000, pool=soak.POOL,
                              decode_max_running_requests=None, hicache_ratio=None)
    prefill, decode = soak.server_commands(args, phase, soak.phase_ports(args, phase))
    env = soak.phase_env(args, phase)
    assert env["SGLANG_ENABLE_STRICT_MEM_CHECK_DURING_IDLE"] == "0"
    p, d = _resolve(prefill, env, monkeypatch), _resolve(decode, env, monkeypatch)
    flag_on = soak.PHASES[phase].flag_on
    assert getattr(p, FLAG_DEST) is flag_on and getattr(d, FLAG_DEST) is flag_on
    for side in (p, d) if flag_on else ():
        assert configuration_problems(side) == []
    cfg, dcfg = sg.resolved_view(p), sg.resolved_view(d)
    assert (cfg.enable_prefill_cp, cfg.cp_strategy, cfg.attn_cp_size) == (True, INTERLEAVE, cp_size)
    assert cfg.enable_metrics and dcfg.enable_metrics
    assert (cfg.max_total_tokens, dcfg.max_total_tokens) == (soak.POOL, soak.decode_pool_for(cp_size, soak.POOL))


@needs_v0523
def test_the_soak_on_0523_keeps_its_phases_apart_and_refuses_what_0523_does_not_serve(monkeypatch, tmp_path, capsys):
    """Its records carry the interleave tag (a work folder shared with 0.5.12.post1's phases never
    mixes them); 0.5.23 serves every CP size (CP3 taken), and no CP is refused naming the sizes."""
    soak = load_script("soak_pd")
    seen = {}
    monkeypatch.setattr(soak, "accumulate_runs", lambda work, tag, *a, **k: (seen.setdefault("tag", tag), ({}, {}))[1])
    monkeypatch.setattr(sys, "argv", ["soak_pd.py", "--cp-size", "2", "--share-gpu", "--phases", "",
                                      "--workdir", str(tmp_path / "w"), "--out", str(tmp_path / "soak.json")])
    assert soak.main() == 1  # no phase: nothing judged
    assert seen["tag"].startswith("cp2.") and seen["tag"].endswith(".share-gpu.interleave")
    assert v0523.RELEASE.served_cp_sizes is None
    monkeypatch.setattr(sys, "argv", ["soak_pd.py", "--cp-size", "3", "--phases", "", "--workdir", str(tmp_path / "w"),
                                      "--out", str(tmp_path / "soak.json")])
    assert soak.main() == 1 and seen["tag"].startswith("cp2.")  # (the first tag kept: setdefault)
    monkeypatch.setattr(sys, "argv", ["soak_pd.py", "--cp-size", "1"])
    with pytest.raises(SystemExit) as exit_:
        soak.main()
    assert exit_.value.code == 2 and "choose one of (2, 3, 4, 5, 6, 7, 8)" in capsys.readouterr().err
