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
#   -d DIR    folder where each server announces its URL as local-<i>-port<port>.url
#             while it is healthy, for `llm-annotator run --servers-dir DIR`, and
#             writes its log as vllm-<i>-port<port>.log (default ./servers)
#   --        what follows goes to every vLLM server
#
# A thin wrapper around `llm-annotator serve-local`: it prints one base URL per line
# once every server is healthy (if one fails to start, all are stopped), then serves
# until SIGINT or SIGTERM and stops them all. A server that exits withdraws its URL;
# the others go on. Settings (environment variables):
#   MODEL              model name or folder (required)
#   SERVED_MODEL_NAME  name requests use (default: MODEL)
#   HOST               address the servers listen on, also written into the URLs
#                      (default 127.0.0.1)
#   MAX_MODEL_LEN      context length in tokens (default: the model's)
#   STARTUP_TIMEOUT    seconds to wait for every server to be healthy (default 1800)
#   VLLM_ARGS          more vLLM arguments, split on whitespace
#   LLM_ANNOTATOR      the llm-annotator command (default: llm-annotator on PATH)
#   LLM_ANNOTATOR_VLLM_PYTHON  the Python that has vLLM (default: the one running
#                      llm-annotator, if it can import vllm)
#
# Then, in another shell:
#   llm-annotator run --servers-dir servers --input data.jsonl --output-dir runs/x \
#       --prompt-template 'Classify the sentiment of: {text}'
set -euo pipefail

num_servers=""
gpus_per_server=1
port_base=8000
servers_dir="servers"

usage() {
    # The comment block above, without its comment marks.
    awk 'NR == 1 { next } /^#/ { sub(/^# ?/, ""); print; next } { exit }' \
        "${BASH_SOURCE[0]}" >&2
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
[[ "$port_base" =~ ^[1-9][0-9]*$ ]] || usage

gpus="$(nvidia-smi --list-gpus 2>/dev/null | grep -c '^GPU' || true)"
if [[ -z "$num_servers" ]]; then
    num_servers=$((gpus / gpus_per_server))
    ((num_servers > 0)) || num_servers=1
fi
[[ "$num_servers" =~ ^[1-9][0-9]*$ ]] || usage
if ((gpus == 0)); then
    echo "serve.sh: warning: nvidia-smi lists no GPU" >&2
elif ((num_servers * gpus_per_server > gpus)); then
    echo "serve.sh: warning: -n $num_servers -g $gpus_per_server needs" \
        "$((num_servers * gpus_per_server)) GPUs; nvidia-smi lists $gpus" >&2
fi

vllm_args=()
read -ra extra <<<"${VLLM_ARGS:-}"
for arg in "${extra[@]}" "$@"; do
    vllm_args+=("--vllm-arg=$arg")
done

exec "${LLM_ANNOTATOR:-llm-annotator}" serve-local \
    --num-servers "$num_servers" \
    --gpus-per-server "$gpus_per_server" \
    --dtype auto \
    --no-enforce-eager \
    --servers-dir "$servers_dir" \
    --log-dir "$servers_dir" \
    --model "$MODEL" \
    --served-model-name "${SERVED_MODEL_NAME:-$MODEL}" \
    --host "${HOST:-127.0.0.1}" \
    --port-base "$port_base" \
    --max-model-len "${MAX_MODEL_LEN:-auto}" \
    --startup-timeout "${STARTUP_TIMEOUT:-1800}" \
    "${vllm_args[@]}"
