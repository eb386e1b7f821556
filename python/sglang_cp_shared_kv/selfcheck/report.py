"""The selfcheck's checks and how they are shown: a table for people, JSON for machines.

:func:`build_report` turns the per-process results into figures and checks; a check
passes only on positive evidence (a process that did not report fails every check that
needs it). The verdict is PASS when every check passes.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, Dict, List, Optional

from sglang_cp_shared_kv.releases import installed
from sglang_cp_shared_kv.pool.kv_geometry import (
    NSA_INDEX_HEAD_DIM,
    NSA_KV_LORA_RANK,
    NSA_QK_ROPE_HEAD_DIM,
    PAGE_SIZE,
    NsaModelShape,
)
from sglang_cp_shared_kv.pool.planner import plan_capacity
from sglang_cp_shared_kv.selfcheck.options import SelfcheckOptions


@dataclass(frozen=True)
class Check:
    name: str
    passed: bool
    detail: str


def _harness_shape() -> NsaModelShape:
    from sglang_cp_shared_kv_testing.cp_rig import LAYERS

    return NsaModelShape(name="selfcheck (DeepSeek-V3.2 latent and index widths)", num_layers=LAYERS,
                         kv_lora_rank=NSA_KV_LORA_RANK, qk_rope_head_dim=NSA_QK_ROPE_HEAD_DIM,
                         index_head_dim=NSA_INDEX_HEAD_DIM, index_topk=32, max_context_len=0)


def _write_paths(paths: Dict[str, int]) -> str:
    """How the forwards' chunk rows reached the shards, in words."""
    local = paths.get("index=local,mla=local", 0)
    index_only = paths.get("index=local,mla=gathered", 0)
    gathered = paths.get("index=gathered,mla=gathered", 0)
    words = [f"{local} stored where computed"] + (
        [f"{index_only} with index keys stored where computed, the latent gathered"] if index_only else [])
    return ", ".join(words + [f"{gathered} gathered by SGLang and copied out"])


def build_report(options: SelfcheckOptions, ranks: List[Optional[Dict[str, Any]]],
                 decode: Optional[Dict[str, Any]], wall_s: float, problem: Optional[str],
                 workdir: str = "") -> Dict[str, Any]:
    n = options.cp_size
    reported = [r for r in ranks if r]
    checks: List[Check] = []

    def check(name: str, passed: bool, detail: str) -> None:
        checks.append(Check(name, bool(passed), detail))

    def section(name: str) -> list:
        """The ``name`` figures of every rank that got that far (a failed rank may have)."""
        return [r[name] for r in reported if name in r]

    fatal = [f"rank {i}: {r['fatal'].strip().splitlines()[-1]}" for i, r in enumerate(ranks) if r and "fatal" in r]
    if decode and "fatal" in decode:
        fatal.append(f"decode: {decode['fatal'].strip().splitlines()[-1]}")
    missing = [f"rank {i}" for i, r in enumerate(ranks) if r is None] + ([] if decode else ["decode"])
    check("processes", not fatal and not missing and problem is None,
          "; ".join(fatal + [f"{m}: no result" for m in missing] + ([problem] if problem else [])) or
          f"{n} prefill ranks and a decode ran to the end")

    capacity = section("capacity")
    physical = capacity[0]["physical_tokens"] if capacity else 0
    plan = plan_capacity(_harness_shape(), n, options.kv_cache_dtype, kv_tokens_per_rank=physical) if physical else None
    check("capacity", len(capacity) == n and all(
        c["logical_tokens"] == c["allocator_tokens"] == n * c["physical_tokens"] == c["layout_logical_tokens"]
        and c["kv_bytes"] == c["stock_kv_bytes_same_physical"] for c in capacity)
        and plan is not None and plan.logical_tokens == capacity[0]["logical_tokens"]
        and plan.kv_bytes_per_rank == capacity[0]["kv_bytes"],
        f"logical {capacity[0]['logical_tokens']:,} = {n} x physical {physical:,} tokens per rank; KV per rank "
        f"{capacity[0]['kv_bytes']:,} B, as a flag-off pool of the physical size and the planner" if capacity
        else "no rank built its pool")

    prefill = section("prefill")
    errors = [f"rank {i}: {e}" for i, p in enumerate(prefill) for e in p["errors"]]
    check("prefill bit-exact", len(prefill) == n and not errors,
          "; ".join(errors[:3]) if errors else
          f"kernel inputs and reference attention equal the replicated pool's ({prefill[0]['forwards']} forwards "
          f"on each of {n} ranks: {_write_paths(prefill[0].get('write_paths', {}))})" if len(prefill) == n
          else f"{len(prefill)} of {n} ranks finished the prefill")
    decisions = [p["allocation"] for p in prefill]
    check("allocator decisions identical", len(decisions) == n and all(d == decisions[0] for d in decisions),
          f"{decisions[0]} on every rank" if len(decisions) == n else f"{len(decisions)} of {n} ranks reported")

    transfers = section("transfer")
    pages = prefill[0]["request_pages"] if prefill else []
    sent = [t["stats"]["kv_pages"] if "stats" in t else None for t in transfers]
    stored = [s["pages"] for s in section("stored")]
    check("every page sent once", len(sent) == n and None not in sent and sum(sent) == len(pages) and sent == stored,
          f"pages sent per rank {sent} = the pages each stores, {len(pages)} in all" if len(sent) == n
          else f"{len(sent)} of {n} ranks sent their shard")

    received = (decode or {}).get("receive") or {}
    check("decode pool", received.get("status") == "success" and received.get("verified") is True,
          "; ".join(received.get("problems") or []) or received.get("error") or
          ("every KV and index byte decode received equals the replicated pool's" if received else "nothing received"))
    stray = (decode or {}).get("stray_writes")
    check("no stray writes on decode", stray == [],
          "; ".join(stray) if stray else "no page outside the request written" if stray == [] else "not checked")

    rank_rows = []
    for i, r in enumerate(ranks):
        if not r or "stored" not in r:
            rank_rows.append({"cp_rank": i, "reported": False})
            continue
        t = r.get("transfer") or {}
        stats = t.get("stats") or {}
        rank_rows.append({"cp_rank": i, "reported": True, "stored_pages": r["stored"]["pages"],
                          "stored_bytes": r["stored"]["bytes"], "sent_bytes": stats.get("write_bytes"),
                          "sent_pages": stats.get("kv_pages"), "kv_descriptors": stats.get("kv_descriptors"),
                          "state_descriptors": stats.get("state_descriptors"),
                          "materialized_bytes_per_layer": r["materialized_bytes_per_layer"]["bytes"]})
    return {
        "verdict": "PASS" if all(c.passed for c in checks) else "FAIL",
        "sglang_version": installed.INSTALLED_VERSION,
        "options": asdict(options),
        "capacity": {"physical_tokens_per_rank": physical,
                     "logical_tokens": capacity[0]["logical_tokens"] if capacity else None,
                     "kv_bytes_per_rank": capacity[0]["kv_bytes"] if capacity else None,
                     "planner": plan.to_dict() if plan else None},
        "request": {"tokens": options.context_len, "prefix_tokens": options.prefix_len,
                    "chunk_ends": options.chunk_ends, "pages": len(pages), "page_size": PAGE_SIZE},
        "ranks": rank_rows,
        #: forwards by how their chunk rows reached the shards (rank 0's count; every rank decides alike)
        "write_paths": prefill[0].get("write_paths", {}) if prefill else {},
        "checks": [asdict(c) for c in checks],
        "wall_s": round(wall_s, 1),
        "logs": workdir,
    }


