#!/usr/bin/env bash
# The newest-releases job (ci/test.sh runs it beside the main tests): a second, small
# environment with the newest torch and Triton that pip resolves (ci/requirements-newest.txt,
# unpinned) and mori's four packages installed from wheels built from this checkout. From outside
# the source tree, so that every import is of the installed packages, it runs:
#   - mori-triton's CPU tests: Triton, LLVM IR and MLIR to PTX, the bitcode and its rebuild;
#   - mori-io's tests that take torch tensors (the io test files that import torch or the client
#     replays' helpers, _kv_clients, whose caches are torch tensors);
#   - mori.ops's CPU tests (mori-shmem's test_ops_*.py);
#   - mori-shmem's rdma extra: the UCX it brings carries two PEs' remote puts (ci/shmem_ucx_extra.py).
# Each runs on several pytest-xdist workers. The environment lives in a temporary folder, built
# anew each run (about 6 GB: torch's CUDA wheels, which torch needs to import even on a CPU), and
# is removed at exit.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
# Installed without byte code (--no-compile below), torch is compiled as it is imported: once, if
# Python may write the byte code; in every test process (3 s of CPU each), where a machine sets
# PYTHONDONTWRITEBYTECODE. numpy's BLAS: one thread (see ci/test.sh).
unset PYTHONDONTWRITEBYTECODE
export OPENBLAS_NUM_THREADS=1
[ -x .venv/bin/python ] || bash ci/setup.sh  # clang-19 and the build tools come from there
start=$SECONDS
work=$(mktemp -d "${TMPDIR:-/tmp}/mori-newest.XXXXXX")
trap 'rm -rf "$work"' EXIT
env=$work/venv
wheels=$work/wheels

echo "-- wheels"
# mori-core's build hook links the native module into the tree it builds from, where ci/test.sh's
# other jobs are importing it at the same time: its wheel is built from a copy (the compiled
# objects copied too, with their times, so the hook only links).
mkdir "$work/src"
cp -a packages/version.py packages/mori-core "$work/src/"
.venv/bin/python -m pip wheel -q --no-deps --no-build-isolation -w "$wheels" \
  "$work/src/mori-core" packages/mori-shmem packages/mori-io packages/mori-triton
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
  "$(one mori_core)[cuda]" "$(one mori_shmem)[rdma]" "$(one mori_io)[torch]" "$(one mori_triton)[torch,mlir]"
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
echo "-- mori-shmem[rdma]: the UCX it brings"
"$env/bin/python" "$root/ci/shmem_ucx_extra.py"

# Not the tests marked quiet either: they run alone in the main job, and this one runs beside others.
tests() {
  "$env/bin/python" -m pytest -c "$root/pyproject.toml" -m "not gpu and not quiet" -p no:cacheprovider \
    -n "$(nproc)" --dist worksteal "$@"
}
echo "-- mori-triton (installed)"
tests "$root/packages/mori-triton/tests"
echo "-- mori-io's tests that take torch tensors, and mori.ops's CPU tests"
# every mori-io test file that imports torch or the client replays' helpers (_kv_clients: caches
# as tensors); one session with mori.ops's, not with mori-triton's (both packages have a test_gpu.py)
mapfile -t io_tests < <(grep -rlE --include='test_*.py' \
  '^(import torch|torch = pytest.importorskip|from _kv_clients import)' "$root/packages/mori-io/tests" | sort)
tests "${io_tests[@]}" "$root"/packages/mori-shmem/tests/test_ops_*.py
echo "newest: passed in $((SECONDS - start)) s (the environment's removal follows)"
