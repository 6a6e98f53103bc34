#!/usr/bin/env bash
# The main job, from nothing: a virtual environment with torch 2.13.0 (CPU),
# dpcore built and installed, then the collective and step benchmarks on
# four CPU devices (or every GPU when one is present), results in
# bench-results/.
# Env: DPCORE_VENV (default .venv)
set -euo pipefail
cd "$(dirname "$0")/.."
root=$(pwd)
venv=${DPCORE_VENV:-$root/.venv}
[ -x "$venv/bin/python" ] || python3 -m venv "$venv"
# shellcheck disable=SC1091
source "$venv/bin/activate"
python -m pip install -q --upgrade pip >/dev/null
python -m pip install -q "torch==${DPCORE_TORCH:-2.13.0}" ninja setuptools wheel
python -m pip install -q --no-build-isolation "$root"
cd "$root/bench"
python bench_comm.py --json "$root/bench-results/comm.json"
python bench_step.py --json "$root/bench-results/step.json"
