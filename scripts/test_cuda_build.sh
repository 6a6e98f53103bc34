#!/usr/bin/env bash
# Builds dpcore as a CUDA extension against torch 2.11.0 (CUDA 13.0, from the
# package registry) with nvcc, checks that it imports as a CUDA build (and
# passes its libstdc++ self-check), and runs the tests of what the CUDA build
# compiles differently against it: the kernels and operators, the
# collectives, host transfers, info and the link check; and the tests that
# need torchvision (timm, and torchvision's own detection models). The rest of the suite
# runs in scripts/test.sh; a full rerun here would push CI past 30 minutes. torch 2.11.0+cu130 is what the GPU machine
# (bench/gpu_check.sh) runs, so this compiles what runs there; the CPU suite
# (scripts/test.sh) stays on torch 2.13.0. Works without a GPU (the CUDA
# tests then skip).
# Usage: bash scripts/test_cuda_build.sh [--venv-only]
#      --venv-only: set up the virtual environment and stop (.ci/run does it
#      while the CPU suite runs: the download waits on the network, the
#      suite on the cores).
# Env: DPCORE_CUDA_VENV (default ~/.cache/dpcore/venv-torch-2.11.0, reused
#      between runs: torch with CUDA is 5.5 GB), CUDA_HOME (default
#      /usr/local/cuda), TORCH_CUDA_ARCH_LIST (default 9.0), PYTEST_WORKERS
#      (pytest-xdist workers, default auto: one per core).
set -euo pipefail
cd "$(dirname "$0")/.."
root=$(pwd)
venv_only=0
for arg in "$@"; do
  case $arg in
  --venv-only) venv_only=1 ;;
  *)
    echo "error: unknown argument $arg (the only option is --venv-only)" >&2
    exit 2
    ;;
  esac
done
torch_version=2.11.0
torchvision_version=0.26.0
timm_version=1.0.31
venv=${DPCORE_CUDA_VENV:-$HOME/.cache/dpcore/venv-torch-$torch_version}
export CUDA_HOME=${CUDA_HOME:-/usr/local/cuda}
export TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0}
export MAX_JOBS=${MAX_JOBS:-$(nproc)}

step() { printf '\n==> %s\n' "$*"; }

if [ ! -x "$CUDA_HOME/bin/nvcc" ]; then
  echo "error: no nvcc at $CUDA_HOME/bin/nvcc; set CUDA_HOME to a CUDA 13 toolkit" >&2
  exit 1
fi

step "virtual environment $venv with torch $torch_version (CUDA 13.0)"
[ -x "$venv/bin/python" ] || python3 -m venv "$venv"
# shellcheck disable=SC1091
source "$venv/bin/activate"
# torchvision and timm: they need a torchvision built for this torch (PyPI's
# does not load beside the CPU suite's torch 2.13.0 wheel), so the timm and
# detection tests run here.
python -m pip install -q "torch==$torch_version" "torchvision==$torchvision_version" "timm==$timm_version" \
  pytest "pytest-xdist==3.8.0" hypothesis numpy ninja setuptools wheel scikit-learn tqdm matplotlib
if [ "$venv_only" = 1 ]; then
  exit 0
fi

step "build dpcore with nvcc (DPCORE_CUDA=1, arch $TORCH_CUDA_ARCH_LIST)"
# A fresh build tree: the CPU build's objects must not be reused (nor are
# the virtual environments and build folders copied).
build=$(mktemp -d)
trap 'rm -rf "$build"' EXIT
mkdir "$build/src"
tar -C "$root" --exclude=./.git --exclude='./.venv*' --exclude=./build --exclude=./build-cmake \
  --exclude=./build-asan -cf - . | tar -C "$build/src" -xf -
DPCORE_CUDA=1 python -m pip install -q --no-build-isolation "$build/src"

step "import check"
( cd / && python - <<'PY'
import dpcore
info = dpcore.info()
print(info)
assert info["build"] == "cuda", f"expected a CUDA build, got {info['build']}"
assert info["torch_matches"], info
assert info["self_check"] == "ok", info["self_check"]
PY
)

step "pytest against the CUDA build"
cd "$root/tests"
# In the suite's own (alphabetical) order: on a CUDA torch without a driver,
# torch.library.opcheck (test_kernels) leaves the CUDA device count nonzero,
# and test_comm's invisible-device checks must run before it. pytest-xdist
# with --dist loadfile keeps that order: each worker takes whole files, in
# the order given. The tests marked serial run afterwards, alone.
files=(test_comm.py test_cuda_graphs.py test_detection.py test_host_cache.py test_host_transfer.py test_info.py
  test_kernels.py test_link_check.py test_timm.py)
python -m pytest -q -p no:cacheprovider -n "${PYTEST_WORKERS:-auto}" --dist loadfile -m "not serial" ${PYTEST_ARGS:-} \
  "${files[@]}"
python -m pytest -q -p no:cacheprovider -m serial ${PYTEST_ARGS:-} "${files[@]}"
