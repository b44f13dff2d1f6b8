"""mori.core.host: one definition of "same host" (machine and network namespace)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from mori.core.host import HostIdentity, one_host_error, this_host


def test_this_host_reads_the_kernel_and_namespace() -> None:
    me = this_host()
    with open("/proc/sys/kernel/random/boot_id") as f:
        assert me.machine == f.read().strip()
    assert me.netns == os.stat("/proc/self/ns/net").st_ino
    assert HostIdentity.from_key(me.key) == me


def test_a_child_process_has_the_same_identity() -> None:
    code = "from mori.core.host import this_host; print(this_host().key)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == this_host().key


@pytest.mark.parametrize("bad", ["", "abc", "m/", "/5", "m/x1"])
def test_from_key_rejects_what_is_not_a_key(bad: str) -> None:
    with pytest.raises(ValueError, match="is not 'machine/netns'"):
        HostIdentity.from_key(bad)


def test_one_host_error_names_the_groups_and_the_reason() -> None:
    a, b, c = HostIdentity("boot-a", 7), HostIdentity("boot-a", 8), HostIdentity("boot-b", 7)
    assert one_host_error([a, a, a]) is None
    assert one_host_error([]) is None
    ns = one_host_error([a, b, a], "PE")
    assert ns is not None and "one machine but in 2 network namespaces" in ns
    assert "PEs 0, 2 on boot-a/7" in ns and "PEs 1 on boot-a/8" in ns
    hosts = one_host_error([a, c])
    assert hosts is not None and "run on 2 machines" in hosts and "ranks 1 on boot-b/7" in hosts
