// Python bindings of the native TCP data plane: TcpTarget, TcpPeer, TcpTransfer, TRANSFER_CODES.
// Every call that can block (connect, wait, deregister, close) releases the GIL.
#include <pybind11/numpy.h>
#include <pybind11/stl.h>

#include "registry.hpp"
#include "tcp_engine.hpp"

namespace py = pybind11;
using namespace mori;
using namespace mori::tcp;

namespace {

using U64Array = py::array_t<uint64_t, py::array::c_style | py::array::forcecast>;

std::vector<uint64_t> to_vector(const U64Array& a) {
    if (a.ndim() != 1) throw std::invalid_argument("offset and size arrays must be 1-d");
    return std::vector<uint64_t>(a.data(), a.data() + a.shape(0));
}

mori::native::Registration reg([](py::module_& m) {
    py::dict codes;  // transfer.hpp's Code by mori.core.codes.TransferCode's names
    codes["SUCCESS"] = static_cast<int>(kSuccess);
    codes["NOT_STARTED"] = static_cast<int>(kNotStarted);
    codes["IN_PROGRESS"] = static_cast<int>(kInProgress);
    codes["ERR_INVALID_ARGS"] = static_cast<int>(kErrInvalidArgs);
    codes["ERR_NOT_FOUND"] = static_cast<int>(kErrNotFound);
    codes["ERR_TRANSPORT"] = static_cast<int>(kErrTransport);
    codes["ERR_BAD_STATE"] = static_cast<int>(kErrBadState);
    codes["ERR_DEVICE"] = static_cast<int>(kErrDevice);
    m.attr("TRANSFER_CODES") = codes;

    py::class_<Transfer, std::shared_ptr<Transfer>>(m, "TcpTransfer",
                                                    "Completion of one native TCP transfer.")
        .def("code", &Transfer::code, "TransferCode value (IN_PROGRESS=2 until finished).")
        .def("message", &Transfer::message, "Why it failed ('' on success).")
        .def("wait", &Transfer::wait, py::arg("timeout"), py::call_guard<py::gil_scoped_release>(),
             "Waits up to timeout seconds; True when finished.");

    py::class_<Peer, std::shared_ptr<Peer>>(m, "TcpPeer", "Data connections from this engine to one target.")
        // A factory, not py::init with a call guard: connecting releases the GIL, but pybind11
        // must hold the GIL while it sets up the new instance around the returned holder.
        .def(py::init([](const std::string& name, const std::string& host, int port, int nconn,
                         const std::string& myKey, const std::string& token, const std::string& ticket,
                         double ioTimeout, const std::string& timeoutSetting) {
                 py::gil_scoped_release release;
                 return std::make_shared<Peer>(name, host, port, nconn, myKey, token, ticket, ioTimeout,
                                               timeoutSetting);
             }),
             py::arg("name"), py::arg("host"), py::arg("port"), py::arg("num_connections"), py::arg("my_key"),
             py::arg("token"), py::arg("ticket"), py::arg("io_timeout"), py::arg("timeout_setting") = "io_timeout",
             "Connects to a target; timeout messages name timeout_setting (the caller's setting for io_timeout).")
        .def(
            "submit",
            [](Peer& p, int op, uint64_t localBase, std::vector<uint64_t> lofs, uint64_t memId,
               std::vector<uint64_t> rofs, std::vector<uint64_t> sizes, uint64_t uid, bool notify, uint64_t stripe) {
                py::gil_scoped_release release;
                return p.submit(static_cast<uint8_t>(op), localBase, lofs, memId, rofs, sizes, uid, notify, stripe);
            },
            py::arg("op"), py::arg("local_base"), py::arg("local_offsets"), py::arg("mem_id"),
            py::arg("remote_offsets"), py::arg("sizes"), py::arg("uid"), py::arg("notify"), py::arg("stripe"),
            "Starts a transfer of len(sizes) blocks (op 1 = read, 2 = write); returns its TcpTransfer.")
        .def(
            "submit_arrays",
            [](Peer& p, int op, uint64_t localBase, const U64Array& lofs, uint64_t memId, const U64Array& rofs,
               const U64Array& sizes, uint64_t uid, bool notify, uint64_t stripe) {
                auto l = to_vector(lofs), r = to_vector(rofs), s = to_vector(sizes);
                py::gil_scoped_release release;
                return p.submit(static_cast<uint8_t>(op), localBase, l, memId, r, s, uid, notify, stripe);
            },
            py::arg("op"), py::arg("local_base"), py::arg("local_offsets"), py::arg("mem_id"),
            py::arg("remote_offsets"), py::arg("sizes"), py::arg("uid"), py::arg("notify"), py::arg("stripe"),
            "submit() for numpy integer arrays (no per-element conversion); needs numpy.")
        .def("healthy", &Peer::healthy, "False once a connection has failed.")
        .def("close", &Peer::close, py::call_guard<py::gil_scoped_release>());

    py::class_<Target, std::shared_ptr<Target>>(m, "TcpTarget",
                                                "Serves registered memory to authenticated peers.")
        .def(py::init([](const std::string& host, int port, std::string token, double ioTimeout,
                         size_t maxConnections, size_t maxHandshakes, double helloTimeout, size_t maxInbound,
                         double inboundTtl, std::string timeoutSetting, size_t maxPerKey) {
                 TargetLimits lim;
                 lim.maxPerKey = maxPerKey;
                 lim.maxConnections = maxConnections;
                 lim.maxHandshakes = maxHandshakes;
                 lim.helloTimeout = helloTimeout;
                 lim.maxInbound = maxInbound;
                 lim.inboundTtl = inboundTtl;
                 return std::make_shared<Target>(host, port, std::move(token), ioTimeout, lim, std::move(timeoutSetting));
             }),
             py::arg("host"), py::arg("port"), py::arg("token"), py::arg("io_timeout"),
             py::arg("max_connections") = TargetLimits{}.maxConnections,
             py::arg("max_handshakes") = TargetLimits{}.maxHandshakes,
             py::arg("hello_timeout") = TargetLimits{}.helloTimeout,
             py::arg("max_inbound") = TargetLimits{}.maxInbound,
             py::arg("inbound_ttl") = TargetLimits{}.inboundTtl, py::arg("timeout_setting") = "io_timeout",
             py::arg("max_per_key") = TargetLimits{}.maxPerKey,
             "Listens on host:port; the limits bound what peers can consume; timeout messages name "
             "timeout_setting.")
        .def_property_readonly("port", &Target::port)
        .def("register_region", &Target::register_region, py::arg("mem_id"), py::arg("addr"), py::arg("size"))
        .def("deregister_region", &Target::deregister_region, py::arg("mem_id"),
             py::call_guard<py::gil_scoped_release>(),
             "Stops serving a region: waits up to io_timeout for requests in flight on it, then cuts "
             "their connections; no byte of it is touched once this returns. False when unknown.")
        .def("pop_inbound", &Target::pop_inbound, py::arg("key"), py::arg("uid"),
             "Final TransferCode of transfer uid from engine key, or None (the record is removed).")
        .def("issue_ticket", &Target::issue_ticket, py::arg("key"), py::arg("ticket"),
             py::call_guard<py::gil_scoped_release>(),
             "Admits data connections from engine key presenting ticket (64 at most, for 60 s).")
        .def("connection_count", &Target::connection_count, py::call_guard<py::gil_scoped_release>())
        .def("inbound_count", &Target::inbound_count, "Completion records kept now.")
        .def(
            "stats",
            [](Target& t) {
                TargetStats s = t.stats();
                py::dict d;
                d["refused"] = s.refused;
                d["evicted"] = s.evicted;
                d["accept_errors"] = s.acceptErrors;
                d["inbound_dropped"] = s.inboundDropped;
                d["bad_tickets"] = s.badTickets;
                d["idle_evicted"] = s.idleEvicted;
                d["cut"] = s.cut;
                return d;
            },
            "Counts of connections refused or evicted (in their hello; admitted ones over max_per_key or "
            "idle while descriptors ran out), accept failures, records dropped, bad hellos, and "
            "connections cut by a deregistration that outwaited io_timeout.")
        .def("close", &Target::close, py::call_guard<py::gil_scoped_release>());
});

}  // namespace
