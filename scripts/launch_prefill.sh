#!/usr/bin/env bash
# Launch one node of a shared-KV prefill server (NSA model, in-seq-split CP, PD prefill,
# Mooncake). Prints the exact command (with its environment) before running it.
#
#   scripts/launch_prefill.sh --model deepseek-ai/DeepSeek-V3.2 --cp-size 8
#   scripts/launch_prefill.sh --model zai-org/GLM-5-FP8 --cp-size 8 --ib-device mlx5_0,mlx5_1 \
#       --kv-cache-dtype fp8_e4m3
#
# Options (defaults in brackets):
#   --model PATH            model path or Hugging Face id (required)
#   --cp-size N             prefill CP size = --tp-size (required: 2, 4 or 8, all SGLang's in-seq split serves)
#   --host H [0.0.0.0]      HTTP host;  --port P [30000] HTTP port
#   --bootstrap-port P [8998]  Mooncake bootstrap port (decode and the router use it)
#   --nnodes N [1] --node-rank R [0] --dist-init-addr HOST:PORT (required when nnodes > 1)
#   --ib-device DEVS        RDMA devices for Mooncake (e.g. mlx5_0,mlx5_1); none: TCP fallback
#   --kv-cache-dtype D [bfloat16]  bfloat16 or fp8_e4m3; decode must use the same
#   --mem-fraction-static F [0.8]  --context-length N (default: the model's)
#   --base-gpu-id G [0]     first GPU (to share a node with decode in a test pair)
#   --off                   the same server without shared KV (stock replicated CP)
#   --dry-run               print the command, do not run it
#   -- ARGS...              passed to sglang.launch_server unchanged
set -euo pipefail
usage() { sed -n '2,21p' "$0" | sed 's/^# \{0,1\}//'; exit "${1:-2}"; }
source "$(dirname "$0")/launch_common.sh"

model="" cp_size="" port=30000 mem_fraction=0.8 bootstrap_port=8998 shared=1
while [ $# -gt 0 ]; do
  parse_common_option "$@"
  if [ "$shift_by" -gt 0 ]; then shift "$shift_by"; continue; fi
  case "$1" in
    --model) model=$2; shift 2 ;;
    --cp-size) cp_size=$2; shift 2 ;;
    --bootstrap-port) bootstrap_port=$2; shift 2 ;;
    --off) shared=0; shift ;;
    -h|--help) usage 0 ;;
    --) shift; extra=("$@"); break ;;
    *) echo "launch_prefill: unknown option '$1' (see --help)" >&2; exit 2 ;;
  esac
done
[ -n "$model" ] || { echo "launch_prefill: --model is required" >&2; exit 2; }
case "$cp_size" in ''|*[!0-9]*) echo "launch_prefill: --cp-size N (an integer >= 2) is required" >&2; exit 2 ;; esac
case "$cp_size" in
  2|4|8) ;;
  *) echo "launch_prefill: --cp-size must be 2, 4 or 8 (one rank has nothing to shard; SGLang 0.5.12.post1's" \
       "in-seq-split CP serves no other size and at most 8 ranks: docs/troubleshooting.md)" >&2; exit 2 ;;
esac
check_nodes launch_prefill

cmd=("${PYTHON:-python3}" -m sglang.launch_server --model-path "$model" --trust-remote-code
     --tp-size "$cp_size" --enable-nsa-prefill-context-parallel --nsa-prefill-cp-mode in-seq-split
     --disaggregation-mode prefill --disaggregation-bootstrap-port "$bootstrap_port")
common_server_args
[ "$shared" = 1 ] && cmd+=(--enable-nsa-prefill-cp-shared-kv)
print_and_run
