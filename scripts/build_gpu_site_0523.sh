#!/usr/bin/env bash
# Build the sglang 0.5.23 GPU stack for the lent Hopper machine (issue 37), slimmed and split
# into parts that each fit one device call (64 MiB a call, the checkout included).
#
# The lent image has torch 2.11.0+cu130, Triton 3.6, NCCL 2.28.9, CUDA 13.0 (driver 580),
# Python 3.12 and no network. sglang 0.5.23 pins torch==2.14.1 (which pins triton~=3.8.0,
# nvidia-nccl-cu13==2.30.7, cudnn 9.24, cuda-toolkit 13.0.3). What this script carries and
# what it leaves to the image (measured on CPU 2026-12-06 for issue 37's feasibility study):
#   * torch 2.14.1 itself (libtorch_cpu / libtorch_cuda cannot come from the image);
#   * NOT the CUDA libraries: torch 2.14.1's NEEDED sonames (libcudart.so.13, libcublas(Lt).so.13,
#     libcufft.so.12, libcufile.so.0, libcurand.so.10, libcusparse.so.12, libcusolver.so.12,
#     libnvrtc.so.13, libcupti.so.13, libcusparseLt.so.0, libcudnn.so.9, libnvshmem_host.so.3)
#     all resolve, symbol by symbol, against the versions torch 2.11.0 installs
#     (cuda-toolkit 13.0.2 = 13.0.3 except cuBLAS 13.1.0.3 vs 13.1.1.3; cuDNN 9.19; cuSPARSELt
#     0.8.0; NVSHMEM 3.4.5), so the image's copies serve (cuDNN: set
#     PYTORCH_SKIP_CUDNN_COMPATIBILITY_CHECK=1; nothing here runs a cuDNN kernel);
#   * NCCL: the image's 2.28.9 lacks 11 symbols libtorch_cuda.so links (ncclCommGetUniqueId,
#     ncclCommGrow, ncclCommMemStats, ncclCommSuspend/Resume, ncclSignal/PutSignal/WaitSignal,
#     ncclWinGetUserPtr, ncclGet{Lsa,}Multimem/PeerDevicePointer), so `import torch` fails on it.
#     Two ways are packed: a stub library answering ncclInvalidUsage for those 11 (LD_PRELOAD it
#     beside the image's NCCL; source and an x86-64 build under nccl-stub/), and NCCL 2.30.7
#     itself, pruned to sm_90 (under nccl-2.30.7/lib; never LD_PRELOAD the stub with it);
#   * Triton 3.8 as a separate, optional group (the image's 3.6 may serve: see the report).
#
# Output (DEST, default .gpu-site-0523, must be git-ignored or it travels with every call):
#   <group>.tar.xz.partNN   parts of at most PART_MIB MiB (default 59; 64 MiB minus the ~3 MiB
#                           checkout); concatenate a group's parts in order, then xz -d | tar -x
#   SHA256SUMS, MANIFEST.txt (files per group, raw and compressed sizes, parts), CALLS.txt (which
#   parts each device call carries), probe_torch214.sh (the first device check, see section 6)
# Groups: torch (torch + nccl-2.30.7 + nccl-stub: everything the first probe needs), stack
# (sglang, sgl-kernel, FlashMLA, DeepGEMM, flashinfer, tvm-ffi, torchvision, pure-python deps,
# torch/include, Mooncake if .gpu-site/mooncake-cuda13.tar.xz exists), triton38 (optional).
# On the device: mkdir -p ~/site0523 && for g in torch stack; do cat .gpu-site-0523/$g.tar.xz.part* | xz -dc | tar -x -C ~/site0523; done
# Usage, from the project root: scripts/build_gpu_site_0523.sh [DEST]
# Env: PART_MIB (59), XZ_LEVEL (-9), TRITON38=0 skips that group, STRIP=0 keeps symbol tables.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
dest=$(realpath -m "${1:-$root/.gpu-site-0523}")
part_mib=${PART_MIB:-59}
xz_level=${XZ_LEVEL:--9}
case "$dest" in
  "$root"/*)  # inside the checkout: it must be ignored, else every device call would carry it
    rel=${dest#"$root"/}
    if ! git -C "$root" check-ignore -q "$rel/x" 2>/dev/null; then
      exclude=$(cd "$root" && realpath -m "$(git rev-parse --git-path info/exclude)")
      mkdir -p "$(dirname "$exclude")" && echo "/$rel/" >> "$exclude"
      echo "build_gpu_site_0523: added /$rel/ to $exclude (untracked files travel with every device call)"
    fi ;;
esac
mkdir -p "$dest"
work=$(mktemp -d); trap 'rm -rf "$work"' EXIT
site=$work/site
plat=(--only-binary=:all: --python-version 3.12 --implementation cp --abi cp312 --abi abi3 --abi none)
for p in 2_39 2_35 2_34 2_31 2_28 2_27 2_24 2_18 2_17; do plat+=(--platform "manylinux_${p}_x86_64"); done
plat+=(--platform manylinux2014_x86_64 --platform manylinux1_x86_64 --platform linux_x86_64 --platform any)

# --- 1. wheels (pinned to what sglang 0.5.23's resolution installs) -------------------------
# GPU stack: the pins of sglang 0.5.23 / torch 2.14.1.
big=(torch==2.14.1 nvidia-nccl-cu13==2.30.7 sglang==0.5.23 sglang-kernel==0.4.10 sgl-flash-mla==1.0.0
     flashinfer_python==0.7.2 apache-tvm-ffi==0.1.11 sgl-deep-gemm==0.2.3.post2 torchvision==0.29.1)
[ "${TRITON38:-1}" = 0 ] || big+=(triton==3.8.0)
# Pure-python / small deps that the 0.5.12.post1 bundle carried (updated to 0.5.23's pins) plus
# those sglang 0.5.23 imports unguarded that 0.5.12 did not (prometheus_client: the Mooncake
# connector). Left to the image because 0.5.12 servers imported them there: aiohttp, uvloop,
# xgrammar, einops, scipy, pillow, httpx, huggingface_hub 1.33, tokenizers 0.23.2 (= 0.5.23's
# pin), safetensors, sentencepiece, tiktoken, regex, requests, psutil, numpy 2.5, cuda-bindings,
# torchaudio 2.11.0 (= 0.5.23's pin; stable-ABI extension, loads under torch 2.14.1).
small=(annotated_types==0.8.0 cffi==2.1.1 compressed_tensors==0.18.0 dill==0.4.1 distro==1.9.0
       fastapi==0.165.0 gguf==0.19.0 ipython==9.19.1 jsonschema==4.26.0
       jsonschema_specifications==2025.9.1 loguru==0.7.3 msgspec==0.23.0 openai==2.8.0
       opentelemetry_api==1.45.3 orjson==3.13.0 partial_json_parser==0.2.1.1.post7
       prometheus_client==0.26.0 pybase64==1.5.1 pycparser==3.12 pydantic==2.14.4
       pydantic_core==2.50.5 python_multipart==0.0.34 pyzmq==27.3.0 referencing==0.37.0
       rpds_py==2026.9.1 setproctitle==1.3.8 sniffio==1.3.1 soundfile==0.13.1 starlette==1.10.0
       traitlets==5.16.1 transformers==5.19.0 typing_extensions==4.16.0 typing_inspection==0.4.5
       uvicorn==0.55.0)
# NOT carried, with why:
#   tilelang 0.1.12 (+ z3-solver, torch-c-dlpack-ext): on CUDA, sglang 0.5.23 imports it only for
#     --dsa-*-backend tilelang, SGLANG_OPT_USE_TILELANG_INDEXER=1, ROCm or MiniCPM (25 MiB as xz);
#   flash-attn-4, nvidia-cutlass-dsl, sgl-deep-ep, nccl4py, cuda-tile, humming-kernels, quack,
#     kernels, mistral_common, outlines, llguidance, modelscope...: imported behind try/except or
#     only by model families / backends a tiny DeepSeek-V3.2 DSA server does not take;
#   flashinfer-cubin / flashinfer-jit-cache: flashinfer JIT-compiles what it runs (nvcc 13 is there);
#   nvidia-cudnn-cu13 9.24, cuda-toolkit 13.0.3 libs, nvidia-cusparselt 0.8.1, nvshmem: the image's.
python3 -m pip download -q --no-deps "${plat[@]}" -d "$work/wheels" "${big[@]}" "${small[@]}"
python3 -m pip install -q --no-deps --no-compile "${plat[@]}" --target "$site" "$work"/wheels/*.whl

# --- 2. drops -------------------------------------------------------------------------------
cd "$site"
rm -rf bin share    # console scripts: nothing here runs them
# sgl-kernel: FlashAttention 3 (flash_ops, 1 GB) is imported lazily by sgl_kernel.flash_attn
# only (the DSA paths use FlashMLA; the dense short-prompt path that would take FA3 is turned
# off with SGLANG_DSA_PREFILL_DENSE_ATTN_KV_LEN_THRESHOLD=0); infllm_ops is loaded on demand by
# sgl_kernel.infllm_v2._loader (MiniCPM only); sm100/ is the Blackwell build of common_ops.
rm -rf sgl_kernel/flash_ops.abi3.so sgl_kernel/infllm_ops.*.so sgl_kernel/sm100
# sglang's Rust extensions for the Rust HTTP server, gRPC, multimodal processors and benchmarks
# are loaded only when those are switched on (rust_tree_core's mem_cache stays).
rm -f sglang/srt/rust_extensions/_{bench,grpc,multimodal,server}.*.so
# torch: CMake configs and the protobuf compiler are build-time tools (torch_shm_manager stays).
rm -rf torch/share torch/bin/protoc torch/bin/protoc-*
if [ -d triton ]; then
  # Triton: the AMD backend (and its entry point, else backend discovery imports it), the
  # Blackwell ptxas, CUPTI (the Proton profiler only), cuobjdump/nvdisasm (SASS dumps only),
  # the plugin test library. ptxas (CUDA 12.9, Hopper) and libdevice stay.
  rm -rf triton/backends/amd triton/backends/nvidia/bin/{cuobjdump,nvdisasm,ptxas-blackwell} \
         triton/backends/nvidia/lib/cupti triton/backends/nvidia/lib/cupti-blackwell \
         triton/plugins/libTritonPluginsTestLib.so
  sed -i '/^amd *=/d' triton-*.dist-info/entry_points.txt
fi
# NCCL 2.30.7 moves out of nvidia/: torch's RPATH ($ORIGIN/../../nvidia/nccl/lib) would pick it
# before the image's and the two ways could not be told apart. Headers and the device-API bitcode
# are for building device-initiated kernels, which nothing here does.
mkdir -p nccl-2.30.7/lib && mv nvidia/nccl/lib/libnccl.so.2 nccl-2.30.7/lib/ && rm -rf nvidia
mv nvidia_nccl_cu13-*.dist-info nccl-2.30.7/  # its metadata would claim a package the site does not hold
# The stub for the image's NCCL 2.28.9 (source + a build; gcc -shared -fPIC -O2 rebuilds it).
mkdir -p nccl-stub
cat > nccl-stub/nccl_2_30_stubs.c <<'EOF'
/* Symbols torch 2.14.1's libtorch_cuda.so links (built against NCCL 2.30.7) that NCCL 2.28.9 does
 * not export. Each answers ncclInvalidUsage (5). They serve communicator grow/suspend/resume,
 * memory statistics and the symmetric-memory signal API, which init and the collectives are not
 * expected to call (probe_torch214.sh case A checks). LD_PRELOAD beside the image's libnccl.so.2
 * only, never with NCCL 2.30.7 (the stubs would shadow the real functions). */
