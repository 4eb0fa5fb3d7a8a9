#!/usr/bin/env bash
# The whole test suite, from a fresh machine: project venv, install, the cached vLLM
# environment, then lint (code, deploy scripts and manifests), types, unit tests,
# doctests, the real-vLLM tests and the SLURM tests on a single-node cluster they start.
# Extra arguments go to pytest (e.g. `scripts/test.sh -m "not integration"`).
set -euo pipefail
cd "$(dirname "$0")/.."

python="${PYTHON:-python3}"
if [[ ! -x .venv/bin/python ]]; then
    "$python" -m venv .venv
fi
.venv/bin/python -m pip install --quiet --upgrade pip 2>&1 | grep -v "is ignored" >&2 || true
.venv/bin/python -m pip install --quiet -e '.[dev]' 2>&1 | grep -v "is ignored" >&2 || true
.venv/bin/python -c 'import llm_annotator, aiohttp, pytest' # fail here if the install failed

LLM_ANNOTATOR_VLLM_PYTHON="$(bash scripts/vllm-env.sh)"
export LLM_ANNOTATOR_VLLM_PYTHON
export LLM_ANNOTATOR_REQUIRE_VLLM=1  # the real-vLLM tests must run, never skip
export LLM_ANNOTATOR_REQUIRE_SLURM=1  # and so must the SLURM tests (the cluster is ours)

.venv/bin/ruff check .
.venv/bin/ruff format --check .
.venv/bin/mypy
bash scripts/lint-deploy.sh
.venv/bin/pytest "$@"
