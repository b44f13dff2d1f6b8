"""ci/check_planes.py over planted trees: what it reports, what it lets through, and this checkout."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
CHECK = REPO / "ci" / "check_planes.py"
CSRC = "packages/mori-core/csrc"

# A tree shaped like this one: the kit, and planes that include it and each other's interfaces.
LAYOUT = {
    "module.cpp": '#include "base/registry.hpp"\n',
    "base/registry.hpp": "#pragma once\n",
    "base/regions.hpp": '#pragma once\n#include "base/registry.hpp"\n#include <memory>\n',
    "base/tickets.hpp": "#pragma once\ntemplate <class T> class TicketTable {\n  std::list<T> order_;\n"
    "  std::unordered_map<std::string, T> ticketOf_;\n};\n",
    "batch/plan.hpp": '#pragma once\n#include "base/regions.hpp"\n',
    "gpu/staging.hpp": '#pragma once\n#include "base/regions.hpp"\n',
    "tcp/wire.hpp": '#pragma once\n#include "mori/device/proxy_ring.cuh"\n',
    "tcp/engine.hpp": '#pragma once\n#include "tcp/wire.hpp"\n#include "gpu/staging.hpp"\n#include "batch/plan.hpp"\n',
    "ucx/engine.hpp": '#pragma once\n#include "same_host/ring.hpp"\n',
    "same_host/ring.hpp": '#pragma once\n#include "base/regions.hpp"\nstruct Hello { uint64_t ticket; };\n',
    "same_host/service.cpp": '#include "ucx/engine.hpp"\n#include "ucx/wire.hpp"\n',
}


def check(tree: Path, extra: dict[str, str]) -> tuple[int, list[str]]:
    for rel, text in {**LAYOUT, **extra}.items():
        path = tree / CSRC / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    proc = subprocess.run([sys.executable, str(CHECK), "--root", str(tree)], capture_output=True, text=True, timeout=60)
    return proc.returncode, [line for line in proc.stdout.splitlines() if ":" in line and "native files" not in line]


def test_the_layout_passes(tmp_path: Path) -> None:
    rc, found = check(tmp_path, {})
    assert (rc, found) == (0, [])


@pytest.mark.parametrize(
    ("rel", "text", "expected"),
    [
        (
            "ucx/post.cpp",
            '#include "tcp/wire.hpp"\n',
            "ucx/post.cpp:1: tcp/wire.hpp is private to tcp/ (its interface: engine.hpp)",
        ),
        (
            "proxy/proxy.cpp",
            '// x\n#include "gpu/host_standin.cpp"\n',
            "proxy/proxy.cpp:2: gpu/host_standin.cpp is private to gpu/",
        ),
        ("base/ops.hpp", '#include "ucx/engine.hpp"\n', "base/ops.hpp:1: the kit (base/) includes no plane"),
        ("batch/batch.hpp", '#include "gpu/staging.hpp"\n', "batch/batch.hpp:1: the kit (batch/) includes no plane"),
        ("module.cpp", '#include "tcp/engine.hpp"\n', "module.cpp:1: module.cpp includes base/registry.hpp only"),
        (
            "ucx/engine.hpp",
            '#pragma once\n#include "base/tickets.hpp"\n  std::unordered_map<uint64_t, std::string> tickets_;\n',
            "ucx/engine.hpp:3: tickets_: tickets of the plane's own (they are issued and checked in base/tickets.hpp)",
        ),
        (
            "tcp/target.cpp",
            "struct Ticket {\n",
            "tcp/target.cpp:1: Ticket: tickets of the plane's own",
        ),
        (
            "rdma/post.cpp",
            '#include "base/regions.hpp"\n',
            "rdma/post.cpp:1: folder rdma/ is neither the kit nor a plane",
        ),
    ],
)
def test_offences_are_reported_where_they_are(tmp_path: Path, rel: str, text: str, expected: str) -> None:
    rc, found = check(tmp_path, {rel: text})
    assert rc == 1
    assert len(found) == 1 and found[0].startswith(f"{CSRC}/{expected}"), found


def test_this_checkout_passes() -> None:
    proc = subprocess.run([sys.executable, str(CHECK)], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout
    assert "no plane includes another's private files" in proc.stdout
