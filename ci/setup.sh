#!/usr/bin/env bash
# Prepares a fresh machine for mori's CPU jobs: system packages through apt-get, then a virtual
# environment at .venv with the five packages installed editable and the dev tools of
# ci/requirements-dev.txt. Needs only python3, pip and apt-get. Safe to run again.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"

# clang-19/llvm-19: builds and inspects the device bitcode; iproute2: network-namespace tests;
# g++: the native module; python3-venv: the environment below; Open MPI: the mpirun test of
# the bootstrap's MPI launcher (mpi4py needs an MPI library); libucx0 + ucx-utils: Debian's UCX,
# built with verbs, which mori.core.ucx prefers over the libucx wheel (its tests run on both), and
# ucx_info; redis-server: the UMBP master's Redis store tests; pkg-config + libgrpc++-dev: gRPC
# C++, which mori-umbp's optional native gRPC transport (the master's server, its client's channel)
# is built against, and libxxhash-dev, the checksums of that module's SSD reads.
pkgs=()
command -v clang-19 >/dev/null || pkgs+=(clang-19 llvm-19)
command -v llvm-link-19 >/dev/null || pkgs+=(llvm-19)
command -v ip >/dev/null || pkgs+=(iproute2)
command -v g++ >/dev/null || pkgs+=(g++)
command -v mpirun >/dev/null || pkgs+=(openmpi-bin libopenmpi-dev)
command -v ucx_info >/dev/null || pkgs+=(libucx0 ucx-utils)
command -v redis-server >/dev/null || pkgs+=(redis-server)
command -v pkg-config >/dev/null || pkgs+=(pkg-config)
pkg-config --exists grpc++ 2>/dev/null || pkgs+=(libgrpc++-dev)
pkg-config --exists libxxhash 2>/dev/null || pkgs+=(libxxhash-dev)
python3 -c 'import venv, ensurepip' 2>/dev/null || pkgs+=(python3-venv)
if [ ${#pkgs[@]} -gt 0 ]; then
  sudo=""; [ "$(id -u)" = 0 ] || sudo=sudo
  echo "setup: apt-get install ${pkgs[*]}"
  $sudo apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends "${pkgs[@]}" >/dev/null
fi

[ -x .venv/bin/python ] || python3 -m venv .venv
. .venv/bin/activate
python -m pip install -q --upgrade pip
python -m pip install -q -r ci/requirements-dev.txt
python -m pip install -q --no-deps \
  -e packages/mori-core -e packages/mori-shmem -e packages/mori-io -e packages/mori-triton \
  -e packages/mori-umbp
python -m pip check >/dev/null || { python -m pip check; exit 1; }
echo "setup: ready ($(python --version), venv at $root/.venv)"
