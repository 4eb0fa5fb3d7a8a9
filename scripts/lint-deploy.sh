#!/usr/bin/env bash
# Check deploy/ and scripts/ offline: shellcheck on every shell script, the Kubernetes
# manifests against the Kubernetes API's schemas, and the YAML of compose.yaml.
#
#   scripts/lint-deploy.sh            everything
#   scripts/lint-deploy.sh FILE...    only these (shell scripts and Kubernetes YAML)
#
# Needs shellcheck (Debian package `shellcheck`, installed with apt-get when missing and
# run as root) and the PyPI package kubernetes-validate, which carries the schemas
# (installed with pip into $PYTHON, default .venv/bin/python, when missing). The
# kustomization is also rendered and the result validated, when kubectl is on PATH.
set -euo pipefail
cd "$(dirname "$0")/.."

python="${PYTHON:-.venv/bin/python}"
[[ -x "$python" ]] || python="$(command -v python3)"
status=0

die() {
    echo "lint-deploy: error: $*" >&2
    exit 1
}

fail() {
    echo "lint-deploy: FAILED: $*" >&2
    status=1
}

ensure_shellcheck() {
    command -v shellcheck >/dev/null && return 0
    if [[ $EUID -ne 0 ]] || ! command -v apt-get >/dev/null; then
        die "shellcheck is missing: install it (Debian and Ubuntu: apt-get install shellcheck)"
    fi
    echo "lint-deploy: installing shellcheck" >&2
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq shellcheck >/dev/null 2>&1 || {
        apt-get update -qq >/dev/null 2>&1 || true
        DEBIAN_FRONTEND=noninteractive apt-get install -y -qq shellcheck >/dev/null ||
            die "apt-get could not install shellcheck"
    }
}

ensure_validator() {
    "$python" -c 'import kubernetes_validate, yaml' 2>/dev/null && return 0
    echo "lint-deploy: installing kubernetes-validate into $python" >&2
    "$python" -m pip install --quiet kubernetes-validate >&2 ||
        die "pip could not install kubernetes-validate into $python"
}

is_shell_script() {
    case "$1" in
        *.sh | *.sbatch | *.bash) return 0 ;;
        *.yaml | *.yml | *.md | *.py | Dockerfile | *.Dockerfile) return 1 ;;
    esac
    head -n 1 "$1" 2>/dev/null | grep -Eq '^#!.*(/|env )(ba)?sh\b'
}

is_kubernetes_manifest() {
    [[ "$1" == *.yaml || "$1" == *.yml ]] && [[ "$(basename "$1")" != kustomization.* ]] &&
        grep -Eq '^apiVersion:' "$1" && grep -Eq '^kind:' "$1"
}

shell_scripts=()
manifests=()
others=()
if (($# > 0)); then
    candidates=("$@")
else
    mapfile -t candidates < <(find deploy scripts -type f ! -path '*/__pycache__/*' | sort)
fi
for file in "${candidates[@]}"; do
    if is_shell_script "$file"; then
        shell_scripts+=("$file")
    elif is_kubernetes_manifest "$file"; then
        manifests+=("$file")
    else
        others+=("$file")
    fi
done

if (($# > 0 && ${#others[@]} > 0)); then
    echo "lint-deploy: neither a shell script nor a Kubernetes manifest: ${others[*]}" >&2
fi

if ((${#shell_scripts[@]} > 0)); then
    ensure_shellcheck
    echo "lint-deploy: shellcheck ${shell_scripts[*]}"
    shellcheck --severity=info "${shell_scripts[@]}" || fail "shellcheck"
fi

ensure_validator
if ((${#manifests[@]} > 0)); then
    echo "lint-deploy: kubernetes-validate ${manifests[*]}"
    "$python" -m kubernetes_validate --strict --quiet "${manifests[@]}" ||
        fail "kubernetes-validate"
fi

if (($# == 0)); then
    # compose.yaml: YAML that parses to a services mapping (no Compose schema offline).
    "$python" - deploy/local/compose.yaml <<'EOF' || fail "compose.yaml"
import sys
import yaml

with open(sys.argv[1], encoding="utf-8") as handle:
    compose = yaml.safe_load(handle)
if not isinstance(compose, dict) or not isinstance(compose.get("services"), dict):
    sys.exit(f"{sys.argv[1]}: no services mapping")
print(f"lint-deploy: {sys.argv[1]} parses ({len(compose['services'])} services)")
EOF
    if command -v kubectl >/dev/null; then
        rendered="$(mktemp --suffix=.yaml)"
        trap 'rm -f "$rendered"' EXIT
        for folder in deploy/kubernetes deploy/kubernetes-sharded deploy/kubernetes-elastic deploy/kubernetes-pipeline; do
            echo "lint-deploy: kubectl kustomize $folder | kubernetes-validate"
            if kubectl kustomize "$folder" >"$rendered"; then
                "$python" -m kubernetes_validate --strict --quiet "$rendered" ||
                    fail "the rendered kustomization of $folder"
            else
                fail "kubectl kustomize $folder"
            fi
        done
    else
        echo "lint-deploy: kubectl not found: the kustomization is not rendered" >&2
    fi
fi

if ((status == 0)); then
    echo "lint-deploy: ok (${#shell_scripts[@]} shell scripts, ${#manifests[@]} manifests)"
fi
exit "$status"
