"""The 0.5.23 launch commands the README and docs/ give (the ones with 0.5.23's option
names, ``--enable-prefill-cp``) parse with 0.5.23's own parser (``prepare_server_args``, the
plugin's flag and alias on it) into the record the flag and interleave CP are set on (the
model paths are Hugging Face ids, so resolution, which reads their configs, is not run). Runs only where sglang 0.5.23 is installed (``.venv-0.5.23``); 0.5.12.post1's commands:
test_deploy_commands.py."""

import shlex

import pytest

from sglang_cp_shared_kv.releases import installed, v0523

if installed.INSTALLED is not v0523.RELEASE:
    pytest.skip(f"needs sglang {v0523.RELEASE.version}", allow_module_level=True)

from sglang_cp_shared_kv.settings.config import FLAG_DEST  # noqa: E402
from sglang_cp_shared_kv_testing.doc_commands import launch_commands, launch_server_args  # noqa: E402

pytestmark = pytest.mark.usefixtures("plugin_loaded")
COMMANDS = launch_commands(v0523.RELEASE)
FLAG_SPELLINGS = ("--enable-nsa-prefill-cp-shared-kv", "--enable-prefill-cp-shared-kv")


def test_docs_show_the_0523_launch_commands():
    names = {name for name, _ in COMMANDS}
    assert {"README.md", "deploy.md"} <= names, names
    modes = {launch_server_args(argv)[launch_server_args(argv).index("--disaggregation-mode") + 1]
             for _, argv in COMMANDS if "--disaggregation-mode" in argv}
    assert modes == {"prefill", "decode"}, modes


@pytest.mark.parametrize("where,argv", COMMANDS, ids=lambda v: v if isinstance(v, str) else None)
def test_every_documented_0523_launch_command_parses(where, argv):
    from sglang.srt.server_args import prepare_server_args

    args = launch_server_args(argv)
    try:
        server_args = prepare_server_args(args)
    except SystemExit as exc:  # an unknown option exits
        raise AssertionError(f"0.5.23's parser rejects: {shlex.join(args)}") from exc
    assert getattr(server_args, FLAG_DEST) is any(flag in args for flag in FLAG_SPELLINGS)
    if server_args.disaggregation_mode == "prefill":
        assert server_args.enable_prefill_cp and server_args.cp_strategy == "interleave"
