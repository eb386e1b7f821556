# Sourced by scripts/launch_prefill.sh and scripts/launch_decode.sh: the options both take,
# and printing then running the command. Not a command itself.

# Defaults of the shared options (each script sets its own --port and --mem-fraction-static).
host=0.0.0.0 nnodes=1 node_rank=0 dist_init_addr="" ib_device="" kv_dtype=bfloat16
context_length="" base_gpu=0 dry_run=0 extra=()

# parse_common_option "$@": consume one shared option; sets $shift_by (0: not a shared option).
parse_common_option() {
  shift_by=2
  case "$1" in
    --host) host=$2 ;;
    --port) port=$2 ;;
    --nnodes) nnodes=$2 ;;
    --node-rank) node_rank=$2 ;;
    --dist-init-addr) dist_init_addr=$2 ;;
    --ib-device) ib_device=$2 ;;
    --kv-cache-dtype) kv_dtype=$2 ;;
    --mem-fraction-static) mem_fraction=$2 ;;
    --context-length) context_length=$2 ;;
    --base-gpu-id) base_gpu=$2 ;;
    --dry-run) dry_run=1; shift_by=1 ;;
    *) shift_by=0 ;;
  esac
}

# check_nodes NAME: a multi-node server needs the address its nodes meet at.
check_nodes() {
  if [ "$nnodes" -gt 1 ] && [ -z "$dist_init_addr" ]; then
    echo "$1: --dist-init-addr HOST:PORT is required with --nnodes $nnodes" >&2; exit 2
  fi
}

# common_server_args: append the shared sglang.launch_server options to cmd.
common_server_args() {
  cmd+=(--disaggregation-transfer-backend mooncake --kv-cache-dtype "$kv_dtype"
        --mem-fraction-static "$mem_fraction" --host "$host" --port "$port" --base-gpu-id "$base_gpu"
        --enable-metrics)
  [ "$nnodes" -gt 1 ] && cmd+=(--nnodes "$nnodes" --node-rank "$node_rank" --dist-init-addr "$dist_init_addr")
  [ -n "$ib_device" ] && cmd+=(--disaggregation-ib-device "$ib_device")
  [ -n "$context_length" ] && cmd+=(--context-length "$context_length")
  return 0
}

# print_and_run: show the command with its environment, then run it (unless --dry-run).
# Every CP rank sends its own pages; decode must wait for all of them: the variable goes on
# both servers.
print_and_run() {
  local env_vars=(SGLANG_DISAGGREGATION_ALL_CP_RANKS_TRANSFER=1)
  cmd+=("${extra[@]}")
  printf '%s \\\n  ' "${env_vars[@]}" && printf '%q ' "${cmd[@]}" && printf '\n'
  [ "$dry_run" = 1 ] && exit 0
  exec env "${env_vars[@]}" "${cmd[@]}"
}
