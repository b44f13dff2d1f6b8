// Self-registration of native subsystems: each .cpp defines a static Registration that adds its
// bindings to the module, so module.cpp never needs editing when a subsystem is added.
#pragma once
#include <pybind11/pybind11.h>

#include <functional>
#include <string>
#include <vector>

namespace mori::native {

using RegisterFn = std::function<void(pybind11::module_&)>;

inline std::vector<RegisterFn>& registrations() {
    static std::vector<RegisterFn> list;
    return list;
}

struct Registration {
    explicit Registration(RegisterFn fn) { registrations().push_back(std::move(fn)); }
};

// The submodule `name` of the native module (made by the first subsystem that asks), importable
// by its full name (`from mori.core._native.tcp import Peer`), so that the public module named by
// what it holds (mori.core.tcp) imports from it. Each is named after its C++ namespace.
inline pybind11::module_ submodule(pybind11::module_& m, const char* name, const char* doc) {
    if (pybind11::hasattr(m, name)) return m.attr(name).cast<pybind11::module_>();
    pybind11::module_ sub = m.def_submodule(name, doc);
    pybind11::module_::import("sys").attr("modules")[sub.attr("__name__")] = sub;
    return sub;
}

}  // namespace mori::native
