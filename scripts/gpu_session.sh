#!/usr/bin/env bash
# One GPU test campaign on a lent H200 (or any CUDA 13 machine with torch 2.11 / Triton 3.6),
# run from the repository root with these prepared here and carried along:
#   .gpu-site/site312.tar.xz   ../shared/tools/gpu-site/build.sh .gpu-site   (sglang + server deps)
#   .wheels/*.whl              pytest & hypothesis wheels for Python 3.12 (see docs/gpu.md)
# The plugin, its kernels and its test rigs travel as source: python/ and sgl-kernel/python/
# go on PYTHONPATH (no install, no sys.path edits in the tests).
# Usage: scripts/gpu_session.sh [pytest args...]   results go to $OUT (default ./gpu-out)
#   TESTS="test/gpu/x.py ..." narrows the tests (default: test/gpu; "none" skips them);
#   BENCH=0 skips the benchmarks; E2E="off_a,on,..." runs those servers of
#   scripts/e2e_cp_logprobs.py (needs 2 GPUs; runs accumulate in ~/e2e-work while the
#   machine stays warm, logs are copied to $out; E2E_ARGS="--stable-topk" adds options,
#   E2E=all with E2E_ARGS="--tp 1" is the one-GPU determinism probe; E2E_ARGS="--tp 4
#   --share-gpu" runs CP4 on one GPU; several sets, separated by ';', run one after
#   another, each report named after its arguments); TTFT="--runs 5 ..." runs
#   scripts/bench_e2e_ttft.py with those arguments (needs 2 GPUs; "--cp-size 1 ..." the stock
#   TP1 noise floor on one; JSON and logs to $out);
#   HICACHE="--tp 2 --share-gpu --parallel 4" runs scripts/e2e_hicache_logprobs.py (HiCache's host tier
#   under the flag vs a device hit; several sets separated by ';', each report named after them;
#   "... --runs device,off_storage,on_storage": its storage tier, L3, against a Mooncake store it
#   starts, which needs .gpu-site/mooncake-cuda13.tar.xz built with STORE=1);
#   CP_SIZES="3,5,6,7" runs scripts/repro_cp_sizes.py (stock in-seq split at those CP sizes, one GPU; CP_SIZES_ARGS adds options);
#   PD="--cp-size 1 ..." runs scripts/e2e_pd_gpu.py with those arguments (needs
#   .gpu-site/mooncake-cuda13.tar.xz from scripts/build_gpu_mooncake.sh; JSON and logs to $out;
#   PD_SEED=dir first copies dir/*.json, the runs of an earlier call, into its work folder;
#   several argument sets separated by ';' run one after another, each report named after them;
#   with SITE0523=1 the same script runs sglang 0.5.23's pair -- interleave CP, its Mooncake engine
#   from the stack part -- and keeps its runs apart from 0.5.12.post1's there, tag ".interleave");
#   SOAK="--cp-size 4 --share-gpu ..." runs scripts/soak_pd.py with those arguments (a PD pair under
#   load; its phases on/off/fault accumulate in ~/soak-work, SOAK_SEED=dir first copies dir/*.json,
#   an earlier call's phases, there; JSON to $out/soak_pd.json, the phases' records and server logs
#   to $out/soak-logs.tar.xz, packed every PACK_EVERY seconds while it runs; several sets separated
#   by ';' run at once, on their own ports, each report named after its arguments);
#   PD_BENCH="--cp-sizes 1,2,4 ..." runs scripts/bench_pd_transfer.py on this machine's CPU
#   cores (host buffers, Mooncake TCP on loopback, the same engine; JSON to $out);
#   SELFCHECK="--cp-size 2 ..." runs `python -m sglang_cp_shared_kv selfcheck --device cuda --json` with
#   those arguments (the ranks share the GPUs present; JSON to $out/selfcheck_cuda.json);
#   MATERIALIZE="--nprocs 2 ..." runs scripts/bench_materialize.py --collective over NCCL, one
#   process per GPU (history gathers vs a plain all-gather; chunk gathers, SGLang's vs local
#   writes; JSON to $out/bench_materialize_nccl.json).
# SITE0523=1: sglang 0.5.23 instead (issue 37): its stack from .gpu-site-0523/
#   (scripts/build_gpu_site_0523.sh), whose parts earlier calls of this warm machine carried
#   (CALLS.txt); assembled once into ~/site0523 (the torch group, the stack, triton38 where
#   its parts are there). NCCL0523=stub (default) runs torch 2.14.1 on the image's NCCL 2.28.9
#   with the stub of the 11 functions it lacks preloaded; NCCL0523=2.30.7 preloads the carried
#   NCCL instead (probe_torch214.sh tells which works). The image's CUDA libraries serve as
#   they are (build_gpu_site_0523.sh says why); the Mooncake engine rides in the stack.
# Optional: .gpu-site/jit-cache.tar.xz (a previous session's ~/.cache: SGLang's tvm-ffi,
# DeepGEMM and flashinfer JIT builds) is unpacked into ~/.cache first: servers start faster;
# without it, this machine's cache is packed to $out/jit-cache.tar.xz after every job, for the next.
# PACK=file: after every job, everything under $out is packed into that one tar.xz (the
# device tool brings back at most 8 files; a call stopped at its time limit keeps the last pack).
set -uo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
out=${OUT:-$root/gpu-out}
mkdir -p "$out"
site=$HOME/gpu-site
if [ "${SITE0523:-0}" = 1 ]; then
  site=$HOME/site0523 parts=.gpu-site-0523
  # the image's CUDA libraries, found through its own torch (before PYTHONPATH names ours)
  imgnv=$(python3 -c 'import os, torch; print(os.path.realpath(os.path.join(os.path.dirname(torch.__file__), "..", "nvidia")))')
  for group in torch stack triton38; do
    ls "$parts/$group.tar.xz.part"* >/dev/null 2>&1 || continue
    [ -f "$site/.unpacked-$group" ] && continue
    (cd "$parts" && sha256sum -c --quiet --ignore-missing SHA256SUMS) || { echo "gpu_session: $parts corrupt"; exit 1; }
    mkdir -p "$site" && cat "$parts/$group.tar.xz.part"* | xz -dc -T0 | tar -x -C "$site" \
      && touch "$site/.unpacked-$group" || { echo "gpu_session: unpacking $group failed"; exit 1; }
  done
  [ -d "$site/sglang" ] || echo "gpu_session: SITE0523=1: no stack in $parts yet (torch and Triton only)"
  export PYTORCH_SKIP_CUDNN_COMPATIBILITY_CHECK=1  # the image's cuDNN 9.19; nothing here runs a cuDNN kernel
  export LD_LIBRARY_PATH=$imgnv/cu13/lib:$imgnv/cudnn/lib:$imgnv/cusparselt/lib:$imgnv/nccl/lib:$imgnv/nvshmem/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
  case "${NCCL0523:-stub}" in
    stub) export LD_PRELOAD=$site/nccl-stub/libnccl_2_30_stubs.so ;;
    2.30.7) export LD_PRELOAD=$site/nccl-2.30.7/lib/libnccl.so.2 ;;
    *) echo "gpu_session: NCCL0523 must be stub or 2.30.7"; exit 2 ;;
  esac
  [ -d .wheels ] && [ ! -d "$site/_pytest" ] && python3 -m pip install -q --no-deps --no-index --target "$site" .wheels/*.whl
elif [ ! -d "$site/sglang" ]; then
  mkdir -p "$site" && tar -xJf .gpu-site/site312.tar.xz -C "$site"
  python3 -m pip install -q --no-deps --no-index --target "$site" .wheels/*.whl
fi
# (again where the carried bundle has the store, STORE=1, and the site does not yet)
if [ -f .gpu-site/mooncake-cuda13.tar.xz ] && { [ ! -f "$site/mooncake/engine.so" ] || { [ ! -d "$site/mooncake/store" ] \
    && tar -tJf .gpu-site/mooncake-cuda13.tar.xz ./mooncake/store/__init__.py >/dev/null 2>&1; }; }; then
  tar -xJf .gpu-site/mooncake-cuda13.tar.xz -C "$site"
fi
if [ -f .gpu-site/jit-cache.tar.xz ] && [ ! -d "$HOME/.cache/tvm-ffi" ]; then
  tar -xJf .gpu-site/jit-cache.tar.xz -C "$HOME"
fi
# The plugin travels as source on PYTHONPATH; SGLang finds plugins by entry point, so
# give it the entry point of an installed distribution.
dist=$site/sglang_cp_shared_kv-0.1.0.dist-info
if [ ! -f "$dist/entry_points.txt" ]; then
  mkdir -p "$dist"
  printf 'Metadata-Version: 2.1\nName: sglang-cp-shared-kv\nVersion: 0.1.0\n' > "$dist/METADATA"
  sed -n '/^\[project.entry-points."sglang.srt.plugins"\]/,/^$/p' pyproject.toml \
    | sed -e '1s/.*/[sglang.srt.plugins]/' -e 's/"//g' > "$dist/entry_points.txt"
