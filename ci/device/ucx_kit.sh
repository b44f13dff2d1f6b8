#!/usr/bin/env bash
# Prepares UCX for mori-io's RDMA backend on the device machine (which has no registry access):
# the libucx-cu13 wheel from PyPI, cut down to fit a device run's carry: the shared libraries
# under the two names the loader and the modules ask for (libucp.so, libucp.so.0; the wheel
# ships a third copy of each), stripped of symbols, without headers, static libraries and the
# ucx_* binaries. Output: .devkit/ucx/*.whl, installed by ci/device/io.sh, which then runs
# ci/device/rdma_gpu.py. Run from the repository root.
# `bash ci/device/ucx_kit.sh cu12` makes .devkit/ucx-cu12 from libucx-cu12 instead, for a device
# whose driver predates CUDA 13 (its UCX cannot load the cu13 build's CUDA transports);
# ci/device/shmem_proxy.sh picks the one that matches the driver.
set -euo pipefail
root=$(git rev-parse --show-toplevel)
cuda=${1:-cu13}
case $cuda in cu12) out="$root/.devkit/ucx-cu12" ;; cu13) out="$root/.devkit/ucx" ;; *) echo "usage: $0 [cu12|cu13]" >&2; exit 2 ;; esac
rm -rf "$out"
mkdir -p "$out/download"
python3 -m pip download -q --no-deps --only-binary=:all: -d "$out/download" "libucx-$cuda"
python3 - "$out" <<'PY'
import base64
import hashlib
import re
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

out = Path(sys.argv[1])
drop = re.compile(r"^libucx/(include|bin|share)/|\.(a|la)$|^libucx/lib/.*\.so\.\d+\.\d+\.\d+$|/(cmake|pkgconfig)/"
                  r"|perftest")
for whl in sorted((out / "download").glob("*.whl")):
    with zipfile.ZipFile(whl) as src, zipfile.ZipFile(out / whl.name, "w", zipfile.ZIP_DEFLATED) as dst, \
            tempfile.TemporaryDirectory() as tmp:
        record_name, record = "", []
        for info in src.infolist():
            name = info.filename
            if name.endswith(".dist-info/RECORD"):
                record_name = name
                continue
            if drop.search(name) or name.endswith("/"):
                continue
            data = src.read(name)
            if re.search(r"\.so(\.\d+)?$", name):
                path = Path(tmp) / "lib.so"
                path.write_bytes(data)
                subprocess.run(["strip", "--strip-unneeded", str(path)], check=True)
                data = path.read_bytes()
            dst.writestr(info, data)
            digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
            record.append(f"{name},sha256={digest},{len(data)}")
        record.append(f"{record_name},,")
        dst.writestr(record_name, "\n".join(record) + "\n")
    print(f"{whl.name}: {whl.stat().st_size >> 20} MiB -> {(out / whl.name).stat().st_size >> 20} MiB")
PY
rm -rf "$out/download"
