#!/usr/bin/env bash
# The demo, from a fresh machine: project venv, install, the cached vLLM environment,
# then `llm-annotator demo` (local vLLM servers on the tiny model, a built-in dataset).
# Extra arguments go to `llm-annotator demo` (e.g. `--num-servers 3 --rows 2000`).
set -euo pipefail
cd "$(dirname "$0")/.."

python="${PYTHON:-python3}"
if [[ ! -x .venv/bin/python ]]; then
    "$python" -m venv .venv
fi
.venv/bin/python -m pip install --quiet -e '.[speed,report]' 2>&1 | grep -v "is ignored" >&2 || true
.venv/bin/python -c 'import llm_annotator' # fail here if the install failed

LLM_ANNOTATOR_VLLM_PYTHON="$(bash scripts/vllm-env.sh)"
export LLM_ANNOTATOR_VLLM_PYTHON
exec .venv/bin/llm-annotator demo "$@"
