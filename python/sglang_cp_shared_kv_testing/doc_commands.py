"""The shell commands the README and docs/ tell a user to run, as argv lists, for the tests
that parse them (``test_deploy_commands.py`` on 0.5.12.post1, ``test_deploy_commands_v0523.py``
on 0.5.23).

A code block whose comments name ``sglang 0.5.23`` holds 0.5.23's commands (its option
names: ``--enable-prefill-cp --cp-strategy interleave``, ...); every other block,
0.5.12.post1's.
"""

from __future__ import annotations

import re
import shlex
from pathlib import Path
from typing import List, Optional, Tuple

from sglang_cp_shared_kv.releases import v0523
from sglang_cp_shared_kv.releases.release import Release

ROOT = Path(__file__).resolve().parents[2]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
_ENV_ASSIGNMENT = re.compile(r"^[A-Z_][A-Z0-9_]*=")
#: what a code block of 0.5.23's commands says in a comment
RELEASE_0523_MARK = f"sglang {v0523.RELEASE.version}"


def shell_commands(text: str, marker: str, release: Optional[Release] = None) -> List[List[str]]:
    """Each shell command in ``text``'s code blocks that contains ``marker`` (continuation
    lines joined, comments dropped), as argv after the environment assignments; with
    ``release``, only those of that release's blocks (module docstring)."""
    out = []
    for block in re.findall(r"```(?:bash|sh)?\n(.*?)```", text, flags=re.S):
        if release is not None and (RELEASE_0523_MARK in block) != (release is v0523.RELEASE):
            continue
        joined = re.sub(r"\\\n\s*", " ", block)
        for line in joined.splitlines():
            line = line.split(" #", 1)[0].strip()
            if marker not in line or line.startswith("#"):
                continue
            for part in re.split(r"\s*&&\s*", line):
                if marker in part:
                    argv = shlex.split(part)
                    while argv and _ENV_ASSIGNMENT.match(argv[0]):
                        argv.pop(0)
                    out.append(argv)
    return out


def launch_server_args(argv: List[str]) -> List[str]:
    return argv[argv.index("sglang.launch_server") + 1:]


def launch_commands(release: Release) -> List[Tuple[str, List[str]]]:
    """(document name, argv) of every documented ``sglang.launch_server`` command of ``release``."""
    return [(doc.name, argv) for doc in DOCS
            for argv in shell_commands(doc.read_text(), "sglang.launch_server", release)]
