"""Startup validation: every unsupported setting refused with a message naming it and the fix."""

import pytest

from sglang_cp_shared_kv.settings.config import FLAG
from sglang_cp_shared_kv.settings.server_args import CpSharedKVConfigError, configuration_problems
from sglang_cp_shared_kv_testing.support import decode_guard_kwargs, shared_kv_kwargs

pytestmark = pytest.mark.usefixtures("plugin_loaded", "pretend_hopper", "all_cp_ranks_env")

# id: (ServerArgs keywords, attributes set after construction, env changes, setting named, fix named)
REFUSALS = {
    "non_cuda_device": ({"device": "cpu"}, {}, {}, "--device cpu", "CUDA GPUs only"),
    "round_robin_split": ({"nsa_prefill_cp_mode": "round-robin-split"}, {}, {},
                          "--nsa-prefill-cp-mode round-robin-split", "set --nsa-prefill-cp-mode in-seq-split"),
    "no_prefill_cp": ({"enable_nsa_prefill_context_parallel": False}, {}, {},
                      "--enable-nsa-prefill-context-parallel is off", "add --enable-nsa-prefill-context-parallel"),
    "cp_size_one": ({"tp_size": 1}, {}, {}, "attention CP size 1", "use --tp-size 2 or more"),
    "cp_size_three": ({"tp_size": 3}, {}, {}, "--tp-size 3 (attention CP size 3)", "use --tp-size 2, 4 or 8"),
    "page_size": ({}, {"page_size": 32}, {}, "--page-size 32", "set --page-size 64"),
    "not_pd_prefill": ({"disaggregation_mode": "null"}, {}, {}, "--disaggregation-mode null",
                       "--disaggregation-mode prefill"),
    "not_mooncake": ({"disaggregation_transfer_backend": "nixl"}, {}, {},
                     "--disaggregation-transfer-backend nixl", "--disaggregation-transfer-backend mooncake"),
    "all_cp_ranks_env_unset": ({}, {}, {"SGLANG_DISAGGREGATION_ALL_CP_RANKS_TRANSFER": None},
                               "SGLANG_DISAGGREGATION_ALL_CP_RANKS_TRANSFER is not set",
                               "SGLANG_DISAGGREGATION_ALL_CP_RANKS_TRANSFER=1 on this server and on the decode"),
    "staging_buffer": ({}, {}, {"SGLANG_DISAGG_STAGING_BUFFER": "1"}, "SGLANG_DISAGG_STAGING_BUFFER=1",
                       "unset SGLANG_DISAGG_STAGING_BUFFER"),
    "hicache_storage": ({"enable_hierarchical_cache": True, "hicache_storage_backend": "file"}, {}, {},
                        "--hicache-storage-backend file", "use --hicache-storage-backend mooncake"),
    "hicache_storage_tag": ({"enable_hierarchical_cache": True, "hicache_storage_backend": "mooncake",
                             "hicache_mem_layout": "page_first_direct",
                             "hicache_storage_backend_extra_config": '{"extra_backend_tag": "a"}'}, {}, {},
                            "--hicache-storage-backend-extra-config extra_backend_tag='a'", "remove extra_backend_tag"),
    "hisparse": ({"enable_hisparse": True, "disable_radix_cache": True}, {}, {}, "--enable-hisparse", "Remove --enable-hisparse"),
    "speculative_nextn": ({"speculative_algorithm": "NEXTN"}, {}, {}, "--speculative-algorithm",
                          "Remove the speculative-decoding options"),
    "return_routed_experts": ({"enable_return_routed_experts": True}, {}, {},
                              "--enable-return-routed-experts", "Remove the option"),
    "return_indexer_topk": ({"enable_return_indexer_topk": True}, {}, {},
                            "--enable-return-indexer-topk", "Remove the option"),
    "fp8_flashmla_kv_chosen": ({"kv_cache_dtype": "fp8_e4m3", "nsa_prefill_backend": "flashmla_kv"}, {}, {},
                               "--nsa-prefill-backend flashmla_kv with --kv-cache-dtype fp8_e4m3",
                               "set --nsa-prefill-backend flashmla_sparse --nsa-decode-backend flashmla_sparse"),
    "fp8_flashmla_auto_chosen": ({"kv_cache_dtype": "fp8_e4m3", "nsa_prefill_backend": "flashmla_auto"}, {}, {},
                                 "--nsa-prefill-backend flashmla_auto with --kv-cache-dtype fp8_e4m3",
                                 "flashmla_auto picks flashmla_kv for fp8 KV on Hopper"),
    "two_batch_overlap": ({}, {"enable_two_batch_overlap": True}, {}, "--enable-two-batch-overlap",
                          "Remove --enable-two-batch-overlap from the prefill server"),
    "flashinfer_autotune": ({}, {"moe_runner_backend": "flashinfer_trtllm"}, {},
                            "--moe-runner-backend flashinfer_trtllm with FlashInfer autotune",
                            "add --disable-flashinfer-autotune to the prefill server"),
    "ray_scheduler_actors": ({}, {"use_ray": True}, {}, "--use-ray", "launch the prefill server without --use-ray"),
    "prefill_only_no_kv_cache": ({}, {"prefill_only_disable_kv_cache": True}, {},
                                 "--prefill-only-disable-kv-cache", "remove --prefill-only-disable-kv-cache"),
}


