#!/usr/bin/env bash
# mori-core on the GPU machine: CUDA VMM memory exported by one process and imported by another
# (GPU0 -> GPU1 over NVLink, and GPU0 -> GPU0; only the second on a one-GPU machine), byte for byte,
# then the gpu-marked mori-core tests.
# Run from the repository root with .devkit carried; logs and the JSON report go to $OUT.
# Installs mori-core only when the installed copy is missing or differs from this checkout, so
# that ci/device/shmem.sh (which installs it first) can call this within a short time limit.
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/mori-out}
mkdir -p "$OUT"
export MORI_CACHE_DIR=${MORI_CACHE_DIR:-/tmp/mori-cache}
repo=$PWD
t0=$(date +%s)

# Is the installed mori.core this checkout's? Compare every Python source file.
current=$(cd /tmp && python3 - "$repo/packages/mori-core/src/mori/core" <<'PY'
import filecmp, pathlib, sys
try:
    import mori.core._native, mori.core
except ImportError:
    print("missing"); sys.exit()
src, dst = pathlib.Path(sys.argv[1]), pathlib.Path(mori.core.__file__).parent
if src.resolve() == dst.resolve():
    print("editable"); sys.exit()
same = all((dst / p.relative_to(src)).is_file() and filecmp.cmp(p, dst / p.relative_to(src), shallow=False)
           for p in src.rglob("*.py"))
print("same" if same else "stale")
PY
)
echo "== installed mori-core: $current"
if [ "$current" != same ] && [ "$current" != editable ]; then
  python3 -m pip install -q --no-index --find-links .devkit/wheels ./packages/mori-core 2>&1 | tail -5
  echo "== installed in $(( $(date +%s) - t0 ))s"
fi
nvidia-smi --query-gpu=index,name --format=csv,noheader | head -4
status=0
cd /tmp  # import mori from site-packages, not the source tree
echo "== VMM export/import across processes"
timeout 150 python3 "$repo/ci/device/core_vmm_check.py" --out "$OUT/core_vmm.json"
rc=$?; echo "rc=$rc"; [ $rc = 0 ] || status=1
echo "== gpu-marked mori-core tests"
select=()  # the second-GPU case fails (not skips) without a second GPU: on one GPU it is left out, and said so
if [ "$(nvidia-smi --query-gpu=index --format=csv,noheader | wc -l)" -lt 2 ]; then
  echo "(one GPU: test_import_on_a_second_gpu_reads_over_peer_access not run)"; select=(-k "not second_gpu")
fi
timeout 120 python3 -m pytest -q -m gpu -p no:cacheprovider "${select[@]}" \
  "$repo/packages/mori-core/tests/test_memory_vmm.py" "$repo/packages/mori-core/tests/test_gpu_device.py" \
  > "$OUT/core_tests.log" 2>&1
rc=$?; echo "rc=$rc"; tail -15 "$OUT/core_tests.log"
[ $rc = 0 ] || status=1
echo "== core done in $(( $(date +%s) - t0 ))s, status $status"
exit $status
