#!/usr/bin/env bash
# Fill the GPU machine's kit beside this checkout: .bench_tmp/ (ComfyUI 0.33.0's tarball and a PyAV stub) and .whl/
# (the wheels ComfyUI 0.33.0 needs that the GPU image lacks). Runs here, from the repository root, with network.
# The GPU command then carries .whl and .bench_tmp and starts with `source benchmarks/gpu_setup.sh`.
#   bash benchmarks/gpu_kit.sh                 # cp312 wheels into .whl/
#   bash benchmarks/gpu_kit.sh --ck 0.2.40     # also comfy-kitchen 0.2.40 alone in .whl_ck040/ (kernel comparisons)
#   bash benchmarks/gpu_kit.sh --av            # also PyAV in .whl/ (renders saving video: SaveVideo, mp4), as its
#                                              # installed files xz-packed (23 MiB, the wheel is 33): with the tree,
#                                              # ~60 MiB of the 64 a GPU command carries (so without --ck)
#   bash benchmarks/gpu_kit.sh --python 3.11 --whl DIR   # the same set for another Python (a CPU rehearsal here)
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

PYVER=3.12
WHL=.whl
CK=
AV=
SHARED=${LOWVRAM_SHARED:-../shared}
while [ $# -gt 0 ]; do
    case "$1" in
        --ck) CK=$2; shift 2 ;;
        --av) AV=av==19.0.2; shift ;;
        --python) PYVER=$2; shift 2 ;;
        --whl) WHL=$2; shift 2 ;;
        --shared) SHARED=$2; shift 2 ;;
        *) echo "gpu_kit.sh: unknown option $1 (known: --ck VERSION, --av, --python X.Y, --whl DIR, --shared DIR)" >&2
           exit 2 ;;
    esac
done

# What ComfyUI 0.33.0 imports to start a server and run Wan / Qwen-Image that the GPU image does not hold (its
# package list: the device notes' KINDS.md). Requirements of each are listed beside it; av is stubbed; spandrel
# (upscale models) and PyOpenGL (GLSL nodes) are left out: those nodes log "IMPORT FAILED", no Wan/Qwen graph uses them.
WHEELS=(
    comfy-aimdo==0.4.13
    comfy-kitchen==0.2.31
    torchsde==0.2.6 trampoline==0.1.2                       # k-diffusion's SDE samplers (imported by comfy.samplers)
    alembic==1.20.1 Mako==1.4.3 SQLAlchemy==2.1.9           # app.database (main.py imports it at start)
    simpleeval==1.0.8 blake3==1.0.11                        # comfy_extras math nodes, app.assets hashing
    pydantic==2.14.4 pydantic_core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5
    typing_extensions==4.16.0                               # pydantic 2.14.4 needs >= 4.16; the image's is unread
    pydantic-settings==2.16.3 python-dotenv==1.2.4           # pyproject.toml of custom nodes (else a warning)
    kornia==0.9.0 kornia_rs==0.2.0                           # nodes_post_processing, which nodes_latent imports:
                                                            # ImageScaleToTotalPixels (Qwen-Image-Edit), LatentConcat
    gguf==0.19.0                                            # ComfyUI-GGUF (tests/vendor): the render's GGUF rows;
                                                            # pure Python on numpy, pyyaml, tqdm, requests (all there)
)
PLATFORMS=(manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_24_x86_64 manylinux_2_17_x86_64
           manylinux2014_x86_64 manylinux1_x86_64)

download() {  # download DEST SPEC...: the wheels for PYVER on x86-64 Linux, no dependencies (each is named)
    local dest=$1; shift
    local plat=() p
    for p in "${PLATFORMS[@]}"; do plat+=(--platform "$p"); done
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version "$PYVER" --implementation cp \
        "${plat[@]}" -d "$dest" "$@" 2> >(grep -v "is ignored: it is neither" >&2)
    # comfy-kitchen ships machine code for six GPU generations and ROCm (58 MiB): keep the H200's (sm_90)
    local w
    for w in "$dest"/comfy_kitchen-*.whl; do
        [ -e "$w" ] && python3 benchmarks/gpu_slim_wheel.py "$w" --sm 90 --drop 'comfy_kitchen/backends/hip/_C*'
    done
}