def _build(model, kwargs, post, env, monkeypatch, server_kwargs=shared_kv_kwargs):
    """A ``ServerArgs`` of ``server_kwargs(model, **kwargs)`` (a shared-KV prefill by default)
    under ``env``, with ``post`` set after construction."""
    from sglang.srt.server_args import ServerArgs

    for name, value in env.items():
        if value is None:
            monkeypatch.delenv(name, raising=False)
        else:
            monkeypatch.setenv(name, value)
    server_args = ServerArgs(**server_kwargs(model, **kwargs))
    for name, value in post.items():
        setattr(server_args, name, value)
    return server_args


@pytest.mark.parametrize("case", sorted(REFUSALS))
def test_each_unsupported_setting_is_refused(case, tiny_nsa_model, monkeypatch):
    kwargs, post, env, setting, fix = REFUSALS[case]
    server_args = _build(tiny_nsa_model, kwargs, post, env, monkeypatch)
    with pytest.raises(CpSharedKVConfigError) as exc:
        server_args.check_server_args()  # the real main-process path (our AFTER hook)
    message = str(exc.value)
    assert message.startswith(f"{FLAG} cannot start with this configuration:")
    problem = next(line for line in message.splitlines() if setting in line)
    assert fix in problem, message


@pytest.mark.parametrize("backend,a2a,refused", [
    ("flashinfer_trtllm", "none", True), ("flashinfer_mxfp4", "none", True), ("flashinfer_cutedsl", "none", True),
    ("flashinfer_cutedsl", "deepep", False), ("flashinfer_cutlass", "none", False),
    ("flashinfer_trtllm_routed", "none", False), ("auto", "none", False),
])
def test_flashinfer_autotune_refused_only_where_sglang_runs_it(backend, a2a, refused, tiny_nsa_model, monkeypatch):
    # 0.5.12.post1's ModelRunner._should_run_flashinfer_autotune: the same answer as ours on a Hopper
    from types import SimpleNamespace

    from sglang.srt.model_executor.model_runner import ModelRunner

    server_args = _build(tiny_nsa_model, {}, {"moe_runner_backend": backend, "moe_a2a_backend": a2a}, {}, monkeypatch)
    problems = configuration_problems(server_args)
    assert any("FlashInfer autotune" in p for p in problems) == refused, problems
    runner = SimpleNamespace(server_args=server_args, is_draft_worker=False,
                             spec_algorithm=SimpleNamespace(is_speculative=lambda: False))
    monkeypatch.setattr("torch.cuda.get_device_capability", lambda *a: (9, 0))
    assert ModelRunner._should_run_flashinfer_autotune(runner) == refused
    server_args.disable_flashinfer_autotune = True
    assert not any("FlashInfer autotune" in p for p in configuration_problems(server_args))


def test_non_nsa_model_is_refused(tiny_mla_model, monkeypatch):
    server_args = _build(tiny_mla_model, {}, {}, {}, monkeypatch)
    with pytest.raises(CpSharedKVConfigError, match=r"DeepseekV3ForCausalLM.*not NSA"):
        server_args.check_server_args()


@pytest.mark.parametrize("case", sorted(REFUSALS))
def test_one_change_gives_one_problem(case, tiny_nsa_model, monkeypatch):
    # one wrong setting, one line naming it (CP off says so once, not also "CP size 1")
    kwargs, post, env, setting, _ = REFUSALS[case]
    (problem,) = configuration_problems(_build(tiny_nsa_model, kwargs, post, env, monkeypatch))
    assert problem.startswith(setting)


