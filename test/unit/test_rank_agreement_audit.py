"""Every ``raise`` on the shared-KV forward path is either rank-identical (every CP rank
raises it together: no rank waits in a collective) or a check carried to the forward's
agreement point (forward/agreement.py); on the PD transfer, whose agreement point is SGLang's
own (the prefill polls each room's status and all-reduces it over the CP group's CPU group,
``disaggregation/utils.poll_and_all_reduce_attn_cp_tp_group``), a problem is a room's
failed status, never a raise while serving. Read from the source: a new ``raise`` fails
here until it is classified, and a carried check called outside ``agreement.carried(...)``
fails too."""

import ast
from pathlib import Path

import sglang_cp_shared_kv

PACKAGE = Path(sglang_cp_shared_kv.__file__).parent
AUDITED = (sorted(PACKAGE.glob("forward/*.py")) + [PACKAGE / "pool/kv_pool_base.py", PACKAGE / "kernels.py"]
           + sorted(PACKAGE.glob("transfer/*.py")))

#: (module, function) -> why raising there cannot leave a rank alone in a collective
RANK_IDENTICAL = {
    ("forward/agreement.py", "record"): "an unknown check name: the same code on every rank",
    ("forward/agreement.py", "agree"): "the agreed error itself, raised by every rank after the exchange",
    ("forward/batch_state.py", "_one_request"): "a per-request length of a batch of several: the same batch "
                                                "on every rank",
    ("forward/batch_state.py", "build_for_forward"): "the forward mode and the batch size: the same batch on "
                                                     "every rank",
    ("forward/dense_layout.py", "build_dense_page_map"): "the batch's lengths and page list: rank-identical",
    ("pool/kv_pool_base.py", "_physical_size_for"): "pool construction at startup, before any forward",
    ("pool/kv_pool_base.py", "_view"): "SGLang reading a view none was built for: a path every rank takes alike",
    ("pool/kv_pool_base.py", "get_index_k_with_scale_buffer"): "an SGLang path (decode, speculative) every rank "
                                                       "takes alike",
    ("pool/kv_pool_base.py", "_refuse"): "an unsupported SGLang path every rank takes alike",
    ("pool/kv_pool_base.py", "stock_store_mla_rows"): "abstract: each release's pool class defines it",
    ("pool/kv_pool_base.py", "stores_packed_fp8"): "abstract: each release's pool class defines it",
    ("kernels.py", "kernel_package"): "the installed packages, checked at startup: the same on every rank",
    ("kernels.py", "fall_back"): "an unknown kernel name: the same code on every rank",
    ("transfer/prefill.py", "__init__"): "the Mooncake manager's construction, at startup",
    ("transfer/prefill.py", "check_pool"): "the prefill bootstrap queue's construction, at startup",
    ("transfer/pages.py", "resolve_max_descriptors_per_batch"): "read by the manager's construction, at startup",
    ("transfer/hooks.py", "check_transfer_matches_pool"): "the prefill bootstrap queue's construction, at startup",
    ("transfer/hooks_v0523.py", "prepare_prefill_transfer"): "the Mooncake manager's construction, at startup",
    ("transfer/hooks.py", "failure_exception_with_cause"): "decode (no CP group): SGLang's own raising method, "
                                                           "its error naming the prefill's cause",
}
#: check functions that raise ``AssertionError`` and are only ever called inside
#: ``agreement.carried(...)`` (or from another of them)
CARRIED = {
    ("forward/batch_state.py", "check_cp_group"), ("forward/batch_state.py", "check_batch_state"),
    ("forward/several_requests_v0523.py", "check_rows"), ("forward/local_writes_v0512.py", "check_segments"),
    ("forward/local_writes_v0512.py", "check_plan"),
}


def _functions_with_raises():
    found = set()
    for path in AUDITED:
        module = path.relative_to(PACKAGE).as_posix()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                nested = {id(n) for inner in node.body if isinstance(inner, (ast.FunctionDef, ast.AsyncFunctionDef))
                          for n in ast.walk(inner)}
                if any(isinstance(n, ast.Raise) and id(n) not in nested for n in ast.walk(node)):
                    found.add((module, node.name))
    return found


def test_every_raise_on_the_forward_path_is_rank_identical_or_carried():
    unclassified = _functions_with_raises() - set(RANK_IDENTICAL) - CARRIED
    assert not unclassified, f"classify these raises (rank-identical, or carried to the agreement point): " \
                             f"{sorted(unclassified)}"
    assert not (set(RANK_IDENTICAL) | CARRIED) - _functions_with_raises(), "stale entries"


def _calls_outside_carried(name: str):
    """Call sites of ``name`` in the runtime package (test rigs aside) that are neither inside a
    ``with <agreement>.carried(...)`` block nor in another carried check."""
    carried_names = {fn for _, fn in CARRIED}
    bad = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if "testing" in path.relative_to(PACKAGE).parts:
            continue
        tree = ast.parse(path.read_text())
        parents = {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}
        for node in ast.walk(tree):
            if not (isinstance(node, ast.Call) and getattr(node.func, "attr", getattr(node.func, "id", None)) == name):
                continue
            up, ok = node, False
            while up in parents and not ok:
                up = parents[up]
                if isinstance(up, ast.With):
                    ok = any(isinstance(item.context_expr, ast.Call)
                             and getattr(item.context_expr.func, "attr", None) == "carried" for item in up.items)
                elif isinstance(up, ast.FunctionDef) and up.name in carried_names:
                    ok = True
            if not ok:
                bad.append(f"{path.relative_to(PACKAGE)}:{node.lineno}")
    return bad


def test_carried_checks_are_called_only_inside_the_agreements_carried_block():
    for _, name in sorted(CARRIED):
        assert _calls_outside_carried(name) == [], name
