// The one native module of mori: mori.core._native.
// Each subsystem lives in its own translation unit and registers its bindings here, so that
// adding a subsystem touches only this list.
#include "registry.hpp"

PYBIND11_MODULE(_native, m) {
    m.doc() = "mori native host runtime (host atomics, TCP data plane)";
    m.attr("ABI_VERSION") = 1;
    for (const auto& reg : mori::native::registrations()) reg(m);
}
