#!/usr/bin/env bash
# Launch one node of the (non-CP) decode server for a shared-KV prefill, with the flag:
# on a decode server it checks the deployment's environment at startup and refuses at once
# a request this decode can never hold (stock decode would hold it, and every request
# behind it, at the head of its queue). Prints the exact command (with its environment)
# before running it.
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
#   --off                   the same server without the flag (stock decode)
#   --dry-run               print the command, do not run it
#   -- ARGS...              passed to sglang.launch_server unchanged
set -euo pipefail
usage() { sed -n '2,23p' "$0" | sed 's/^# \{0,1\}//'; exit "${1:-2}"; }
source "$(dirname "$0")/launch_common.sh"

model="" tp="" port=30001 mem_fraction=0.85 guarded=1
while [ $# -gt 0 ]; do
  parse_common_option "$@"
  if [ "$shift_by" -gt 0 ]; then shift "$shift_by"; continue; fi
  case "$1" in
    --model) model=$2; shift 2 ;;
    --tp) tp=$2; shift 2 ;;
    --off) guarded=0; shift ;;
    -h|--help) usage 0 ;;
    --) shift; extra=("$@"); break ;;
    *) echo "launch_decode: unknown option '$1' (see --help)" >&2; exit 2 ;;
  esac
done
[ -n "$model" ] || { echo "launch_decode: --model is required" >&2; exit 2; }
case "$tp" in ''|*[!0-9]*) echo "launch_decode: --tp N (an integer >= 1) is required" >&2; exit 2 ;; esac
check_nodes launch_decode

cmd=("${PYTHON:-python3}" -m sglang.launch_server --model-path "$model" --trust-remote-code --tp-size "$tp"
     --disaggregation-mode decode)
common_server_args
[ "$guarded" = 1 ] && cmd+=(--enable-nsa-prefill-cp-shared-kv)
print_and_run
