#!/usr/bin/env python3
# Vendored from the workspace tool ../shared/tools/check_sglang_copy.py so that a clean
# clone can run it; test/test_repository.py prefers ../shared/tools/ when that exists.
"""Find runs of lines copied from the installed SGLang source into this project.

The plugin must be our own code: it hooks SGLang at boundaries instead of carrying
copies of SGLang functions. This compares every window of WINDOW meaningful lines
(blank lines, comments, imports and lone punctuation are skipped; whitespace is
folded) in the project's Python files against the installed sglang package.

Usage: check_sglang_copy.py [PROJECT_DIR] [--sglang-dir DIR] [--window N]
Exit status: 0 no copied run found, 1 copied runs found, 2 could not run.
"""
from __future__ import annotations

import argparse
import hashlib
import importlib.util
import os
import re
import subprocess
import sys

TRIVIAL = re.compile(r"^[\s\)\]\}\(\[\{,:;.]*$|^(else|try|finally|pass|return|break|continue)\s*:?$")
MIN_CHARS = 160  # a window must carry this much text to count as a copy


def meaningful_lines(path):
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            raw = f.readlines()
    except OSError:
        return []
    out = []
    for number, line in enumerate(raw, 1):
        text = " ".join(line.split())
        if not text or text.startswith("#") or TRIVIAL.match(text):
            continue
        if text.startswith(("import ", "from ")) and " import " in f" {text} ":
            continue
        if text in ('"""', "'''"):
            continue
        out.append((number, text))
    return out


def windows(lines, size):
    for i in range(len(lines) - size + 1):
        chunk = [t for _, t in lines[i : i + size]]
        if sum(len(t) for t in chunk) < MIN_CHARS:
            continue
        digest = hashlib.blake2b("\n".join(chunk).encode(), digest_size=12).digest()
        yield i, digest


def sglang_dir():
    spec = importlib.util.find_spec("sglang")
    if spec is None or not spec.submodule_search_locations:
        return None
    return list(spec.submodule_search_locations)[0]


def project_files(root):
    try:
        out = subprocess.run(
            ["git", "ls-files", "--cached", "--others", "--exclude-standard", "*.py"],
            cwd=root, capture_output=True, text=True, check=True,
        ).stdout.split()
        return [os.path.join(root, p) for p in out]
    except (OSError, subprocess.CalledProcessError):
        found = []
        for base, dirs, files in os.walk(root):
            dirs[:] = [d for d in dirs if not d.startswith(".") and d not in ("venv", "build")]
            found += [os.path.join(base, f) for f in files if f.endswith(".py")]
        return found


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("project", nargs="?", default=".")
    ap.add_argument("--sglang-dir", default=None)
    ap.add_argument("--window", type=int, default=6)
    args = ap.parse_args()

    src = args.sglang_dir or sglang_dir()
    if not src or not os.path.isdir(src):
        print("check_sglang_copy: sglang is not installed here; pass --sglang-dir", file=sys.stderr)
        return 2

    index = {}
    for base, _, files in os.walk(src):
        for name in files:
            if name.endswith(".py"):
                path = os.path.join(base, name)
                lines = meaningful_lines(path)
                for i, digest in windows(lines, args.window):
                    index.setdefault(digest, (path, lines[i][0]))

    hits = []
    for path in project_files(os.path.abspath(args.project)):
        lines = meaningful_lines(path)
        last_reported = -10**9
        for i, digest in windows(lines, args.window):
            if digest in index and i > last_reported + args.window:
                other, other_line = index[digest]
                hits.append((path, lines[i][0], other, other_line))
                last_reported = i

    root = os.path.abspath(args.project)
    for path, line, other, other_line in hits:
        print(f"copied: {os.path.relpath(path, root)}:{line} ~ sglang/{os.path.relpath(other, src)}:{other_line}")
    print(f"check_sglang_copy: {len(hits)} copied run(s) of {args.window}+ lines")
    return 1 if hits else 0


if __name__ == "__main__":
    sys.exit(main())
