#!/usr/bin/env bash
# mori.umbp beside Mooncake Store in the same run, between network namespaces over TCP (master in
# one, the node that puts and gets in another, the storage node in a third): batch put and get,
# batch_exists, and gets that hit the storage node's SSD (`--points ssd`: those alone). Mooncake
# goes into its own environment at bench-out/peers-venv (as in ci/io-peers.sh). Needs root and
# iproute2.
# Output: the table on stdout, bench-out/umbp-peers.json, the processes' logs in bench-out/umbp-logs.
#   bash ci/umbp-peers.sh [extra mori-umbp-bench arguments]
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
[ -x .venv/bin/python ] || bash ci/setup.sh
mkdir -p bench-out
peers=bench-out/peers-venv
if ! "$peers/bin/python" -c 'import mooncake.store' 2>/dev/null; then
  python3 -m venv "$peers"
  "$peers/bin/python" -m pip install -q --upgrade pip
  "$peers/bin/python" -m pip install -q numpy mooncake-transfer-engine-non-cuda
fi
export PYTHONUNBUFFERED=1
.venv/bin/mori-umbp-bench --peers mooncake --peer-python "$root/$peers/bin/python" \
  --json bench-out/umbp-peers.json --logs bench-out/umbp-logs "$@"
