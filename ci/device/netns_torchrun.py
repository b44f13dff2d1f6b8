"""A torchrun world across two "hosts": two network namespaces joined by a veth pair on this machine.

The GPU tests start their PEs with ``torchrun --standalone`` (test_gpu.py's ``_torchrun``). With
``MORI_TEST_NETNS=1`` in the environment they call :func:`torchrun_two_hosts` instead: half of the
PEs run in each namespace, started by one ``torchrun`` per namespace (``--nnodes 2``, static
rendezvous at the first namespace's address). Each node's PEs share that node's GPUs as
:mod:`gpu_world` assigns them (``LOCAL_RANK``), so on a one-GPU machine every PE shares GPU 0
under MPS (ci/device/multi_pe.sh starts it; its pipe in /tmp is seen from both namespaces).

PEs of one namespace are one host to mori (its host identity includes the network namespace):
P2P between them unless ``MORI_DISABLE_P2P`` is set, the remote transport (UCX over the veth
pair) to the other namespace. The torch process group (gloo) and mori's bootstrap run over the
veth pair too: ``GLOO_SOCKET_IFNAME`` names each namespace's end, ``MORI_BOOTSTRAP_HOST`` the
address of the namespace of rank 0.

Needs root and ``ip`` (iproute2, or ci/device/netns_ip.py on PATH: see ip_shim.sh). From the
command line it runs torchrun's own arguments after the rendezvous ones, e.g. the Triton tests:

    python3 ci/device/netns_torchrun.py 2 -m pytest -q -m gpu -s packages/mori-triton/tests/test_gpu.py
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Mapping, Sequence

from mori.core.testing import network_namespaces

__all__ = ["torchrun_two_hosts"]

_PORT = 29561  # torchrun's static rendezvous, at the first namespace's address


def torchrun_two_hosts(
    args: Sequence[str], nproc: int, env: Mapping[str, str], cwd: str, timeout: float
) -> tuple[int, str, str]:
    """Runs torchrun's ``args`` (a script and its arguments, or ``-m module ...``) as ``nproc`` PEs
    (an even number), half in each of two new network namespaces; returns the worst exit status,
    both nodes' stdout (node 0's first) and stderr. Every process of both nodes is killed at
    ``timeout`` (status 124 then)."""
    if nproc < 2 or nproc % 2:
        raise ValueError(f"two hosts need an even number of PEs (2 or more), got {nproc}")
    with network_namespaces("10.231.29") as spaces:
        procs = []
        for rank, ns in enumerate(spaces):
            node_env = dict(env, GLOO_SOCKET_IFNAME=ns.device, MORI_BOOTSTRAP_HOST=spaces[0].address)
            cmd = [
                "ip",
                "netns",
                "exec",
                ns.name,
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--nnodes=2",
                f"--node_rank={rank}",
                f"--nproc_per_node={nproc // 2}",
                f"--master_addr={spaces[0].address}",
                f"--master_port={_PORT}",
                *args,
            ]
            first = rank * (nproc // 2)
            print(
                f"node {rank}: PEs {first}-{first + nproc // 2 - 1} in network namespace {ns.name} ({ns.address})",
                flush=True,
            )
            # A session of its own per node, so that a timeout kills its torchrun and every PE.
            procs.append(
                subprocess.Popen(
                    cmd,
                    env=node_env,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.PIPE,
                    text=True,
                    cwd=cwd,
                    start_new_session=True,
                )
            )
        outs, errs, codes = [], [], []
        for proc in procs:
            try:
                out, err = proc.communicate(timeout=timeout)
                codes.append(proc.returncode)
            except subprocess.TimeoutExpired:
                for p in procs:
                    if p.poll() is None:
                        os.killpg(p.pid, signal.SIGKILL)
                out, err = proc.communicate()
                codes.append(124)
            outs.append(out)
            errs.append(err)
        rc = next((c for c in codes if c != 0), 0)
        return rc, "".join(outs), "".join(f"--- node {i} ---\n{e}" for i, e in enumerate(errs))


def main() -> int:
    if len(sys.argv) < 3:
        print(__doc__, file=sys.stderr)
        return 2
    rc, out, err = torchrun_two_hosts(sys.argv[2:], int(sys.argv[1]), os.environ, os.getcwd(), 540.0)
    print(out, end="")
    if rc:
        print(err[-8000:], file=sys.stderr)
    return rc


if __name__ == "__main__":
    sys.exit(main())
