"""The release objects: each validates itself, the installed one is found by its exact
version, and no module of the runtime package outside ``releases/`` spells an SGLang
version in its code (docstrings and comments may tell history; a string the code uses may not)."""

from __future__ import annotations

import ast
import dataclasses
import re
from pathlib import Path

import pytest

from sglang_cp_shared_kv.releases import installed, v0512, v0523
from sglang_cp_shared_kv.releases.release import COMMON_SYMBOLS, Release

ROOT = Path(__file__).resolve().parents[2] / "python" / "sglang_cp_shared_kv"
VERSION_LITERAL = re.compile(r"\b0\.5\.\d+")


def test_each_release_is_found_by_its_exact_version():
    assert installed.SUPPORTED == (v0512.RELEASE, v0523.RELEASE)
    for release in installed.SUPPORTED:
        assert installed.for_version(release.version) is release
    assert installed.for_version("0.5.12") is None and installed.for_version(None) is None
    assert installed.RECOMMENDED is v0512.RELEASE and installed.RECOMMENDED.gpu_verified
    assert installed.INSTALLED is installed.for_version(installed.INSTALLED_VERSION)


def test_the_installed_sglang_is_served_here():
    """The suite runs in an environment of scripts/bootstrap.sh: one of the served releases."""
    assert installed.INSTALLED is not None
    assert installed.INSTALLED.bootstrap_target in ("test", "test-0.5.23")


@pytest.mark.parametrize("change, problem", [
    ({"name": "v0513"}, "name 'v0513'"),
    ({"cp_strategy": "zigzag"}, "cp_strategy 'zigzag'"),
    ({"served_cp_sizes": (4, 2)}, "served_cp_sizes (4, 2)"),
    ({"served_cp_sizes": None}, "unserved_cp_size_cause goes with served_cp_sizes"),
    ({"hisparse_signal": "flag"}, "hisparse_signal 'flag'"),
    ({"symbols": {}}, "symbols lack the common"),
])
def test_a_release_record_refuses_what_does_not_hold(change, problem):
    with pytest.raises(ValueError, match=re.escape(problem)):
        dataclasses.replace(v0512.RELEASE, **change)


def test_every_release_has_the_common_symbols_meaning_the_same():
    for release in installed.SUPPORTED:
        assert {k: release.symbols[k] for k in COMMON_SYMBOLS} == dict(COMMON_SYMBOLS)
        assert isinstance(release, Release)


def _code_strings(path: Path):
    """Every string constant of ``path`` but docstrings."""
    tree = ast.parse(path.read_text())
    docstrings = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                docstrings.add(id(first.value))
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings:
            yield node.lineno, node.value


def test_no_version_literal_outside_releases():
    offenders = [f"{path.relative_to(ROOT)}:{line}: {text!r}"
                 for path in sorted(ROOT.rglob("*.py")) if "releases" not in path.relative_to(ROOT).parts
                 for line, text in _code_strings(path) if VERSION_LITERAL.search(text)]
    assert not offenders, offenders


def test_the_version_check_finds_a_literal(tmp_path):
    """The check above can fail: a version in a string the code uses is found."""
    module = tmp_path / "m.py"
    module.write_text('"""Docstring 0.5.23 is history."""\nTARGET = "test-0.5.23"\n')
    assert [text for _, text in _code_strings(module)] == ["test-0.5.23"]
