"""Seed a new virtual environment with hard links to the distributions an existing one already
holds at the same name and version, so that pip finds them installed and the two
environments share their bytes (``scripts/bootstrap.sh test-0.5.23`` beside ``.venv``).

Why: the 0.5.12.post1 and 0.5.23 test environments take about 9.6 and 11 GB and share about
2.4 GB of identical distributions (NVIDIA libraries, pyarrow, scipy, the Mooncake engine, ...);
CI runners with about 20 GB free cannot hold both copies.

Only what pip is about to install is seeded (``--report``: ``pip install --dry-run --report``
of the new environment's requirements), so the new environment resolves exactly as it would
alone. A distribution is left to pip when any of its files lies outside site-packages (console
scripts name their interpreter), when one of its paths already exists in the target, or when
the two environments differ in Python version. Hard links need one file system; without it
nothing is seeded. A seeded file replaced later by either environment's pip is unlinked there
only: the other keeps its copy.

    python scripts/share_identical_dists.py --source .venv --target .venv-0.5.23 --report r.json
"""

from __future__ import annotations

import argparse
import errno
import json
import os
import re
import sys
from importlib.metadata import distributions
from pathlib import Path
from typing import Dict, List, Optional, Tuple


def _normalized(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def site_packages(venv: Path) -> Optional[Path]:
    found = sorted(venv.glob("lib/python3.*/site-packages"))
    return found[0] if len(found) == 1 else None


def planned(report_path: Path) -> Dict[str, str]:
    """name -> version of every distribution pip's report says it will install."""
    report = json.loads(report_path.read_text())
    return {_normalized(item["metadata"]["name"]): item["metadata"]["version"] for item in report.get("install", [])}


def shareable(source: Path, wanted: Dict[str, str]) -> List[Tuple[str, str, List[str]]]:
    """(name, version, files relative to site-packages) of each source distribution pip
    would install at the same version, whose files all lie in site-packages."""
    out = []
    for dist in distributions(path=[str(source)]):
        name = _normalized(dist.metadata["Name"])
        if wanted.get(name) != dist.version or dist.files is None:
            continue
        files = [str(f) for f in dist.files]
        if any(f.startswith("..") or os.path.isabs(f) for f in files):
            continue
        out.append((name, dist.version, files))
    return out


def link_distribution(source: Path, target: Path, files: List[str]) -> bool:
    """Hard-link ``files`` from ``source`` into ``target``; False (nothing left behind) when a
    path exists in the target already."""
    if any((target / f).exists() for f in files):
        return False
    done = []
    try:
        for f in files:
            src = source / f
            if not src.exists():  # RECORD lists a .pyc never written: pip writes what it needs
                continue
            (target / f).parent.mkdir(parents=True, exist_ok=True)
            os.link(src, target / f)
            done.append(target / f)
    except BaseException:
        for path in done:
            path.unlink(missing_ok=True)
        raise
    return True


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--source", type=Path, required=True, help="the existing virtual environment")
    ap.add_argument("--target", type=Path, required=True, help="the new virtual environment (pip not run yet)")
    ap.add_argument("--report", type=Path, required=True, help="pip install --dry-run --report of the target")
    args = ap.parse_args(argv)
    source, target = site_packages(args.source), site_packages(args.target)
    if source is None or target is None or source.parent.name != target.parent.name:
        print(f"share_identical_dists: nothing shared ({args.source} and {args.target} need one Python version)",
              file=sys.stderr)
        return 0
    shared, size = [], 0
    try:
        for name, version, files in shareable(source, planned(args.report)):
            if link_distribution(source, target, files):
                shared.append(f"{name}=={version}")
                size += sum((source / f).stat().st_size for f in files if (source / f).exists())
    except OSError as exc:
        if exc.errno not in (errno.EXDEV, errno.EPERM, errno.EMLINK):
            raise
        print(f"share_identical_dists: hard links refused ({exc.strerror}); the rest is installed by pip",
              file=sys.stderr)
    print(f"share_identical_dists: {len(shared)} distributions ({size / 2**30:.2f} GiB) shared with {args.source} "
          "by hard links", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
