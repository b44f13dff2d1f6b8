"""``python -m mori.triton.mlir --arch sm_90 --out DIR [--cubin]``: builds the seed's MLIR kernels.

Writes ``DIR/shmem_basic_kernel.ptx`` and ``DIR/shmem_put_kernel.ptx`` (plus ``.cubin`` files with
``--cubin``) and prints one line per file. Exit status 1 with the reason when a build fails.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from .._bitcode import DEFAULT_ARCH, BitcodeError
from ._build import KERNELS
from ._compile import compile_mlir


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m mori.triton.mlir", description=__doc__.splitlines()[0])
    parser.add_argument("--arch", default=DEFAULT_ARCH, help=f"GPU architecture (default {DEFAULT_ARCH})")
    parser.add_argument("--out", required=True, type=Path, help="output folder (created if missing)")
    parser.add_argument("--cubin", action="store_true", help="also write each kernel's cubin")
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    for name, build in KERNELS.items():
        try:
            ptx, cubin = compile_mlir(build(), args.arch)
        except (BitcodeError, ImportError) as e:
            print(f"error: {name}: {e}", file=sys.stderr)
            return 1
        outputs = {".ptx": ptx.encode(), ".cubin": cubin} if args.cubin else {".ptx": ptx.encode()}
        for suffix, data in outputs.items():
            path = args.out / f"{name}{suffix}"
            path.write_bytes(data)
            print(f"{path} ({len(data)} bytes)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