def format_report(report: Dict[str, Any]) -> str:
    cap, req = report["capacity"], report["request"]
    lines = [
        f"selfcheck: CP{report['options']['cp_size']}, {report['options']['kv_cache_dtype']} KV, "
        f"{report['options']['device']}, a {req['tokens']:,}-token request ({req['prefix_tokens']:,} from the radix "
        f"cache, chunks ending at {', '.join(f'{e:,}' for e in req['chunk_ends'])}) in {report['wall_s']} s, "
        f"sglang {report['sglang_version']}",
        f"capacity      logical {cap['logical_tokens'] or 0:,} tokens = {report['options']['cp_size']} x physical "
        f"{cap['physical_tokens_per_rank'] or 0:,} per rank; KV per rank {cap['kv_bytes_per_rank'] or 0:,} B",
        "",
        f"{'rank':>4}  {'stored pages':>12}  {'stored B':>12}  {'sent B':>12}  {'descriptors KV+index':>21}  "
        f"{'materialized B/layer':>20}",
    ]
    for row in report["ranks"]:
        if not row["reported"]:
            lines.append(f"{row['cp_rank']:>4}  (no result)")
            continue
        desc = f"{row['kv_descriptors']} + {row['state_descriptors']}" if row["kv_descriptors"] is not None else "-"
        lines.append(f"{row['cp_rank']:>4}  {row['stored_pages']:>12,}  {row['stored_bytes']:>12,}  "
                     f"{row['sent_bytes'] or 0:>12,}  {desc:>21}  {row['materialized_bytes_per_layer']:>20,}")
    lines.append("")
    width = max(len(c["name"]) for c in report["checks"])
    for c in report["checks"]:
        lines.append(f"{'PASS' if c['passed'] else 'FAIL'}  {c['name']:<{width}}  {c['detail']}")
    lines.append("")
    if report["verdict"] != "PASS" and report.get("logs"):
        lines.append(f"process logs: {report['logs']}")
    lines.append(f"verdict: {report['verdict']}")
    return "\n".join(lines)
