// The one native module of mori: mori.core._native.
// Each subsystem lives in its own translation unit (a folder per plane, built from base/) and
// registers its bindings itself (base/registry.hpp), so adding one touches nothing here.
#include "base/registry.hpp"

PYBIND11_MODULE(_native, m) {
    m.doc() =
        "mori-core's native planes, one module: submodules atomics, batch, codes, gpu, inbound, memory, tcp and ucx, "
        "each presented by the mori.core module of its name (mori.core.codes checks its enums against codes). Built "
        "from csrc/, a folder "
        "per plane (tcp, ucx, same_host, gpu, proxy) on one kit (base: region table, request entry, op and reason "
        "codes).";
    m.attr("ABI_VERSION") = 1;
    for (const auto& reg : mori::native::registrations()) reg(m);
}