typedef int ncclResult_t;
#define STUB(name) ncclResult_t name() { return 5; }
STUB(ncclCommGetUniqueId) STUB(ncclCommGrow) STUB(ncclCommMemStats) STUB(ncclCommResume)
STUB(ncclCommSuspend) STUB(ncclGetLsaMultimemDevicePointer) STUB(ncclGetPeerDevicePointer)
STUB(ncclPutSignal) STUB(ncclSignal) STUB(ncclWaitSignal) STUB(ncclWinGetUserPtr)
EOF
gcc -O2 -shared -fPIC -o nccl-stub/libnccl_2_30_stubs.so nccl-stub/nccl_2_30_stubs.c

# --- 3. GPU code a Hopper GPU can never load: zeroed ------------------------------------------
# A fat binary holds per kernel module one entry per target. An sm_90 GPU loads only SASS built
# for sm_90/sm_90a or PTX of compute_XY with XY <= 90; every other entry's payload is zeroed in
# place (headers, sizes and file layout unchanged, so the driver parses the same container and
# picks the same entry as before). The zeros then cost nothing in the xz.
python3 - $(find . -name '*.so*' -type f -size +1M) <<'PY'
import mmap, struct, sys
MAGICS = (b"\x50\xed\x55\xba", b"\xb1\x43\x62\x46")  # 0xBA55ED50 executable, 0x466243B1 relocatable
def sections(mm):
    if mm[:4] != b"\x7fELF" or mm[4] != 2 or mm[5] != 1:
        return []
    shoff, = struct.unpack_from("<Q", mm, 0x28)
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", mm, 0x3A)
    hdr = lambda i: struct.unpack_from("<IIQQQQ", mm, shoff + i * shentsize)
    stroff = hdr(shstrndx)[4]
    out = []
    for i in range(shnum):
        name, typ, _f, _a, off, size = hdr(i)
        n = mm[stroff + name: mm.find(b"\0", stroff + name)].decode()
        if "fatbin" in n and typ != 8 and size:  # 8 = SHT_NOBITS
            out.append((off, size))
    return out
