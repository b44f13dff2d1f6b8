#!/usr/bin/env bash
# The main job: set up, then start 4 local processes that bootstrap over TCP and exchange data.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
bash ci/setup.sh
. .venv/bin/activate
python -m mori.core.bootstrap.demo --nprocs 4
