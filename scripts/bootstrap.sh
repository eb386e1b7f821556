#!/usr/bin/env bash
# Set up .venv at the repository root: sglang==0.5.12.post1 (torch 2.11) and this plugin
# (with its kernel package, sgl-kernel/), installed editable. Safe to re-run (pip skips what is satisfied).
#   scripts/bootstrap.sh          runtime only
#   scripts/bootstrap.sh test     + pytest, hypothesis and the CPU Mooncake engine
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
extras=${1:-}
python=${PYTHON:-python3}

if [ "$extras" = "test" ] && ! ldconfig -p 2>/dev/null | grep -q 'libibverbs\.so\.1'; then
  # mooncake-transfer-engine-non-cuda links libibverbs even when it only uses TCP.
  if command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
    echo "bootstrap: installing libibverbs1 (needed by the CPU Mooncake engine)" >&2
    apt-get install -y -q libibverbs1 >/dev/null 2>&1 \
      || { apt-get update -q >/dev/null 2>&1 && apt-get install -y -q libibverbs1 >/dev/null; }
  else
    echo "bootstrap: libibverbs.so.1 is missing; install it (apt-get install libibverbs1)" >&2
    exit 1
  fi
fi

[ -x .venv/bin/python ] || "$python" -m venv .venv
.venv/bin/python -m pip install -q --disable-pip-version-check --upgrade pip
spec="."
[ -n "$extras" ] && spec=".[$extras]"
.venv/bin/python -m pip install -q --disable-pip-version-check -e "$spec"
