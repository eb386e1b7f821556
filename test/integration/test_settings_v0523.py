"""The flag on SGLang 0.5.23: the settings layer of the port, against 0.5.23's real
``ServerArgs`` (a msgspec record), its CLI parser and its resolution pipeline
(``server_args_dsa``). Runs only where sglang 0.5.23 is installed
(``scripts/bootstrap.sh test-0.5.23``; ``.ci/run`` runs it).

A CPU machine cannot run 0.5.23's whole resolution: its model step asks the GPU for its
compute capability. The fixture answers "Hopper" there and nowhere else.
"""

import pickle

import pytest

from sglang_cp_shared_kv import sglang_api as sg
from sglang_cp_shared_kv.releases import installed, v0512, v0523

if installed.INSTALLED is not v0523.RELEASE:
    pytest.skip(f"needs sglang {v0523.RELEASE.version}", allow_module_level=True)

from sglang_cp_shared_kv import plugin  # noqa: E402

from sglang_cp_shared_kv.settings import server_args_v0523 as server_args_dsa
from sglang_cp_shared_kv.settings.config import FLAG, FLAG_ALIAS, FLAG_DEST  # noqa: E402
from sglang_cp_shared_kv.hook_check import missing_hooks  # noqa: E402
from sglang_cp_shared_kv.settings.server_args import CpSharedKVConfigError  # noqa: E402
from sglang_cp_shared_kv_testing.support import TINY_DSV32  # noqa: E402

GLM5_ARCH = "GlmMoeDsaForCausalLM"


@pytest.fixture
def hopper(monkeypatch, plugin_loaded):
    import torch

    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a, **k: (9, 0))
    monkeypatch.setenv("SGLANG_DISAGGREGATION_ALL_CP_RANKS_TRANSFER", "1")


def _args(model, *extra, flag=FLAG):
    from sglang.srt.server_args import prepare_server_args

    base = ["--model-path", model, "--load-format", "dummy", "--skip-tokenizer-init", "--device", "cuda",
            "--tp", "2", "--enable-prefill-cp", "--cp-strategy", "interleave", "--page-size", "64",
            "--disaggregation-mode", "prefill", "--disaggregation-transfer-backend", "mooncake"]
    return prepare_server_args(base + ([flag] if flag else []) + list(extra))


def _problems(server_args):
    server_args.resolve_once()
    with pytest.raises(CpSharedKVConfigError) as exc:
        server_args.check_server_args()
    return str(exc.value)


def test_the_0523_table_is_registered_and_every_hook_is_in_place(plugin_loaded):
    table = plugin.hooks_for(v0523.RELEASE)
    # settings layer, pool and capacity, metrics, decode server (10); the idle pool audit (2: around
    # Scheduler.on_idle, after SchedulerInvariantChecker._check_all_pools); the forward path (4) and its
    # agreement point after ModelRunner.forward (1); HiCache's host tier (4) and its storage tier (2: the
    # backend, the external layout); the PD transfer (14: with the refusal at intake, PrefillBootstrapQueue.add)
    assert set(table) <= set(plugin_loaded) and len(table) == 10 + 2 + 4 + 1 + 4 + 2 + 14
    assert missing_hooks(table) == []
    forward = {spec.target.rsplit(".", 2)[-2] + "." + spec.target.rsplit(".", 1)[-1] for spec in table
               if ".dsa" in spec.target}
    assert forward == {"DeepseekSparseAttnBackend.init_forward_metadata", "DeepseekSparseAttnBackend.forward_extend",
                       "Indexer._store_index_k_cache", "Indexer._fused_k_prepare_and_store"}


@pytest.mark.parametrize("spelling", [FLAG, FLAG_ALIAS])
def test_both_spellings_reach_the_scheduler_processes(hopper, tiny_nsa_model, spelling):
    server_args = _args(tiny_nsa_model, flag=spelling)
    assert getattr(server_args, FLAG_DEST) is True
    assert getattr(pickle.loads(pickle.dumps(server_args)), FLAG_DEST) is True  # how SGLang spawns them
    assert getattr(_args(tiny_nsa_model, flag=None), FLAG_DEST) is False