fi
export PYTHONPATH="$site:$root/python:$root/sgl-kernel/python"
export LD_LIBRARY_PATH="$site/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"  # rdma-core/numa for Mooncake
export CUDA_HOME=/usr/local/cuda PATH=/usr/local/cuda/bin:$PATH HF_HUB_OFFLINE=1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
# NOTE: a call that ran out of time on a warm machine leaves its servers running (the scripts
# start each in its own session); they hold their ports and answer the next call's requests.
# Stop every process group of a leftover server first (the machine runs nothing else), unless
# KEEP_SERVERS=1: two sessions started side by side in one call (E2E beside PD) keep each other's.
[ "${KEEP_SERVERS:-0}" = 1 ] || for pid in $(pgrep -f "sglang.launch_server" || true); do
  pgid=$(ps -o pgid= "$pid" 2>/dev/null | tr -d ' ')
  [ -n "$pgid" ] && echo "gpu_session: stopping leftover SGLang server group $pgid" && kill -9 -- "-$pgid" 2>/dev/null
done
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$out/gpu.txt"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" | tee -a "$out/gpu.txt"
if [ "${SITE0523:-0}" = 1 ]; then  # Inductor on the Triton this site runs (the image's 3.6, or the carried 3.8)
  python3 -c "import torch; f = torch.compile(lambda x: (x * x).relu().sum(-1), dynamic=True); x = torch.randn(37, 129, device='cuda'); print('inductor', 'PASS' if torch.allclose(f(x), (x * x).relu().sum(-1), atol=1e-4) else 'FAIL')" 2>&1 | tail -3 | tee -a "$out/gpu.txt"
