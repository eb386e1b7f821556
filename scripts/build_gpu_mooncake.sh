#!/usr/bin/env bash
# Build .gpu-site/mooncake-cuda13.tar.xz here (network needed), for a lent GPU machine that
# has no network and no rdma-core: the CUDA 13 Mooncake engine slimmed to what
# `mooncake.engine` loads (engine.so, libasio, libetcd_wrapper and the four wheel libraries
# they link, ~36 MB -> ~7 MB as xz) plus libibverbs1 / libmlx5 (ibverbs-providers) /
# libnuma1 from Debian, unpacked under lib/. scripts/gpu_session.sh unpacks it into the
# site folder and puts lib/ on LD_LIBRARY_PATH. See ../shared/docs/gpu-testing.md.
# Usage: scripts/build_gpu_mooncake.sh [out_dir]   (default .gpu-site)
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
closure=$(python3 - "$work/wheel" <<'PY'
import os, re, subprocess, sys
root = sys.argv[1]
ships = {}
for sub in ("mooncake", "mooncake_transfer_engine_cuda13.libs"):
    for name in os.listdir(os.path.join(root, sub)):
        ships[name] = os.path.join(sub, name)
seen, todo = set(), ["mooncake/engine.so"]
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
(cd "$work/debs" && apt-get download -q libibverbs1 ibverbs-providers libnuma1 >/dev/null)
for deb in "$work"/debs/*.deb; do dpkg -x "$deb" "$work/debs/root"; done
cp -a "$work"/debs/root/usr/lib/x86_64-linux-gnu/{libibverbs.so.1*,libmlx5.so.1*,libnuma.so.1*} "$work/site/lib/"
tar -cJf "$out/mooncake-cuda13.tar.xz" -C "$work/site" .
echo "$out/mooncake-cuda13.tar.xz: $(du -h "$out/mooncake-cuda13.tar.xz" | cut -f1) (mooncake-transfer-engine-cuda13 $version:" \
  $(echo "$closure" | xargs -n1 basename | tr '\n' ' ')"+ libibverbs, libmlx5, libnuma)"
