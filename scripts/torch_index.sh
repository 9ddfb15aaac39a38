#!/usr/bin/env bash
# The PyTorch wheel index for this machine (used by `make install`): with an NVIDIA driver, the newest of
# the CUDA builds given (ascending, e.g. `126 128 130`) that the driver runs, or the CPU build if it runs
# none of them; without a driver, nothing (PyPI's wheel).
set -euo pipefail
driver=$(nvidia-smi 2>/dev/null | sed -n 's/.*CUDA Version: *\([0-9]*\)\.\([0-9]*\).*/\1 \2/p' | head -n 1) || true
[ -n "$driver" ] || exit 0
read -r major minor <<<"$driver"
best=
for build in "$@"; do
    if [ "$build" -le $((major * 10 + minor)) ]; then best=$build; fi
done
if [ -z "$best" ]; then
    echo "scripts/torch_index.sh: the driver runs CUDA $major.$minor, older than every build of TORCH_CUDA_BUILDS ($*):" \
        "taking the CPU build; update the driver for a CUDA one" >&2
    echo "https://download.pytorch.org/whl/cpu"
    exit 0
fi
echo "https://download.pytorch.org/whl/cu$best"
