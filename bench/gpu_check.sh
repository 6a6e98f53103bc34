#!/usr/bin/env bash
# GPU check of dpcore on a machine with a CUDA GPU, written for one H200 with
# 16 cores, Python 3.12, torch 2.11.0+cu130, nvcc, pytest, pytest-xdist and
# pytest-timeout installed, and no network. Steps:
#   1. environment: Python, torch, CUDA, the GPU;
#   2. build and install dpcore (arch 9.0, 16 jobs) with the system compiler
#      (/usr/bin/gcc, /usr/bin/g++, whatever CC / CXX say: a compiler that
#      links libstdc++ statically makes a library that crashes next to torch,
#      and the build refuses it), offline: pip install --no-deps
#      --no-build-isolation --no-index;
#   3. `python -m dpcore.info` (fails when C++ error messages lose numbers);
#   4. the CUDA tests (device lists on the one GPU, repeats included) in 8
#      pytest-xdist workers with a per-test timeout, so that a hang or a crash
#      fails its own test and the others still run;
#   5. bench_comm, bench_kernels and bench_step on [0, 0, 0, 0] (bench_step
#      with its cuda_graphs=True rows, --cuda-graphs on, at 10 repeats and
#      0.25 s per measurement so that its six models fit the step's timeout;
#      the CUDA tests of step 4 include the demo with --cuda-graphs);
#   6. bench_optimizer on [0, 0], quick (the sharded optimizer's peak memory
#      per step against the plain one's);
#   7. bench_zero2 on [0, 0], quick: the shard_gradients and shard_parameters
#      training steps against the sharded optimizer's, ZeRO-2's and the
#      default mode's, and each mode's per-position peak memory with the
#      allocator's (the GPT-2 rows only where transformers is installed);
#   8. the libstdc++ link tests (tests/test_link_check.py, test_info.py).
# Writes into $OUT: log.txt (everything), one <step>.log per step,
# pytest-*.xml (JUnit) and the benchmarks' JSON.
# Time: at most GPU_CHECK_BUDGET_S (default 470 s, under 8 minutes) in all:
# each step has its own timeout, cut to what is left of the budget, so a hang
# cannot eat the rest; a step with no time left is reported as skipped. A
# failed step after the build does not stop the later ones (the exit status
# says whether any failed); a failed build stops the script.
# Usage: OUT=/path/for/results bash bench/gpu_check.sh
# Env: OUT (default ./gpu-check-out), PYTHON (default python, else python3),
#      CUDA_HOME (default /usr/local/cuda), TORCH_CUDA_ARCH_LIST (default
#      9.0), MAX_JOBS (default 16), PYTEST_WORKERS (default 8),
#      TEST_TIMEOUT_S (per test, default 60), GPU_CHECK_BUDGET_S,
#      DPCORE_SKIP_BUILD=1 (reuse the dpcore a previous run installed on this
#      machine: a quick rerun of the checks, tests and benchmarks).
set -uo pipefail
cd "$(dirname "$0")/.."
root=$(pwd)
OUT=${OUT:-$root/gpu-check-out}
mkdir -p "$OUT"
exec > >(tee "$OUT/log.txt") 2>&1

if [ -n "${PYTHON:-}" ]; then
  py=$PYTHON
elif command -v python >/dev/null 2>&1; then
  py=python
else
  py=python3
fi
export CUDA_HOME=${CUDA_HOME:-/usr/local/cuda}
export TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0}
export MAX_JOBS=${MAX_JOBS:-16}
export DPCORE_CUDA=1
workers=${PYTEST_WORKERS:-8}
test_timeout=${TEST_TIMEOUT_S:-60}
budget=${GPU_CHECK_BUDGET_S:-470}
deadline=$(( $(date +%s) + budget ))
failed=0

step() {  # step ID NAME TIMEOUT COMMAND...: output also in $OUT/ID.log
  local id=$1 name=$2 limit=$3; shift 3
  local left=$(( deadline - $(date +%s) ))
  if [ "$left" -lt 5 ]; then
    printf '\n==> %s SKIPPED: the %ss budget is spent\n' "$name" "$budget" | tee "$OUT/$id.log"
    failed=1
    return
  fi
  [ "$limit" -gt "$left" ] && limit=$left
  printf '\n==> %s (timeout %ss)\n' "$name" "$limit"
  local begin status
  begin=$(date +%s)
  timeout -k 10 "$limit" "$@" 2>&1 | tee "$OUT/$id.log"
  status=${PIPESTATUS[0]}
  [ -n "$(tail -c 1 "$OUT/$id.log")" ] && echo  # a killed command may leave a line open
  if [ "$status" = 0 ]; then
    echo "<== $name ok in $(( $(date +%s) - begin )) s"
  else
    echo "<== $name FAILED (status $status$([ "$status" = 124 ] && echo ', timed out')) after $(( $(date +%s) - begin )) s"
    failed=1
  fi
}

