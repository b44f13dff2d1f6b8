// Python bindings of the UCX engine: ucx_load/ucx_library/ucx_components, UcxEngine, UcxPeer,
// UcxTransfer (typed in _native.pyi, presented by mori.core.ucx). Every call that can block
// (connect, submit, wait, deregister, close) releases the GIL.
#include <pybind11/stl.h>

#include <climits>
#include <optional>

#include "base/registry.hpp"
#include "ucx/engine.hpp"

namespace py = pybind11;
using namespace mori;
using namespace mori::ucx;

namespace {

py::dict library_dict(const Library& lib) {
    py::dict d;
    d["path"] = lib.path;
    d["source"] = lib.source;
    d["version"] = py::make_tuple(lib.major, lib.minor, lib.release);
    return d;
}

// A transfer as Python sees it (None for none): the one every transfer that finished as it started
// reports through (finished_transfer) is one Python object made once, so a direct same-host copy
// makes and drops no wrapper (and looks up no type) per call.
py::object to_python(std::shared_ptr<Transfer> t) {
    if (!t) return py::none();
    if (t == finished_transfer()) {
        static const py::object* finished = new py::object(py::cast(finished_transfer()));  // kept to the end
        return *finished;
    }
    return py::cast(std::move(t));
}

// One pair of regions' single-block transfers (mori-io's Lane.start): the pair's ids and flags bound
// once, so that a start converts five arguments and runs no Python.
struct Lane {
    std::shared_ptr<Peer> peer;
    uint64_t localId, remoteId;
    bool notify, remoteGpu;
    std::string refused;  // the start of a refusal's message

    // submit of Batch::one(src, dst, bytes); None (nothing started) once the peer has failed or was
    // closed. A refusal (a block outside the local region, the engine closed) comes back as a
    // failed transfer (ERR_INVALID_ARGS, ERR_BAD_STATE) whose message starts with `refused`.
    py::object start(int op, uint64_t src, uint64_t dst, uint64_t bytes, uint64_t uid) const {
        std::shared_ptr<Transfer> t;
        int code = kSuccess;
        std::string why;
        {
            py::gil_scoped_release release;
            try {
                if (peer->healthy())
                    t = peer->submit(static_cast<Op>(op), localId, mori::plan::Batch::one(src, dst, bytes), remoteId,
                                     uid, notify, remoteGpu);
            } catch (const std::invalid_argument& e) {
                code = kErrInvalidArgs;
                why = e.what();
            } catch (const std::exception& e) {
                code = kErrBadState;
                why = e.what();
            }
        }
        if (code != kSuccess) {
            t = std::make_shared<Transfer>(nullptr, nullptr, 1, INT64_MAX, false, uid);
            t->part_done(code, refused + why);
        }
        return to_python(std::move(t));
    }
};

// Lane.start as a plain CPython function (METH_FASTCALL) bound to its lane: pybind11's dispatcher
// (argument loaders, a call record, overload checks) cost about 0.2 us of a 4 KiB same-host
// transfer's 4. Arguments are taken as pybind11 takes them: ints (or __index__), each within its C type.
constexpr const char* kLaneCapsule = "mori.core.ucx.UcxLane";

// arg as an int (itself, or its __index__, as pybind11 takes it): a new reference, or null with
// TypeError naming the argument.
PyObject* int_arg(PyObject* arg, const char* name) {
    if (PyLong_Check(arg)) {
        Py_INCREF(arg);
        return arg;
    }
    PyObject* n = PyNumber_Index(arg);
    if (n == nullptr && PyErr_ExceptionMatches(PyExc_TypeError)) {
        PyErr_Clear();
        PyErr_Format(PyExc_TypeError, "UcxLane.start: %s must be an int, got %s", name, Py_TYPE(arg)->tp_name);
    }
    return n;
}

bool arg_u64(PyObject* arg, const char* name, uint64_t& out) {
    PyObject* n = int_arg(arg, name);
    if (n == nullptr) return false;
    out = PyLong_AsUnsignedLongLong(n);
    Py_DECREF(n);
    return !(out == static_cast<uint64_t>(-1) && PyErr_Occurred());
}

PyObject* lane_start(PyObject* capsule, PyObject* const* args, Py_ssize_t nargs) {
    if (nargs != 5) {
        PyErr_Format(PyExc_TypeError, "UcxLane.start takes 5 arguments (op, src, dst, bytes, uid), got %zd", nargs);
        return nullptr;
    }
    const auto* lane = static_cast<const Lane*>(PyCapsule_GetPointer(capsule, kLaneCapsule));
    if (lane == nullptr) return nullptr;
    PyObject* opInt = int_arg(args[0], "op");
    if (opInt == nullptr) return nullptr;
    int overflow = 0;
    const long op = PyLong_AsLongAndOverflow(opInt, &overflow);
    Py_DECREF(opInt);
    if (op == -1 && PyErr_Occurred()) return nullptr;
    if (overflow != 0 || op < INT_MIN || op > INT_MAX) {
        PyErr_SetString(PyExc_OverflowError, "UcxLane.start: op is out of range");
        return nullptr;
    }
    uint64_t src, dst, bytes, uid;
    if (!arg_u64(args[1], "src", src) || !arg_u64(args[2], "dst", dst) || !arg_u64(args[3], "bytes", bytes) ||
        !arg_u64(args[4], "uid", uid))
        return nullptr;
    try {
        return lane->start(static_cast<int>(op), src, dst, bytes, uid).release().ptr();
    } catch (py::error_already_set& e) {
        e.restore();
    } catch (const std::exception& e) {
        PyErr_SetString(PyExc_RuntimeError, e.what());
    }
    return nullptr;
}

PyMethodDef kLaneStart = {"start", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(&lane_start)),
                          METH_FASTCALL,
                          "start(op, src, dst, bytes, uid): starts op (1 = read, 2 = write) of bytes between local "
                          "address src and remote offset dst; its UcxTransfer (FINISHED when it finished as it "
                          "started; a failed one when refused), or None with nothing started once the peer has "
                          "failed or was closed."};

