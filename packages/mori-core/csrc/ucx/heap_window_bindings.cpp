// Python binding of the heap window (ucx/heap_window.hpp): UcxHeapWindow in the ucx submodule,
// typed in _native/ucx.pyi and presented by mori.core.ucx. A host operation returns None (an
// atomic: its old value) once done, or (code, message) when it failed, so that the usual call
// costs no Python object beyond its arguments; the GIL is released while it moves bytes.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cstdint>
#include <memory>
#include <vector>

#include "base/registry.hpp"
#include "ucx/heap_window.hpp"

namespace py = pybind11;

namespace mori::ucx {
namespace {

py::object result(const Outcome& o) {
    if (o.code == kSuccess) return py::none();
    return py::make_tuple(o.code, o.message);
}

// put or get, waited for with the GIL released.
template <Outcome (HeapWindow::*Move)(int, uint64_t, uint64_t, uint64_t, bool)>
py::object move(HeapWindow& w, int pe, uint64_t offset, uint64_t local, uint64_t bytes, bool localGpu) {
    Outcome o;
    {
        py::gil_scoped_release release;
        o = (w.*Move)(pe, offset, local, bytes, localGpu);
    }
    return result(o);
}

AtomicOp atomic_op(int op) {
    if (op < kAtomicFetchAdd || op > kAtomicLast)
        throw std::invalid_argument("unknown atomic op " + std::to_string(op));
    return static_cast<AtomicOp>(op);
}

// An int that fits in a uint64_t / an int, or false (anything else: no address, no rank).
bool as_u64(py::handle h, uint64_t& out) {
    if (!PyLong_CheckExact(h.ptr())) return false;
    out = PyLong_AsUnsignedLongLong(h.ptr());
    if (out == static_cast<uint64_t>(-1) && PyErr_Occurred()) {
        PyErr_Clear();  // negative or too large
        return false;
    }
    return true;
}
bool as_int(py::handle h, int& out) {
    if (!PyLong_CheckExact(h.ptr())) return false;
    int overflow = 0;
    const long v = PyLong_AsLongAndOverflow(h.ptr(), &overflow);
    if (overflow != 0 || v < INT32_MIN || v > INT32_MAX) return false;
    out = static_cast<int>(v);
    return true;
}

// True once done; (code, message) when it failed; None, with nothing done, when it is not the
// plain case (see HeapWindow::plain).
py::object quick_put(HeapWindow& w, py::handle dest, uint64_t src, uint64_t bytes, py::handle pe) {
    uint64_t to;
    int rank;
    HeapWindow::Plain plain;
    if (!as_u64(dest, to) || !as_int(pe, rank) || !w.plain(to, src, bytes, rank, plain)) return py::none();
    Outcome o;
    {
        py::gil_scoped_release release;
        o = w.run_plain(plain);
    }
    if (o.code == kSuccess) return py::bool_(true);
    return py::make_tuple(o.code, o.message);
}

mori::native::Registration reg([](py::module_& root) {
    py::module_ m = mori::native::submodule(root, "ucx", "mori-core's UCX engine");
    m.attr("UCX_STAGING_BYTES") = kStagingBytes;
    py::class_<HeapWindow, std::shared_ptr<HeapWindow>>(m, "UcxHeapWindow",
                                                        "The remote side of one symmetric heap (see mori.core.ucx).")
        .def(py::init([](std::shared_ptr<Engine> engine, std::shared_ptr<memory::LiveRanges> live, uint64_t base,
                         uint64_t size, uint64_t reserved, uint64_t chunk, uint64_t firstId, bool gpu,
                         std::vector<std::shared_ptr<Peer>> peers, double timeout) {
                 HeapLayout h{base, size, reserved, chunk, firstId, gpu};
                 return std::make_shared<HeapWindow>(std::move(engine), std::move(live), h, std::move(peers), timeout);
             }),
             py::arg("engine"), py::arg("live"), py::arg("base"), py::arg("size"), py::arg("reserved"),
             py::arg("chunk"), py::arg("first_id"), py::arg("gpu"), py::arg("peers"), py::arg("timeout"))
        .def("grow", &HeapWindow::grow, py::arg("end"), py::call_guard<py::gil_scoped_release>(),
             "Registers the heap's chunks up to end bytes that are not registered yet.")
        .def_property_readonly("registered", &HeapWindow::registered, "Heap bytes registered, from offset 0.")
        .def("register_buffer", &HeapWindow::register_buffer, py::arg("addr"), py::arg("bytes"), py::arg("gpu"),
             py::call_guard<py::gil_scoped_release>(),
             "Registers a buffer outside the heap for good: transfers from or into it go as they are.")
        .def("deregister_buffer", &HeapWindow::deregister_buffer, py::arg("addr"),
             py::call_guard<py::gil_scoped_release>(), "Releases the buffer registered at addr; False when none is.")
        .def("put", &move<&HeapWindow::put>, py::arg("pe"), py::arg("offset"), py::arg("local"), py::arg("bytes"),
             py::arg("local_gpu") = false,
             "Writes bytes from local at heap offset offset of PE pe: None once done, else (code, message).")
        .def("get", &move<&HeapWindow::get>, py::arg("pe"), py::arg("offset"), py::arg("local"), py::arg("bytes"),
             py::arg("local_gpu") = false,
             "Reads bytes at heap offset offset of PE pe into local: None once done, else (code, message).")
        .def(
            "put_signal",
            [](HeapWindow& w, int pe, uint64_t offset, uint64_t local, uint64_t bytes, bool localGpu,
               uint64_t sigOffset, int op, uint64_t value) {
                const AtomicOp sigOp = atomic_op(op);
                Outcome o;
                {
                    py::gil_scoped_release release;
                    o = w.put_signal(pe, offset, local, bytes, localGpu, sigOffset, sigOp, value);
                }
                return result(o);
            },
            py::arg("pe"), py::arg("offset"), py::arg("local"), py::arg("bytes"), py::arg("local_gpu"),
            py::arg("sig_offset"), py::arg("op"), py::arg("value"),
            "A put, then op (store or fetch_add, as ucx_atomic.OPS) with value on the 64-bit word at sig_offset: "
            "None once done, else (code, message).")
        .def(
            "atomic",
            [](HeapWindow& w, int pe, int op, uint64_t offset, uint64_t value, uint64_t compare, int width) {
                const AtomicOp a = atomic_op(op);
                Outcome o;
                {
                    py::gil_scoped_release release;
                    o = w.atomic(pe, a, offset, value, compare, width);
                }
                return o.code == kSuccess ? py::object(py::int_(o.value)) : result(o);
            },
            py::arg("pe"), py::arg("op"), py::arg("offset"), py::arg("value"), py::arg("compare"), py::arg("width"),
            "Applies op (ucx_atomic.OPS) to the width-bit word at heap offset offset of PE pe: its old value, "
            "else (code, message).")
        .def("quick_put", &quick_put, py::arg("dest"), py::arg("src"), py::arg("nbytes"), py::arg("pe"),
             "The plain put of a host caller from addresses: True once done, (code, message) when it failed, None "
             "with nothing done when it is not the plain case.")
        .def(
            "stats",
            [](const HeapWindow& w) {
                const HeapWindow::Stats s = w.stats();
                py::dict d;
                d["staged"] = s.staged;
                d["registered_for_call"] = s.registeredForCall;
                d["registered_buffers"] = s.buffers;
                return d;
            },
            "Transfers whose local side was staged, and registered for the transfer; buffers registered now.")
        .def("close", &HeapWindow::close, py::call_guard<py::gil_scoped_release>(),
             "Releases the buffers and the staging area, and the peers.");
});

}  // namespace
}  // namespace mori::ucx
