#!/usr/bin/env bash
# The main job: set up, then run the mori-io benchmark — an initiator and a target engine as two
# processes moving data over TCP on loopback — and print its table (block sizes x batch sizes,
# MaxBW/AvgBW GB/s, MinLat/AvgLat us).
#   bash ci/demo.sh              the mori-io benchmark (extra arguments go to mori-io-bench)
#   bash ci/demo.sh bootstrap    the bootstrap demo: 4 processes rendezvous over TCP and exchange data
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
bash ci/setup.sh
. .venv/bin/activate
if [ "${1:-}" = bootstrap ]; then
  shift
  exec python -m mori.core.bootstrap.demo --nprocs 4 "$@"
fi
exec python -m mori.io.bench --op write --sizes 4K,64K,1M,4M --batch-sizes 1,64 --iters 50 "$@"
