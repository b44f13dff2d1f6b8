#!/usr/bin/env bash
# The newest-releases job (ci/test.sh runs it after the main one): a second, small environment
# with the newest torch and Triton that pip resolves (ci/requirements-newest.txt, unpinned) and
# mori's four packages installed from wheels built from this checkout. From outside the source
# tree, so that every import is of the installed packages, it runs:
#   - mori-triton's CPU tests: Triton, LLVM IR and MLIR to PTX, the bitcode and its rebuild;
#   - mori-io's tests that take torch tensors (the io test files that import torch or the client
#     replays' helpers, _kv_clients, whose caches are torch tensors);
#   - mori.ops's CPU tests (mori-shmem's test_ops_*.py).
# The environment lives in a temporary folder, built anew each run (about 6 GB: torch's CUDA
# wheels, which torch needs to import even on a CPU), and is removed at exit.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
[ -x .venv/bin/python ] || bash ci/setup.sh  # clang-19 and the build tools come from there
start=$SECONDS
work=$(mktemp -d "${TMPDIR:-/tmp}/mori-newest.XXXXXX")
trap 'rm -rf "$work"' EXIT
env=$work/venv
wheels=$work/wheels

echo "-- wheels"
.venv/bin/python -m pip wheel -q --no-deps --no-build-isolation -w "$wheels" \
  packages/mori-core packages/mori-shmem packages/mori-io packages/mori-triton
one() { local found=("$wheels"/"$1"-*.whl); echo "${found[0]}"; }
wheels_built=$((SECONDS - start))

echo "-- environment"
python3 -m venv "$env"
# This machine's pip configuration caps torch at the releases cached on its disk (a constraints
# file, 'torch<=2.14.1', named in /etc/xdg/pip/pip.conf). This environment exists to see the newest
# release, so here pip reads an empty constraints file instead; its other settings (indexes,
# find-links) still apply, and nothing outside this script is changed.
export PIP_CONSTRAINT=/dev/null
"$env/bin/python" -m pip install -q --upgrade pip
# --no-compile: torch's Python files are byte-compiled as they are imported, not all at install.
"$env/bin/python" -m pip install -q --no-compile -r ci/requirements-newest.txt \
  "$(one mori_core)[cuda]" "$(one mori_shmem)" "$(one mori_io)[torch]" "$(one mori_triton)[torch,mlir]"
"$env/bin/python" -m pip check
built=$((SECONDS - start))

cd "$work"
"$env/bin/python" - "$env" <<'PY'
import sys
from importlib.metadata import version
from pathlib import Path

import mori.core, mori.io, mori.ops, mori.shmem, mori.triton

for module in (mori.core, mori.io, mori.ops, mori.shmem, mori.triton):
    where = Path(module.__file__).resolve()
    assert Path(sys.argv[1]).resolve() in where.parents, f"{module.__name__} was imported from {where}"
names = ("torch", "triton", "xtc-mlir-python-bindings", "cuda-bindings")
print("newest: " + ", ".join(f"{name} {version(name)}" for name in names))
PY
echo "newest: wheels built in ${wheels_built} s, environment installed in $((built - wheels_built)) s"

run_tests() { "$env/bin/python" -m pytest -c "$root/pyproject.toml" -m "not gpu" -p no:cacheprovider "$@"; }
echo "-- mori-triton (installed)"
run_tests "$root/packages/mori-triton/tests"
echo "-- mori-io: the tests that take torch tensors"
# every test file that imports torch or the client replays' helpers (_kv_clients: caches as tensors)
mapfile -t io_tests < <(grep -rlE --include='test_*.py' \
  '^(import torch|torch = pytest.importorskip|from _kv_clients import)' "$root/packages/mori-io/tests" | sort)
run_tests "${io_tests[@]}"
echo "-- mori.ops: CPU tests"
run_tests "$root"/packages/mori-shmem/tests/test_ops_*.py
echo "newest: passed in $((SECONDS - start)) s (the environment's removal follows)"
