// The address and size of a Python object's memory through the buffer protocol: memory in the
// memory submodule, presented by mori.core.memory: buffer_span and LiveRanges. One native call
// replaces the several Python steps (memoryview, numpy, ctypes) that a small transfer otherwise
// spends more time in than in moving its bytes.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cstdint>
#include <memory>
#include <string>

#include "base/registry.hpp"
#include "host/live_ranges.hpp"

namespace py = pybind11;

namespace mori::memory {
namespace {

// A buffer view released when it goes out of scope.
struct View {
    Py_buffer v{};
    bool held = false;
    ~View() {
        if (held) PyBuffer_Release(&v);
    }
};

py::tuple buffer_span(py::handle obj, bool writable) {
    View view;
    const int flags = PyBUF_C_CONTIGUOUS | (writable ? PyBUF_WRITABLE : 0);
    if (PyObject_GetBuffer(obj.ptr(), &view.v, flags) == 0) {
        view.held = true;
        return py::make_tuple(reinterpret_cast<uintptr_t>(view.v.buf), static_cast<size_t>(view.v.len));
    }
    PyErr_Clear();
    const std::string type = Py_TYPE(obj.ptr())->tp_name;
    if (!PyObject_CheckBuffer(obj.ptr())) throw py::type_error(type + " has no buffer protocol");
    // It has one but refused these flags: say which of them (read again without any).
    if (PyObject_GetBuffer(obj.ptr(), &view.v, PyBUF_FULL_RO) != 0) {
        PyErr_Clear();
        throw py::value_error(type + " refused to export its buffer");
    }
    view.held = true;
    if (!PyBuffer_IsContiguous(&view.v, 'C')) throw py::value_error(type + " buffer is not C-contiguous");
    throw py::value_error(type + " buffer is read-only");
}

mori::native::Registration reg([](py::module_& root) {
    py::module_ m = mori::native::submodule(root, "memory", "memory of Python objects");
    m.def("buffer_span", &buffer_span, py::arg("obj"), py::arg("writable"),
          "(address, size in bytes) of obj's C-contiguous buffer; TypeError when obj has no buffer protocol, "
          "ValueError when its buffer is not C-contiguous or, with writable, read-only.");
    py::class_<LiveRanges, std::shared_ptr<LiveRanges>>(
        m, "LiveRanges",
        "The live blocks of a symmetric heap by offset, each with the size its caller asked for (used under the "
        "GIL). mori.shmem's allocator keeps its live blocks here, and mori.core.ucx.UcxHeapWindow checks a put against "
        "them in the native call that moves its bytes.")
        .def(py::init<>())
        .def("add", &LiveRanges::add, py::arg("start"), py::arg("size"),
             "Adds the block [start, start + size); False (nothing changed) when one starts there already.")
        .def("remove", &LiveRanges::remove, py::arg("start"),
             "Removes the block that starts at start; its size, or None when none does.")
        .def("find", &LiveRanges::find, py::arg("offset"), py::arg("nbytes"),
             "(start, size) of the block holding [offset, offset + nbytes) whole, or None.")
        .def("__len__", &LiveRanges::count);
});

}  // namespace
}  // namespace mori::memory
