// Self-registration of native subsystems: each .cpp defines a static Registration that adds its
// bindings to the module, so module.cpp never needs editing when a subsystem is added.
#pragma once
#include <pybind11/pybind11.h>

#include <functional>
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

}  // namespace mori::native
