#!/usr/bin/env bash
# Builds (once, then reuses) a ComfyUI checkout and its venv for one supported host version, from the
# source tarballs in ../shared/comfyui/. Usage: .ci/hosts.sh VERSION  -> prints "COMFYUI_PATH PYTHON".
# Cache: $LOWVRAM_DIT_HOSTS (default ~/.cache/comfyui-lowvram-dit/hosts)/<VERSION>/{ComfyUI,venv}.
# Exit 3 (with a message on stderr) when the tarball is not there, so callers can skip that host.
set -euo pipefail

VERSION="$1"
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
TARBALL="$REPO/../shared/comfyui/ComfyUI-$VERSION.tgz"
CACHE="${LOWVRAM_DIT_HOSTS:-$HOME/.cache/comfyui-lowvram-dit/hosts}/$VERSION"
PYTHON="${PYTHON:-python3}"
export PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_INPUT=1

if [[ ! -f "$TARBALL" ]]; then
    echo "no ComfyUI $VERSION source at ../shared/comfyui/ComfyUI-$VERSION.tgz: integration tests on $VERSION skipped" >&2
    exit 3
fi

# torch per host: 0.8 runs on the release this machine keeps on disk; newer hosts import torchaudio at
# startup, and PyPI's torchaudio wheels pair with torch 2.9.x.
case "$VERSION" in
    0.8.*) TORCH=("torch==2.14.1" "torchvision==0.29.1"); AUDIO=() ;;
    *)     TORCH=("torch==2.9.1" "torchvision==0.24.1"); AUDIO=("torch==2.9.1" "torchaudio==2.9.*") ;;
esac

mkdir -p "$CACHE"
if [[ ! -f "$CACHE/ComfyUI/.source-stamp" ]] || ! cmp -s <(stat -c %s "$TARBALL") "$CACHE/ComfyUI/.source-stamp"; then
    rm -rf "$CACHE/ComfyUI" "$CACHE/ComfyUI.tmp"
    mkdir -p "$CACHE/ComfyUI.tmp"
    tar xzf "$TARBALL" -C "$CACHE/ComfyUI.tmp"
    mv "$CACHE/ComfyUI.tmp/ComfyUI" "$CACHE/ComfyUI"
    rmdir "$CACHE/ComfyUI.tmp"
    stat -c %s "$TARBALL" > "$CACHE/ComfyUI/.source-stamp"
fi

VPY="$CACHE/venv/bin/python"
STAMP="$CACHE/venv/.ready"
if [[ ! -f "$STAMP" ]]; then
    rm -rf "$CACHE/venv"
    "$PYTHON" -m venv "$CACHE/venv"
    PIP=("$VPY" -m pip install -q --no-compile)
    "${PIP[@]}" "${TORCH[@]}" >&2
    if (( ${#AUDIO[@]} )); then "${PIP[@]}" "${AUDIO[@]}" >&2; fi
    # ComfyUI's requirements without torch (pinned above) and without the front-end packages: the tests
    # start the server with --front-end-root on an empty folder, so the 85 MB UI is never needed.
    grep -vE '^\s*(torch|torchvision|torchaudio|comfyui-frontend-package|comfyui-workflow-templates|comfyui-embedded-docs)\b' \
        "$CACHE/ComfyUI/requirements.txt" > "$CACHE/requirements-notorch.txt"
    "${PIP[@]}" -r "$CACHE/requirements-notorch.txt" >&2
    touch "$STAMP"
fi
# The pack itself, editable, with its test tools (fast when already there).
"$VPY" -m pip install -q --no-compile -e "$REPO[test]" >&2
echo "$CACHE/ComfyUI $VPY"
