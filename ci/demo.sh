#!/usr/bin/env bash
# The main job: set up, then run the mori-io benchmark (an initiator and a target engine as two
# processes moving data over TCP on loopback), print its table (block sizes x batch sizes,
# MaxBW/AvgBW GB/s, MinLat/AvgLat us) and say what ran and what the figures mean. On a machine
# where torch sees a CUDA GPU it runs again with both buffers in GPU memory (--mem-type gpu).
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

bench() {  # bench MEM_TYPE [ARGS...]
  python -m mori.io.bench --op write --sizes 4K,64K,1M,4M --batch-sizes 1,64 --iters 50 --no-progress \
    --mem-type "$@"
}

cat <<'EOF'
== mori-io benchmark: what runs
Two mori.io IOEngines with the TCP backend, as a KV-cache transfer between two inference
instances would use them: the target in a child process, the initiator here, both on 127.0.0.1.
Each registers a buffer; the initiator writes blocks of its buffer into the target's with
batch_write (the remote offsets in reverse order, so the blocks really scatter). For each block
size (4K to 4M) and batch size (1 or 64 blocks per transfer): 5 untimed transfers, then 50 timed
ones, each from the call until its status reports SUCCESS.

-- host memory
EOF
bench cpu "$@"

gpu=$(python -c 'import torch; print(torch.cuda.device_count() if torch.cuda.is_available() else 0)' 2>/dev/null) || gpu=0
if [ "$gpu" -gt 0 ]; then
  echo
  echo "-- GPU memory ($gpu GPU(s): the target's buffer on GPU 0, the initiator's on the last one;"
  echo "   TCP cannot reach GPU memory, so mori's native staging copies it through pinned host buffers)"
  bench gpu "$@"
fi

cat <<'EOF'

== How to read the table
  size x batch  bytes one transfer moves: batch blocks of size bytes each
  MaxBW GB/s    size x batch / the fastest transfer's time (1 GB = 1e9 bytes); AvgBW: / the mean time
  MinLat us     the fastest transfer's time, call to SUCCESS; AvgLat: the mean
Small transfers measure the fixed cost of one transfer (posting it, the TCP round trip, the
completion), so read their latency; large ones measure how fast bytes are copied through the
kernel's loopback TCP, so read their bandwidth. A batch of 64 pays the fixed cost once for 64
blocks. On loopback both engines share this machine's CPUs and memory; between two hosts the
network sets the ceiling instead. docs/benchmarks.md has the project's measured runs, beside
NIXL and Mooncake.
EOF
if [ "$gpu" -eq 0 ]; then
  echo "No CUDA GPU here (torch sees none), so only host memory was moved; on a GPU machine this"
  echo "script also moves GPU memory (mori-io-bench --mem-type gpu)."
fi
