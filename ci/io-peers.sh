#!/usr/bin/env bash
# mori-io's TCP backend beside its peers, measured in the same run on loopback: Mooncake Transfer
# Engine (tcp transport) and NIXL (UCX over tcp). The peers go into their own environment at
# bench-out/peers-venv because NIXL pins a torch that differs from the one mori's dev env uses.
# Output: the table on stdout, bench-out/io-peers.json and bench-out/io-peers.png.
#   bash ci/io-peers.sh [extra mori-io-bench arguments]
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
[ -x .venv/bin/python ] || bash ci/setup.sh
mkdir -p bench-out
peers=bench-out/peers-venv
if [ ! -x "$peers/bin/python" ]; then
  python3 -m venv "$peers"
  "$peers/bin/python" -m pip install -q --upgrade pip
  "$peers/bin/python" -m pip install -q numpy mooncake-transfer-engine-non-cuda nixl
fi
. .venv/bin/activate
export PYTHONUNBUFFERED=1
python -m mori.io.bench --op write --sizes 4K,64K,256K,1M --batch-sizes 1,64,1024 --iters 100 \
  --peers mooncake,nixl --peer-python "$peers/bin/python" \
  --json bench-out/io-peers.json --plot bench-out/io-peers.png "$@"
