#!/usr/bin/env bash
# Formats the tree: Python with ruff format (pyproject.toml's [tool.ruff.format]), C++ and CUDA with
# clang-format 19 (.clang-format, and the device folders' own). With --check it changes nothing and
# fails, naming the files, when any is not formatted (ci/test.sh runs it so).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
# The environment's tools (ci/setup.sh), else those on PATH.
ruff=.venv/bin/ruff clang_format=.venv/bin/clang-format
[ -x "$ruff" ] || ruff=ruff
[ -x "$clang_format" ] || clang_format=clang-format
# Generated files keep their generator's layout (mori-triton's test_table compares them with a fresh run).
generated=(':!packages/mori-triton/src/mori/triton/csrc/mori_shmem_wrappers.cu')
mapfile -t cxx < <(git ls-files '*.cpp' '*.hpp' '*.h' '*.cu' '*.cuh' "${generated[@]}")
if [ "${1:-}" = --check ]; then
  status=0
  "$ruff" format --check packages ci docs || status=1
  for f in "${cxx[@]}"; do
    "$clang_format" --dry-run -Werror "$f" >/dev/null 2>&1 || { echo "would reformat $f"; status=1; }
  done
  exit $status
fi
"$ruff" format packages ci docs
"$clang_format" -i "${cxx[@]}"
