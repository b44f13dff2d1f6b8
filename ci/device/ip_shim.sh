# Sourced by the device scripts that make network namespaces (netns_bench.sh, netns_gpu.sh).
#   use_ip_shim   puts `ip` on PATH: iproute2 when the machine has it, else ci/device/netns_ip.py
#                 (pyroute2, installed from .devkit/wheels: the GPU machine has no iproute2; fetch
#                 the wheel beside the others on a machine with PyPI:
#                 python3 -m pip download --no-deps --only-binary=:all: -d .devkit/wheels pyroute2==0.9.7)
use_ip_shim() {
  if command -v ip > /dev/null; then
    echo "== ip: $(command -v ip)"
    return 0
  fi
  local whl shim
  whl=$(ls .devkit/wheels/pyroute2-*.whl 2>/dev/null | head -1)
  if [ -z "$whl" ]; then
    echo "no ip (iproute2) and no .devkit/wheels/pyroute2-*.whl: see ci/device/ip_shim.sh" >&2
    return 1
  fi
  python3 -m pip install -q --no-deps --no-index "$whl" 2>&1 | tail -3
  shim=$(mktemp -d /tmp/mori-ip.XXXXXX)
  ln -s "$PWD/ci/device/netns_ip.py" "$shim/ip"
  export PATH="$shim:$PATH"
  echo "== ip: ci/device/netns_ip.py (pyroute2 $(python3 -c 'import importlib.metadata as m; print(m.version("pyroute2"))'))"
}
