#!/usr/bin/env bash
# The CPU test job (the README's second command, and what .ci/run calls): set up, lint, type
# check, run every package's tests, build the docs with warnings as errors, then test the
# installed wheels with the newest torch and Triton.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
bash ci/setup.sh
. .venv/bin/activate
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1

echo "== lint (ruff)"
ruff check packages ci docs
echo "== layers (no private name outside the distribution that ships it)"
python ci/check_layers.py
echo "== types (mypy, public modules)"
mypy packages/mori-core/src packages/mori-shmem/src packages/mori-io/src packages/mori-triton/src
echo "== tests"
# -m "not gpu": GPU tests run on the device machine through ci/device/*.sh.
# pytest exits 5 when it collects nothing: that fails this script like any other error.
for pkg in mori-core mori-shmem mori-io mori-triton; do
  echo "-- $pkg"
  python -m pytest -m "not gpu" -p no:cacheprovider "packages/$pkg/tests" "$@"
done
echo "== repository checks (ci/tests: the layer check, every example of the docs)"
python -m pytest -m "not gpu" -p no:cacheprovider ci/tests "$@"
echo "== docs"
bash ci/docs.sh
echo "== newest torch and Triton (a second environment, installed from wheels: ci/newest.sh)"
bash ci/newest.sh
echo "== all CPU checks passed"
