"""``python -m sglang_cp_shared_kv selfcheck``: PASS on the real path at N = 2 and 4 (bf16 and
fp8), FAIL naming the check for each fault it can inject, one-line errors for bad
arguments, and JSON whose figures agree with the planner -- on the installed release's
prefill CP (0.5.12.post1: in-seq split with local writes; 0.5.23: interleave)."""

import json
import subprocess
import sys

import pytest

from sglang_cp_shared_kv.releases import installed, v0512, v0523
from sglang_cp_shared_kv.pool.kv_geometry import PAGE_SIZE
from sglang_cp_shared_kv.selfcheck.options import SelfcheckArgumentError, SelfcheckOptions
from sglang_cp_shared_kv_testing.support import mooncake_engine_or_skip

mooncake_engine_or_skip()

CLI = [sys.executable, "-m", "sglang_cp_shared_kv", "selfcheck"]
INSTALLED = installed.INSTALLED_VERSION


def default_write_paths(n: int) -> dict:
    """How the default request's four forwards (the donor, then chunks of 512, 512 and 64
    tokens) reach the shards: on 0.5.12.post1 a chunk of a multiple of 2N x 64 rows (512 for
    N = 2, 4; not for N = 3) is stored where it was computed, SGLang gathers the rest (the
    donor, 448, and the last chunk, 64, always); interleave (0.5.23) computes rows of every
    page on every rank, so all are gathered."""
    local = 2 if INSTALLED == v0512.RELEASE.version and 512 % (2 * n * PAGE_SIZE) == 0 else 0
    paths = {"index=gathered,mla=gathered": 4 - local}
    if local:
        paths["index=local,mla=local"] = local
    return paths


def selfcheck(*args, timeout=600):
    proc = subprocess.run([*CLI, *args], capture_output=True, text=True, timeout=timeout)
    return proc.returncode, proc.stdout, proc.stderr


def checks_of(report):
    return {c["name"]: c for c in report["checks"]}


@pytest.mark.parametrize("args", [
    ["--json"],
    ["--json", "--cp-size", "4", "--kv-cache-dtype", "fp8_e4m3"],
    ["--json", "--cp-size", "3", "--kv-cache-dtype", "fp8_e4m3"],  # odd N: pages do not split evenly
], ids=["N2-bf16-defaults", "N4-fp8", "N3-fp8"])
def test_selfcheck_passes(args):
    code, out, err = selfcheck(*args)
    report = json.loads(out)
    failed = {c["name"]: c["detail"] for c in report["checks"] if not c["passed"]}
    assert code == 0 and report["verdict"] == "PASS", (failed, err[-3000:])
    n = report["options"]["cp_size"]
    ranks = report["ranks"]
    assert len(ranks) == n and all(r["reported"] for r in ranks)
    assert sum(r["sent_pages"] for r in ranks) == report["request"]["pages"]
    assert all(r["kv_descriptors"] > 0 and r["materialized_bytes_per_layer"] > 0 for r in ranks)
    # the capacity figures are the planner's for the same settings
    cap, planner = report["capacity"], report["capacity"]["planner"]
    assert cap["logical_tokens"] == planner["logical_tokens"] == n * cap["physical_tokens_per_rank"]
    assert cap["kv_bytes_per_rank"] == planner["kv_bytes_per_rank"]
    assert planner["page_size"] == PAGE_SIZE and planner["cp_size"] == n
    assert report["sglang_version"] == INSTALLED
    assert report["write_paths"] == default_write_paths(n)


def test_the_table_shows_every_figure_and_check():
    from sglang_cp_shared_kv.selfcheck.report import build_report, format_report

    rank = {"capacity": {"physical_tokens": 640, "logical_tokens": 1280, "allocator_tokens": 1280,
                         "kv_bytes": 1, "stock_kv_bytes_same_physical": 1, "layout_logical_tokens": 1280},
            "prefill": {"errors": [], "forwards": 4, "allocation": {"compute_owner_chunks": 1}, "request_pages": [1, 2]},
            "stored": {"pages": 1, "bytes": 10}, "materialized_bytes_per_layer": {"bytes": 5},
            "transfer": {"stats": {"kv_pages": 1, "write_bytes": 12, "kv_descriptors": 2, "state_descriptors": 2}}}
    report = build_report(SelfcheckOptions(), [rank, rank], {"receive": {"status": "success", "verified": True},
                                                             "stray_writes": []}, 1.0, None)
    text = format_report(report)
    assert report["sglang_version"] == INSTALLED and f"sglang {INSTALLED}" in text.splitlines()[0]
    assert "logical 1,280 tokens = 2 x physical 640 per rank" in text
    assert "FAIL  capacity" in text  # 1 B of KV per rank is not what the planner says for 640 tokens
    for line in ("PASS  prefill bit-exact", "PASS  decode pool", "PASS  every page sent once", "verdict: FAIL"):
        assert line in text, text


