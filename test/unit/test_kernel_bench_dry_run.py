"""scripts/bench_kernels.py keeps running: its --dry-run (tiny shapes, torch paths, CPU)
produces the JSON the H200 run produces, minus the GPU-only paths."""

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_bench_kernels_dry_run(tmp_path):
    out = tmp_path / "kernels.json"
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "bench_kernels.py"), "--dry-run", "--out", str(out)],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["dry_run"] is True and report["statistic"] == "median"
    assert {(r["tokens"], r["cp_size"]) for r in report["results"]} == {(256, 2), (256, 4), (1024, 2), (1024, 4)}
    for row in report["results"]:
        for kernel in ("mla_store_bf16", "mla_store_fp8", "index_store"):
            assert row[kernel]["paths"]["torch_reference"]["us"] > 0
        assert set(row["page_pack"]) == {"mla_bf16", "mla_fp8", "index"}
        assert set(row["page_remap"]["topk_indices"]["paths"]) == {"torch_reference", "sort_searchsorted"}
        assert set(row["rerange"]) == {"latent_576_bf16", "index_key_128_bf16", "hidden_7168_bf16"}
        assert row["rerange"]["latent_576_bf16"]["paths"]["split_cat"]["bytes"] == 2 * row["tokens"] * 576 * 2
    tables = subprocess.run([sys.executable, str(ROOT / "scripts" / "bench_kernels.py"), "--markdown", str(out)],
                            capture_output=True, text=True, timeout=300)
    assert tables.returncode == 0, tables.stderr[-3000:]
    assert "**mla_store_fp8**" in tables.stdout and "| 1K | 4 |" in tables.stdout
