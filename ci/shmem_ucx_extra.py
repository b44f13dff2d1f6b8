"""What ci/newest.sh runs in its fresh environment to show that ``mori-shmem[rdma]`` brings a UCX
that mori.shmem's remote transport finds and runs on.

    python ci/shmem_ucx_extra.py          # checks the environment, then runs itself as 2 PEs

The environment: the libucx wheel is installed as mori-shmem's ``rdma`` extra asks, and
mori-core's UCX loader lists it. Then two CPU PEs with ``MORI_DISABLE_P2P`` (every peer remote)
load that UCX (``MORI_UCX_LIB`` at the wheel: a host with a UCX of its own, as CI's, would
otherwise prefer that one) and each puts a page into the other's heap through the remote
transport, bytes checked.
"""

from __future__ import annotations

import os
import subprocess
import sys
from importlib.metadata import requires, version
from pathlib import Path


def check_environment() -> str:
    """The ``libucp`` of the libucx wheel the extra brought (raises unless it is there)."""
    from mori.core import ucx

    wanted = [
        r for r in requires("mori-shmem") or [] if r.startswith("libucx") and "extra == 'rdma'" in r.replace('"', "'")
    ]
    assert wanted, f"mori-shmem declares no libucx for its rdma extra: {requires('mori-shmem')}"
    name = wanted[0].split(">")[0].split("=")[0].strip()
    print(f"mori-shmem[rdma] asks for {wanted[0]!r}; installed: {name} {version(name)}")
    wheel = [path for path, source in ucx.candidates() if source == "libucx wheel"]
    assert wheel and Path(sys.prefix).resolve() in Path(wheel[0]).resolve().parents, ucx.candidates()
    return wheel[0]


def pe() -> None:
    """One PE: a page into the other PE's heap through the remote transport."""
    import mori.shmem as shmem
    from mori.core import ucx

    shmem.shmem_init_from_env()
    me = shmem.shmem_mype()
    other = 1 - me
    assert shmem.shmem_heap_info()["remote"] == [other], shmem.shmem_heap_info()
    buf = shmem.shmem_malloc(4096)
    shmem.shmem_barrier_all()
    shmem.shmem_putmem(buf, bytes([me + 1]) * 4096, other)
    shmem.shmem_barrier_all()
    assert shmem.shmem_getmem(buf, 4096, me) == bytes([other + 1]) * 4096
    info = ucx.library_info()
    print(f"PE {me}: remote put through UCX {'.'.join(map(str, info['version']))} from {info['path']}")
    shmem.shmem_free(buf)
    shmem.shmem_finalize()


def main() -> None:
    if os.environ.get("MORI_SHMEM_RANK") is not None:
        pe()
        return
    env = {
        **os.environ,
        "MORI_UCX_LIB": check_environment(),
        "MORI_DISABLE_P2P": "ON",
        "MORI_SHMEM_BACKEND": "cpu",
        "MORI_SHMEM_HEAP_SIZE": "16M",
        "MORI_SHMEM_TIMEOUT": "30",
    }
    subprocess.run([sys.executable, "-m", "mori.shmem.run", "-n", "2", __file__], env=env, check=True, timeout=300)


if __name__ == "__main__":
    main()