@pytest.mark.parametrize("fault,caught_by", [
    ("skip-write", {"prefill bit-exact", "decode pool"}),
    ("corrupt-shard", {"prefill bit-exact", "decode pool"}),
    ("drop-batch", {"decode pool"}),
])
def test_each_injected_fault_fails_the_check_that_catches_it(fault, caught_by):
    # on 0.5.12.post1 both chunks (512 and 256 tokens, N = 2) are stored where they were
    # computed: the faults must be caught on that path too
    code, out, err = selfcheck("--json", "--inject", fault, "--context-len", "1024", "--prefix-len", "256",
                               "--chunk-size", "512")
    report = json.loads(out)
    failed = {name for name, c in checks_of(report).items() if not c["passed"]}
    assert code == 1 and report["verdict"] == "FAIL", err[-2000:]
    assert caught_by <= failed, (fault, failed)
    assert "processes" not in failed and "capacity" not in failed  # it ran to the end and said why


@pytest.mark.parametrize("args,named", [
    (["--cp-size", "1"], "--cp-size must be an integer from 2 to 8"),
    (["--context-len", "0"], "--context-len must be an integer from 1"),
    (["--kv-cache-dtype", "fp4"], "--kv-cache-dtype must be one of bf16, fp8_e4m3"),
    (["--chunk-size", "0"], "--chunk-size must be an integer from 1 to 4096"),
    (["--prefix-len", "100"], "--prefix-len must be a multiple of 64"),
    (["--inject", "everything"], "--inject must be one of skip-write, corrupt-shard, drop-batch"),
    (["--cp-size", "two"], "argument --cp-size: expected an integer"),
])
def test_bad_arguments_give_one_line_and_exit_2(args, named):
    code, out, err = selfcheck(*args, timeout=120)
    assert code == 2 and out == "", (out, err)
    assert len(err.strip().splitlines()) == 1 and named in err and "Traceback" not in err, err


def test_options_validate_themselves():
    assert SelfcheckOptions().chunk_ends[-1] == SelfcheckOptions().context_len
    assert SelfcheckOptions().chunk_ends == [960, 1472, 1536]
    assert SelfcheckOptions(context_len=1000, prefix_len=0, chunk_size=333).chunk_ends == [333, 666, 999, 1000]
    assert SelfcheckOptions(context_len=1000, prefix_len=0, chunk_size=4000).chunks == 1
    with pytest.raises(SelfcheckArgumentError, match="--device"):
        SelfcheckOptions(device="tpu")


def test_on_a_release_without_tables_the_selfcheck_says_which_it_drives(monkeypatch, capsys):
    from sglang_cp_shared_kv import __main__ as cli

    monkeypatch.setattr(installed, "INSTALLED_VERSION", "0.5.11")
    monkeypatch.setattr(installed, "INSTALLED", None)
    with pytest.raises(SystemExit) as exit_:
        cli.main(["selfcheck"])
    message = capsys.readouterr().err
    assert exit_.value.code == 2 and "the installed sglang is 0.5.11" in message
    assert f"{v0512.RELEASE.version} or {v0523.RELEASE.version}" in message and "scripts/bootstrap.sh test" in message


def test_on_0523_a_cuda_selfcheck_is_refused_naming_where_it_runs(monkeypatch, capsys):
    """No GPU image with 0.5.23's torch has run it: --device cuda there is refused, not tried."""
    from sglang_cp_shared_kv import __main__ as cli

    monkeypatch.setattr(installed, "INSTALLED", v0523.RELEASE)
    with pytest.raises(SystemExit) as exit_:
        cli.main(["selfcheck", "--device", "cuda"])
    message = capsys.readouterr().err
    assert exit_.value.code == 2 and "--device cuda on sglang 0.5.23" in message and "--device cpu" in message