def containers(mm, start, end):
    pos, nxt = start, {m: mm.find(m, start, end) for m in MAGICS}
    while pos < end - 16:
        for m in MAGICS:
            if 0 <= nxt[m] < pos:
                nxt[m] = mm.find(m, pos, end)
        hits = [h for h in nxt.values() if h >= 0]
        if not hits:
            return
        off = min(hits)
        version, hsize, fsize = struct.unpack_from("<HHQ", mm, off + 4)
        if version == 1 and hsize == 16 and off + 16 + fsize <= end:
            yield off, fsize
            pos = off + 16 + fsize
        else:
            pos = off + 4
kept = zeroed = 0
for path in sys.argv[1:]:
    with open(path, "r+b") as f:
        mm = mmap.mmap(f.fileno(), 0)
        k = z = 0
        for start, size in sections(mm):
            for off, fsize in containers(mm, start, start + size):
                p, cend = off + 16, off + 16 + fsize
                while p + 64 <= cend:
                    kind, _v, ehsize, psize = struct.unpack_from("<HHIQ", mm, p)
                    arch, = struct.unpack_from("<I", mm, p + 28)
                    if ehsize < 64 or p + ehsize + psize > cend:
                        break  # a layout not understood: leave the rest of this container alone
                    usable = arch == 90 if kind in (2, 0x10) else (kind == 1 and arch <= 90)
                    if usable:
                        k += psize
                    else:
                        mm[p + ehsize:p + ehsize + psize] = bytes(psize)
                        z += psize
                    p += ehsize + psize
        mm.flush(); mm.close()
    if k or z:
        print(f"  fatbin {path}: kept {k / 2**20:.1f} MiB (sm_90), zeroed {z / 2**20:.1f} MiB")
    kept += k; zeroed += z
