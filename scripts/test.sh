#!/usr/bin/env bash
# The whole test suite, from a fresh machine: project venv, install, the cached vLLM
# environment, then lint (code, deploy scripts and manifests), types, the documentation
# build, unit tests, doctests, the real-vLLM tests (the small real model included, built
# once into the cache) and the SLURM tests on a single-node cluster they start.
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

# nginx terminates TLS in front of a real vLLM server in the TLS tests.
if ! command -v nginx >/dev/null && [[ ! -x /usr/sbin/nginx ]]; then
    if [[ $EUID -eq 0 ]] && command -v apt-get >/dev/null; then
        echo "test: installing nginx-light" >&2
        DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
            nginx-light >/dev/null 2>&1 || {
            apt-get update -qq >/dev/null 2>&1 || true
            DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
                nginx-light >/dev/null
        }
    else
        echo "test: nginx is missing; install it (Debian: apt-get install nginx-light)" >&2
        exit 1
    fi
fi

# Headless Chromium opens the HTML run report in the report test (renders, no errors).
if ! command -v chromium >/dev/null; then
    if [[ $EUID -eq 0 ]] && command -v apt-get >/dev/null; then
        echo "test: installing chromium" >&2
        DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
            chromium >/dev/null 2>&1 || {
            apt-get update -qq >/dev/null 2>&1 || true
            DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
                chromium >/dev/null
        }
    else
        echo "test: chromium is missing; install it (Debian: apt-get install chromium)" >&2
        exit 1
    fi
fi

LLM_ANNOTATOR_VLLM_PYTHON="$(bash scripts/vllm-env.sh)"
export LLM_ANNOTATOR_VLLM_PYTHON
export LLM_ANNOTATOR_REQUIRE_VLLM=1  # the real-vLLM tests must run, never skip
export LLM_ANNOTATOR_REQUIRE_SLURM=1  # and so must the SLURM tests (the cluster is ours)

.venv/bin/ruff check .
.venv/bin/ruff format --check .
.venv/bin/mypy
.venv/bin/lint-imports  # the one-way layers of pyproject's [tool.importlinter]
bash scripts/lint-deploy.sh
# The documentation, API reference included: any warning fails the build.
docs_site="$(mktemp -d)"
.venv/bin/mkdocs build --strict --quiet --site-dir "$docs_site"
rm -rf "$docs_site"
.venv/bin/pytest "$@"
