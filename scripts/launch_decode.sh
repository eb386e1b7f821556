#!/usr/bin/env bash
# Launch one node of the (non-CP) decode server for a shared-KV prefill. It needs no
# plugin flag; installing the plugin adds the prefill's failure cause to decode's errors.
# Prints the exact command (with its environment) before running it.
#
#   scripts/launch_decode.sh --model deepseek-ai/DeepSeek-V3.2 --tp 8
#   scripts/launch_decode.sh --model zai-org/GLM-5-FP8 --tp 16 --nnodes 2 --node-rank 1 \
#       --dist-init-addr 10.0.0.3:5000 --ib-device mlx5_0,mlx5_1 --kv-cache-dtype fp8_e4m3
#
# Options (defaults in brackets):
#   --model PATH            the prefill's model (required)
#   --tp N                  decode tensor-parallel size over all nodes (required)
#   --host H [0.0.0.0]      HTTP host;  --port P [30001] HTTP port
#   --nnodes N [1] --node-rank R [0] --dist-init-addr HOST:PORT (required when nnodes > 1)
#   --ib-device DEVS        RDMA devices for Mooncake; none: TCP fallback
#   --kv-cache-dtype D [bfloat16]  the prefill's (the transfer copies bytes)
#   --mem-fraction-static F [0.85]  --context-length N (give prefill the same)
#   --base-gpu-id G [0]     first GPU (to share a node with a prefill in a test pair)
#   --dry-run               print the command, do not run it
#   -- ARGS...              passed to sglang.launch_server unchanged
set -euo pipefail
usage() { sed -n '2,21p' "$0" | sed 's/^# \{0,1\}//'; exit "${1:-2}"; }

model="" tp="" host=0.0.0.0 port=30001 nnodes=1 node_rank=0 dist_init_addr="" ib_device=""
kv_dtype=bfloat16 mem_fraction=0.85 context_length="" base_gpu=0 dry_run=0 extra=()
while [ $# -gt 0 ]; do
  case "$1" in
    --model) model=$2; shift 2 ;;
    --tp) tp=$2; shift 2 ;;
    --host) host=$2; shift 2 ;;
    --port) port=$2; shift 2 ;;
    --nnodes) nnodes=$2; shift 2 ;;
    --node-rank) node_rank=$2; shift 2 ;;
    --dist-init-addr) dist_init_addr=$2; shift 2 ;;
    --ib-device) ib_device=$2; shift 2 ;;
    --kv-cache-dtype) kv_dtype=$2; shift 2 ;;
    --mem-fraction-static) mem_fraction=$2; shift 2 ;;
    --context-length) context_length=$2; shift 2 ;;
    --base-gpu-id) base_gpu=$2; shift 2 ;;
    --dry-run) dry_run=1; shift ;;
    -h|--help) usage 0 ;;
    --) shift; extra=("$@"); break ;;
    *) echo "launch_decode: unknown option '$1' (see --help)" >&2; exit 2 ;;
  esac
done
[ -n "$model" ] || { echo "launch_decode: --model is required" >&2; exit 2; }
case "$tp" in ''|*[!0-9]*) echo "launch_decode: --tp N (an integer >= 1) is required" >&2; exit 2 ;; esac
if [ "$nnodes" -gt 1 ] && [ -z "$dist_init_addr" ]; then
  echo "launch_decode: --dist-init-addr HOST:PORT is required with --nnodes $nnodes" >&2; exit 2
fi

python=${PYTHON:-python3}
# Wait for a response from every prefill CP rank (each sends only its own pages).
env_vars=(SGLANG_DISAGGREGATION_ALL_CP_RANKS_TRANSFER=1)
cmd=("$python" -m sglang.launch_server --model-path "$model" --trust-remote-code --tp-size "$tp"
     --disaggregation-mode decode --disaggregation-transfer-backend mooncake
     --kv-cache-dtype "$kv_dtype" --mem-fraction-static "$mem_fraction"
     --host "$host" --port "$port" --base-gpu-id "$base_gpu" --enable-metrics)
[ "$nnodes" -gt 1 ] && cmd+=(--nnodes "$nnodes" --node-rank "$node_rank" --dist-init-addr "$dist_init_addr")
[ -n "$ib_device" ] && cmd+=(--disaggregation-ib-device "$ib_device")
[ -n "$context_length" ] && cmd+=(--context-length "$context_length")
cmd+=("${extra[@]}")

printf '%s \\\n  ' "${env_vars[@]}" && printf '%q ' "${cmd[@]}" && printf '\n'
[ "$dry_run" = 1 ] && exit 0
exec env "${env_vars[@]}" "${cmd[@]}"