fi
status=0
jit_packed=""
checkpoint() {  # PACK: $out as one archive, rewritten after every job
  # this machine's JIT cache for the next machine, whenever it grew (not when one was carried)
  if [ ! -f .gpu-site/jit-cache.tar.xz ] && [ -d "$HOME/.cache" ]; then
    size=$(du -sb "$HOME/.cache" | cut -f1)
    [ "$size" != "$jit_packed" ] && tar -cJf "$out/jit-cache.tar.xz" -C "$HOME" .cache 2>/dev/null && jit_packed=$size
  fi
  [ -n "${PACK:-}" ] || return 0
  tar -cJf "$PACK.tmp" -C "$out" . 2>/dev/null && mv "$PACK.tmp" "$PACK"
}
pack_pd_runs() {  # the finished runs' records (carried to a later call by PD_SEED) and $out, packed
  tar -cJf "$out/pd-logs.tar.xz.tmp" -C "$HOME/pd-work" --exclude='tiny-*' . 2>/dev/null \
    && mv "$out/pd-logs.tar.xz.tmp" "$out/pd-logs.tar.xz"
  [ -z "${PACK:-}" ] || { tar -cJf "$PACK.tmp" -C "$out" --exclude='*.tmp' . 2>/dev/null && mv "$PACK.tmp" "$PACK"; }
}
# NOTE: one PD set can outlast a call (CP8, 10 runs at --parallel 5, did not end in 545 s on
# 2026-12-03 and brought nothing back): while it runs, its finished runs are packed every
# PACK_EVERY seconds, so a call stopped at its limit keeps them for PD_SEED.
pack_pd_runs_every() { while sleep "$1"; do pack_pd_runs; done; }
slug() { printf '%s' "$1" | sed -e 's/--//g' -e 's/[^A-Za-z0-9]\{1,\}/_/g' -e 's/^_//' -e 's/_$//'; }
if [ "${TESTS:-}" != none ]; then
  python3 -m pytest -q -p no:cacheprovider ${TESTS:-test/gpu} "$@" 2>&1 | tee "$out/gpu-tests.txt" || status=1
  checkpoint
