#!/usr/bin/env bash
# Build .gpu-site/mooncake-cuda13.tar.xz here (network needed), for a lent GPU machine that
# has no network and no rdma-core: the CUDA 13 Mooncake engine slimmed to what
# `mooncake.engine` loads (engine.so, libasio, libetcd_wrapper and the four wheel libraries
# they link, ~36 MB -> ~7 MB as xz) plus libibverbs1 / libmlx5 (ibverbs-providers) /
# libnuma1 from Debian, unpacked under lib/. scripts/gpu_session.sh unpacks it into the
# site folder and puts lib/ on LD_LIBRARY_PATH. See ../shared/docs/gpu-testing.md.
# STORE=1 adds the Mooncake store for HiCache's storage tier (L3): `mooncake.store` (its
# native module and the wheel libraries it links) and `mooncake_master` (bin/), for
# scripts/e2e_hicache_logprobs.py's storage runs (mooncake/mooncake_master, beside the package). NOTE: libcurl and libcudart 13, which the
# store links, are on the lent image already (gpu-testing.md); libzmq and libcrypto ship in the wheel.
# Usage: [STORE=1] scripts/build_gpu_mooncake.sh [out_dir]   (default .gpu-site)
set -euo pipefail
out=$(realpath -m "${1:-.gpu-site}")
version=0.3.14
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
mkdir -p "$out" "$work/wheel" "$work/site/mooncake" "$work/site/lib" "$work/debs"
pip download -q --no-deps --only-binary=:all: --python-version 3.12 --platform manylinux_2_28_x86_64 \
  -d "$work" "mooncake-transfer-engine-cuda13==$version"
unzip -q "$work"/mooncake_transfer_engine_cuda13-*.whl -d "$work/wheel"
# the closure of engine.so's NEEDED entries that the wheel itself ships
roots="mooncake/engine.so"
if [ "${STORE:-0}" = 1 ]; then
  roots="$roots $(cd "$work/wheel" && ls mooncake/_store.cpython-312-*.so) mooncake/mooncake_master"
fi
closure=$(python3 - "$work/wheel" $roots <<'PY'
import os, re, subprocess, sys
root, roots = sys.argv[1], sys.argv[2:]
ships = {}
for sub in ("mooncake", "mooncake_transfer_engine_cuda13.libs"):
    for name in os.listdir(os.path.join(root, sub)):
        ships[name] = os.path.join(sub, name)
seen, todo = set(), list(roots)
while todo:
    rel = todo.pop()
    if rel in seen:
        continue
    seen.add(rel)
    dyn = subprocess.run(["readelf", "-d", os.path.join(root, rel)], capture_output=True, text=True, check=True).stdout
    todo += [ships[n] for n in re.findall(r"\(NEEDED\).*\[(.*)\]", dyn) if n in ships]
print("\n".join(sorted(seen)))
PY
)
(cd "$work/wheel" && cp --parents $closure mooncake/*.py "$work/site/")
if [ "${STORE:-0}" = 1 ]; then
  (cd "$work/wheel" && cp -r --parents mooncake/store "$work/site/")
  # NOTE: mooncake_master links its own renamed copies of libetcd_wrapper and libasio (19 MB);
  # where a copy has the Build ID of the one in mooncake/, it becomes a link to it
  for lib in "$work"/site/mooncake_transfer_engine_cuda13.libs/*; do
    id=$(readelf -n "$lib" | awk '/Build ID/ {print $3}')
    for twin in "$work"/site/mooncake/*.so; do
      if [ -n "$id" ] && [ "$(readelf -n "$twin" | awk '/Build ID/ {print $3}')" = "$id" ]; then
        ln -sf "../mooncake/$(basename "$twin")" "$lib"
      fi
    done
  done
fi
(cd "$work/debs" && apt-get download -q libibverbs1 ibverbs-providers libnuma1 >/dev/null)
for deb in "$work"/debs/*.deb; do dpkg -x "$deb" "$work/debs/root"; done
cp -a "$work"/debs/root/usr/lib/x86_64-linux-gnu/{libibverbs.so.1*,libmlx5.so.1*,libnuma.so.1*} "$work/site/lib/"
XZ_OPT=-9 tar -cJf "$out/mooncake-cuda13.tar.xz" -C "$work/site" .
echo "$out/mooncake-cuda13.tar.xz: $(du -h "$out/mooncake-cuda13.tar.xz" | cut -f1) (mooncake-transfer-engine-cuda13 $version${STORE:+, store}:" \
  $(echo "$closure" | xargs -n1 basename | tr '\n' ' ')"+ libibverbs, libmlx5, libnuma)"