print(f"  fatbin total: kept {kept / 2**20:.1f} MiB, zeroed {zeroed / 2**20:.1f} MiB")
PY

# --- 4. symbols and debug info: never read by the dynamic loader ------------------------------
if [ "${STRIP:-1}" = 1 ]; then
  # torch's big libraries: .symtab/.strtab (dynamic symbols stay; only C++ backtraces of
  # non-exported functions lose their names). Others: DWARF only (libtriton.so has 254 MB of it).
  strip --strip-unneeded torch/lib/libtorch_cpu.so torch/lib/libtorch_cuda.so torch/lib/libtorch_python.so
  for f in $(find . -name '*.so*' -type f -size +1M); do
    case "$f" in ./torch/lib/libtorch_cpu.so|./torch/lib/libtorch_cuda.so|./torch/lib/libtorch_python.so) ;;
      *) strip --strip-debug "$f" 2>/dev/null || echo "  strip: left $f as it is" ;; esac
  done
fi

# Mooncake (CUDA 13 engine + rdma-core/numa libs), when scripts/build_gpu_mooncake.sh made it:
# only what `mooncake.engine` loads (the PD transfer). The store (`_store*.so`, `mooncake_master`,
# the libraries only they link) serves HiCache L3, which the 0.5.23 path refuses.
if [ -f "$root/.gpu-site/mooncake-cuda13.tar.xz" ]; then
  mkdir -p "$work/mc" && tar -xJf "$root/.gpu-site/mooncake-cuda13.tar.xz" -C "$work/mc"
  python3 - "$work/mc" <<'PY'
