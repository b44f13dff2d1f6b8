// The one native module of mori: mori.core._native.
// Each subsystem lives in its own translation unit and registers its bindings here, so that
// adding a subsystem touches only this list.
#include "base/registry.hpp"

PYBIND11_MODULE(_native, m) {
    m.doc() = "mori native host runtime: submodules atomics, batch, gpu, tcp (see mori.core's modules of those names)";
    m.attr("ABI_VERSION") = 1;
    for (const auto& reg : mori::native::registrations()) reg(m);
}
