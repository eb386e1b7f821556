"""The package's structure, read from its source with ``ast`` (nothing is imported):

* the import graph of ``sglang_cp_shared_kv`` has no cycle -- module-level and
  function-local imports alike, and importing ``a.b.c`` counts as importing the packages
  ``a.b`` and ``a`` too (Python runs their ``__init__``);
* only :mod:`sglang_cp_shared_kv.sglang_api` imports SGLang (the test rigs under
  ``testing/`` and the ``selfcheck`` that runs them drive SGLang directly, as a server
  would, and are exempt), so one table names every SGLang symbol the plugin uses;
* the pure modules import no SGLang, and torch only inside the functions that take
  tensors (they run, and the planner CLI starts fast, without it);
* the pool package (storage) imports nothing from ``forward/``: what a forward carries
  between hooks is the forward's (``forward.in_flight``), reached through ``pool.in_flight``.
"""

from __future__ import annotations

import ast
from pathlib import Path
from typing import Dict, List, Set

import pytest

PACKAGE = "sglang_cp_shared_kv"
ROOT = Path(__file__).resolve().parents[2] / "python" / PACKAGE
PURE = ("cp_shared_kv_layout", "pool.kv_geometry", "pool.planner", "settings.config", "scoped", "pool.page_split",
        "selfcheck.options", "transfer.pages", "transfer.failure_cause", "observability.stage_timer",
        "observability.prometheus_registry", "decode.admission")
#: The concern packages (their ``__init__`` imports nothing)
PACKAGES = ("forward", "transfer", "selfcheck", "settings", "pool", "decode", "observability")
#: The test rigs: a sibling package of the same distribution, never loaded by a serving process
RIGS = "sglang_cp_shared_kv_testing"


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules() -> Dict[str, Path]:
    return {module_name(p): p for p in sorted(ROOT.rglob("*.py"))}


def imported_names(path: Path, name: str, *, module_level_only: bool = False) -> List[str]:
    """Every module ``path`` imports (absolute names), anywhere in the file (or only in its
    top-level statements)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    is_package = path.name == "__init__.py"
    out = []
    for node in tree.body if module_level_only else ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: resolve against this module's package
                base = name.split(".")
                base = base[: len(base) - node.level + (1 if is_package else 0)]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module
            out.append(source)
            out += [f"{source}.{alias.name}" for alias in node.names]  # `from pkg import module`
    return out


def internal_graph() -> Dict[str, Set[str]]:
    known = modules()
    graph: Dict[str, Set[str]] = {name: set() for name in known}
    for name, path in known.items():
        for target in imported_names(path, name):
            if not target.startswith(PACKAGE):
                continue
            parts = target.split(".")
            # `import a.b.c` runs a/__init__, a/b/__init__ and a/b/c: an edge to each that exists
            for i in range(1, len(parts) + 1):
                prefix = ".".join(parts[:i])
                if prefix in known and prefix != name:
                    graph[name].add(prefix)
    # A package's __init__ is run before any of its submodules: a submodule depends on it.
    for name in known:
        parts = name.split(".")
        for i in range(1, len(parts)):
            parent = ".".join(parts[:i])
            if parent in known:
                graph[name].add(parent)
    return graph


def find_cycle(graph: Dict[str, Set[str]]):
    state: Dict[str, int] = {}
    stack: List[str] = []

    def visit(node):
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state:
                found = visit(nxt)
                if found:
                    return found
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state:
            found = visit(node)
            if found:
                return found
    return None


def test_the_package_import_graph_has_no_cycle():
    graph = internal_graph()
    assert len(graph) > 20  # the walk found the package
    assert f"{PACKAGE}.pool.owned_rows" in graph[f"{PACKAGE}.pool.kv_pool_v0512"]  # the walk sees real edges
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_the_cycle_check_finds_a_cycle():
    """The check above can fail: a function-local import closing a loop is found."""
    graph = internal_graph()
    graph[f"{PACKAGE}.forward.dense_layout"].add(f"{PACKAGE}.forward.hooks")  # as if imported inside a function
    cycle = find_cycle(graph)
    assert cycle is not None and cycle[0] == cycle[-1]


def test_only_the_adapter_imports_sglang():
    offenders = []
    for name, path in modules().items():
        if name == f"{PACKAGE}.sglang_api" or name.startswith(f"{PACKAGE}.selfcheck"):
            continue
        for target in imported_names(path, name):
            if target == "sglang" or target.startswith("sglang."):
                offenders.append(f"{name}: {target}")
    assert not offenders, offenders


@pytest.mark.parametrize("pure", PURE)
def test_pure_modules_import_no_sglang_and_no_torch(pure):
    """Pure modules import only other pure modules (and package ``__init__`` files, which
    import nothing): no SGLang anywhere, no torch at module level."""
    name = f"{PACKAGE}.{pure}"
    graph = internal_graph()
    for target in imported_names(modules()[name], name):
        assert target.split(".")[0] != "sglang", f"{name} imports {target}"
    for target in imported_names(modules()[name], name, module_level_only=True):
        assert target.split(".")[0] != "torch", f"{name} imports {target} at module level"
    allowed = {f"{PACKAGE}.{p}" for p in PURE + PACKAGES} | {PACKAGE}
    assert graph[name] <= allowed, f"{name} imports {sorted(graph[name] - allowed)}"


def test_serving_modules_never_import_the_rigs():
    """The rigs live in their own package: a serving process (every module but the selfcheck,
    which runs them, and ``__main__``, which starts it) never loads them."""
    offenders = []
    for name, path in modules().items():
        if name.startswith(f"{PACKAGE}.selfcheck") or name == f"{PACKAGE}.__main__":
            continue
        offenders += [f"{name}: {t}" for t in imported_names(path, name) if t.split(".")[0] == RIGS]
    assert not offenders, offenders
    assert not (ROOT / "testing").exists()


@pytest.mark.parametrize("package", PACKAGES)
def test_concern_package_inits_import_nothing(package):
    """Importing one module of a concern package runs only that package's docstring."""
    init = ROOT / package / "__init__.py"
    assert imported_names(init, f"{PACKAGE}.{package}") == []


def test_the_pool_package_imports_nothing_from_forward():
    """Storage does not reach up into the forward path (issue 35 item 3)."""
    graph = internal_graph()
    pool_modules = [name for name in graph if name.startswith(f"{PACKAGE}.pool.")]
    assert f"{PACKAGE}.pool.kv_pool_base" in pool_modules and len(pool_modules) > 8
    offenders = {name: sorted(t for t in graph[name] if t.startswith(f"{PACKAGE}.forward"))
                 for name in pool_modules}
    assert not any(offenders.values()), {k: v for k, v in offenders.items() if v}
    # and the check can fail: the forward package does import the pool
    assert any(t.startswith(f"{PACKAGE}.pool.") for t in graph[f"{PACKAGE}.forward.hooks"])
