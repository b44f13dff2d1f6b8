#!/usr/bin/env bash
# mori's UMBP beside Mooncake Store, in the same run, between two network namespaces over TCP:
# batch put and get of 64 pages of 64 KiB and 1 MiB, batch_exists of 1,024 keys, and (mori) a get
# that hits SSD. Mooncake goes into its own environment at bench-out/umbp-peers-venv (its wheel
# ships mooncake_master and the store client). Needs root (the namespaces).
# Output: the table on stdout and bench-out/umbp-bench.json.
#   bash ci/umbp-bench.sh [extra python -m mori.umbp.bench arguments]
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
[ -x .venv/bin/python ] || bash ci/setup.sh
mkdir -p bench-out
peers=bench-out/umbp-peers-venv
if [ ! -x "$peers/bin/python" ]; then
  python3 -m venv "$peers"
  "$peers/bin/python" -m pip install -q --upgrade pip
  "$peers/bin/python" -m pip install -q numpy mooncake-transfer-engine-non-cuda
fi
. .venv/bin/activate
export PYTHONUNBUFFERED=1 MC_LOG_LEVEL=ERROR GLOG_minloglevel=2
python -m mori.umbp.bench --peer-python "$peers/bin/python" --json bench-out/umbp-bench.json "$@"