fi
# NOTE: the short jobs first, so a server run that hits the call's time limit loses only itself
if [ -n "${MATERIALIZE:-}" ]; then
  python3 scripts/bench_materialize.py --collective $MATERIALIZE > "$out/bench_materialize_nccl.json" \
    2> "$out/bench_materialize_nccl.err" || { status=1; tail -5 "$out/bench_materialize_nccl.err"; }
  checkpoint
fi
if [ -n "${SELFCHECK:-}" ]; then
  python3 -m sglang_cp_shared_kv selfcheck --device cuda --json $SELFCHECK > "$out/selfcheck_cuda.json" \
    2> "$out/selfcheck_cuda.err" || status=1
  python3 -c "import json, sys; d = json.load(open(sys.argv[1])); print('selfcheck', d['verdict'], d['write_paths'])" \
    "$out/selfcheck_cuda.json" || tail -5 "$out/selfcheck_cuda.err"
  checkpoint
fi
if [ -n "${E2E:-}" ]; then
  runs=(--runs "$E2E"); [ "$E2E" = all ] && runs=()
  IFS=';' read -ra sets <<< "${E2E_ARGS:-}"; [ ${#sets[@]} -eq 0 ] && sets=("")
  for set in "${sets[@]}"; do
    name=e2e${set:+_$(slug "$set")}
    python3 scripts/e2e_cp_logprobs.py "${runs[@]}" $set --workdir "$HOME/e2e-work" \
      --logdir "$out/e2e-logs" --out "$out/$name.json" > "$out/$name.txt" 2>&1 || status=1
    mkdir -p "$out/e2e-runs" && cp "$HOME"/e2e-work/*.json "$out/e2e-runs/" 2>/dev/null
    grep -E '"pass"|FAILED' "$out/$name.txt" | tail -3
    checkpoint
  done
fi
if [ -n "${HICACHE:-}" ]; then
  IFS=';' read -ra sets <<< "$HICACHE"
  for set in "${sets[@]}"; do
    name=e2e_hicache_$(slug "$set")
    python3 scripts/e2e_hicache_logprobs.py $set --workdir "$HOME/e2e-hicache-work" --logdir "$out/e2e-hicache-logs" \
      --out "$out/$name.json" > "$out/$name.txt" 2>&1 || status=1
    # the runs' records (the report can be made again from them here: --runs "")
    mkdir -p "$out/e2e-hicache-runs" && cp "$HOME"/e2e-hicache-work/*.json "$out/e2e-hicache-runs/" 2>/dev/null
    grep -E '"pass"|FAILED' "$out/$name.txt" | tail -3
    checkpoint
  done
fi
if [ -n "${UNEVEN:-}" ]; then  # UNEVEN="--tp 8": scripts/repro_cp_uneven_split.py, one GPU
  python3 scripts/repro_cp_uneven_split.py $UNEVEN --workdir "$out/uneven-work" --out "$out/repro_cp_uneven_split.json" \
    > "$out/repro_cp_uneven_split.txt" 2>&1 || status=1
  rm -rf "$out/uneven-work/tiny-dsv32-64k"; tail -25 "$out/repro_cp_uneven_split.txt"
  checkpoint
fi
if [ -n "${CP_SIZES:-}" ]; then  # CP_SIZES="3,5,6,7": scripts/repro_cp_sizes.py, one flag-off server per size, one GPU
  python3 scripts/repro_cp_sizes.py --sizes "$CP_SIZES" ${CP_SIZES_ARGS:-} --workdir "$out/cp-sizes-work" \
    --out "$out/repro_cp_sizes.json" > "$out/repro_cp_sizes.txt" 2>&1 || status=1
  python3 -c "import json, sys; d = json.load(open(sys.argv[1])); print('cp sizes served', d['served'], 'not', d['not_served'])" \
    "$out/repro_cp_sizes.json" || tail -20 "$out/repro_cp_sizes.txt"
  checkpoint
fi
if [ -n "${TTFT:-}" ]; then
  # the work folder under $out: its server logs come back even if the call runs out of time
  python3 scripts/bench_e2e_ttft.py $TTFT --workdir "$out/ttft-work" --out "$out/bench_e2e_ttft.json" \
    > "$out/bench_e2e_ttft.txt" 2>&1 || status=1
  tail -20 "$out/bench_e2e_ttft.txt"
fi
if [ -n "${PD:-}" ]; then
  mkdir -p "$HOME/pd-work"
  # runs of an earlier call on another machine (their JSON from its pd-logs.tar.xz)
  [ -n "${PD_SEED:-}" ] && cp "$PD_SEED"/*.json "$HOME/pd-work/"
  IFS=';' read -ra sets <<< "$PD"
  for set in "${sets[@]}"; do
    name=e2e_pd_gpu; [ ${#sets[@]} -gt 1 ] && name=e2e_pd_gpu_$(slug "$set")
    pack_pd_runs_every "${PACK_EVERY:-60}" & packer=$!
    python3 scripts/e2e_pd_gpu.py $set --workdir "$HOME/pd-work" --logdir "$out/pd-logs" \
      --out "$out/$name.json" > "$out/$name.txt" 2>&1 || status=1
    kill "$packer" 2>/dev/null; wait "$packer" 2>/dev/null
    pack_pd_runs
    grep "^\[e2e-pd\]" "$out/$name.txt"; grep -E '"pass"' "$out/$name.txt" | tail -1
    checkpoint
  done
fi
if [ -n "${SOAK:-}" ]; then  # SOAK="--cp-size 4 --share-gpu --phases on,off": scripts/soak_pd.py, one GPU
  mkdir -p "$HOME/soak-work"
  [ -n "${SOAK_SEED:-}" ] && cp "$SOAK_SEED"/*.json "$HOME/soak-work/"  # phases of an earlier call (soak-logs.tar.xz)
  pack_soak() {
    tar -cJf "$out/soak-logs.tar.xz.tmp" -C "$HOME/soak-work" --exclude='tiny-*' . 2>/dev/null \
      && mv "$out/soak-logs.tar.xz.tmp" "$out/soak-logs.tar.xz"
    [ -z "${PACK:-}" ] || { tar -cJf "$PACK.tmp" -C "$out" --exclude='*.tmp' . 2>/dev/null && mv "$PACK.tmp" "$PACK"; }
  }
  ( while sleep "${PACK_EVERY:-60}"; do pack_soak; done ) & packer=$!
  # several sets separated by ';' go at once, set i from port 23000 + 100 i (a set's own --port
  # wins): they share the work folder, where each set's records carry its own tag
  IFS=';' read -ra sets <<< "$SOAK"
  names=(); pids=()
  for i in "${!sets[@]}"; do
    name=soak_pd; [ ${#sets[@]} -gt 1 ] && name=soak_pd_$(slug "${sets[$i]}")
    python3 scripts/soak_pd.py --port $((23000 + 100 * i)) ${sets[$i]} --workdir "$HOME/soak-work" \
      --out "$out/$name.json" > "$out/$name.txt" 2>&1 & pids+=($!); names+=("$name")
  done
  for pid in "${pids[@]}"; do wait "$pid" || status=1; done
  kill "$packer" 2>/dev/null; wait "$packer" 2>/dev/null
  pack_soak
  for name in "${names[@]}"; do
    echo "== $name"; grep "^\[soak\]" "$out/$name.txt"
    python3 -c "import json, sys; d = json.load(open(sys.argv[1])); [print('soak', v['pass'], k) for k, v in d['checks'].items()]; print('soak pass', d['pass'], 'phases', d['phases'], 'failed', d['failed_phases'])" \
      "$out/$name.json" || tail -20 "$out/$name.txt"
  done
  checkpoint
fi
if [ -n "${PD_BENCH:-}" ]; then
  python3 scripts/bench_pd_transfer.py $PD_BENCH --workdir "$HOME/pd-bench-work" --out "$out/bench_pd_transfer.json" \
    > "$out/bench_pd_transfer.txt" 2>&1 || status=1
  tar -cJf "$out/pd-bench-logs.tar.xz" -C "$HOME/pd-bench-work" . 2>/dev/null
  tail -30 "$out/bench_pd_transfer.txt"
fi
checkpoint
[ "${BENCH:-1}" = 0 ] && exit $status
for bench in scripts/bench_kernels.py scripts/bench_materialize.py; do
  [ -f "$bench" ] || continue
  name=$(basename "$bench" .py)
  python3 "$bench" > "$out/$name.json" 2> "$out/$name.err" || { status=1; tail -5 "$out/$name.err"; }
done
exit $status
