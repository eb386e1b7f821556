"""scripts/bench_materialize.py --collective keeps running: on CPU processes over gloo
(N = 2 and 3, tiny histories) it checks, per rank, that the plugin's materialize of the
history equals a plain all-gather of the same pages, and reports both timings."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("nprocs", [2, 3])
def test_collective_bench_on_gloo(nprocs):
    proc = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "bench_materialize.py"), "--collective", "--backend", "gloo",
         "--nprocs", str(nprocs), "--histories", "100,1000", "--reps", "2"],
        capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout)
    assert report["cp_size"] == nprocs and report["backend"] == "gloo"
    rows = report["rows"]
    assert {(r["kind"], r["history_tokens"]) for r in rows} == {
        (k, h) for k in ("mla_bf16", "mla_fp8", "index") for h in (100, 1000)}
    for row in rows:
        pages = -(-row["history_tokens"] // 64)
        assert row["pages_per_rank"] == -(-pages // nprocs)
        assert row["ours_us"] > 0 and row["plain_us"] > 0 and row["pack_us"] > 0
        assert row["ours_over_plain_bandwidth"] > 0
        assert set(row["per_forward_ms"]) == {"glm-5", "deepseek-v3.2"}