import os, re, subprocess, sys
root = sys.argv[1]
libs = {n: os.path.join(d, n) for d in ("mooncake", "mooncake_transfer_engine_cuda13.libs")
        if os.path.isdir(os.path.join(root, d)) for n in os.listdir(os.path.join(root, d))}
keep, todo = set(), ["mooncake/engine.so"]
while todo:
    rel = todo.pop()
    if rel in keep:
        continue
    keep.add(rel)
    dyn = subprocess.run(["readelf", "-dW", os.path.join(root, rel)], capture_output=True, text=True).stdout
    todo += [libs[n] for n in re.findall(r"\(NEEDED\).*\[(.*)\]", dyn) if n in libs]
for rel in libs.values():
    path = os.path.join(root, rel)
    if os.path.isfile(path) and not rel.endswith(".py") and rel not in keep and (".so" in rel or os.access(path, os.X_OK)):
        os.remove(path)
print("  mooncake: kept", " ".join(sorted(os.path.basename(k) for k in keep)))
PY
  cp -a "$work/mc/." "$site/"
fi

# --- 5. groups, xz, parts -----------------------------------------------------------------------
torch_group=(torch functorch torchgen torch-2.14.1.dist-info nccl-2.30.7 nccl-stub)
triton_group=()
[ -d triton ] && triton_group=(triton triton-3.8.0.dist-info)
stack_group=()
for e in $(ls -A); do
  case " ${torch_group[*]} ${triton_group[*]} " in *" $e "*) ;; *) stack_group+=("$e") ;; esac
