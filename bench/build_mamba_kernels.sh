#!/usr/bin/env bash
# Build causal-conv1d and mamba-ssm wheels from their sdists for this machine's GPU architecture only.
#
# Why: Mamba's fast kernels (mamba_ssm's selective scan and fused SSD training path, causal_conv1d's
# convolution) come as prebuilt wheels only for some torch/CUDA pairs; elsewhere pip compiles them for
# ten GPU architectures, which takes an hour. Building for the one architecture a node has takes minutes.
# Needs nvcc matching torch's CUDA major version, and setuptools, wheel, ninja and packaging importable.
#
#   bench/build_mamba_kernels.sh SDIST_DIR WHEEL_DIR [ARCH]    # ARCH e.g. 90 (default: this GPU's)
#
# SDIST_DIR holds causal_conv1d-*.tar.gz and mamba_ssm-*.tar.gz (pip download --no-binary :all: ...).
# Both build at once; MAX_JOBS (default: all cores) bounds nvcc processes per package.
set -euo pipefail

sdists=${1:?usage: build_mamba_kernels.sh SDIST_DIR WHEEL_DIR [ARCH]}
wheels=${2:?usage: build_mamba_kernels.sh SDIST_DIR WHEEL_DIR [ARCH]}
arch=${3:-$(python3 -c 'import torch; m, n = torch.cuda.get_device_capability(); print(f"{m}{n}")')}
work=$(mktemp -d)
mkdir -p "$wheels"

patch_setup() {
    # Keep only -gencode pairs for $arch and drop -lineinfo (debug line tables double the library size).
    python3 - "$1" "$arch" <<'PY'
import re
import sys
from pathlib import Path

path, arch = Path(sys.argv[1]), sys.argv[2]
text = path.read_text()
pair = re.compile(r'cc_flag\.append\("-gencode"\)\n(\s*)cc_flag\.append\("arch=compute_(\w+?),code=sm_\w+"\)')
kept = []


def keep_or_drop(match):
    if match.group(2) == arch:
        kept.append(arch)
        return match.group(0)
    return "pass\n" + match.group(1) + "pass"


text = pair.sub(keep_or_drop, text).replace('"-lineinfo",', "")
if not kept:
    sys.exit(f"{path}: no -gencode pair for compute_{arch}; this sdist does not support that GPU")
path.write_text(text)
PY
}

pids=()
for name in causal_conv1d mamba_ssm; do
    sdist=$(ls "$sdists"/${name}-*.tar.gz | head -n1)
    tar -xzf "$sdist" -C "$work"
    src=$(ls -d "$work"/${name}-*/ | head -n1)
    patch_setup "$src/setup.py"
    echo "building $(basename "$src") for sm_$arch"
    (
        cd "$src"
        CAUSAL_CONV1D_FORCE_BUILD=TRUE MAMBA_FORCE_BUILD=TRUE MAX_JOBS=${MAX_JOBS:-$(nproc)} \
            python3 -m pip wheel --no-build-isolation --no-deps --no-index -w "$wheels" . \
            >"$wheels/build-$name.log" 2>&1 || { tail -n 40 "$wheels/build-$name.log"; exit 1; }
    ) &
    pids+=($!)
done
status=0
for pid in "${pids[@]}"; do wait "$pid" || status=1; done
rm -rf "$work"
ls -la "$wheels"
exit $status
