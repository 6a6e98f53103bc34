#!/usr/bin/env bash
# Builds the C++ core and its gtest suite with AddressSanitizer and
# UndefinedBehaviorSanitizer (CMake -DDPCORE_SANITIZE=ON, in build-asan/) and
# runs the gtests under them; any report fails the run.
# libtorch is not instrumented (its own code goes unchecked) and needs no
# suppressions: the run is clean with leak checking on.
# Usage: bash scripts/test_sanitizers.sh [gtest arguments, e.g. --gtest_filter='Pack.*']
# Env:   DPCORE_VENV (default .venv, as scripts/test.sh makes it; without one,
#        the python on PATH must have torch), CMAKE_CXX_COMPILER_LAUNCHER
#        (e.g. ccache; read by CMake itself)
set -euo pipefail
cd "$(dirname "$0")/.."
root=$(pwd)
venv=${DPCORE_VENV:-$root/.venv}
build=$root/build-asan
start=$(date +%s)

step() { printf '\n==> %s\n' "$*"; }

if [ -f "$venv/bin/activate" ]; then
  # shellcheck disable=SC1091
  source "$venv/bin/activate"
fi
if ! prefix=$(python -c 'import torch.utils; print(torch.utils.cmake_prefix_path)' 2>/dev/null); then
  echo "error: no torch importable by $(command -v python || echo python); run scripts/test.sh first" \
    "or set DPCORE_VENV to a virtual environment with torch" >&2
  exit 1
fi

step "configure and build $build (-DDPCORE_SANITIZE=ON)"
cmake -S "$root" -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DDPCORE_SANITIZE=ON \
  -DCMAKE_PREFIX_PATH="$prefix" >/dev/null
cmake --build "$build" -j "$(nproc)"

step "gtest under ASan + UBSan"
# Leak checking stays on (LeakSanitizer, the default). The initialisation-order
# checks cover the operators' static registrars (TORCH_LIBRARY and
# TORCH_LIBRARY_IMPL). Options already in the environment are appended, so
# they win (e.g. ASAN_OPTIONS=detect_leaks=0 under a debugger, where
# LeakSanitizer cannot run).
export ASAN_OPTIONS="check_initialization_order=1:strict_init_order=1:detect_stack_use_after_return=1:halt_on_error=1${ASAN_OPTIONS:+:$ASAN_OPTIONS}"
export UBSAN_OPTIONS="print_stacktrace=1:halt_on_error=1${UBSAN_OPTIONS:+:$UBSAN_OPTIONS}"
"$build/dpcore_tests" --gtest_color=no "$@"

echo "sanitizer run finished in $(( $(date +%s) - start )) s"