def test_all_problems_are_reported_together(tiny_nsa_model, monkeypatch):
    server_args = _build(tiny_nsa_model, {"disaggregation_mode": "null", "enable_hierarchical_cache": True,
                                          "hicache_storage_backend": "file"}, {},
                         {"SGLANG_DISAGGREGATION_ALL_CP_RANKS_TRANSFER": None}, monkeypatch)
    assert len(configuration_problems(server_args)) == 3


def test_hicache_host_memory_is_served(tiny_nsa_model, monkeypatch):
    """HiCache with host memory only (L2): each rank's host pool holds its own pages."""
    for layout in ("layer_first", "page_first_direct"):
        server_args = _build(tiny_nsa_model, {"enable_hierarchical_cache": True, "hicache_mem_layout": layout}, {}, {},
                             monkeypatch)
        assert configuration_problems(server_args) == []


def test_hicache_storage_in_mooncake_is_served(tiny_nsa_model, monkeypatch):
    """HiCache with a Mooncake store (L3): each rank stores and fetches its own pages."""
    server_args = _build(tiny_nsa_model, {"enable_hierarchical_cache": True, "hicache_storage_backend": "mooncake",
                                          "hicache_mem_layout": "page_first_direct",
                                          "hicache_storage_backend_extra_config": '{"prefetch_threshold": 64}'},
                         {}, {}, monkeypatch)
    assert configuration_problems(server_args) == []


def test_valid_configuration_passes(tiny_nsa_model, monkeypatch):
    server_args = _build(tiny_nsa_model, {}, {}, {}, monkeypatch)
    assert configuration_problems(server_args) == []
    server_args.check_server_args()
    fp8 = _build(tiny_nsa_model, {"kv_cache_dtype": "fp8_e4m3"}, {}, {}, monkeypatch)
    fp8.check_server_args()


# (--tp-size, --dp-size, refused): 3 and 5 measured, 6 and 7 predicted from the code
CP_SIZES = [(2, 1, False), (3, 1, True), (4, 1, False), (5, 1, True), (6, 1, True), (7, 1, True), (8, 1, False),
            (8, 2, False), (8, 4, False), (6, 2, True)]


@pytest.mark.parametrize("tp,dp,refused", CP_SIZES)
def test_only_the_cp_sizes_stock_in_seq_split_serves_start(tp, dp, refused, tiny_nsa_model, monkeypatch):
    """CP3 and CP5 crashed stock SGLang's first prefill on an H200 (flag off too), CP2/4/8 served;
    CP6 and CP7 are refused from the code (DeepEP over all --tp-size ranks: 2, 4 or 8). The
    attention CP size is --tp-size / --dp-size, and --tp-size is DeepEP's width: both must fit."""
    server_args = _build(tiny_nsa_model, {"tp_size": tp, "dp_size": dp}, {}, {}, monkeypatch)
    cp_size = tp // dp
    assert server_args.attn_cp_size == cp_size and server_args.ep_size == tp
    problems = configuration_problems(server_args)
    if not refused:
        assert problems == []
        server_args.check_server_args()
        return
    dp_option = f" --dp-size {dp}" if dp > 1 else ""
    (problem,) = problems
    assert problem.startswith(f"--tp-size {tp}{dp_option} (attention CP size {cp_size}): SGLang 0.5.12.post1's "
                              "in-seq-split NSA prefill CP serves CP sizes 2, 4 and 8 only"), problem
    assert "CUDA error: an illegal memory access" in problem and "DeepEP" in problem, problem
    assert "use --tp-size 2, 4 or 8" in problem, problem
    with pytest.raises(CpSharedKVConfigError, match=rf"--tp-size {tp}{dp_option} \(attention CP size {cp_size}\)"):
        server_args.check_server_args()
    stock = _build(tiny_nsa_model, {"tp_size": tp, "dp_size": dp, "enable_nsa_prefill_cp_shared_kv": False}, {}, {},
                   monkeypatch)
    stock.check_server_args()  # flag off: stock SGLang starts it (and crashes at the first prompt)