done
rm -f "$dest"/*.tar.xz.part* "$dest/SHA256SUMS" "$dest/MANIFEST.txt"
pack() {  # pack NAME TAR-ARGS...: one xz stream, split into parts
  local name=$1; shift
  local raw; raw=$(tar -cf - "$@" | wc -c)
  tar -cf - "$@" | xz "$xz_level" -T0 | split -b "${part_mib}M" -d -a 2 - "$dest/$name.tar.xz.part"
  local xzb; xzb=$(cat "$dest/$name.tar.xz.part"* | wc -c)
  local n; n=$(ls "$dest/$name.tar.xz.part"* | wc -l)
  awk -v n="$name" -v r="$raw" -v x="$xzb" -v p="$n" -v w="$*" \
    'BEGIN { printf "%-8s raw %7.1f MiB  xz %6.1f MiB  parts %s  (%s)\n", n, r / 1048576, x / 1048576, p, w }' \
    | tee -a "$dest/MANIFEST.txt"
}
# torch/include rides with the stack, so the torch group stays the smallest thing the first probe
# needs. It is not optional: DeepGEMM 0.2.3's JIT kernels (the DSA indexer's fp8 MQA logits)
# include torch's stable C shim headers (deep_jit/backend/cuda/stable_torch_utils.h).
pack torch --exclude=torch/include "${torch_group[@]}"
pack stack "${stack_group[@]}" torch/include
[ ${#triton_group[@]} -eq 0 ] || pack triton38 "${triton_group[@]}"
(cd "$dest" && sha256sum *.tar.xz.part* > SHA256SUMS)
ls -la "$dest"
echo "parts: $(ls "$dest"/*.tar.xz.part* | wc -l) of at most $part_mib MiB; total $(du -cb "$dest"/*.tar.xz.part* | tail -1 | cut -f1 | awk '{printf "%.1f MiB", $1/1048576}')"

# --- 6. the probe of issue 37's riskiest question, and a call plan ----------------------------
# probe_torch214.sh runs on the device once the torch group's parts are there (it travels in
# DEST, carried with the last torch part): image facts; torch 2.14.1 + a CUDA op + a two-rank
# NCCL all-gather/all-reduce on the one GPU (distinct NCCL_HOSTID, sockets over lo, as the
# e2e --share-gpu mode does) (A) with the image's NCCL 2.28.9 and the stub, (B) with the
# carried NCCL 2.30.7; (C) torch.compile (Inductor) on the image's Triton 3.6.
cat > "$dest/probe_torch214.sh" <<'EOF'
#!/usr/bin/env bash
# Usage on the device, from the project root: bash .gpu-site-0523/probe_torch214.sh  (OUT: results)
set -uo pipefail
d=$(cd "$(dirname "$0")" && pwd); site=${SITE0523:-$HOME/site0523}; out=${OUT:-/tmp/probe-out}; mkdir -p "$out"
imgnv=$(python3 -c 'import os, torch; print(os.path.realpath(os.path.join(os.path.dirname(torch.__file__), "..", "nvidia")))')
{ nvidia-smi --query-gpu=name,driver_version --format=csv,noheader; python3 -m pip list --format=freeze
  ls "$imgnv"/*/lib; command -v gcc xz zstd; xz --version | head -1; } > "$out/image.txt" 2>&1
echo "image nvidia libs: $imgnv"; grep -iE '^(torch|triton|nvidia-(nccl|cudnn|cublas|cusparselt)|xgrammar|uvloop|aiohttp|torchvision)[=-]' "$out/image.txt"
if [ ! -f "$site/torch/__init__.py" ]; then
  (cd "$d" && sha256sum -c --quiet --ignore-missing SHA256SUMS) || { echo "parts corrupt"; exit 1; }
  mkdir -p "$site" && cat "$d"/torch.tar.xz.part* | xz -dc -T0 | tar -x -C "$site" || exit 1
  touch "$site/.unpacked-torch"  # scripts/gpu_session.sh (SITE0523=1) then leaves the group as it is
fi
export LD_LIBRARY_PATH=$imgnv/cu13/lib:$imgnv/cudnn/lib:$imgnv/cusparselt/lib:$imgnv/nccl/lib:$imgnv/nvshmem/lib
export PYTHONPATH=$site PYTORCH_SKIP_CUDNN_COMPATIBILITY_CHECK=1 NCCL_SOCKET_IFNAME=lo NCCL_IB_DISABLE=1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
cat > "$out/probe.py" <<'PY'
import ctypes, os, sys
import torch, torch.distributed as dist, torch.multiprocessing as mp
def rank(r, n, port, q):
    os.environ["NCCL_HOSTID"] = f"probe-{port}-{r}"  # two ranks of one communicator on one GPU
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=r, world_size=n)
    x = torch.full((4,), float(r + 1), device="cuda"); y = torch.empty(4 * n, device="cuda")
    dist.all_gather_into_tensor(y, x); dist.all_reduce(x); torch.cuda.synchronize()
    q.put(y.tolist() == [float(i + 1) for i in range(n) for _ in range(4)] and x.tolist() == [n * (n + 1) / 2] * 4)
    dist.destroy_process_group()