def test_a_valid_configuration_starts_saying_it_has_not_run_on_a_gpu(hopper, tiny_nsa_model, capfd):
    server_args = _args(tiny_nsa_model)
    server_args.resolve_once()
    server_args.check_server_args()  # no problem: the main process goes on to start the servers
    assert server_args_dsa.NOT_GPU_VERIFIED in capfd.readouterr().err
    assert f"sglang=={v0512.RELEASE.version}" in server_args_dsa.NOT_GPU_VERIFIED


def test_flag_off_resolves_and_checks_as_stock(hopper, tiny_nsa_model):
    server_args = _args(tiny_nsa_model, flag=None)
    server_args.resolve_once()
    server_args.check_server_args()


def test_sglangs_own_sharding_beside_the_flag_is_refused_naming_both(hopper, tiny_nsa_model):
    with pytest.raises(CpSharedKVConfigError, match="--enable-kv-cache-sharding: SGLang's own KV sharding"):
        _args(tiny_nsa_model, "--enable-kv-cache-sharding").resolve_once()
    with pytest.raises(ValueError) as stock:  # the flag off: SGLang's own verdict, untouched
        _args(tiny_nsa_model, "--enable-kv-cache-sharding", flag=None).resolve_once()
    assert not isinstance(stock.value, CpSharedKVConfigError)


@pytest.mark.parametrize("extra, named", [
    (["--dsa-prefill-backend", "trtllm"], "--dsa-prefill-backend trtllm"),
    # with fp8 KV it makes the prefill fuse RoPE for trtllm and skip interleave's chunk gather
    (["--dsa-decode-backend", "trtllm"], "--dsa-decode-backend trtllm"),
    (["--enable-dsa-cache-layer-split"], "--enable-dsa-cache-layer-split"),
    (["--disaggregation-transfer-backend", "nixl"], "--disaggregation-transfer-backend nixl"),
])
def test_each_unsupported_setting_is_named_with_its_fix(hopper, tiny_nsa_model, extra, named):
    message = _problems(_args(tiny_nsa_model, *extra))
    assert named in message and message.count("\n  - ") == 1


def test_the_kv_checksum_is_refused_on_the_prefill_saying_why_and_the_fix(hopper, tiny_nsa_model):
    """SGLang's KvChecksumComputer digests logical page ids against this rank's physical shard
    buffers (out-of-bounds reads on the GPU), and every CP rank writes its own digest into the
    same decode aux slot: refused under the flag; stock keeps the option."""
    message = _problems(_args(tiny_nsa_model, "--disaggregation-enable-kv-checksum"))
    assert message.count("\n  - ") == 1
    problem = message.split("\n  - ")[1]
    assert problem.startswith("--disaggregation-enable-kv-checksum: ") and "turn it off" in problem
    assert "logical page ids" in problem and "physical shard" in problem and "decode server" in problem
    stock = _args(tiny_nsa_model, "--disaggregation-enable-kv-checksum", flag=None)
    stock.resolve_once()
    stock.check_server_args()


def test_the_kv_checksum_on_a_decode_server_is_left_to_sglang(hopper, tiny_nsa_model):
    """Decode under the flag holds a stock (unsharded) pool; with the prefill refusing the
    option no digest arrives and SGLang skips the check (signature 0; the checksum is the
    last aux buffer, so the prefill's buffer-count ERROR at registration misaligns nothing):
    the decode server is not refused for it."""
    from sglang.srt.server_args import prepare_server_args

    decode = prepare_server_args(
        ["--model-path", tiny_nsa_model, "--load-format", "dummy", "--skip-tokenizer-init", "--device", "cuda",
         "--tp", "1", "--page-size", "64", "--disaggregation-mode", "decode", "--disaggregation-transfer-backend",
         "mooncake", FLAG, "--disaggregation-enable-kv-checksum"])
    decode.resolve_once()
    assert server_args_dsa.configuration_problems(decode) == []