echo "gpu_check: python=$py ($(command -v "$py" || echo 'not found')), budget ${budget}s, results in $OUT"
step environment "environment" 60 "$py" -c "import sys, torch; print(sys.version); print('torch', torch.__version__, 'cuda', torch.version.cuda, 'available', torch.cuda.is_available()); print(torch.cuda.get_device_name(0) if torch.cuda.is_available() else 'no GPU')"

# Any dpcore installed before is removed first, so that a failed build cannot
# leave the later steps testing a stale one; without a build they would mean
# nothing, so the script stops there.
if [ "${DPCORE_SKIP_BUILD:-0}" = 1 ]; then
  echo "==> build skipped (DPCORE_SKIP_BUILD=1): checking the dpcore installed before"
else
  "$py" -m pip uninstall -y dpcore >/dev/null 2>&1 || true
  # PIP_BREAK_SYSTEM_PACKAGES: the interpreter with torch may be a system one
  # (PEP 668); dpcore goes next to that torch.
  step build "build (arch $TORCH_CUDA_ARCH_LIST, $MAX_JOBS jobs, /usr/bin/g++)" 240 \
    env CC=/usr/bin/gcc CXX=/usr/bin/g++ PIP_BREAK_SYSTEM_PACKAGES=1 \
    "$py" -m pip install --no-deps --no-build-isolation --no-index "$root"
  if [ $failed != 0 ]; then
    echo "gpu_check: the build failed; nothing else was run. Log: $OUT/build.log"
    exit 1
  fi
fi

cd "$OUT"  # import the installed dpcore, not the source folder
step info "python -m dpcore.info" 60 "$py" -m dpcore.info

# -p no:cacheprovider: nothing written into the source folder. The thread
# method of pytest-timeout also ends a test stuck inside C++ (CUDA); its
# worker dies and xdist reports that test and starts another worker.
pytest_args=(-q -rfE -p no:cacheprovider)
if "$py" -c "import xdist, pytest_timeout" >/dev/null 2>&1; then
  pytest_args+=(--timeout "$test_timeout" --timeout-method thread)
  cuda_workers=(-n "$workers")
  cuda_how="$workers workers, ${test_timeout}s per test"
else
  echo "gpu_check: pytest-xdist or pytest-timeout is missing: the tests run in one process, without per-test timeouts"
  cuda_workers=()
  cuda_how="one process"
fi
# The hypothesis properties (tests/reliability) are CPU-only and need the
# hypothesis package, which a bare GPU machine may lack: leave that module out
# there rather than fail the whole collection.
if ! "$py" -c "import hypothesis" >/dev/null 2>&1; then
  pytest_args+=(--ignore "$root/tests/reliability/test_properties.py")
  echo "gpu_check: hypothesis is missing: tests/reliability/test_properties.py (CPU only) is left out"
fi
step cuda-tests "CUDA tests ($cuda_how)" 180 "$py" -m pytest "${pytest_args[@]}" \
  ${cuda_workers[@]+"${cuda_workers[@]}"} -m cuda "$root/tests" --junitxml="$OUT/pytest-cuda.xml"
step bench-comm "bench_comm [0,0,0,0]" 90 "$py" "$root/bench/bench_comm.py" --devices 0,0,0,0 --json "$OUT/comm.json"
step bench-kernels "bench_kernels [0,0,0,0]" 90 "$py" "$root/bench/bench_kernels.py" --devices 0,0,0,0 --json "$OUT/kernels.json"
step bench-step "bench_step [0,0,0,0], eager and CUDA graphs" 90 "$py" "$root/bench/bench_step.py" --devices 0,0,0,0 \
  --cuda-graphs on --repeats 10 --min-seconds 0.25 --json "$OUT/step.json"
step bench-optimizer "bench_optimizer [0,0] --quick (peak GPU memory per step)" 60 "$py" "$root/bench/bench_optimizer.py" \
  --devices 0,0 --quick --json "$OUT/optimizer.json"
step bench-zero2 "bench_zero2 [0,0] --quick (ZeRO-2 and ZeRO-3 step and memory)" 60 "$py" "$root/bench/bench_zero2.py" \
  --devices 0,0 --quick --json "$OUT/zero2.json"
step link-tests "libstdc++ link and info tests" 90 "$py" -m pytest "${pytest_args[@]}" \
  "$root/tests/test_link_check.py" "$root/tests/test_info.py" --junitxml="$OUT/pytest-link.xml"
echo
echo "gpu_check: $([ $failed = 0 ] && echo all steps passed || echo SOME STEPS FAILED) in $(( budget - (deadline - $(date +%s)) )) s; results in $OUT"
exit $failed
