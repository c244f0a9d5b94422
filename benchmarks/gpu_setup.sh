# Make the GPU machine (bare, no network, the image's python3 with torch) ready for the pack's benchmarks and GPU
# tests: the wheels of .whl/ into /tmp/site, ComfyUI 0.33.0 unpacked to /tmp/ComfyUI, the PyAV stub where PyAV is
# missing, the checkout importable as comfyui_lowvram_dit. Sourced, from the repository root, at the start of a
# GPU command whose carry names .whl and .bench_tmp (filled here by benchmarks/gpu_kit.sh):
#   source benchmarks/gpu_setup.sh || exit 1
# Exports PYTHONPATH and COMFYUI_PATH=/tmp/ComfyUI. LOWVRAM_CK_WHL=.whl_ck040 (carried too) puts that comfy-kitchen
# ahead of the default one. Idempotent: a second source on the same machine reinstalls nothing (about 1 s).

_lowvram_setup() {
    local root site=/tmp/site stubs ck_site=
    root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
    ls "$root"/.whl/*.whl >/dev/null 2>&1 \
        || { echo "gpu_setup.sh: no wheels in $root/.whl; run benchmarks/gpu_kit.sh here and carry .whl" >&2; return 1; }
    [ -f "$root/.bench_tmp/ComfyUI-0.33.0.tgz" ] \
        || { echo "gpu_setup.sh: .bench_tmp/ComfyUI-0.33.0.tgz missing; run benchmarks/gpu_kit.sh and carry .bench_tmp" >&2; return 1; }
    _lowvram_install "$root/.whl" "$site" || return 1
    if [ -n "${LOWVRAM_CK_WHL:-}" ]; then
        ck_site=/tmp/site_ck
        _lowvram_install "$root/$LOWVRAM_CK_WHL" "$ck_site" || return 1
    fi
    if [ ! -f /tmp/ComfyUI/main.py ]; then
        mkdir -p /tmp/ComfyUI && tar xzf "$root/.bench_tmp/ComfyUI-0.33.0.tgz" -C /tmp/ComfyUI --strip-components=1 \
            || { echo "gpu_setup.sh: could not unpack .bench_tmp/ComfyUI-0.33.0.tgz into /tmp/ComfyUI" >&2; return 1; }
    fi
    # The repository root is the package: a link named comfyui_lowvram_dit makes `python -m comfyui_lowvram_dit...` work
    mkdir -p /tmp/pkgs && ln -sfn "$root" /tmp/pkgs/comfyui_lowvram_dit
    # Our entries first (a second source replaces them rather than adding more); the caller's after them
    local rest
    rest=$(printf %s "${PYTHONPATH:-}" | tr : '\n' | grep -vxF -e /tmp/site -e /tmp/site_ck -e /tmp/pkgs \
        -e "$root/.bench_tmp/stubs" | paste -sd:)
    export PYTHONPATH="${ck_site:+$ck_site:}$site:/tmp/pkgs${rest:+:$rest}"
    # The stub only where no real PyAV is installed: last on the path, never shadowing one
    python3 -c "import importlib.util as u, sys; sys.exit(u.find_spec('av') is None)" || export PYTHONPATH="$PYTHONPATH:$root/.bench_tmp/stubs"
    export COMFYUI_PATH=/tmp/ComfyUI
    _lowvram_check "$root"
}

_lowvram_install() {  # _lowvram_install WHEEL_DIR TARGET: install once per set of wheels (a stamp lists them)
    local stamp="$2/.kit-wheels" want t
    want=$(cd "$1" && ls -l *.whl *.site.tar.xz 2>/dev/null | awk '{print $5, $NF}')
    [ -n "$want" ] || { echo "gpu_setup.sh: no wheels in $1" >&2; return 1; }
    [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ] && return 0
    rm -rf "$2"
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$2" "$1"/*.whl \
        || { echo "gpu_setup.sh: pip could not install the wheels of $1 into $2 (see above)" >&2; return 1; }
    for t in "$1"/*.site.tar.xz; do  # a wheel's installed files, xz-packed by gpu_kit.sh (--av)
        [ -e "$t" ] || continue
        tar xJf "$t" -C "$2" || { echo "gpu_setup.sh: could not unpack $t into $2" >&2; return 1; }
    done
    echo "$want" >"$stamp"
}

_lowvram_check() {  # the imports ComfyUI needs, ComfyUI's own start with the pack linked (once per kit), versions
    # no frontend package on that machine: an empty --front-end-root, as the benchmark servers use
    local root=$1 base log stamp=/tmp/.lowvram-kit-ok want
    want="$PYTHONPATH $(cat /tmp/site/.kit-wheels /tmp/site_ck/.kit-wheels 2>/dev/null | tr '\n' ' ')"
    if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
        base=$(mktemp -d /tmp/lowvram-check.XXXX) && mkdir -p "$base/custom_nodes" "$base/web" \
            && ln -s "$root" "$base/custom_nodes/comfyui_lowvram_dit" && log="$base/start.log"
        if ! (cd /tmp/ComfyUI && timeout 120 python3 main.py --cpu --quick-test-for-ci --disable-all-custom-nodes \
                --whitelist-custom-nodes comfyui_lowvram_dit --base-directory "$base" --front-end-root "$base/web" \
                >"$log" 2>&1) \
            || grep -q "IMPORT FAILED.*comfyui_lowvram_dit" "$log"; then
            grep -E "Error|error:|IMPORT FAILED|No module named" "$log" | tail -15 >&2
            echo "gpu_setup.sh: ComfyUI 0.33.0 did not start with the pack (log above, whole log $log)" >&2
            return 1
        fi
        grep -o "IMPORT FAILED: .*" "$log" | sed 's/^/gpu_setup.sh: optional ComfyUI node, no Wan\/Qwen graph needs it: /'
        echo "$want" >"$stamp"
        rm -rf "$base"
    fi
    python3 - <<'EOF'
import importlib, importlib.metadata as md, re, sys
for name in ("torch", "triton", "comfy_aimdo", "comfy_kitchen", "torchsde", "sqlalchemy", "alembic", "pydantic",
             "blake3", "simpleeval", "kornia", "av", "gguf"):
    try:
        importlib.import_module(name)
    except Exception as e:
        sys.exit(f"gpu_setup.sh: python3 cannot import {name} ({type(e).__name__}: {e}); "
                 "add its wheel to WHEELS in benchmarks/gpu_kit.sh")
import torch, triton, comfy_kitchen as ck
gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "no GPU"
if torch.cuda.is_available():  # the wheel keeps sm_90 machine code only (gpu_slim_wheel.py): prove one kernel runs
    try:
        with ck.use_backend("cuda"):
            x = torch.randn(256, 256, device="cuda")
            q = ck.quantize_per_tensor_fp8(x, torch.tensor(1.0, device="cuda"))
        torch.testing.assert_close(q.float(), x.to(torch.float8_e4m3fn).float())
    except Exception as e:
        sys.exit(f"gpu_setup.sh: comfy_kitchen's CUDA backend failed on {gpu} ({type(e).__name__}: {e}); "
                 "the slimmed wheel keeps sm_90 only (benchmarks/gpu_slim_wheel.py)")
comfy = re.search(r'"(.+)"', open("/tmp/ComfyUI/comfyui_version.py").read()).group(1)
print(f"gpu_setup: torch {torch.__version__}, triton {triton.__version__}, comfy_aimdo {md.version('comfy-aimdo')}, "
      f"comfy_kitchen {md.version('comfy-kitchen')} (cuda backend "
      f"{'ok' if ck.list_backends()['cuda']['available'] else 'unavailable'}), ComfyUI {comfy}, {gpu}")
EOF
}

_lowvram_setup
