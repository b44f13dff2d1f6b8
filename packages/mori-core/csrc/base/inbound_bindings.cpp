// mori.core._native.inbound: the completion-record table (base/inbound.hpp) for Python, so that one
// table can be written by the native data planes (handed to tcp.Target and ucx.UcxEngine) and by
// Python channels alike, and read in one place.
#include <pybind11/stl.h>

#include "base/inbound.hpp"
#include "base/registry.hpp"

namespace py = pybind11;
using mori::InboundRecords;

namespace {

mori::native::Registration reg([](py::module_& root) {
    py::module_ m = mori::native::submodule(root, "inbound", "completion records of inbound transfers");
    py::class_<InboundRecords, std::shared_ptr<InboundRecords>>(
        m, "InboundRecords",
        "Completion records of inbound transfers: (code, message) by (engine key, uid), popped once; at most "
        "max_records, each kept at most ttl seconds (the oldest go first; the first drop is logged once, naming "
        "`settings`). Thread-safe.")
        .def(py::init<size_t, double, std::string>(), py::arg("max_records"), py::arg("ttl"),
             py::arg("settings") = "max_records and ttl",
             "A table of at most max_records records, each kept at most ttl seconds; ValueError unless both are "
             "positive.")
        .def(
            "record",
            [](InboundRecords& t, const std::string& key, uint64_t uid, int code, std::string message) {
                if (!mori::is_final_code(code))
                    throw py::value_error("InboundRecords.record: code " + std::to_string(code) +
                                          " is not a final TransferCode");
                return t.record(key, uid, code, std::move(message));
            },
            py::arg("key"), py::arg("uid"), py::arg("code"), py::arg("message") = "",
            "Keeps the final TransferCode and message of transfer uid from engine key (replacing an earlier "
            "record of it); returns how many old records were dropped to make room. ValueError for a code "
            "that is not final.")
        .def("pop", &InboundRecords::pop, py::arg("key"), py::arg("uid"),
             "(code, message) of transfer uid from engine key, removing the record; None when there is none.")
        .def("__len__", &InboundRecords::count, "Records kept now (expired ones dropped first).")
        .def_property_readonly("dropped", &InboundRecords::dropped, "Records dropped so far (count or age).");
});

}  // namespace
