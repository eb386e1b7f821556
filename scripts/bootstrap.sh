#!/usr/bin/env bash
# Set up .venv at the repository root: sglang==0.5.12.post1 (torch 2.11) and this plugin
# (with its kernel package, sgl-kernel/), installed editable. Safe to re-run (pip skips what is satisfied).
#   scripts/bootstrap.sh          runtime only
#   scripts/bootstrap.sh test     + pytest, hypothesis and the CPU Mooncake engine
#                                  (mooncake-transfer-engine-non-cuda; links libibverbs1)
#   scripts/bootstrap.sh gpu      + the CUDA 13 Mooncake engine for PD serving on GPUs
#                                  (mooncake-transfer-engine-cuda13; links libibverbs1,
#                                  libmlx5-1 and libnuma1). torch 2.11 from PyPI is a CUDA 13
#                                  build; the plain mooncake-transfer-engine wheel links CUDA
#                                  12 and does not load next to it. Never install the
#                                  non-cuda and the cuda13 engines into one environment.
#   scripts/bootstrap.sh test-0.5.23   a second environment, .venv-0.5.23: sglang==0.5.23
#                                  (torch 2.14.1, Python >= 3.11), this plugin (editable, its
#                                  0.5.12.post1 pins left out), pytest, hypothesis and the CPU
#                                  Mooncake engine (as for test; links libibverbs1); pytest
#                                  there runs its own tests (*_v0523.py) and test/conftest.py's SHARED_WITH_V0523.
# Each environment takes about 10-11 GB (torch's CUDA build and its NVIDIA libraries). The CPU
# test environments (test, test-0.5.23) leave out flashinfer-cubin (1.5 GB of GPU kernel
# binaries; flashinfer looks for it and carries on without it), and test-0.5.23 shares the
# distributions it would install at the same version as .venv (about 2.4 GB) by hard links
# (scripts/share_identical_dists.py; SHARE_DISTS=0 turns it off). A new environment is refused
# up front when the disk it goes on, or pip's temporary folder (TMPDIR, /tmp), has less than
# MIN_FREE_GB free (11 for .venv; 10 for .venv-0.5.23 beside .venv, 12 alone): pip would
# otherwise stop half-way with "No space left on device". MIN_FREE_GB=0 skips the check.
# MAKE_ROOM=1 (what .ci/run passes: a throwaway clone): when a new .venv-0.5.23 does not fit
# beside .venv, bootstrap test-0.5.23 removes .venv first, saying so (the 0.5.12.post1 suite
# has run by then; the next `scripts/bootstrap.sh test` rebuilds it).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
target=${1:-}
python=${PYTHON:-python3}

case "$target" in
  "") extras="" ; libs="" ;;
  test) extras="test" ; libs="libibverbs1:libibverbs.so.1" ;;
  gpu) extras="pd" ; libs="libibverbs1:libibverbs.so.1 libmlx5-1:libmlx5.so.1 libnuma1:libnuma.so.1" ;;
  test-0.5.23) extras="" ; libs="libibverbs1:libibverbs.so.1" ;;
  *) echo "bootstrap: unknown target '$target' (use nothing, test, gpu or test-0.5.23)" >&2; exit 2 ;;
esac

# The Mooncake engines link system libraries even when they only use TCP.
missing=""
for pair in $libs; do
  ldconfig -p 2>/dev/null | grep -q "${pair#*:}" || missing="$missing ${pair%%:*}"
done
if [ -n "$missing" ]; then
  if command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
    echo "bootstrap: installing$missing (needed by the Mooncake engine)" >&2
    apt-get install -y -q $missing >/dev/null 2>&1 \
      || { apt-get update -q >/dev/null 2>&1 && apt-get install -y -q $missing >/dev/null; }
  else
    echo "bootstrap: missing system libraries:$missing; install them (apt-get install$missing)" >&2
    exit 1
  fi
fi

