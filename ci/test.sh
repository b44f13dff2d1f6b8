#!/usr/bin/env bash
# The CPU test job (the README's second command, and what .ci/run calls): set up, lint, type
# check, then every package's tests, the repository's own tests, the docs build with warnings as
# errors, and the installed wheels with the newest torch and Triton (ci/newest.sh), side by side.
# Extra arguments go to every pytest run of the packages and of ci/tests.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
bash ci/setup.sh
. .venv/bin/activate
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
# The tests start hundreds of Python processes. Let them write byte code once rather than compile
# mori's modules in every one (some machines set PYTHONDONTWRITEBYTECODE), and give numpy's BLAS
# one thread: its idle thread spins for ~0.1 s of CPU in every process that imports numpy, and
# nothing here uses BLAS.
unset PYTHONDONTWRITEBYTECODE
export OPENBLAS_NUM_THREADS=1
start=$SECONDS

echo "== lint (ruff)"
ruff check packages ci docs
echo "== layers (no private name outside the distribution that ships it; no native plane includes another's private files; no import cycles)"
python ci/check_layers.py
python ci/check_planes.py
python ci/check_cycles.py
echo "== format (ruff format, clang-format: bash ci/format.sh formats the tree)"
bash ci/format.sh --check
echo "== types (mypy, public modules)"
mypy packages/mori-core/src packages/mori-shmem/src packages/mori-io/src packages/mori-triton/src \
  packages/mori-umbp/src

echo "== tests, docs and the newest releases"
# First, alone, the tests marked quiet: they time steps too tightly to share the CPU. Then four
# lanes at once, each its steps in turn. Many tests wait (on processes, sockets, deadlines) more
# than they compute, so the lanes together keep the cores busy, and a step's pytest-xdist workers
# (-n) spread its longest tests. Tests that share a machine-wide resource take turns through a lock
# (mori-io's fixed ports); network namespaces, /dev/shm files and sockets are named per process.
# mori-shmem runs on no extra workers: its tests are processes of PEs already.
# -m "not gpu": GPU tests run on the device machine through ci/device/*.sh.
# pytest exits 5 when it collects nothing: that fails the step like any other error.
cores=$(nproc)
tests() {  # tests WORKERS PATH [MARKS]: a package's tests (WORKERS 0: no xdist), those not quiet by default
  python -m pytest -m "not gpu and ${3:-not quiet}" -p no:cacheprovider -n "$1" --dist worksteal "$2" \
    "${pytest_args[@]}"
}
step() {
  case $1 in
    quiet) tests 0 packages/mori-io/tests quiet ;;
    mori-core) tests $((cores + 1)) packages/mori-core/tests ;;
    mori-io) tests $((cores + 1)) packages/mori-io/tests ;;
    mori-shmem) tests 0 packages/mori-shmem/tests ;;
    mori-triton) tests "$cores" packages/mori-triton/tests ;;
    mori-umbp) tests "$cores" packages/mori-umbp/tests ;;
    ci-tests) tests "$cores" ci/tests ;;
    docs) bash ci/docs.sh ;;
    newest) bash ci/newest.sh ;;
  esac
}
lane() {  # lane STEP...: the steps one after another; each one's output, exit status and seconds in $logs
  local name t rc
  for name; do
    t=$SECONDS
    if step "$name" >"$logs/$name.log" 2>&1; then rc=0; else rc=$?; fi
    echo "$rc $((SECONDS - t))" >"$logs/$name.rc"
  done
}
failed=() summary=()
report() {  # report STEP: its output, and a line for the summary
  local name=$1 rc took counts
  read -r rc took <"$logs/$name.rc"
  echo "---- $name (exit $rc, $took s)"
  cat "$logs/$name.log"
  # pytest's closing lines ("== 195 passed, 26 deselected in 99.03s =="), one per session
  counts=$(grep -E '^=+ .* in [0-9.]+s( \([0-9:]+\))? =+$' "$logs/$name.log" \
    | sed -E 's/^=+ | =+$//g' | paste -sd ';' - | sed 's/;/; /g') || true
  summary+=("$(printf '%-12s %4d s  exit %-3d %s' "$name" "$took" "$rc" "$counts")")
  [ "$rc" = 0 ] || failed+=("$name")
}
pytest_args=("$@")
logs=$(mktemp -d "${TMPDIR:-/tmp}/mori-test.XXXXXX")
declare -A lane_steps
# Each lane in a process group of its own (job control), so that a run that stops early, failed or
# interrupted, stops every lane with all the processes in it.
set -m
trap 'for pid in "${!lane_steps[@]}"; do kill -- -"$pid" 2>/dev/null || true; done; rm -rf "$logs"' EXIT

lane quiet </dev/null
report quiet
echo "-- side by side (each lane's output follows when it ends)"
for steps in "newest" "mori-core" "mori-io" "mori-shmem mori-triton mori-umbp ci-tests docs"; do
  # $steps unquoted: each word is a step
  lane $steps </dev/null &
  lane_steps[$!]=$steps
done
while [ ${#lane_steps[@]} -gt 0 ]; do
  wait -n -p pid || true  # a lane always exits 0: its steps' statuses are in $logs
  for name in ${lane_steps[$pid]}; do
    report "$name"
  done
  unset "lane_steps[$pid]"
done
echo "== summary ($((SECONDS - start)) s after set-up)"
printf '  %s\n' "${summary[@]}"
if [ ${#failed[@]} -gt 0 ]; then
  echo "== FAILED: ${failed[*]}"
  exit 1
fi
echo "== all CPU checks passed"
