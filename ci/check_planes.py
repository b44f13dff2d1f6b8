"""Fails when one of mori-core's native planes includes another plane's private files.

``packages/mori-core/csrc/`` holds a folder per plane, built from one kit:

* ``base/`` is the kit (region table, ticket table, request entry, op and reason codes, transfer
  codes, completion records, the registry of bindings): it includes nothing of the planes.
* ``batch/`` (the batch value and its planner) builds on ``base/`` only.
* every other folder is a plane or a piece of one; another folder may include only the headers it
  names in ``INTERFACES`` below (its interface), everything else of it is private. A folder not in
  the table is an offence until it says what it offers.
* ``module.cpp`` at the top includes ``base/registry.hpp`` only.
* tickets are issued and checked in ``base/tickets.hpp`` only: outside ``base/`` no container is
  named for tickets (``std::unordered_map<...> tickets_;``) and no type is a ticket of its own
  (``struct Ticket``).

Includes are the quoted ones (``#include "tcp/wire.hpp"``); ``mori/device/...`` (the layouts shared
with device code) and system headers are anyone's. Prints each offence as ``path:line: what``;
exit 1 when any. ``--root DIR`` checks another tree (the tests plant offences in a temporary one).
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CSRC = "packages/mori-core/csrc"

# The kit: anyone includes it, and it includes no plane.
KIT = {"base": set(), "batch": {"base"}}
# Each plane's interface: the headers other folders may include.
INTERFACES = {
    "host": {"live_ranges.hpp"},
    # disjoint_ranges.hpp: the rule of a scattered copy's ranges, which every gathering plane asks.
    "gpu": {"staging.hpp", "host_standin.hpp", "disjoint_ranges.hpp"},
    "tcp": {"engine.hpp"},
    "ucx": {"engine.hpp", "wire.hpp", "atomic.hpp", "heap_window.hpp"},
    # window.hpp: the registrations the UCX engine publishes to same-host initiators' direct copies.
    "same_host": {"ring.hpp", "window.hpp"},
    "proxy": {"proxy.hpp"},
}
INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"')
# A ticket table of a plane's own: a container named for tickets, or a type that is a ticket.
OWN_TICKETS = re.compile(
    r"\bstd::(?:unordered_map|map|unordered_set|set|deque|list|vector)<.*>\s+(\w*ticket\w*)\s*[;{=]"
    r"|\b(?:struct|class)\s+(\w*Ticket\w*)\b",
    re.IGNORECASE,
)


def offences(path: Path, csrc: Path) -> list[str]:
    """What ``path`` (a file under ``csrc``) includes that its folder may not."""
    rel = path.relative_to(csrc)
    folder = rel.parts[0] if len(rel.parts) > 1 else ""
    found = []
    if folder and folder not in KIT and folder not in INTERFACES:
        found.append(
            f"{rel}:1: folder {folder}/ is neither the kit nor a plane with an interface in ci/check_planes.py"
        )
    for lineno, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
        own = OWN_TICKETS.search(line) if folder != "base" else None
        if own:
            found.append(
                f"{rel}:{lineno}: {own.group(1) or own.group(2)}: tickets of the plane's own"
                " (they are issued and checked in base/tickets.hpp)"
            )
        m = INCLUDE.match(line)
        if not m or m.group(1).startswith("mori/"):
            continue
        target = Path(m.group(1))
        other = target.parts[0] if len(target.parts) > 1 else ""
        if other == folder:
            continue
        if folder == "":
            why = None if m.group(1) == "base/registry.hpp" else "module.cpp includes base/registry.hpp only"
        elif folder in KIT:
            why = None if other in KIT[folder] else f"the kit ({folder}/) includes no plane"
        elif other in KIT or target.name in INTERFACES.get(other, set()):
            why = None
        else:
            why = (
                f"{m.group(1)} is private to {other or 'the top'}/ (its interface: "
                + (", ".join(sorted(INTERFACES.get(other, set()))) or "none")
                + ")"
            )
        if why:
            found.append(f"{rel}:{lineno}: {why}")
    return found


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--root", type=Path, default=ROOT, help="the tree to check (default: this checkout)")
    args = parser.parse_args(argv)
    csrc = args.root / CSRC
    files = sorted(p for p in csrc.rglob("*") if p.suffix in (".cpp", ".hpp", ".h", ".cuh"))
    found = [o for p in files for o in offences(p, csrc)]
    for line in found:
        print(f"{CSRC}/{line}")
    if found:
        return 1
    print(
        f"{len(files)} native files: no plane includes another's private files; the kit includes no plane;"
        " no plane keeps tickets of its own"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
