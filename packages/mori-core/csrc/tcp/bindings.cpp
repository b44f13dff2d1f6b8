// mori.core._native.tcp: the native TCP data plane for Python (Target, Peer, Transfer,
// TRANSFER_CODES, OP_CODES). Every call that can block (connect, submit, wait, deregister, close) releases
// the GIL.
#include <pybind11/stl.h>

#include "base/registry.hpp"
#include "gpu/staging.hpp"
#include "tcp/engine.hpp"

namespace py = pybind11;
using namespace mori;
using namespace mori::tcp;

namespace {

mori::native::Registration reg([](py::module_& root) {
    py::module_ m = mori::native::submodule(root, "tcp", "the native TCP data plane");
    py::class_<Transfer, std::shared_ptr<Transfer>>(m, "Transfer", "Completion of one native TCP transfer.")
        .def("code", &Transfer::code, "TransferCode value (IN_PROGRESS=2 until finished).")
        .def("message", &Transfer::message, "Why it failed ('' on success).")
        .def("wait", &Transfer::wait, py::arg("timeout"), py::call_guard<py::gil_scoped_release>(),
             "Waits up to timeout seconds; True when finished.");

    py::class_<Peer, std::shared_ptr<Peer>>(m, "Peer", "Data connections from this engine to one target.")
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
            [](Peer& p, int op, const mori::plan::Batch& batch, uint64_t memId, uint64_t uid, bool notify,
               uint64_t stripe, std::shared_ptr<mori::gpu::Stager> staging) {
                py::gil_scoped_release release;
                return p.submit(static_cast<uint8_t>(op), batch, memId, uid, notify, stripe, std::move(staging));
            },
            py::arg("op"), py::arg("batch"), py::arg("mem_id"), py::arg("uid"), py::arg("notify"), py::arg("stripe"),
            py::arg("staging") = nullptr,
            "Starts moving a mori.core.batch.Batch of rows (local address, offset in the target's region mem_id, "
            "bytes): op 1 = read, 2 = write; rows cut at `stripe` bytes (at least 4096) and dealt over the "
            "connections; the target records uid's outcome when notify is set. With `staging` (a "
            "mori.core.staging Stager) the local addresses are GPU memory, staged through it. Returns its Transfer.")
        .def(
            "submit_one",
            [](Peer& p, int op, uint64_t src, uint64_t dst, uint64_t bytes, uint64_t memId, uint64_t uid, bool notify,
               uint64_t stripe, std::shared_ptr<mori::gpu::Stager> staging) {
                py::gil_scoped_release release;
                if (!p.healthy()) return std::shared_ptr<Transfer>();
                return p.submit(static_cast<uint8_t>(op), mori::plan::Batch::one(src, dst, bytes), memId, uid, notify,
                                stripe, std::move(staging));
            },
            py::arg("op"), py::arg("src"), py::arg("dst"), py::arg("bytes"), py::arg("mem_id"), py::arg("uid"),
            py::arg("notify"), py::arg("stripe"), py::arg("staging") = nullptr,
            "submit of Batch.one(src, dst, bytes) with no Batch object made, or None (nothing started) once a "
            "connection has failed or was closed: for a caller that starts one block at a time (mori-io's read and "
            "write), where building the Batch and asking healthy() are a large share of the call.")
        .def("healthy", &Peer::healthy, "False once a connection has failed.")
        .def("close", &Peer::close, py::call_guard<py::gil_scoped_release>());

    py::class_<Target, std::shared_ptr<Target>>(m, "Target", "Serves registered memory to authenticated peers.")
        .def(py::init([](const std::string& host, int port, std::string token, double ioTimeout, size_t maxConnections,
                         size_t maxHandshakes, double helloTimeout, size_t maxInbound, double inboundTtl,
                         std::string timeoutSetting, size_t maxPerKey, std::shared_ptr<InboundRecords> inbound) {
                 TargetLimits lim;
                 lim.maxPerKey = maxPerKey;
                 lim.maxConnections = maxConnections;
                 lim.maxHandshakes = maxHandshakes;
                 lim.helloTimeout = helloTimeout;
                 lim.maxInbound = maxInbound;
                 lim.inboundTtl = inboundTtl;
                 return std::make_shared<Target>(host, port, std::move(token), ioTimeout, lim,
                                                 std::move(timeoutSetting), std::move(inbound));
             }),
             py::arg("host"), py::arg("port"), py::arg("token"), py::arg("io_timeout"),
             py::arg("max_connections") = TargetLimits{}.maxConnections,
             py::arg("max_handshakes") = TargetLimits{}.maxHandshakes,
             py::arg("hello_timeout") = TargetLimits{}.helloTimeout, py::arg("max_inbound") = TargetLimits{}.maxInbound,
             py::arg("inbound_ttl") = TargetLimits{}.inboundTtl, py::arg("timeout_setting") = "io_timeout",
             py::arg("max_per_key") = TargetLimits{}.maxPerKey, py::arg("inbound") = nullptr,
             "Listens on host:port; the limits bound what peers can consume; timeout messages name "
             "timeout_setting. Completion records go to `inbound` (a mori.core.inbound.InboundRecords shared with "
             "the caller's other channels), else to a table of its own bounded by max_inbound and inbound_ttl.")
        .def_property_readonly("port", &Target::port)
        .def("register_region", &Target::register_region, py::arg("mem_id"), py::arg("addr"), py::arg("size"),
             py::arg("staging") = nullptr,
             "Serves [addr, addr + size) as region mem_id; with `staging` (a mori.core.staging Stager) it is GPU "
             "memory, staged through it.")
        .def("deregister_region", &Target::deregister_region, py::arg("mem_id"),
             py::call_guard<py::gil_scoped_release>(),
             "Stops serving a region: waits up to io_timeout for requests in flight on it, then cuts "
             "their connections; no byte of it is touched once this returns. False when unknown.")
        .def("pop_inbound", &Target::pop_inbound, py::arg("key"), py::arg("uid"),
             "Final TransferCode of transfer uid from engine key, or None (the record is removed).")
        .def("issue_ticket", &Target::issue_ticket, py::arg("key"), py::arg("ticket") = py::none(),
             py::call_guard<py::gil_scoped_release>(),
             "Admits data connections from engine key presenting its ticket (64 at most, within 60 s): `ticket` "
             "when given (a str of 1..256 bytes), else the one key holds, drawn here (128 random bits in hex) "
             "when it holds none. A key holds one ticket; issuing again renews it. Returns the ticket.")
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
