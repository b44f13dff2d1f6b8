#!/usr/bin/env python3
"""``ip`` for a machine without iproute2, on pyroute2: the commands with which mori's tests and
benchmarks make two network namespaces joined by a veth pair and run processes in them
(mori.core.testing.network_namespaces and start_in_netns, ci/rdma_bench.sh, mori-io-bench's
``--target-netns``), and nothing else:

    ip netns add NAME | ip netns del NAME | ip netns list | ip netns exec NAME COMMAND [ARG...]
    ip link add DEV type veth peer name PEER
    ip [-n NS] link set DEV netns NS | ip [-n NS] link set DEV up
    ip [-n NS] addr add ADDRESS/PREFIX dev DEV
    ip [-n NS] route replace PREFIX/LENGTH dev DEV congctl ALGORITHM

``ci/device/netns_bench.sh`` puts it first on PATH under the name ``ip``. ``netns exec`` does what
iproute2's does: enters the namespace (setns), then in a mount namespace of its own remounts
/sys, so that /sys/class/net (where UCX looks for interfaces) shows the namespace's devices, and
execs the command. Needs root. Anything else exits 2 naming what it does not do.
"""

from __future__ import annotations

import ctypes
import os
import sys

CLONE_NEWNS, CLONE_NEWNET = 0x00020000, 0x40000000
MS_REC, MS_SLAVE, MNT_DETACH = 0x4000, 0x80000, 2


def _fail(msg: str, code: int = 1) -> None:
    print(f"ip (pyroute2 stand-in): {msg}", file=sys.stderr)
    sys.exit(code)


def _libc_call(name: str, *args: object) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    if getattr(libc, name)(*args) != 0:
        err = ctypes.get_errno()
        _fail(f"{name}: {os.strerror(err)}")


def _exec_in(ns: str, argv: list[str]) -> None:
    from pyroute2 import netns

    path = os.path.join(netns.NETNS_RUN_DIR, ns)
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError as exc:
        _fail(f'cannot open network namespace "{ns}": {exc.strerror}')
    _libc_call("setns", fd, CLONE_NEWNET)
    os.close(fd)
    _libc_call("unshare", CLONE_NEWNS)
    # Keep the new /sys to this mount namespace; then sysfs mounted from inside the network
    # namespace lists its devices.
    _libc_call("mount", b"", b"/", b"none", ctypes.c_ulong(MS_SLAVE | MS_REC), None)
    libc = ctypes.CDLL(None, use_errno=True)
    libc.umount2(b"/sys", MNT_DETACH)  # may not be mounted: then there is nothing to detach
    _libc_call("mount", ns.encode(), b"/sys", b"sysfs", ctypes.c_ulong(0), None)
    try:
        os.execvp(argv[0], argv)
    except OSError as exc:
        _fail(f'exec of "{argv[0]}" failed: {exc.strerror}')


def _index(ipr: object, dev: str) -> int:
    found = ipr.link_lookup(ifname=dev)  # type: ignore[attr-defined]
    if not found:
        _fail(f'cannot find device "{dev}"')
    return int(found[0])


def main(args: list[str]) -> None:
    from pyroute2 import IPRoute, netns

    ns = None
    if args[:1] == ["-n"] and len(args) > 2:
        ns, args = args[1], args[2:]
    words = " ".join(args)
    if args[:2] == ["netns", "add"] and len(args) == 3 and ns is None:
        netns.create(args[2])
    elif args[:1] == ["netns"] and args[1:2] in (["del"], ["delete"]) and len(args) == 3 and ns is None:
        try:
            netns.remove(args[2])
        except OSError as exc:
            _fail(f'cannot remove namespace "{args[2]}": {exc.strerror}')
    elif args[:2] == ["netns", "list"] and ns is None:
        print("\n".join(netns.listnetns()))
    elif args[:2] == ["netns", "exec"] and len(args) > 3 and ns is None:
        _exec_in(args[2], args[3:])
    elif args[:2] == ["link", "add"] and len(args) == 8 and args[3:7] == ["type", "veth", "peer", "name"]:
        with IPRoute(**({"netns": ns} if ns else {})) as ipr:
            ipr.link("add", ifname=args[2], kind="veth", peer=args[7])
    elif args[:2] == ["link", "set"] and len(args) == 5 and args[3] == "netns":
        with IPRoute(**({"netns": ns} if ns else {})) as ipr:
            ipr.link("set", index=_index(ipr, args[2]), net_ns_fd=args[4])
    elif args[:2] == ["link", "set"] and len(args) == 4 and args[3] == "up":
        with IPRoute(**({"netns": ns} if ns else {})) as ipr:
            ipr.link("set", index=_index(ipr, args[2]), state="up")
    elif args[:2] == ["addr", "add"] and len(args) == 5 and args[3] == "dev" and "/" in args[2]:
        address, prefix = args[2].split("/", 1)
        with IPRoute(**({"netns": ns} if ns else {})) as ipr:
            ipr.addr("add", index=_index(ipr, args[4]), address=address, prefixlen=int(prefix))
    elif (
        args[:2] == ["route", "replace"]
        and len(args) == 7
        and args[3] == "dev"
        and args[5] == "congctl"
        and "/" in args[2]
    ):
        prefix, length = args[2].split("/", 1)
        with IPRoute(**({"netns": ns} if ns else {})) as ipr:
            ipr.route(
                "replace",
                dst=prefix,
                dst_len=int(length),
                oif=_index(ipr, args[4]),
                scope=253,  # link
                metrics={"RTAX_CC_ALGO": args[6]},
            )
    else:
        _fail(
            f"'ip {('-n ' + ns + ' ') if ns else ''}{words}' is not one of the commands this stand-in does "
            "(see ci/device/netns_ip.py)",
            2,
        )


if __name__ == "__main__":
    main(sys.argv[1:])
