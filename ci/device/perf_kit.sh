#!/usr/bin/env bash
# Prepares `perf` for the device machine (which has no registry access and no perf): Debian's
# linux-perf package, its binary and the shared libraries it loads that a Python 3.12 machine may
# lack (every one but the C library's family), packed as .devkit/perf.tar.xz (about 7 MB). The
# device scripts unpack it and run perf with LD_LIBRARY_PATH on the libraries (io_probe.sh's
# tcp_perf step: where a staged TCP transfer's threads spend their CPU, kernel included).
# Run from the repository root on a Debian machine with apt's package lists.
set -euo pipefail
root=$(git rev-parse --show-toplevel)
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
chmod a+rwx "$work"  # apt's download user writes there
(cd "$work" && apt-get download linux-perf > /dev/null)
dpkg-deb -x "$work"/linux-perf_*.deb "$work/x"
mkdir -p "$work/bundle/lib"
cp "$work/x/usr/bin/perf" "$work/bundle/"
for lib in $(ldd "$work/x/usr/bin/perf" | awk '/=>/ {print $3}'); do
  case $(basename "$lib") in
    libc.so.*|libm.so.*|libstdc++.so.*|libgcc_s.so.*|libz.so.*) ;;  # the machine's own
    *) cp -L "$lib" "$work/bundle/lib/" ;;
  esac
done
mkdir -p "$root/.devkit"
tar cJf "$root/.devkit/perf.tar.xz" -C "$work/bundle" .
LD_LIBRARY_PATH="$work/bundle/lib" "$work/bundle/perf" --version
echo "perf kit: $root/.devkit/perf.tar.xz ($(du -h "$root/.devkit/perf.tar.xz" | cut -f1))"
