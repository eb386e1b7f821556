"""Capacity planner: the user's CP8 numbers, byte geometry, and the CLI contract."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from sglang_cp_shared_kv.__main__ import main
from sglang_cp_shared_kv.pool.kv_geometry import BUNDLED_CONFIG_DIR, GIB, ModelConfigError, NsaModelShape
from sglang_cp_shared_kv.pool.planner import format_plan, pages_owned_per_rank, plan_capacity

GLM5 = NsaModelShape.load("glm-5")
DSV32 = NsaModelShape.load("deepseek-v3.2")


def test_bundled_shapes():
    assert (GLM5.num_layers, GLM5.kv_lora_rank, GLM5.qk_rope_head_dim, GLM5.index_head_dim) == (78, 512, 64, 128)
    assert (DSV32.num_layers, DSV32.index_topk) == (61, 2048)


def test_row_bytes():
    assert GLM5.mla_row_bytes("bf16") == 1152
    assert GLM5.mla_row_bytes("fp8_e4m3") == 656
    assert GLM5.index_row_bytes == 132


def test_user_cp8_case():
    plan = plan_capacity(GLM5, 8, "bf16", kv_tokens_per_rank=237_312)
    assert plan.physical_tokens_per_rank == 237_312
    assert plan.logical_tokens == 1_898_496
    assert round(plan.kv_gb_per_rank, 2) == 22.14
    assert plan.replicated_logical_tokens == 237_312


def test_decode_must_hold_the_whole_logical_request():
    """A non-CP decode GPU keeps a request's whole KV: 8 x the rank's pool, minus the 7
    dummy pages 8 separate pools would have had."""
    plan = plan_capacity(GLM5, 8, "bf16", kv_tokens_per_rank=237_312)
    per_token = (1152 + 132) * 78
    assert plan.decode_kv_bytes_for_logical_tokens == (1_898_496 + 64) * per_token
    assert plan.decode_kv_bytes_for_logical_tokens == 8 * plan.kv_bytes_per_rank - 7 * 64 * per_token
    assert "decode KV per GPU          177.09 GB for one prompt of all 1,898,496 tokens" in format_plan(plan)


def test_gb_sizing_inverts_token_sizing():
    by_tokens = plan_capacity(GLM5, 8, "bf16", kv_tokens_per_rank=237_312)
    by_gb = plan_capacity(GLM5, 8, "bf16", kv_gb_per_rank=by_tokens.kv_bytes_per_rank / GIB)
    assert by_gb.physical_tokens_per_rank == 237_312
    # one byte less no longer fits the last page
    smaller = plan_capacity(GLM5, 8, "bf16", kv_gb_per_rank=(by_tokens.kv_bytes_per_rank - 1) / GIB)
    assert smaller.physical_tokens_per_rank == 237_312 - 64


def test_request_figures_cp8_128k_fp8():
    plan = plan_capacity(DSV32, 8, "fp8_e4m3", kv_tokens_per_rank=100_000, context_len=131_072)
    req = plan.request
    # 256 pages per rank block, one more for the separately padded current chunk, and the dummy page
    assert req.pages == 2048 and req.scratch_pages_per_rank == 257
    assert req.scratch_mla_bytes_per_layer == (1 + 8 * 257) * 64 * 656
    assert req.scratch_index_bytes_per_layer == (1 + 8 * 257) * 64 * 132
    assert req.scratch_mla_bytes_with_prefetch == 2 * req.scratch_mla_bytes_per_layer
    assert [s.pages for s in req.pd_send_per_rank] == [256] * 8
    assert sum(s.kv_bytes + s.index_bytes for s in req.pd_send_per_rank) == req.pd_bytes_replicated
    assert not req.fits_replicated and req.fits_shared


@pytest.mark.parametrize("pages, n", [(0, 3), (1, 3), (10, 3), (11, 4), (7, 8), (64, 8)])
def test_pages_owned_per_rank_is_balanced(pages, n):
    owned = pages_owned_per_rank(pages, n)
    assert sum(owned) == pages and max(owned) - min(owned) <= 1


def test_cli_table_and_json(capsys):
    argv = ["plan", "--model-config", "glm-5", "--cp-size", "8", "--kv-cache-dtype", "bf16",
            "--kv-tokens-per-rank", "237312"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "1,898,496" in out and "22.14 GB" in out
    assert main(argv + ["--json", "--context-len", "300000"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["logical_tokens"] == 1_898_496 and data["kv_gb_per_rank"] == pytest.approx(22.14, abs=0.005)
    assert data["request"]["fits_shared"] and not data["request"]["fits_replicated"]


def test_cli_accepts_a_config_path(tmp_path, capsys):
    cfg = json.loads((BUNDLED_CONFIG_DIR / "glm-5.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    assert main(["plan", "--model-config", str(tmp_path / "config.json"), "--cp-size", "2",
                 "--kv-cache-dtype", "fp8_e4m3", "--kv-gb-per-rank", "10"]) == 0
    assert main(["plan", "--model-config", str(tmp_path), "--cp-size", "2",
                 "--kv-cache-dtype", "fp8_e4m3", "--kv-gb-per-rank", "10"]) == 0


BAD_INPUTS = [
    (["--model-config", "llama-3"], "unknown model config 'llama-3'"),
    (["--cp-size", "0"], "--cp-size: expected an integer >= 1"),
    (["--cp-size", "two"], "--cp-size: expected an integer, got 'two'"),
    (["--kv-tokens-per-rank", "lots"], "--kv-tokens-per-rank: expected an integer"),
    (["--kv-tokens-per-rank", "10"], "kv tokens per rank must be >= 64"),
    (["--kv-cache-dtype", "fp4"], "--kv-cache-dtype: invalid choice"),
    (["--context-len", "-5"], "--context-len: expected an integer >= 1"),
]


@pytest.mark.parametrize("override, message", BAD_INPUTS)
def test_cli_bad_input_one_line_exit_2(override, message, capsys):
    args = {"--model-config": "glm-5", "--cp-size": "8", "--kv-cache-dtype": "bf16",
            "--kv-tokens-per-rank": "237312"}
    args.update(dict(zip(override[::2], override[1::2])))
    argv = ["plan"] + [x for kv in args.items() for x in kv]
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0], err


def test_cli_rejects_non_nsa_config(tmp_path, capsys):
    (tmp_path / "config.json").write_text(json.dumps(
        {"architectures": ["LlamaForCausalLM"], "num_hidden_layers": 32, "hidden_size": 4096}))
    with pytest.raises(SystemExit) as exc:
        main(["plan", "--model-config", str(tmp_path / "config.json"), "--cp-size", "2",
              "--kv-cache-dtype", "bf16", "--kv-gb-per-rank", "10"])
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "is not an MLA model" in err[0]


def test_mla_without_indexer_is_not_nsa():
    with pytest.raises(ModelConfigError, match="is not an NSA model"):
        NsaModelShape.from_hf_config({"num_hidden_layers": 61, "kv_lora_rank": 512, "qk_rope_head_dim": 64}, "dsv3")


def test_cli_both_sizes_rejected(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["plan", "--model-config", "glm-5", "--cp-size", "8", "--kv-cache-dtype", "bf16",
              "--kv-tokens-per-rank", "1000", "--kv-gb-per-rank", "2"])
    assert exc.value.code == 2 and "not allowed with" in capsys.readouterr().err


def test_module_entry_point_runs():
    proc = subprocess.run(
        [sys.executable, "-m", "sglang_cp_shared_kv", "plan", "--model-config", "glm-5", "--cp-size", "8",
         "--kv-cache-dtype", "bf16", "--kv-tokens-per-rank", "237312", "--json"],
        capture_output=True, text=True, timeout=60,
        env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2] / "python")},
    )
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["logical_tokens"] == 1_898_496


def test_the_decode_pool_the_plan_names_holds_every_request_of_the_context_and_no_less_does():
    """The planner's "decode pool" line and decode's admission bound are one figure: a pool
    of that many tokens (whole pages, as SGLang rounds --max-total-tokens down to a page)
    admits the longest prompt of the context length, one page less refuses it
    (decode_admission)."""
    from sglang_cp_shared_kv.decode.admission import DEFAULT_RESERVED_DECODE_TOKENS, DecodeAdmission
    from sglang_cp_shared_kv.pool.kv_geometry import PAGE_SIZE

    plan = plan_capacity(NsaModelShape.load("glm-5"), 8, "fp8_e4m3", kv_gb_per_rank=25, context_len=202_752)
    pool = plan.request.decode_pool_tokens
    assert pool % PAGE_SIZE == 0 and pool - PAGE_SIZE < 202_752 - 1 + DEFAULT_RESERVED_DECODE_TOKENS <= pool
    for tokens, admits in ((pool, True), (pool - PAGE_SIZE, False)):
        bound = DecodeAdmission(tokens, DEFAULT_RESERVED_DECODE_TOKENS)
        assert (bound.longest_context() >= 202_752) == admits
        assert (bound.refusal(202_751) is None) == admits  # the longest prompt the context allows
    assert f"decode pool                >= {pool:,} tokens" in format_plan(plan)


def test_host_tier_is_stocks_per_rank_and_n_times_over_the_group():
    """HiCache under the flag: stock's host pool for the rank's physical device pool
    (int(tokens x ratio), floored to pages, plus one page), N times over the group."""
    plan = plan_capacity(DSV32, 8, "bf16", kv_tokens_per_rank=100_000, hicache_ratio=2)
    host = plan.host
    assert plan.physical_tokens_per_rank == 99_968
    assert host.host_tokens_per_rank == (99_968 * 2 // 64 + 1) * 64 == 200_000
    assert host.logical_host_tokens == 8 * 200_000 and host.replicated_logical_host_tokens == 200_000
    assert host.mla_host_bytes_per_rank == 200_000 * 1152 * 61
    assert host.index_host_bytes_per_rank == (200_000 // 64 + 1) * 64 * 132 * 61  # a page more, as SGLang's
    assert plan.to_dict()["host"]["host_bytes_per_rank"] == host.host_bytes_per_rank
    text = format_plan(plan)
    assert "host_tokens_per_rank       200,000 (--hicache-ratio 2)" in text
    assert "host_logical_tokens        1,600,000" in text
    # --hicache-size: GB of the MLA host pool, SGLang's 10**9 bytes; fp8 rows of 656 bytes
    by_size = plan_capacity(DSV32, 8, "fp8_e4m3", kv_tokens_per_rank=100_000, hicache_size_gb=100).host
    assert by_size.host_tokens_per_rank == (int(100e9 // (656 * 61)) // 64 + 1) * 64
    assert plan_capacity(DSV32, 8, "bf16", kv_tokens_per_rank=100_000).host is None


def test_host_tier_not_larger_than_the_device_pool_is_refused_naming_the_fix():
    with pytest.raises(ValueError, match="not more than the rank's device pool of 99,968.*raise --hicache-ratio"):
        plan_capacity(DSV32, 8, "bf16", kv_tokens_per_rank=100_000, hicache_ratio=0.5)
    with pytest.raises(ValueError, match="exactly one"):
        plan_capacity(DSV32, 8, "bf16", kv_tokens_per_rank=100_000, hicache_ratio=2, hicache_size_gb=10)
    with pytest.raises(SystemExit):
        main(["plan", "--model-config", "glm-5", "--cp-size", "4", "--kv-cache-dtype", "bf16",
              "--kv-tokens-per-rank", "1000", "--hicache-ratio", "2", "--hicache-size", "1"])