# NOTE: checked only where the environment is new: re-running over an existing one installs
# little or nothing
require_free_space() {
  local venv=$1 min=${MIN_FREE_GB:-$2} dir free_gb
  [ -x "$venv/bin/python" ] && return 0
  [ "$min" -gt 0 ] || return 0
  for dir in "$root" "${TMPDIR:-/tmp}"; do
    free_gb=$(df -Pk "$dir" | awk 'NR == 2 { print int($4 / 1048576) }')
    if [ "$free_gb" -lt "$min" ]; then
      echo "bootstrap: $venv needs about $min GB free on $dir (the environment and pip's unpacking);" \
        "df says $free_gb GB. Free space there (old environments, CI clones), point TMPDIR at" \
        "a larger disk, or set MIN_FREE_GB=0 to try anyway" >&2
      exit 1
    fi
  done
}

# The CPU test environments never load GPU kernel binaries: flashinfer-cubin goes (flashinfer
# checks for it with find_spec and JIT-compiles without it, which a CPU test never asks for).
drop_gpu_kernel_binaries() {
  "$1/bin/python" -m pip uninstall -q -y --disable-pip-version-check flashinfer-cubin 2>/dev/null || true
}

# NOTE: CI runners differ in free disk (seen: 10 GB and 4 GB left after .venv); the two
# environments side by side need about 17 GB, .venv-0.5.23 alone about 11 GB
make_room_for_second_environment() {
  local free_gb need=${MIN_FREE_GB:-10}
  [ "${MAKE_ROOM:-0}" = 1 ] && [ -d .venv ] && [ ! -x .venv-0.5.23/bin/python ] || return 0
  free_gb=$(df -Pk "$root" | awk 'NR == 2 { print int($4 / 1048576) }')
  [ "$free_gb" -lt "$need" ] || return 0
  echo "bootstrap: MAKE_ROOM=1: .venv-0.5.23 needs about $need GB beside .venv and df says $free_gb GB;" \
    "removing .venv ($(du -sh .venv | cut -f1)) first (scripts/bootstrap.sh test rebuilds it)" >&2
  rm -rf .venv
}

if [ "$target" = test-0.5.23 ]; then
  make_room_for_second_environment
  # NOTE: sizes measured 2026-12-05: .venv-0.5.23 11 GB alone, 8.6 GB beside .venv
  if [ -x .venv/bin/python ] && [ "${SHARE_DISTS:-1}" = 1 ]; then
    require_free_space .venv-0.5.23 10
  else
    require_free_space .venv-0.5.23 12
  fi
  "$python" -c 'import sys; sys.exit(sys.version_info < (3, 11))' \
    || { echo "bootstrap: sglang 0.5.23 needs Python >= 3.11 (PYTHON=python3.11 scripts/bootstrap.sh test-0.5.23)" >&2; exit 1; }
  venv=.venv-0.5.23
  [ -x $venv/bin/python ] || "$python" -m venv $venv
  $venv/bin/python -m pip install -q --disable-pip-version-check --upgrade pip
  # NOTE: the plugin's own requirements pin the serving base (sglang 0.5.12.post1, torch
  # 2.11, kernels 0.12): here SGLang comes first, with its own pins (torch 2.14.1, kernels
  # 0.14), and the plugin joins it without its pins
  # NOTE: the same test requirements as pyproject.toml's `test` extra (the extra itself would
  # bring the plugin's pins along)
  requirements=("sglang==0.5.23" numpy "pytest>=8" "hypothesis>=6.100" mooncake-transfer-engine-non-cuda)
  if [ -x .venv/bin/python ] && [ "${SHARE_DISTS:-1}" = 1 ]; then
    report=$(mktemp --suffix=.json)
    $venv/bin/python -m pip install -q --disable-pip-version-check --dry-run --ignore-installed \
      --report "$report" "${requirements[@]}"
    $venv/bin/python scripts/share_identical_dists.py --source .venv --target $venv --report "$report"
    rm -f "$report"
  fi
  $venv/bin/python -m pip install -q --disable-pip-version-check "${requirements[@]}"
  drop_gpu_kernel_binaries $venv
  $venv/bin/python -m pip install -q --disable-pip-version-check --no-deps -e .
  exit 0
fi

require_free_space .venv 11
[ -x .venv/bin/python ] || "$python" -m venv .venv
.venv/bin/python -m pip install -q --disable-pip-version-check --upgrade pip
spec="."
[ -n "$extras" ] && spec=".[$extras]"
.venv/bin/python -m pip install -q --disable-pip-version-check -e "$spec"
[ "$target" = test ] && drop_gpu_kernel_binaries .venv
exit 0
