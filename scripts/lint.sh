#!/usr/bin/env bash
# Lint: ruff with the rules of pyproject.toml ([tool.ruff.lint]) over the
# Python tree. CI runs it with --format (scripts/test.sh, in the test
# environment, with ruff 0.17.6 and clang-format 23.1.5).
# --format also checks the layout: `ruff format --check` and clang-format
# (.clang-format) over csrc/ and tests/cpp/; for a tree formatted once with
# `ruff format . && clang-format -i $(git ls-files 'csrc/*' 'tests/cpp/*')`.
# Usage: bash scripts/lint.sh [--format]     (needs ruff; --format also clang-format)
set -euo pipefail
cd "$(dirname "$0")/.."
ruff --version
ruff check .
if [ "${1:-}" = "--format" ]; then
  ruff format --check .
  clang-format --version
  # shellcheck disable=SC2046
  clang-format --dry-run -Werror $(git ls-files 'csrc/*.h' 'csrc/*.cpp' 'csrc/*.cu' 'csrc/*.cuh' 'tests/cpp/*.h' 'tests/cpp/*.cpp')
fi
echo "lint: clean"
