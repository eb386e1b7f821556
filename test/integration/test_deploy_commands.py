"""Every command the README and docs/ tell a user to run parses, and the launch scripts
print commands that parse: SGLang's own argument parser (with the plugin's flag) for
``sglang.launch_server``, the plugin's parser for ``python -m sglang_cp_shared_kv``,
``bash -n`` for every script. The router command is not checked (``sglang-router`` is not
a dependency). The planner figures in docs/deploy.md are recomputed."""

from __future__ import annotations

import argparse
import shlex
import subprocess

import pytest

from sglang_cp_shared_kv.releases import v0512
from sglang_cp_shared_kv.settings.config import FLAG, FLAG_DEST
from sglang_cp_shared_kv_testing.doc_commands import DOCS, ROOT, launch_commands, launch_server_args, shell_commands

SCRIPTS = sorted((ROOT / "scripts").rglob("*.sh")) + [ROOT / ".ci" / "run"]

pytestmark = pytest.mark.usefixtures("plugin_loaded")


def _sglang_parser():
    from sglang.srt.server_args import ServerArgs

    parser = argparse.ArgumentParser(exit_on_error=False)
    ServerArgs.add_cli_args(parser)
    return parser


def _parse_launch(parser, args):
    try:
        return parser.parse_args(args)
    except (argparse.ArgumentError, SystemExit) as exc:  # an unknown option exits
        raise AssertionError(f"SGLang's parser rejects: {shlex.join(args)}: {exc}") from exc


def _launch_commands():
    return launch_commands(v0512.RELEASE)


def test_docs_show_launch_commands():
    names = {name for name, _ in _launch_commands()}
    assert {"README.md", "deploy.md"} <= names, names


@pytest.mark.parametrize("where,argv", _launch_commands(), ids=lambda v: v if isinstance(v, str) else None)
def test_every_documented_launch_command_parses(where, argv):
    args = launch_server_args(argv)
    parsed = _parse_launch(_sglang_parser(), args)
    assert getattr(parsed, FLAG_DEST) == (FLAG in args)
    if parsed.disaggregation_mode == "prefill" and FLAG in args:
        assert parsed.enable_nsa_prefill_context_parallel and parsed.nsa_prefill_cp_mode == "in-seq-split"


def test_every_documented_plugin_command_parses():
    from sglang_cp_shared_kv.__main__ import build_parser

    seen = 0
    for doc in DOCS:
        for argv in shell_commands(doc.read_text(), "-m sglang_cp_shared_kv "):
            args = argv[argv.index("sglang_cp_shared_kv") + 1:]
            build_parser().parse_args(args)  # exits with status 2 (SystemExit) on a bad argument
            seen += 1
    assert seen >= 4


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_script_is_valid_bash(script):
    proc = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr


LAUNCH_CASES = {
    "prefill-cp8": ("launch_prefill.sh", ["--model", "deepseek-ai/DeepSeek-V3.2", "--cp-size", "8"]),
    "prefill-cp8-fp8": ("launch_prefill.sh", [
        "--model", "zai-org/GLM-5-FP8", "--cp-size", "8", "--ib-device", "mlx5_0,mlx5_1", "--kv-cache-dtype",
        "fp8_e4m3", "--context-length", "202752", "--", "--chunked-prefill-size", "16384"]),
    "prefill-off": ("launch_prefill.sh", ["--model", "m", "--cp-size", "2", "--off", "--base-gpu-id", "0",
                                          "--mem-fraction-static", "0.45"]),
    "decode-tp8": ("launch_decode.sh", ["--model", "deepseek-ai/DeepSeek-V3.2", "--tp", "8"]),
    "decode-two-nodes": ("launch_decode.sh", ["--model", "m", "--tp", "16", "--nnodes", "2", "--node-rank", "0",
                                              "--dist-init-addr", "10.0.0.3:5000", "--kv-cache-dtype", "fp8_e4m3"]),
    "decode-off": ("launch_decode.sh", ["--model", "m", "--tp", "1", "--off"]),
}