if __name__ == "__main__":
    v = ctypes.c_int(); ctypes.CDLL("libnccl.so.2").ncclGetVersion(ctypes.byref(v))
    print("import torch", torch.__version__, "PASS; NCCL runtime", v.value, flush=True)
    a = torch.randn(1024, 1024, device="cuda", dtype=torch.bfloat16)
    print(torch.cuda.get_device_name(0), "bf16 matmul", "PASS" if float((a @ a).float().abs().sum()) > 0 else "FAIL")
    ctx = mp.get_context("spawn"); q = ctx.Queue(); port = int(sys.argv[1])
    ps = [ctx.Process(target=rank, args=(r, 2, port, q)) for r in range(2)]
    [p.start() for p in ps]; [p.join(150) for p in ps]
    ok = all(p.exitcode == 0 for p in ps) and all(q.get(timeout=5) for _ in ps)
    print("NCCL 2-rank all_gather + all_reduce:", "PASS" if ok else f"FAIL exit codes {[p.exitcode for p in ps]}")
PY
echo "== A: image NCCL + stub"; LD_PRELOAD=$site/nccl-stub/libnccl_2_30_stubs.so timeout 200 python3 "$out/probe.py" 29511 2>&1 | tail -12 | tee "$out/probe_a.txt"
# B only where A did not pass, unless PROBE_B=1 (device time: A passing answers the question)
if [ "${PROBE_B:-0}" = 1 ] || ! grep -q "all_reduce: PASS" "$out/probe_a.txt"; then
  echo "== B: carried NCCL 2.30.7"; LD_PRELOAD=$site/nccl-2.30.7/lib/libnccl.so.2 timeout 200 python3 "$out/probe.py" 29512 2>&1 | tail -12
fi
echo "== C: torch.compile with the image's Triton"; LD_PRELOAD=$site/nccl-stub/libnccl_2_30_stubs.so timeout 200 python3 - <<'PY' 2>&1 | tail -8
import torch, triton
print("triton", triton.__version__, triton.__file__)
f = torch.compile(lambda x, y: (x * y).relu().sum(-1), dynamic=True)
x, y = torch.randn(37, 129, device="cuda"), torch.randn(37, 129, device="cuda")
print("inductor on triton:", "PASS" if torch.allclose(f(x, y), (x * y).relu().sum(-1), atol=1e-4) else "FAIL")
PY
EOF
chmod +x "$dest/probe_torch214.sh"
# Call plan: parts in order (torch, stack, triton38), packed greedily into calls of at most
# PART_MIB MiB (small tails share a call). A call must follow the one before within the
# machine's 30 s warm window, or the parts carried so far are gone.
(cd "$dest" && for g in torch stack triton38; do for f in "$g".tar.xz.part*; do if [ -f "$f" ]; then echo "$(stat -c %s "$f") $f"; fi; done; done | awk -v lim=$((part_mib * 1048576)) -v dir="$(basename "$dest")" '
  { sz = $1; f = $2; if (cur + sz > lim && cur > 0) { n++; print "call " n ": " line " (" sprintf("%.1f", cur / 1048576) " MiB)"; line = ""; cur = 0 }
    line = line (line ? " " : "") dir "/" f; cur += sz }
  END { n++; print "call " n ": " line " (" sprintf("%.1f", cur / 1048576) " MiB)" }' ) | tee "$dest/CALLS.txt"
echo "add probe_torch214.sh and SHA256SUMS to the carry of the call with the last torch part"
