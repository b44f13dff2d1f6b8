# Sourced by the ci/device scripts whose PEs reach each other through UCX on the GPU machine
# (shmem.sh, shmem_proxy.sh, ep.sh --proxy). Not run on its own.
#
#   use_ucx_wheel   installs the libucx wheel of .devkit (unless MORI_SKIP_INSTALL is set) and
#                   exports MORI_UCX_LIB at its libraries. libucx-cu13's CUDA transports need a
#                   CUDA 13 driver; an older driver takes libucx-cu12 (ci/device/ucx_kit.sh cu12)
#                   where .devkit has it. Why the wheel's UCX and not the system's: the device
#                   machine has a UCX 1.16 without CUDA, which mori-core's loader would take first.
#                   Run it from the repository root.

use_ucx_wheel() {
  local driver_cuda kit=.devkit/ucx
  driver_cuda=$(nvidia-smi | grep -o "CUDA Version: [0-9]*" | grep -o "[0-9]*$")
  if [ "${driver_cuda:-13}" -lt 13 ] && ls .devkit/ucx-cu12/*.whl >/dev/null 2>&1; then kit=.devkit/ucx-cu12; fi
  echo "driver: CUDA ${driver_cuda:-?}; UCX from $kit"
  if [ -z "${MORI_SKIP_INSTALL:-}" ]; then
    python3 -m pip install -q --no-deps --no-index $kit/*.whl 2>&1 | tail -3
  fi
  MORI_UCX_LIB=$(cd /tmp && python3 -c "import importlib.util, os; s = importlib.util.find_spec('libucx'); print(os.path.join(list(s.submodule_search_locations)[0], 'lib'))")
  export MORI_UCX_LIB
}