def test_flag_off_never_validates(tiny_nsa_model, monkeypatch):
    server_args = _build(tiny_nsa_model, {"enable_nsa_prefill_cp_shared_kv": False,
                                          "disaggregation_mode": "null"}, {},
                         {"SGLANG_DISAGGREGATION_ALL_CP_RANKS_TRANSFER": None}, monkeypatch)
    server_args.check_server_args()  # stock behaviour: nothing of ours is checked


def test_testing_switch_allows_a_prefill_only_server_without_pd(tiny_nsa_model, monkeypatch):
    monkeypatch.setenv("SGLANG_CP_SHARED_KV_TESTING_ALLOW_NON_PD", "1")
    server_args = _build(tiny_nsa_model, {"disaggregation_mode": "null"}, {},
                         {"SGLANG_DISAGGREGATION_ALL_CP_RANKS_TRANSFER": None}, monkeypatch)
    assert configuration_problems(server_args) == []
    monkeypatch.delenv("SGLANG_CP_SHARED_KV_TESTING_ALLOW_NON_PD")
    assert any("--disaggregation-mode null" in p for p in configuration_problems(server_args))


def test_a_broken_install_without_the_kernel_package_is_refused(tiny_nsa_model, monkeypatch):
    """The kernels' torch references are the fallbacks, and they ship in the kernel
    package: without it the flag cannot run, and startup says how to fix the install."""
    import sys

    server_args = _build(tiny_nsa_model, {}, {}, {}, monkeypatch)
    monkeypatch.setitem(sys.modules, "sglang_cp_shared_kv_kernel", None)  # import raises ImportError
    with pytest.raises(CpSharedKVConfigError) as exc:
        server_args.check_server_args()
    problem = next(line for line in str(exc.value).splitlines() if "the plugin installation" in line)
    assert "sglang_cp_shared_kv_kernel does not import" in problem and "reinstall the plugin" in problem


def test_troubleshooting_names_every_refusal():
    """docs/troubleshooting.md has a row for every setting startup can refuse."""
    from pathlib import Path

    text = (Path(__file__).resolve().parents[2] / "docs" / "troubleshooting.md").read_text()
    for case, (_, _, _, setting, _) in REFUSALS.items():
        head = setting.split(" ")[0]  # "--page-size 32" -> "--page-size"
        assert f"`{head}" in text, (case, head)


# ------------------------------------------- fp8 KV with in-seq-split: the NSA backends
def _backends(server_args):
    return server_args.nsa_prefill_backend, server_args.nsa_decode_backend


def test_fp8_in_seq_split_picks_the_backends_that_work(tiny_nsa_model, caplog):
    """SGLang's Hopper default for fp8 KV (flashmla_kv) fails with in-seq-split CP; under
    the flag, backends the user left unset become flashmla_sparse, with one WARNING."""
    from sglang.srt.server_args import ServerArgs, prepare_server_args

    with caplog.at_level("WARNING", logger="sglang_cp_shared_kv.settings.server_args"):
        engine_style = ServerArgs(**shared_kv_kwargs(tiny_nsa_model, kv_cache_dtype="fp8_e4m3"))
    assert _backends(engine_style) == ("flashmla_sparse", "flashmla_sparse")
    assert "instead of SGLang's default flashmla_kv" in caplog.text
    engine_style.check_server_args()
    cli = prepare_server_args([
        "--model-path", tiny_nsa_model, "--skip-tokenizer-init", "--device", "cuda", "--tp-size", "2",
        "--enable-nsa-prefill-context-parallel", "--nsa-prefill-cp-mode", "in-seq-split",
        "--disaggregation-mode", "prefill", "--kv-cache-dtype", "fp8_e4m3", FLAG])
    assert _backends(cli) == ("flashmla_sparse", "flashmla_sparse")


def test_fp8_backend_defaults_stay_stock_without_the_flag_or_when_chosen(tiny_nsa_model):
    from sglang.srt.server_args import ServerArgs

    off = ServerArgs(**shared_kv_kwargs(tiny_nsa_model, kv_cache_dtype="fp8_e4m3",
                                        enable_nsa_prefill_cp_shared_kv=False))
    assert _backends(off) == ("flashmla_kv", "flashmla_kv")  # stock, crash and all
    bf16 = ServerArgs(**shared_kv_kwargs(tiny_nsa_model, kv_cache_dtype="bfloat16"))
    assert _backends(bf16) == ("flashmla_sparse", "fa3")  # SGLang's Hopper bf16 defaults
    chosen = ServerArgs(**shared_kv_kwargs(tiny_nsa_model, kv_cache_dtype="fp8_e4m3", nsa_decode_backend="fa3"))
    assert _backends(chosen) == ("flashmla_sparse", "fa3")  # only the unset side changes


