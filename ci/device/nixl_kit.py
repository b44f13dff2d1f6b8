"""NIXL for the GPU machine, which has no registry access: downloads ``nixl`` and ``nixl-cu13``
(cp312, the device's Python) into ``.devkit/nixl`` and repacks the cu13 wheel without its
``nixl_ep_cu13`` extension modules and C++ headers (58.8 MB to 29.7 MB: a device run carries at
most 64 MiB). Neither is used by NIXL's Python agent. Run on a machine with PyPI, from the
repository root; the device installs them with ``pip install --no-deps --no-index .devkit/nixl/*.whl``
(torch and numpy, their dependencies, are there already).

    python ci/device/nixl_kit.py [--version 1.5.1]
"""

from __future__ import annotations

import argparse
import base64
import csv
import hashlib
import io
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

OUT = Path(".devkit/nixl")


def _dropped(name: str) -> bool:
    return name.startswith("nixl_ep_cu13/") or ".data/headers/" in name


def slim(src: Path, dst: Path) -> None:
    """``src`` without the dropped members, its RECORD rewritten to match."""
    with zipfile.ZipFile(src) as zin, zipfile.ZipFile(dst, "w", zipfile.ZIP_DEFLATED) as zout:
        rows, record = [], None
        for info in zin.infolist():
            if info.filename.endswith(".dist-info/RECORD"):
                record = info.filename
                continue
            if _dropped(info.filename):
                continue
            data = zin.read(info)
            zout.writestr(info, data)
            digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
            rows.append((info.filename, f"sha256={digest}", str(len(data))))
        if record is None:
            raise SystemExit(f"{src.name} has no RECORD")
        text = io.StringIO()
        csv.writer(text, lineterminator="\n").writerows([*rows, (record, "", "")])
        zout.writestr(record, text.getvalue())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--version", default="1.5.1")
    args = parser.parse_args()
    OUT.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run(
            [
                sys.executable,
                "-m",
                "pip",
                "download",
                "-q",
                "--no-deps",
                "--only-binary=:all:",
                "--python-version",
                "3.12",
                "--platform",
                "manylinux_2_28_x86_64",
                "-d",
                tmp,
                f"nixl=={args.version}",
                f"nixl-cu13=={args.version}",
            ],
            check=True,
        )
        for wheel in Path(tmp).glob("*.whl"):
            target = OUT / wheel.name
            if wheel.name.startswith("nixl_cu13-"):
                slim(wheel, target)
            else:
                target.write_bytes(wheel.read_bytes())
            print(f"{target} ({target.stat().st_size / 1e6:.1f} MB)")


if __name__ == "__main__":
    main()
