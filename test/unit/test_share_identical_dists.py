"""scripts/share_identical_dists.py: the 0.5.23 test environment takes the distributions it
would install at the same version as .venv as hard links, and nothing else."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "share_identical_dists.py"


def _dist(site: Path, name: str, version: str, files: dict) -> None:
    info = site / f"{name.replace('-', '_')}-{version}.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
    for rel, text in files.items():
        (site / rel).parent.mkdir(parents=True, exist_ok=True)
        (site / rel).write_text(text)
    record = [*files, f"{info.name}/METADATA", f"{info.name}/RECORD"]
    (info / "RECORD").write_text("".join(f"{r},,\n" for r in record))


def _venv(root: Path, name: str) -> Path:
    site = root / name / "lib" / "python3.11" / "site-packages"
    site.mkdir(parents=True)
    return site


def test_only_same_version_site_packages_only_distributions_are_linked(tmp_path):
    source, target = _venv(tmp_path, "a"), _venv(tmp_path, "b")
    _dist(source, "same-lib", "1.0", {"same_lib/__init__.py": "x = 1\n", "same_lib/data.bin": "bytes"})
    _dist(source, "other-version", "1.0", {"other_version/__init__.py": ""})
    _dist(source, "has-script", "2.0", {"has_script/__init__.py": "", "../../../bin/has-script": "#!python\n"})
    _dist(source, "not-planned", "1.0", {"not_planned/__init__.py": ""})
    report = tmp_path / "report.json"
    report.write_text(json.dumps({"install": [{"metadata": {"name": n, "version": v}} for n, v in (
        ("Same_Lib", "1.0"), ("other-version", "1.1"), ("has-script", "2.0"))]}))
    out = subprocess.run([sys.executable, str(SCRIPT), "--source", str(tmp_path / "a"), "--target",
                          str(tmp_path / "b"), "--report", str(report)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "1 distributions" in out.stderr
    linked = target / "same_lib" / "data.bin"
    assert linked.read_text() == "bytes" and os.stat(linked).st_ino == os.stat(source / "same_lib" / "data.bin").st_ino
    assert (target / "same_lib-1.0.dist-info" / "RECORD").exists()
    for absent in ("other_version", "has_script", "not_planned"):
        assert not (target / absent).exists()


def test_a_path_already_in_the_target_leaves_the_distribution_to_pip(tmp_path):
    source, target = _venv(tmp_path, "a"), _venv(tmp_path, "b")
    _dist(source, "same-lib", "1.0", {"same_lib/__init__.py": "x = 1\n", "same_lib/b.py": ""})
    (target / "same_lib").mkdir()
    (target / "same_lib" / "b.py").write_text("theirs")
    report = tmp_path / "report.json"
    report.write_text(json.dumps({"install": [{"metadata": {"name": "same-lib", "version": "1.0"}}]}))
    out = subprocess.run([sys.executable, str(SCRIPT), "--source", str(tmp_path / "a"), "--target",
                          str(tmp_path / "b"), "--report", str(report)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and "0 distributions" in out.stderr
    assert not (target / "same_lib" / "__init__.py").exists() and (target / "same_lib" / "b.py").read_text() == "theirs"
