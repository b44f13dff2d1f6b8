#!/usr/bin/env bash
# mori-io-bench between two network namespaces joined by a veth pair (two "hosts" on this machine):
# mori's RDMA backend (UCX over MORI_IO_RDMA_TRANSPORTS, default tcp: no RDMA NIC here), mori's TCP
# backend, and NIXL's UCX backend on the same UCX transports, in one run. Needs root and iproute2.
# Usage: ci/rdma_bench.sh [PEER_PYTHON] [extra mori-io-bench args]; PEER_PYTHON has nixl installed
# (default: no NIXL). Example: bash ci/rdma_bench.sh /tmp/nixl-venv/bin/python --op read
# MORI_PYTHON: the interpreter with mori-io (default: the checkout's .venv; python3 on the device).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
peer_python=${1:-}
shift || true
tag=$$
ns_t=mori_bt$tag ns_i=mori_bi$tag
cleanup() { ip netns del "$ns_t" 2>/dev/null || true; ip netns del "$ns_i" 2>/dev/null || true; }
trap cleanup EXIT
ip netns add "$ns_t"
ip netns add "$ns_i"
ip link add "vbt$tag" type veth peer name "vbi$tag"
ip link set "vbt$tag" netns "$ns_t"
ip link set "vbi$tag" netns "$ns_i"
ip -n "$ns_t" addr add 10.231.9.1/24 dev "vbt$tag"
ip -n "$ns_i" addr add 10.231.9.2/24 dev "vbi$tag"
for ns in "$ns_t" "$ns_i"; do ip -n "$ns" link set lo up; done
ip -n "$ns_t" link set "vbt$tag" up
ip -n "$ns_i" link set "vbi$tag" up
# TCP between the "hosts" as between real ones: CUBIC, on the route (why: mori.core.testing's
# host_congestion_control; a machine defaulting to BBR halves connections' bandwidth at random).
if grep -qw cubic /proc/sys/net/ipv4/tcp_available_congestion_control 2>/dev/null; then
  ip -n "$ns_t" route replace 10.231.9.0/24 dev "vbt$tag" congctl cubic
  ip -n "$ns_i" route replace 10.231.9.0/24 dev "vbi$tag" congctl cubic
fi
export MORI_IO_RDMA_TRANSPORTS=${MORI_IO_RDMA_TRANSPORTS:-tcp}
peers=()
[ -n "$peer_python" ] && peers=(--peers nixl --peer-python "$peer_python")
ip netns exec "$ns_i" "${MORI_PYTHON:-$root/.venv/bin/python}" -m mori.io.bench --backend rdma,tcp --host 10.231.9.2 \
  --target-host 10.231.9.1 --target-netns "$ns_t" --no-progress "${peers[@]}" "$@"