# ------------------------------------------------ the flag on a decode server
# id: (ServerArgs keywords, attributes set after construction, env changes, setting named, fix named)
DECODE_REFUSALS = {
    "not_mooncake": ({"disaggregation_transfer_backend": "nixl"}, {}, {},
                     "--disaggregation-transfer-backend nixl", "--disaggregation-transfer-backend mooncake"),
    "all_cp_ranks_env_unset": ({}, {}, {"SGLANG_DISAGGREGATION_ALL_CP_RANKS_TRANSFER": None},
                               "SGLANG_DISAGGREGATION_ALL_CP_RANKS_TRANSFER is not set",
                               "SGLANG_DISAGGREGATION_ALL_CP_RANKS_TRANSFER=1 on this server and on the prefill"),
    "hisparse": ({"nsa_decode_backend": "flashmla_sparse"}, {"enable_hisparse": True}, {}, "--enable-hisparse",
                 "Remove --enable-hisparse from the decode"),
    "ray_scheduler_actors": ({}, {"use_ray": True}, {}, "--use-ray", "launch the decode server without --use-ray"),
    "failed_room_hold_not_positive": ({}, {}, {"SGLANG_CP_SHARED_KV_FAILED_ROOM_HOLD_S": "0"},
                                      "SGLANG_CP_SHARED_KV_FAILED_ROOM_HOLD_S", "unset it for the default 30"),
}


def _decode(model, kwargs, post, env, monkeypatch):
    return _build(model, kwargs, post, env, monkeypatch, server_kwargs=decode_guard_kwargs)


@pytest.mark.parametrize("case", sorted(DECODE_REFUSALS))
def test_the_flag_on_a_decode_server_refuses_each_unsupported_setting(case, tiny_nsa_model, monkeypatch):
    from sglang_cp_shared_kv.settings.server_args import decode_configuration_problems

    kwargs, post, env, setting, fix = DECODE_REFUSALS[case]
    server_args = _decode(tiny_nsa_model, kwargs, post, env, monkeypatch)
    (problem,) = decode_configuration_problems(server_args)  # one change, one problem naming it
    assert problem.startswith(setting) and fix in problem, problem
    with pytest.raises(CpSharedKVConfigError, match=f"{FLAG} cannot start with this configuration"):
        server_args.check_server_args()


def test_the_flag_on_a_decode_server_refuses_a_model_that_is_not_nsa(tiny_mla_model, monkeypatch):
    server_args = _decode(tiny_mla_model, {}, {}, {}, monkeypatch)
    with pytest.raises(CpSharedKVConfigError, match=r"DeepseekV3ForCausalLM.*not NSA"):
        server_args.check_server_args()


def test_the_flag_on_a_decode_server_is_accepted_without_the_prefill_settings(tiny_nsa_model, monkeypatch, caplog):
    """A decode server has no CP group, no prefill CP mode and one GPU: none of the prefill's
    checks apply to it, and it says what the flag does there."""
    from sglang_cp_shared_kv.settings.config import guards_decode, shares_kv

    server_args = _decode(tiny_nsa_model, {}, {}, {}, monkeypatch)
    assert guards_decode(server_args) and not shares_kv(server_args)
    with caplog.at_level("INFO", logger="sglang_cp_shared_kv.settings.server_args"):
        server_args.check_server_args()
    assert "decode server of a shared-KV deployment" in caplog.text
    # the same server as a prefill would be refused for every prefill requirement it lacks
    assert len(configuration_problems(server_args)) >= 3


def test_troubleshooting_names_every_decode_refusal():
    """docs/troubleshooting.md's decode-server section has a row for each decode refusal."""
    from pathlib import Path

    text = (Path(__file__).resolve().parents[2] / "docs" / "troubleshooting.md").read_text()
    section = text.split("## At startup on the decode server", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in section.splitlines() if line.startswith("| `")]
    for case, (_, _, _, setting, _) in DECODE_REFUSALS.items():
        assert any(row.startswith(f"| `{setting.split(' ')[0]}") for row in rows), case
    assert any("not NSA" in row for row in rows)
