#!/usr/bin/env bash
# The main job, from nothing: a virtual environment with torch 2.13.0 (CPU),
# dpcore built and installed with its demo extras (scikit-learn, tqdm,
# matplotlib), then the demo: a small CNN trained on scikit-learn's bundled
# handwritten digits with dpcore.DataParallel on every GPU present, else on
# four CPU devices, after a float64 check that the first steps equal a
# single-device run. Arguments are passed to the demo, e.g.
#   bash scripts/run.sh --epochs 5 --devices cpu:2
# The benchmarks: `python -m dpcore.bench` in the same environment.
# Env: DPCORE_VENV (default .venv), DPCORE_TORCH (default 2.13.0)
set -euo pipefail
cd "$(dirname "$0")/.."
root=$(pwd)
venv=${DPCORE_VENV:-$root/.venv}
[ -x "$venv/bin/python" ] || python3 -m venv "$venv"
# shellcheck disable=SC1091
source "$venv/bin/activate"
python -m pip install -q --upgrade pip >/dev/null
# numpy before the build: the build imports torch, which warns "Failed to
# initialize NumPy" without it (the demo extras would bring it only after).
python -m pip install -q "torch==${DPCORE_TORCH:-2.13.0}" numpy ninja setuptools wheel
python -m pip install -q --no-build-isolation "$root[demo]"
# Run outside the source folder so that the installed dpcore (with its
# built extension) is imported, not the source tree.
cd /
python "$root/examples/digits.py" "$@"