def test_every_cp_rank_sending_is_required(hopper, tiny_nsa_model, monkeypatch):
    monkeypatch.delenv("SGLANG_DISAGGREGATION_ALL_CP_RANKS_TRANSFER")
    assert "SGLANG_DISAGGREGATION_ALL_CP_RANKS_TRANSFER is not set" in _problems(_args(tiny_nsa_model))


def test_glm5_zigzag_which_sglang_lets_through_is_refused(hopper, tmp_path):
    import json

    (tmp_path / "config.json").write_text(json.dumps({**TINY_DSV32, "architectures": [GLM5_ARCH]}))
    server_args = _args(str(tmp_path), "--cp-strategy", "zigzag")
    server_args.resolve_once()
    if not sg.is_deepseek_dsa(sg.model_config_of(server_args).hf_config):
        pytest.skip(f"sglang {v0523.RELEASE.version} does not treat {GLM5_ARCH} as DSA here")
    with pytest.raises(CpSharedKVConfigError, match="--cp-strategy zigzag"):
        server_args.check_server_args()


@pytest.fixture
def breakable_by_default(monkeypatch):
    """What 0.5.23 decides on a CUDA machine for interleave DSA CP: the breakable prefill graph."""
    import sglang.srt.layers.cp.bcg as bcg

    monkeypatch.setattr(bcg, "supports_prefill_cp_bcg", lambda *a, **k: True)


def test_the_prefill_cuda_graph_is_turned_off_with_a_warning(hopper, breakable_by_default, tiny_nsa_model, capfd):
    stock = _args(tiny_nsa_model, flag=None)
    stock.resolve_once()
    assert sg.resolved_view(stock).cuda_graph_config.prefill.backend == "breakable"  # the flag off: stock's
    capfd.readouterr()
    ours = _args(tiny_nsa_model)
    ours.resolve_once()
    assert sg.resolved_view(ours).cuda_graph_config.prefill.backend == "disabled"
    # NOTE: read from stderr: SGLang's resolution reconfigures logging (caplog's handler is gone)
    assert f"{FLAG}: prefill CUDA graph 'breakable' turned off" in capfd.readouterr().err


def test_a_prefill_cuda_graph_the_user_chose_is_refused(hopper, breakable_by_default, tiny_nsa_model):
    message = _problems(_args(tiny_nsa_model, "--cuda-graph-backend-prefill", "breakable"))
    assert "--cuda-graph-backend-prefill breakable" in message and "--disable-prefill-cuda-graph" in message


def test_prefill_batches_keep_their_stock_size_under_the_flag(hopper, tiny_nsa_model):
    """Interleave CP deals a batch of several requests out; the shared-KV batch state takes
    them (forward/several_requests_v0523.py, test_cp_harness_v0523.py's batched_requests): the flag
    leaves --prefill-max-requests as the user set it (stock: no limit)."""
    for extra in ((), ("--prefill-max-requests", "4")):
        stock, ours = _args(tiny_nsa_model, *extra, flag=None), _args(tiny_nsa_model, *extra)
        stock.resolve_once()
        ours.resolve_once()
        assert sg.resolved_view(ours).prefill_max_requests == sg.resolved_view(stock).prefill_max_requests
        ours.check_server_args()  # a valid configuration, whatever the batch size


def test_flashinfer_autotune_is_declared_off_under_the_flag(hopper, tiny_nsa_model, capfd):
    """Its warmup is a decode-shaped dummy forward, which a shared-KV prefill rank refuses
    (test_forward_hooks_v0523.py): off under the flag, as SGLang turns it off for its own
    KV sharding; stock keeps it."""
    stock = _args(tiny_nsa_model, flag=None)
    stock.resolve_once()
    assert sg.resolved_view(stock).disable_flashinfer_autotune is False
    capfd.readouterr()
    ours = _args(tiny_nsa_model)
    ours.resolve_once()
    assert sg.resolved_view(ours).disable_flashinfer_autotune is True
    assert f"{FLAG}: FlashInfer autotune off" in capfd.readouterr().err
    ours.check_server_args()  # nothing refused: the declaration is the flag's own
