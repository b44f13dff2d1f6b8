#!/usr/bin/env bash
# Prepares the NVLink peers of mori-io's benchmark for the device machine (which has no registry
# access): NIXL (nixl + nixl-cu13) and Mooncake Transfer Engine (mooncake-transfer-engine-cuda13),
# cp312 wheels from PyPI, cut down to what a transfer engine needs so that they fit in a device
# run's carry (64 MiB with .devkit): NIXL's EP extension (three torch builds), its storage
# plugins and scripts, and Mooncake's store, EP, process-group and server binaries are left
# out; the transfer-engine code is PyPI's, unchanged. Mooncake's engine also needs system
# libraries the device image may lack (libibverbs, libmlx5, libnl, libnuma): copies of this
# machine's go beside the wheels, used only where the device has none (ci/device/io.sh).
# Output: .devkit/peers/{*.whl,lib/}. Run from the repository root after ../shared/device/kit.sh.
set -euo pipefail
root=$(git rev-parse --show-toplevel)
out="$root/.devkit/peers"
rm -rf "$out"
mkdir -p "$out/lib" "$out/download"
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
  --platform manylinux_2_28_x86_64 -d "$out/download" nixl nixl-cu13 mooncake-transfer-engine-cuda13
python3 - "$out" <<'PY'
import re
import sys
import zipfile
from pathlib import Path

out = Path(sys.argv[1])
DROP = [
    r"^nixl_ep_cu\d+/",  # NIXL's expert-parallel extension, one build per torch version
    r"^nixl_cu\d+\.scripts/",
    r"/(nixl|plugins)/libplugin_(?!UCX)[^/]*\.so$",  # keep the UCX backend plugin only
    r"^nixl_cu\d+\.libs/lib(aws|azure|s2n|gusli)",  # libraries of the object-store plugins
    r"^mooncake/(_store|_ep)\.",
    r"^mooncake/(mooncake_client|mooncake_master|transfer_engine_bench|libmooncake_pg|libmooncake_ep)",
    r"^mooncake_transfer_engine_cuda\d+\.libs/libetcd_wrapper-",  # engine.so loads mooncake/libetcd_wrapper.so
]
drop = re.compile("|".join(DROP))
for whl in sorted((out / "download").glob("*.whl")):
    kept = 0
    with zipfile.ZipFile(whl) as src, zipfile.ZipFile(out / whl.name, "w", zipfile.ZIP_DEFLATED) as dst:
        names = [i.filename for i in src.infolist()]
        gone = {n for n in names if drop.search(n)}
        for info in src.infolist():
            if info.filename in gone:
                continue
            data = src.read(info)
            if info.filename.endswith(".dist-info/RECORD"):
                lines = [ln for ln in data.decode().splitlines() if ln.split(",")[0] not in gone]
                data = ("\n".join(lines) + "\n").encode()
            dst.writestr(info, data, compress_type=zipfile.ZIP_DEFLATED, compresslevel=9)
            kept += 1
    print(f"{whl.name}: {kept} files kept, {len(gone)} left out, "
          f"{(out / whl.name).stat().st_size / 2**20:.1f} MiB (was {whl.stat().st_size / 2**20:.1f})")
PY
rm -rf "$out/download"
libs=(libibverbs.so.1 libmlx5.so.1 libnl-3.so.200 libnl-route-3.so.200 libnuma.so.1)
if ! ldconfig -p | grep -q libmlx5.so.1 || ! ldconfig -p | grep -q libnuma.so.1; then
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends libibverbs1 ibverbs-providers libnuma1 >/dev/null
fi
for l in "${libs[@]}"; do cp -L "$(ldconfig -p | awk -v l="$l" '$1 == l {print $NF; exit}')" "$out/lib/"; done
du -sh "$root/.devkit"
