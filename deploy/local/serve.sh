#!/usr/bin/env bash
# A pool of vLLM servers on one multi-GPU machine, each pinned to its own GPUs.
#
#   MODEL=Qwen/Qwen3-8B deploy/local/serve.sh                 # one server per GPU
#   MODEL=Qwen/Qwen3-32B deploy/local/serve.sh -g 2 -- --max-model-len 8192
#
# Options:
#   -n N      number of servers (default: the GPUs nvidia-smi lists, divided by -g)
#   -g K      GPUs per server (default 1): server i gets GPUs i*K .. i*K+K-1 through
#             CUDA_VISIBLE_DEVICES, and --tensor-parallel-size K when K > 1
#   -p PORT   ports PORT, PORT+1, ... (default 8000)
#   -d DIR    folder where each server announces its URL as gpu<i>.url while it is
#             healthy, for `llm-annotator run --servers-dir DIR` (default ./servers)
#   --        what follows goes to every vLLM server
#
# Prints one base URL per line once every server is healthy, then serves until SIGINT or
# SIGTERM, and stops them all. A server that exits withdraws its URL; the others go on.
# The other settings of deploy/slurm/server.sbatch apply here too: VLLM_CMD, VLLM_ARGS,
# SERVED_MODEL_NAME, BIND_HOST, ADVERTISE_HOST (default 127.0.0.1), STARTUP_TIMEOUT.
# Each server's output goes to DIR/gpu<i>.log.
#
# Then, in another shell:
#   llm-annotator run --servers-dir servers --input data.jsonl --output-dir runs/x \
#       --prompt-template 'Classify the sentiment of: {text}'
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
server_script="$here/../slurm/server.sbatch"
num_servers=""
gpus_per_server=1
port_base=8000
servers_dir="servers"

usage() {
    sed -n '2,20p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//' >&2
    exit 2
}

while (($# > 0)); do
    case "$1" in
        -n) num_servers="${2:?}" && shift 2 ;;
        -g) gpus_per_server="${2:?}" && shift 2 ;;
        -p) port_base="${2:?}" && shift 2 ;;
        -d) servers_dir="${2:?}" && shift 2 ;;
        --) shift && break ;;
        -h | --help) usage ;;
        *) echo "serve.sh: unknown option $1" >&2 && usage ;;
    esac
done
: "${MODEL:?set MODEL to the model to serve}"
[[ "$gpus_per_server" =~ ^[1-9][0-9]*$ ]] || usage

if [[ -z "$num_servers" ]]; then
    gpus="$(nvidia-smi --list-gpus 2>/dev/null | grep -c '^GPU' || true)"
    num_servers=$((gpus / gpus_per_server))
    ((num_servers > 0)) || num_servers=1
fi
[[ "$num_servers" =~ ^[1-9][0-9]*$ ]] || usage

mkdir -p "$servers_dir"
servers_dir="$(cd "$servers_dir" && pwd)"
extra="${VLLM_ARGS:-}"
((gpus_per_server > 1)) && extra+=" --tensor-parallel-size $gpus_per_server"
extra+="${*:+ $*}"

pids=()
# shellcheck disable=SC2317 # called from the trap
stop_all() {
    trap - TERM INT
    echo "serve.sh: stopping ${#pids[@]} servers" >&2
    kill -TERM "${pids[@]}" 2>/dev/null || true
    wait "${pids[@]}" 2>/dev/null || true
    exit 0
}
trap stop_all TERM INT

for ((i = 0; i < num_servers; i++)); do
    first=$((i * gpus_per_server))
    devices="$(seq -s , "$first" $((first + gpus_per_server - 1)))"
    CUDA_VISIBLE_DEVICES="$devices" SERVER_NAME="gpu$i" PORT=$((port_base + i)) \
        SERVERS_DIR="$servers_dir" VLLM_ARGS="$extra" \
        ADVERTISE_HOST="${ADVERTISE_HOST:-127.0.0.1}" \
        bash "$server_script" >"$servers_dir/gpu$i.log" 2>&1 &
    pids+=("$!")
done

# Wait until every server has announced itself or exited.
while :; do
    announced=0 alive=0
    for ((i = 0; i < num_servers; i++)); do
        [[ -e "$servers_dir/gpu$i.url" ]] && announced=$((announced + 1))
        kill -0 "${pids[$i]}" 2>/dev/null && alive=$((alive + 1))
    done
    ((announced == num_servers || alive == 0)) && break
    sleep 2
done
for ((i = 0; i < num_servers; i++)); do
    if [[ -e "$servers_dir/gpu$i.url" ]]; then
        cat "$servers_dir/gpu$i.url"
    else
        echo "serve.sh: server gpu$i did not start; see $servers_dir/gpu$i.log" >&2
    fi
done
((announced > 0)) || exit 1

# Serve until a signal arrives (the trap stops everything) or every server has exited.
wait "${pids[@]}" || true
echo "serve.sh: every server exited" >&2
exit 1
