"""Shared pytest setup: the repository's python/ tree and test helpers are importable."""

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
for path in (ROOT / "test", ROOT / "python"):
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))
