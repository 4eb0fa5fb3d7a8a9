#!/usr/bin/env bash
# Submit an annotation run: the vLLM server array, then the annotate job.
#
#   MODEL=Qwen/Qwen3-8B deploy/slurm/submit.sh -n 8 -i /shared/data.jsonl -o /shared/runs/x \
#       -- --prompt-template 'Classify the sentiment of: {text}' --max-completion-tokens 16
#
# Options:
#   -n N      number of servers, one array task each (default 4)
#   -a N      number of annotator processes (shards), one array task each (default 1:
#             one annotate job); with N > 1 a merge job follows the array
#   -e N      a corpus by elastic workers instead: an array of N annotator tasks that
#             all run `--shard claim` and take its units one at a time; add workers
#             later with SHARD=claim sbatch --array=0-K deploy/slurm/annotate-array.sbatch
#   -i PATH   input: a file, or a corpus (a directory, or a save_to_disk folder) (required
#             unless -p)
#   -p FILE   a pipeline file instead of one job: `llm-annotator pipeline run FILE` on
#             these servers (the file leaves out servers); with -e N, N elastic workers
#   -o DIR    run folder, where annotations.parquet ends up (required)
#   -s DIR    folder the servers announce their URLs in (default: DIR.servers beside -o)
#   --        what follows goes to `llm-annotator run` (prompt template, --config, ...)
#
# Every path must be on a filesystem that the GPU nodes and the CPU node share.
#
# Settings (environment variables):
#   MODEL, SERVED_MODEL_NAME, VLLM_CMD, VLLM_ARGS, STARTUP_TIMEOUT
#                         for the servers, see server.sbatch (MODEL is required)
#   LLM_ANNOTATOR, SERVERS_WAIT
#                         for the annotate job, see annotate.sbatch
#   SERVER_SBATCH_ARGS    sbatch options of the server array, split on whitespace
#                         (default "--gres=gpu:1 --cpus-per-task=8"); the place for the
#                         partition, account, QOS, GPU type and time limit
#   ANNOTATE_SBATCH_ARGS  sbatch options of the annotate job (default: none)
#
# The annotate job starts once the first server task has started (--dependency=after),
# waits for the first URL, and cancels the server array when the run ends. Prints the
# job ids on stdout as `server_job=ID` and `annotate_job=ID` (and `merge_job=ID` with -a).
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
num_servers=4
num_shards=1
elastic=""
merge_job=""
input=""
pipeline=""
output_dir=""
servers_dir=""

usage() {
    sed -n '2,21p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//' >&2
    exit 2
}

while (($# > 0)); do
    case "$1" in
        -n) num_servers="${2:?}" && shift 2 ;;
        -a) num_shards="${2:?}" && shift 2 ;;
        -e) num_shards="${2:?}" && elastic=1 && shift 2 ;;
        -i) input="${2:?}" && shift 2 ;;
        -p) pipeline="${2:?}" && shift 2 ;;
        -o) output_dir="${2:?}" && shift 2 ;;
        -s) servers_dir="${2:?}" && shift 2 ;;
        --) shift && break ;;
        -h | --help) usage ;;
        *) echo "submit.sh: unknown option $1" >&2 && usage ;;
    esac
done
[[ (-n "$input" || -n "$pipeline") && -n "$output_dir" ]] || usage
[[ "$num_servers" =~ ^[1-9][0-9]*$ ]] || {
    echo "submit.sh: -n wants a positive number, not '$num_servers'" >&2
    exit 2
}
[[ "$num_shards" =~ ^[1-9][0-9]*$ ]] || {
    echo "submit.sh: -a and -e want a positive number, not '$num_shards'" >&2
    exit 2
}
: "${MODEL:?set MODEL to the model the servers serve}"
if [[ -n "$pipeline" ]]; then
    [[ -f "$pipeline" ]] || {
        echo "submit.sh: no pipeline file $pipeline" >&2
        exit 2
    }
    pipeline="$(realpath "$pipeline")"
else
    [[ -e "$input" ]] || {
        echo "submit.sh: no input $input" >&2
        exit 2
    }
    input="$(realpath "$input")"
fi
output_dir="$(realpath -m "$output_dir")"
servers_dir="$(realpath -m "${servers_dir:-$output_dir.servers}")"
mkdir -p "$servers_dir" "$(dirname "$output_dir")"

default_server_opts="--gres=gpu:1 --cpus-per-task=8"
# Set but empty means no options at all (a cluster without GPUs, the tests).
read -r -a server_opts <<<"${SERVER_SBATCH_ARGS-$default_server_opts}"
read -r -a annotate_opts <<<"${ANNOTATE_SBATCH_ARGS:-}"

# The jobs take their settings from the environment (sbatch's default --export=ALL).
export SERVERS_DIR="$servers_dir" INPUT="$input" OUTPUT_DIR="$output_dir" MODEL PIPELINE="$pipeline"

server_job="$(sbatch --parsable --array="0-$((num_servers - 1))" "${server_opts[@]}" \
    "$here/server.sbatch")"
server_job="${server_job%%;*}" # "ID;cluster" on federated clusters

if ((num_shards == 1)) && [[ -z "$elastic" ]]; then
    annotate_job="$(SERVER_JOB_ID="$server_job" sbatch --parsable \
        --dependency="after:${server_job}_0" "${annotate_opts[@]}" \
        "$here/annotate.sbatch" "$@")"
    annotate_job="${annotate_job%%;*}"
else
    # The shards (or elastic workers), then the merge once all of them ended (it frees
    # the servers).
    shard="auto"
    [[ -n "$elastic" ]] && shard="claim"
    annotate_job="$(SHARD="$shard" ANNOTATE_SCRIPT="$here/annotate.sbatch" sbatch --parsable \
        --array="0-$((num_shards - 1))" --dependency="after:${server_job}_0" \
        "${annotate_opts[@]}" "$here/annotate-array.sbatch" "$@")"
    annotate_job="${annotate_job%%;*}"
    merge_job="$(SERVER_JOB_ID="$server_job" sbatch --parsable \
        --dependency="afterany:$annotate_job" "${annotate_opts[@]}" "$here/merge.sbatch")"
    merge_job="${merge_job%%;*}"
    echo "merge_job=$merge_job"
fi

echo "server_job=$server_job"
echo "annotate_job=$annotate_job"
cat >&2 <<EOF
submitted $num_servers servers (job $server_job) and the annotator (job $annotate_job)
  servers announce themselves in  $servers_dir
  results go to                   $output_dir (annotations.parquet; a corpus: annotations/)
  follow with: squeue -j $server_job,$annotate_job${merge_job:+,$merge_job}   stop with: scancel $server_job $annotate_job${merge_job:+ $merge_job}
EOF