mkdir -p "$WHL" && rm -f "$WHL"/*.whl
download "$WHL" "${WHEELS[@]}" ${AV:+"$AV"}
for w in "$WHL"/av-*.whl; do  # a wheel is a zip of the installed files: xz packs them a third smaller
    [ -e "$w" ] || continue
    unpacked=$(mktemp -d) && python3 -m zipfile -e "$w" "$unpacked"
    tar cf - -C "$unpacked" . | xz -9 -T2 >"${w%%-cp*}.site.tar.xz" && rm -rf "$unpacked" "$w"
done
if [ -n "$CK" ]; then
    ckdir=.whl_ck$(printf %03d "${CK##*.}")  # 0.2.40 -> .whl_ck040
    mkdir -p "$ckdir" && rm -f "$ckdir"/*.whl
    download "$ckdir" "comfy-kitchen==$CK"
    echo "comfy-kitchen $CK in $ckdir/ (carry it too; gpu_setup.sh: LOWVRAM_CK_WHL=$ckdir)"
fi

tgz="$SHARED/comfyui/ComfyUI-0.33.0.tgz"
[ -f "$tgz" ] || { echo "gpu_kit.sh: $tgz not found; pass --shared DIR (the folder holding comfyui/)" >&2; exit 1; }
mkdir -p .bench_tmp
cp -f "$tgz" .bench_tmp/ComfyUI-0.33.0.tgz

# PyAV is a 30+ MB wheel: a stub lets ComfyUI import its video modules; only encoding through PyAV fails, loudly
# with ImportError (SaveWEBM, SaveVideo, SaveAudio*, SaveImageAdvanced; SaveAnimatedWEBP/PNG and SaveImage use Pillow).
mkdir -p .bench_tmp/stubs/av
cat > .bench_tmp/stubs/av/__init__.py <<'EOF'
"""Stand-in for PyAV on the GPU machine: imports resolve, any call raises ImportError (what callers that probe for
PyAV, torchvision's among them, already catch). Not part of the pack."""
import importlib.abc
import importlib.machinery
import sys
import types

MESSAGE = "PyAV is not installed on this machine (a stub from benchmarks/gpu_kit.sh): video/audio encoding is unavailable"


class _Missing(type):
    """Any attribute of a stub class is another stub class; calling one raises ImportError."""

    def __getattr__(cls, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return _Missing(name, (Exception,), {})

    def __call__(cls, *args, **kwargs):
        raise ImportError(MESSAGE)


def _module_getattr(name):
    if name.startswith("__"):
        raise AttributeError(name)
    return _Missing(name, (Exception,), {})


class _Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Every av.* submodule is an empty stub module."""

    def find_spec(self, fullname, path=None, target=None):
        if fullname.startswith("av."):
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec):
        mod = types.ModuleType(spec.name)
        mod.__path__ = []
        mod.__getattr__ = _module_getattr
        return mod

    def exec_module(self, module):
        return None


def open(*args, **kwargs):
    raise ImportError(MESSAGE)


__version__ = "0.0.0+stub"
__getattr__ = _module_getattr
sys.meta_path.append(_Finder())
EOF

size() { du -sb "$@" 2>/dev/null | awk '{s += $1} END {printf "%.1f", s / 1048576}'; }
tree=$( { git ls-files -z; git ls-files -z --others --exclude-standard; } 2>/dev/null | xargs -0 -r du -cb 2>/dev/null \
        | awk '$2 == "total" {s += $1} END {printf "%.1f", s / 1048576}')
carried=$(size "$WHL" .bench_tmp ${ckdir:+"$ckdir"})
echo "wheels ($PYVER): $(ls "$WHL" | wc -l) in $WHL/ ($(size "$WHL") MiB); .bench_tmp $(size .bench_tmp) MiB"
echo "travels: tree $tree MiB + carried $carried MiB = $(echo "$tree $carried" | awk '{printf "%.1f", $1 + $2}') MiB (limit 64)"