// The lane's start function: it holds a copy of the lane (the peer shared), freed with it.
py::object lane_start_function(const Lane& lane) {
    auto* held = new Lane(lane);
    PyObject* capsule = PyCapsule_New(
        held, kLaneCapsule, [](PyObject* c) { delete static_cast<Lane*>(PyCapsule_GetPointer(c, kLaneCapsule)); });
    if (capsule == nullptr) {
        delete held;
        throw py::error_already_set();
    }
    PyObject* f = PyCFunction_NewEx(&kLaneStart, capsule, nullptr);
    Py_DECREF(capsule);  // the function holds it
    if (f == nullptr) throw py::error_already_set();
    return py::reinterpret_steal<py::object>(f);
}

mori::native::Registration reg([](py::module_& root) {
    py::module_ m = mori::native::submodule(root, "ucx", "mori-core's UCX engine");
    py::register_exception<LoadError>(m, "UcxLoadError", PyExc_RuntimeError);
    m.attr("MAX_EAGER_BYTES") = kMaxEagerBytes;

    m.def(
        "ucx_load",
        [](const std::vector<std::pair<std::string, std::string>>& candidates) {
            std::vector<Candidate> cs;
            for (const auto& [path, source] : candidates) cs.push_back(Candidate{path, source});
            const Library* lib;
            {
                py::gil_scoped_release release;
                lib = &load(cs);
            }
            return library_dict(*lib);
        },
        py::arg("candidates"),
        "Loads UCX from the first (libucp path, source label) that opens, or uses the one already in "
        "this process; returns {path, source, version}. Raises UcxLoadError listing what was tried.");
    m.def("ucx_library", [] { return library_dict(library()); }, "The loaded UCX; UcxLoadError before ucx_load.");
    m.def("ucx_components", &components, "UCX's components and the devices (memory domains) each one found.");
    m.def(
        "ucx_finished", [] { return to_python(finished_transfer()); },
        "The UcxTransfer that submit and UcxLane.start return for every transfer that finished successfully as "
        "it started (a same-host direct copy): always the same object.");

    py::class_<Transfer, std::shared_ptr<Transfer>>(m, "UcxTransfer", "Completion of one UCX engine transfer.")
        .def("code", &Transfer::code, "TransferCode value (IN_PROGRESS=2 until finished).")
        .def("message", &Transfer::message, "Why it failed ('' on success).")
        .def("wait", &Transfer::wait, py::arg("timeout"), py::call_guard<py::gil_scoped_release>(),
             "Waits up to timeout seconds (progressing the worker on this thread first); True when finished.");

    py::class_<Lane>(m, "UcxLane", "Single-block transfers between two regions (UcxPeer.lane).")
        .def_property_readonly("start", &lane_start_function,
                               "start(op, src, dst, bytes, uid): starts op (1 = read, 2 = write) of bytes between "
                               "local address src and remote offset dst; its UcxTransfer (FINISHED when it finished "
                               "as it started; a failed one when refused), or None with nothing started once the peer "
                               "has failed or was closed. A plain function bound to the lane (no pybind11 dispatch "
                               "per call): take it once and call it.");

    py::class_<Peer, std::shared_ptr<Peer>>(m, "UcxPeer", "Endpoints from a UCX engine to one peer engine.")
        .def_property_readonly("key", &Peer::key)
        .def(
            "submit",
            [](Peer& p, int op, uint64_t localId, const mori::plan::Batch& batch, uint64_t remoteId, uint64_t uid,
               bool notify, bool remoteGpu) {
                std::shared_ptr<Transfer> t;
                {
                    py::gil_scoped_release release;
                    t = p.submit(static_cast<Op>(op), localId, batch, remoteId, uid, notify, remoteGpu);
                }
                return to_python(std::move(t));
            },
            py::arg("op"), py::arg("local_id"), py::arg("batch"), py::arg("remote_id"), py::arg("uid") = 0,
            py::arg("notify") = false, py::arg("remote_gpu") = false,
            "Starts a transfer (op 1 = read, 2 = write) of a mori.core.batch.Batch of rows (local address inside "
            "local_id, offset in remote_id, bytes; Batch.one for one block); returns its UcxTransfer.")
        .def(
            "lane",
            [](std::shared_ptr<Peer> p, uint64_t localId, uint64_t remoteId, bool notify, bool remoteGpu,
               std::string refused) {
                return Lane{std::move(p), localId, remoteId, notify, remoteGpu, std::move(refused)};
            },
            py::arg("local_id"), py::arg("remote_id"), py::arg("notify"), py::arg("remote_gpu"), py::arg("refused"),
            "A UcxLane: single blocks between local_id and remote_id, started with those bound (mori-io's "
            "read and write, where each Python step and argument is a visible share of a 4 KiB transfer).")
        .def(
            "run_one",
            [](Peer& p, int op, uint64_t localId, uint64_t src, uint64_t dst, uint64_t bytes, uint64_t remoteId,
               bool remoteGpu, double timeout) {
                std::shared_ptr<Transfer> t;
                {
                    py::gil_scoped_release release;
                    t = p.run_one(static_cast<Op>(op), localId, src, dst, bytes, remoteId, remoteGpu, timeout);
                }
                const int code = t->code();
                return py::make_tuple(code, code == mori::kSuccess ? std::string() : t->message());
            },
            py::arg("op"), py::arg("local_id"), py::arg("src"), py::arg("dst"), py::arg("bytes"), py::arg("remote_id"),
            py::arg("remote_gpu"), py::arg("timeout"),
            "submit of Batch.one(src, dst, bytes), wait(timeout) and code() in one call, for a caller that waits at "
            "once (a host put or get of mori.shmem: on a fast transport a 4 KiB one feels every Python step): "
            "(code, message), code IN_PROGRESS (2) when it did not finish within timeout seconds.")
        .def_property_readonly("same_host", &Peer::same_host,
                               "True when host-memory transfers take the same-host path (process_vm_readv/writev).")
        .def_property_readonly("same_host_refusal", &Peer::same_host_refusal,
                               "Why a same-host peer could not use that path ('' when it was not offered or works).")
        .def_property_readonly("same_host_path", &Peer::same_host_path,
                               "On the same-host path, how transfers move: 'direct' (this process copies those of "
                               "up to 64 KiB itself, checked against the target's published registrations), or "
                               "'served: ' and why not (the target's thread copies every one); '' off that path.")
        .def("healthy", &Peer::healthy, "False once the peer failed or was closed.")
        .def("failure", &Peer::failure, "Why the peer failed ('' while healthy).")
        .def("describe", &Peer::describe, py::call_guard<py::gil_scoped_release>(),
             "UCX's description of the endpoints: the transports and devices of each lane.")
        .def("fail", &Peer::fail, py::arg("why"), py::call_guard<py::gil_scoped_release>(),
             "Fails the peer: its transfers in flight end with why, its endpoints close.")
        .def("close", &Peer::close, py::call_guard<py::gil_scoped_release>());

    py::class_<Engine, std::shared_ptr<Engine>>(m, "UcxEngine", "mori-core's UCX engine (see mori.core.ucx).")
        .def(
            py::init([](const std::string& name, const std::vector<std::pair<std::string, std::string>>& settings,
                        int workers, int lanes, bool polling, double timeout, const std::string& timeoutSetting,
                        bool rma, size_t maxInbound, double inboundTtl, size_t maxTickets,
                        std::shared_ptr<mori::InboundRecords> inbound, bool sameHost, uint64_t sendQueue,
                        double sendQueueWait, bool roundRobin, bool standAside, bool sameHostDirect) {
                EngineOptions o;
                o.name = name;
                o.settings = settings;
                o.workers = workers;
                o.lanes = lanes;
                o.polling = polling;
                o.timeout = timeout;
                o.timeoutSetting = timeoutSetting;
                o.rma = rma;
                o.maxInbound = maxInbound;
                o.inboundTtl = inboundTtl;
                o.maxTickets = maxTickets;
                o.inbound = std::move(inbound);
                o.sendQueue = sendQueue;
                o.sendQueueWait = sendQueueWait;
                o.roundRobin = roundRobin;
                o.standAside = standAside;
                o.sameHostDirect = sameHostDirect;
                // One definition of "this host": mori.core.host's key (machine and network namespace).
                o.hostKey = py::module_::import("mori.core.host").attr("this_host")().attr("key").cast<std::string>();
                o.sameHost = sameHost && !o.hostKey.empty();
                py::gil_scoped_release release;
                return std::make_shared<Engine>(std::move(o));
            }),
            py::arg("name") = "mori", py::arg("settings") = std::vector<std::pair<std::string, std::string>>{},
            py::arg("workers") = 1, py::arg("lanes") = 1, py::arg("polling") = true, py::arg("timeout") = 30.0,
            py::arg("timeout_setting") = "timeout", py::arg("rma") = false,
            py::arg("max_inbound") = EngineOptions{}.maxInbound, py::arg("inbound_ttl") = EngineOptions{}.inboundTtl,
            py::arg("max_tickets") = EngineOptions{}.maxTickets, py::arg("inbound") = nullptr,
            py::arg("same_host") = true, py::arg("send_queue") = EngineOptions{}.sendQueue,
            py::arg("send_queue_wait") = EngineOptions{}.sendQueueWait, py::arg("round_robin") = true,
            py::arg("stand_aside") = true, py::arg("same_host_direct") = true,
            "Notification records go to `inbound` (a mori.core.inbound.InboundRecords shared with the caller's "
            "other channels), else to a table of its own bounded by max_inbound and inbound_ttl. same_host: offer "
            "and take the same-host path; same_host_direct: on it, copy small transfers in the initiator (and offer "
            "this engine's host regions for it). send_queue: operations (rows) in flight per worker and peer, 0 for no "
            "bound; a transfer that finds no room waits up to send_queue_wait seconds, then fails 'SQ full'. A "
            "transfer of "
            "512 KiB or more is spread over the workers; the others start on the workers in turn (round_robin) or "
            "on the first. stand_aside: once a caller that led a worker is done, its progress thread sleeps at once; "
            "False: it polls on as after any activity.")
        .def_property_readonly(
            "addresses",
            [](const Engine& e) {
                py::list out;
                for (const auto& a : e.addresses()) out.append(py::bytes(a));
                return out;
            },
            "The UCX address of each worker, for peers to connect to.")
        .def_property_readonly(
            "same_host_address", [](const Engine& e) { return py::bytes(e.same_host_address()); },
            "What a peer on this host passes to connect(same_host=...) to take the same-host path (b'' when off).")
        .def_property_readonly("cuda_supported", &Engine::cuda_supported)
        .def(
            "store_mark", [](Engine& e) { return e.stores().mark(); },
            "How many words this engine's handlers wrote so far (signal puts' signals, atomics): where a "
            "waiter starts next_store, taken before it first reads the word itself.")
        .def(
            "next_store",
            [](Engine& e, uint64_t addr, int width, uint64_t since, double timeout) {
                if (width != 32 && width != 64) throw py::value_error("width must be 32 or 64");
                if (!(timeout >= 0)) throw py::value_error("timeout must be >= 0 seconds");
                bool lost = false;
                std::optional<uint64_t> value;
                {
                    py::gil_scoped_release release;
                    value = e.stores().next(addr, width, since, static_cast<int64_t>(timeout * 1e9), lost);
                }
                return py::make_tuple(value ? py::object(py::int_(*value)) : py::object(py::none()), since, lost);
            },
            py::arg("addr"), py::arg("width"), py::arg("since"), py::arg("timeout"),
            "The value of the first write by this engine's handlers into the width-bit word at addr after "
            "store_mark() gave `since`, once that write is visible, waiting up to `timeout` seconds: (value or "
            "None, the mark to pass next, lost). lost: writes after `since` left the engine's log of the last "
            "256 before this call looked (then, and for writes by anyone else, read the word itself).")
        .def_property("eager_bytes", &Engine::eager_bytes, &Engine::set_eager_bytes,
                      "Host-memory messages smaller than this go eager (a write's request with its bytes, a read's "
                      "reply), and blocks smaller than this are grouped (up to 256 KiB a message, as blocks under "
                      "16 KiB always are): for transports that would move them by a rendezvous handshake over tcp. "
                      "0 (the default): UCX's choice; at most MAX_EAGER_BYTES (ValueError beyond).")
        .def_property_readonly("settings", &Engine::settings,
                               "The UCX settings the context was made with: the caller's, then the defaults the engine "
                               "added, as (name, value) pairs.")
        .def(
            "register_memory",
            [](Engine& e, uint64_t id, uint64_t addr, uint64_t size, bool gpu) {
                std::string rkey;
                {
                    py::gil_scoped_release release;
                    rkey = e.register_region(id, addr, size, gpu);
                }
                return py::bytes(rkey);
            },
            py::arg("mem_id"), py::arg("addr"), py::arg("size"), py::arg("gpu") = false,
            "Registers memory as mem_id; returns its packed remote key.")
        .def("deregister_memory", &Engine::deregister_region, py::arg("mem_id"),
             py::call_guard<py::gil_scoped_release>(),
             "Refuses new accesses to mem_id, waits for those in flight; False when unknown.")
        .def("admit", &Engine::admit, py::arg("key"), "The ticket engine key must present (issued once per key).")
        .def(
            "connect",
            [](Engine& e, const std::string& key, const std::vector<py::bytes>& addresses, uint64_t ticket,
               const py::bytes& sameHost, bool stagesGpu) {
                std::vector<std::string> addrs;
                for (const auto& a : addresses) addrs.emplace_back(a);
                std::shared_ptr<Peer> peer;
                {
                    py::gil_scoped_release release;
                    peer = e.connect(key, addrs, ticket, std::string(sameHost), stagesGpu);
                }
                static bool told = false;  // said once per process: the reason is the host's, not the peer's
                if (!peer->same_host_refusal().empty() && !told) {
                    told = true;
                    py::module_::import("mori.core.log")
                        .attr("get_logger")("core")
                        .attr("warning")(
                            "UCX engine: same-host transfers go through UCX instead of process_vm_readv/writev: " +
                            peer->same_host_refusal());
                }
                return peer;
            },
            py::arg("key"), py::arg("addresses"), py::arg("ticket"), py::arg("same_host") = py::bytes(),
            py::arg("stages_gpu") = false,
            "Endpoints to the engine with these worker addresses, presenting the ticket it issued; same_host: "
            "its same_host_address (the same-host path when it names this host); stages_gpu: it stages its GPU "
            "memory (serve_gpu with stage), so small writes from GPU memory this engine stages go to it eager.")
        .def("fail_peer", &Engine::fail_peer, py::arg("key"), py::arg("why"), py::call_guard<py::gil_scoped_release>())
        .def("pop_inbound", &Engine::pop_inbound, py::arg("key"), py::arg("uid"),
             "Final TransferCode of transfer uid from engine key, or None (the record is removed).")
        .def("inbound_count", &Engine::inbound_count, "Notification records kept now.")
        .def(
            "stats",
            [](const Engine& e) {
                EngineStats s = e.stats();
                py::dict d;
                d["bad_tickets"] = s.badTickets;
                d["refused"] = s.refused;
                d["malformed"] = s.malformed;
                d["late_replies"] = s.lateReplies;
                d["spread"] = s.spread;
                return d;
            },
            "Counts of messages with no valid ticket, refused requests, malformed messages, late replies, and of "
            "transfers spread over several workers.")
        .def("describe", &Engine::describe, "UCX's description of the context: its transports and devices.")
        .def("close", &Engine::close, py::call_guard<py::gil_scoped_release>());
});

}  // namespace
