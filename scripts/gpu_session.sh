#!/usr/bin/env bash
# One GPU test campaign on a lent H200 (or any CUDA 13 machine with torch 2.11 / Triton 3.6),
# run from the repository root with these prepared here and carried along:
#   .gpu-site/site312.tar.xz   ../shared/tools/gpu-site/build.sh .gpu-site   (sglang + server deps)
#   .wheels/*.whl              pytest & hypothesis wheels for Python 3.12 (see docs/gpu.md)
# Usage: scripts/gpu_session.sh [pytest args...]   results go to $OUT (default ./gpu-out)
#   TESTS="test/gpu/x.py ..." narrows the tests (default: test/gpu; "none" skips them);
#   BENCH=0 skips the benchmarks.
set -uo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
out=${OUT:-$root/gpu-out}
mkdir -p "$out"
site=$HOME/gpu-site
if [ ! -d "$site/sglang" ]; then
  mkdir -p "$site" && tar -xJf .gpu-site/site312.tar.xz -C "$site"
  python3 -m pip install -q --no-deps --no-index --target "$site" .wheels/*.whl
fi
export PYTHONPATH="$site:$root/python:$root/sgl-kernel/python:$root/test"
export CUDA_HOME=/usr/local/cuda PATH=/usr/local/cuda/bin:$PATH HF_HUB_OFFLINE=1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$out/gpu.txt"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" | tee -a "$out/gpu.txt"
status=0
if [ "${TESTS:-}" != none ]; then
  python3 -m pytest -q -p no:cacheprovider ${TESTS:-test/gpu} "$@" 2>&1 | tee "$out/gpu-tests.txt" || status=1
fi
[ "${BENCH:-1}" = 0 ] && exit $status
for bench in scripts/bench_kernels.py scripts/bench_materialize.py; do
  [ -f "$bench" ] || continue
  name=$(basename "$bench" .py)
  python3 "$bench" > "$out/$name.json" 2> "$out/$name.err" || { status=1; tail -5 "$out/$name.err"; }
done
exit $status