@pytest.mark.parametrize("case", sorted(LAUNCH_CASES))
def test_launch_scripts_print_a_command_sglang_parses(case):
    script, options = LAUNCH_CASES[case]
    proc = subprocess.run(["bash", str(ROOT / "scripts" / script), *options, "--dry-run"]
                          if "--" not in options else
                          ["bash", str(ROOT / "scripts" / script), "--dry-run", *options],
                          capture_output=True, text=True, timeout=30)
    assert proc.returncode == 0, proc.stderr
    assert "SGLANG_DISAGGREGATION_ALL_CP_RANKS_TRANSFER=1" in proc.stdout
    argv = shlex.split(proc.stdout.replace("\\\n", " "))
    parsed = _parse_launch(_sglang_parser(), launch_server_args(argv))
    assert getattr(parsed, FLAG_DEST) is ("--off" not in options)  # the flag on both servers unless --off
    if script == "launch_prefill.sh":
        assert parsed.tensor_parallel_size == int(options[options.index("--cp-size") + 1])
        assert parsed.disaggregation_mode == "prefill" and parsed.nsa_prefill_cp_mode == "in-seq-split"
    else:
        assert parsed.disaggregation_mode == "decode" and not parsed.enable_nsa_prefill_context_parallel
    if "--nnodes" in options:
        assert parsed.nnodes == 2 and parsed.dist_init_addr
    if "--" in options:
        assert parsed.chunked_prefill_size == 16384


@pytest.mark.parametrize("script,options,message", [
    ("launch_prefill.sh", ["--cp-size", "8"], "--model is required"),
    ("launch_prefill.sh", ["--model", "m", "--cp-size", "1"], "--cp-size must be 2, 4 or 8"),
    ("launch_prefill.sh", ["--model", "m", "--cp-size", "16"], "--cp-size must be 2, 4 or 8"),
    ("launch_prefill.sh", ["--model", "m", "--cp-size", "3"], "--cp-size must be 2, 4 or 8"),
    ("launch_prefill.sh", ["--model", "m", "--cp-size", "8", "--nnodes", "2"], "--dist-init-addr HOST:PORT is required"),
    ("launch_decode.sh", ["--model", "m"], "--tp N"),
    ("launch_decode.sh", ["--model", "m", "--tp", "8", "--bogus"], "unknown option '--bogus'"),
])
def test_launch_scripts_refuse_bad_options(script, options, message):
    proc = subprocess.run(["bash", str(ROOT / "scripts" / script), *options, "--dry-run"],
                          capture_output=True, text=True, timeout=30)
    assert proc.returncode == 2 and message in proc.stderr, (proc.returncode, proc.stderr)


def _documented_launch_script_calls():
    found = []
    for doc in DOCS:
        text = doc.read_text()
        for script in ("launch_prefill.sh", "launch_decode.sh"):
            found += [(doc.name, argv) for argv in shell_commands(text, f"scripts/{script}")]
    return found


def test_docs_show_launch_script_calls():
    assert len([1 for name, _ in _documented_launch_script_calls() if name == "deploy.md"]) >= 4


@pytest.mark.parametrize("where,argv", _documented_launch_script_calls(),
                         ids=lambda v: v if isinstance(v, str) else None)
def test_every_documented_launch_script_call_prints_a_command_sglang_parses(where, argv):
    """The launch-script lines of the docs, as written (``…`` elisions aside), dry-run."""
    script = next(a for a in argv if a.startswith("scripts/launch_"))
    options = [a for a in argv[argv.index(script) + 1:] if a != "…"]
    proc = subprocess.run(["bash", str(ROOT / script), "--dry-run", *options], capture_output=True, text=True,
                          timeout=30)
    assert proc.returncode == 0, (where, argv, proc.stderr)
    printed = shlex.split(proc.stdout.replace("\\\n", " "))
    parsed = _parse_launch(_sglang_parser(), launch_server_args(printed))
    assert getattr(parsed, FLAG_DEST) is ("--off" not in options)


def test_deploy_planner_table_matches_the_planner():
    """docs/deploy.md's sizing table: every row recomputed at 25 GB per rank, 163,840 tokens."""
    from sglang_cp_shared_kv.pool.kv_geometry import GIB, NsaModelShape
    from sglang_cp_shared_kv.pool.planner import plan_capacity

    text = (ROOT / "docs" / "deploy.md").read_text()
    rows = {"DeepSeek-V3.2 (61 layers), fp8_e4m3": ("deepseek-v3.2", "fp8_e4m3"),
            "DeepSeek-V3.2, bf16": ("deepseek-v3.2", "bf16"),
            "GLM-5 (78 layers), fp8_e4m3": ("glm-5", "fp8_e4m3"), "GLM-5, bf16": ("glm-5", "bf16")}
    for label, (model, dtype) in rows.items():
        plan = plan_capacity(NsaModelShape.load(model), 8, dtype, kv_gb_per_rank=25, context_len=163_840)
        send = plan.request.pd_send_per_rank[0]
        row = (f"| {label} | {plan.physical_tokens_per_rank:,} | {plan.logical_tokens:,} | "
               f"{plan.replicated_logical_tokens:,} | {plan.request.pd_bytes_replicated / GIB:.2f} GB | "
               f"{send.pages} pages, {(send.kv_bytes + send.index_bytes) / GIB:.2f} GB |")
        assert row in text, row

