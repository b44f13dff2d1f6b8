// Python binding of the proxy of device-initiated RMA (proxy/proxy.hpp): UcxProxy in the ucx
// submodule, typed in _native/ucx.pyi and presented by mori.core.ucx_proxy.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include "base/registry.hpp"
#include "mori/device/proxy_ring.cuh"
#include "proxy/proxy.hpp"

namespace py = pybind11;
using namespace mori;
using namespace mori::ucx;

namespace {

mori::native::Registration reg([](py::module_& root) {
    py::module_ m = mori::native::submodule(root, "ucx", "mori-core's UCX engine");
    m.attr("PROXY_SLOTS") = mori::device::kProxySlots;
    m.attr("PROXY_SLOT_BYTES") = sizeof(mori::device::ProxySlot);
    m.attr("PROXY_HEADER_BYTES") = sizeof(mori::device::ProxyHeader);
    py::class_<Proxy, std::shared_ptr<Proxy>>(m, "UcxProxy", "The proxy thread of device-initiated RMA.")
        .def(py::init([](std::shared_ptr<HeapWindow> window, uintptr_t ring, uintptr_t bounce) {
                 py::gil_scoped_release release;
                 return std::make_shared<Proxy>(std::move(window), ring, bounce);
             }),
             py::arg("window"), py::arg("ring"), py::arg("bounce"),
             "Starts the proxy thread on the ring at host address ring, for the heap of window (a UcxHeapWindow; see "
             "mori.core.ucx_proxy).")
        .def("wait_idle", &Proxy::wait_idle, py::arg("timeout"), py::call_guard<py::gil_scoped_release>(),
             "True once every command posted so far is complete; False after timeout seconds.")
        .def("failure", &Proxy::failure, "Why the first failed command failed ('' when none did).")
        .def("executed", &Proxy::executed, "Commands taken and executed so far.")
        .def("stop", &Proxy::stop, py::call_guard<py::gil_scoped_release>(),
             "Ends the thread once the commands already posted are done.");
});

}  // namespace
