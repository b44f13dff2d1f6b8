// mori.umbp._grpc_native: the UMBP master's gRPC server and the master client's channel on
// gRPC C++ (Debian's libgrpc++), for the Python code that answers and makes the calls.
//
// Why: with grpcio's Python server every call hops between its polling thread and a handler
// thread three times, and its Python client walks several Python layers per call; on a loaded
// 2-core machine that was 0.4 to 0.5 ms a call before any work. Here a call's handler runs on the
// C++ worker that received the request, which takes the GIL once to run the Python handler on
// the request's bytes, and a client call waits without the GIL on its thread's completion queue.
//
// Both sides move serialized messages only (the generic service and stub): the protocol, its
// checks and its errors stay in Python, but for a peer service's resolves and releases of pages
// on SSD only, which a server given a PeerSsdReads answers in C++ (peer_ssd.h).
#include <absl/synchronization/mutex.h>
#include <grpcpp/generic/async_generic_service.h>
#include <grpcpp/generic/generic_stub.h>
#include <grpcpp/grpcpp.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <chrono>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <thread>
#include <tuple>
#include <vector>

#include "peer_ssd.h"

namespace py = pybind11;

namespace {

// A (code, details, body) answer, as both sides hand it to Python.
using Answer = std::tuple<int, std::string, py::bytes>;

py::bytes to_bytes(const grpc::ByteBuffer& buffer) {
    std::vector<grpc::Slice> slices;
    if (!buffer.Dump(&slices).ok()) return py::bytes();
    PyObject* out = PyBytes_FromStringAndSize(nullptr, static_cast<Py_ssize_t>(buffer.Length()));
    if (out == nullptr) throw py::error_already_set();
    char* at = PyBytes_AS_STRING(out);
    for (const grpc::Slice& s : slices) {
        std::memcpy(at, s.begin(), s.size());
        at += s.size();
    }
    return py::reinterpret_steal<py::bytes>(out);
}

grpc::ByteBuffer to_buffer(const py::bytes& body) {
    char* data = nullptr;
    Py_ssize_t size = 0;
    if (PyBytes_AsStringAndSize(body.ptr(), &data, &size) != 0) throw py::error_already_set();
    grpc::Slice slice(data, static_cast<size_t>(size));  // copies: the bytes belong to Python
    return grpc::ByteBuffer(&slice, 1);
}

// No HTTP/2 BDP pings from servers, nor from channels but peers' (GRPC_ARG_HTTP2_BDP_PROBE 0; see
// Channel). With them on at the server, a call after a pause made the server ping the client on
// the request's arrival, ahead of the answer: the client woke for the ping, acknowledged it and
// slept again before the answer came (0.05 to 0.1 ms of a small call after an idle spell, on a
// loaded 2-core machine). The pings tune flow-control windows for bulk streams; an 8 MiB request
// takes as long without them here.

bool python_finalizing() {
#if PY_VERSION_HEX >= 0x030D0000
    return Py_IsFinalizing() != 0;
#else
    return _Py_IsFinalizing() != 0;
#endif
}

// Waits for the one operation outstanding on `cq`; false when it failed or the queue shut down.
bool await_one(grpc::CompletionQueue* cq) {
    void* tag = nullptr;
    bool ok = false;
    return cq->Next(&tag, &ok) && ok;
}

// Shuts `cq` down and takes what is left on it (gRPC requires a queue drained before it goes).
void drain(grpc::CompletionQueue* cq) {
    cq->Shutdown();
    void* tag = nullptr;
    bool ok = false;
    while (cq->Next(&tag, &ok)) {
    }
}

// The server: `workers` threads take calls from one completion queue, at most `workers` at once
// (a call is asked for again only when one ends), and each serves the call it took to its answer,
// the call's read and answer completing on a queue of the call's own that only that thread polls.
// So the thread that polled the arrival runs the handler: with a queue per worker, an arrival
// polled by another worker's thread was handed over to its own, and with one queue for all the
// steps, the read's completion went to whichever worker slept on it (a handoff either way, about
// twice the server's CPU a call with 8 workers). Calls beyond the workers wait in gRPC (at most
// `max_streams` per connection) until one ends or their deadline passes.
class Server {
public:
    Server(const std::string& address, py::object dispatch, int workers, int max_message_bytes, int max_streams,
           std::shared_ptr<umbp::PeerSsdReads> ssd_reads)
        : dispatch_(std::move(dispatch)), ssd_reads_(std::move(ssd_reads)) {
        if (workers < 1) throw std::invalid_argument("workers must be at least 1");
        grpc::ServerBuilder builder;
        builder.AddListeningPort(address, grpc::InsecureServerCredentials(), &port_);
        builder.RegisterAsyncGenericService(&service_);
        builder.SetMaxReceiveMessageSize(max_message_bytes);
        builder.SetMaxSendMessageSize(max_message_bytes);
        builder.AddChannelArgument(GRPC_ARG_ALLOW_REUSEPORT, 0);
        builder.AddChannelArgument(GRPC_ARG_MAX_CONCURRENT_STREAMS, max_streams);
        builder.AddChannelArgument(GRPC_ARG_HTTP2_BDP_PROBE, 0);  // no BDP pings (see above)
        queue_ = builder.AddCompletionQueue();
        {
            py::gil_scoped_release unlocked;
            server_ = builder.BuildAndStart();
        }
        if (!server_ || port_ == 0) {
            server_.reset();
            throw std::runtime_error("cannot listen on " + address);
        }
        for (int i = 0; i < workers; ++i) request();
        for (int i = 0; i < workers; ++i) threads_.emplace_back([this] { serve(); });
    }

    ~Server() {
        if (server_ && python_finalizing()) {
            // A worker asking for the GIL now may never get it (Python 3.14 makes it wait forever):
            // joining could hang the exit. Leave the server, its queue and its threads to the end.
            for (auto& t : threads_) t.detach();
            (void)server_.release();
            (void)queue_.release();
            for (auto& steps : spare_) (void)steps.release();
            return;
        }
        stop(0.0);
    }

    int port() const { return port_; }

    // In-flight calls get `grace_s` to finish, then are cancelled; returns once every worker ended.
    void stop(double grace_s) {
        if (!server_) return;
        py::gil_scoped_release unlocked;  // the workers need the GIL to finish their calls
        {
            std::lock_guard<std::mutex> hold(requests_);
            stopping_ = true;  // calls that end from now on are not asked for again
        }
        auto deadline =
            std::chrono::system_clock::now() + std::chrono::microseconds(static_cast<int64_t>(grace_s * 1e6));
        server_->Shutdown(deadline);  // the calls asked for come back not ok
        queue_->Shutdown();           // the workers end once it is drained
        for (auto& t : threads_) t.join();
        threads_.clear();
        server_.reset();
        unanswered_.clear();  // their queues are shut down after the server let go of them
        for (auto& steps : spare_) drain(steps.get());
        spare_.clear();
        queue_.reset();
    }

private:
    // One call: its arrival comes on the server's queue, its read and answer on a queue of its own
    // that only the worker serving it polls. That queue is one an answered call left (see
    // `finish`), or a new one: making and draining a queue for each call was work on every call.
    struct Call {
        grpc::GenericServerContext ctx;
        grpc::GenericServerAsyncReaderWriter stream{&ctx};
        std::unique_ptr<grpc::CompletionQueue> steps;

        explicit Call(std::unique_ptr<grpc::CompletionQueue> queue) : steps(std::move(queue)) {}
        ~Call() {
            if (steps) drain(steps.get());
        }
    };

    // Asks gRPC for the next call into a new Call (nothing once the server is stopping).
    void request() {
        std::lock_guard<std::mutex> hold(requests_);
        if (stopping_) return;
        std::unique_ptr<grpc::CompletionQueue> steps;
        if (spare_.empty()) {
            steps = std::make_unique<grpc::CompletionQueue>();
        } else {
            steps = std::move(spare_.back());
            spare_.pop_back();
        }
        Call* call = new Call(std::move(steps));
        service_.RequestCall(&call->ctx, &call->stream, call->steps.get(), queue_.get(), call);
    }

    // Ends an answered call and keeps its queue for a later one. Both of the call's operations were
    // taken off it; what gRPC may still put there for the call is its own bookkeeping, which a
    // later Next passes by without returning it.
    void finish(std::unique_ptr<Call> call) {
        std::unique_ptr<grpc::CompletionQueue> steps = std::move(call->steps);
        call.reset();
        std::lock_guard<std::mutex> hold(requests_);
        spare_.push_back(std::move(steps));
    }

    void serve() {
        {
            // The thread's Python thread state lives as long as the thread. Otherwise each call's
            // GIL made a new one and dropped it (an allocation, its 16 KiB frame stack mapped and
            // unmapped, and the interpreter's thread list locked twice, a call).
            py::gil_scoped_acquire kept;
            kept.inc_ref();
        }
        void* tag = nullptr;
        bool ok = false;
        while (queue_->Next(&tag, &ok)) {
            std::unique_ptr<Call> call(static_cast<Call*>(tag));
            if (!ok) {  // the server is shutting down: gRPC still lists this call's queue as its own
                std::lock_guard<std::mutex> hold(requests_);
                unanswered_.push_back(std::move(call));
                continue;
            }
            answer(call.get());
            finish(std::move(call));
            request();
        }
        py::gil_scoped_acquire last;
        last.dec_ref();  // the thread state goes when this scope ends
    }

    // The call from its request to its answer, on this thread.
    void answer(Call* c) {
        grpc::ByteBuffer request;
        c->stream.Read(&request, c);
        grpc::Status status(grpc::StatusCode::INTERNAL, "the call carried no request message");
        grpc::ByteBuffer response;
        if (await_one(c->steps.get()) && !answer_here(c->ctx.method(), request, &response, &status))
            status = call(c->ctx.method(), request, &response);
        if (status.ok()) {
            c->stream.WriteAndFinish(response, grpc::WriteOptions(), status, c);
        } else {
            c->stream.Finish(status, c);
        }
        await_one(c->steps.get());
    }

    // A peer service's resolve or release that its PeerSsdReads takes, answered without Python.
    bool answer_here(const std::string& method, const grpc::ByteBuffer& request, grpc::ByteBuffer* response,
                     grpc::Status* status) {
        if (!ssd_reads_) return false;
        bool done = false;
        if (method == "/umbp.UMBPPeer/BatchResolveKeys") {
            done = ssd_reads_->resolve(request, response);
        } else if (method == "/umbp.UMBPPeer/BatchReleaseKeys") {
            done = ssd_reads_->release(request, response);
        }
        if (done) *status = grpc::Status::OK;
        return done;
    }

    grpc::Status call(const std::string& method, const grpc::ByteBuffer& request, grpc::ByteBuffer* response) {
        py::gil_scoped_acquire locked;
        try {
            auto [code, details, body] = dispatch_(method, to_bytes(request)).cast<Answer>();
            if (code == 0) *response = to_buffer(body);
            return grpc::Status(static_cast<grpc::StatusCode>(code), details);
        } catch (py::error_already_set& e) {  // the dispatcher answers errors itself: this is a bug
            std::string what = e.what();
            e.discard_as_unraisable(__func__);
            return grpc::Status(grpc::StatusCode::UNKNOWN, "Exception calling application: " + what);
        }
    }

    py::object dispatch_;
    std::shared_ptr<umbp::PeerSsdReads> ssd_reads_;
    grpc::AsyncGenericService service_;
    std::unique_ptr<grpc::ServerCompletionQueue> queue_;
    std::unique_ptr<grpc::Server> server_;
    std::vector<std::thread> threads_;
    std::vector<std::unique_ptr<Call>> unanswered_;              // calls the shutdown returned, freed after it
    std::vector<std::unique_ptr<grpc::CompletionQueue>> spare_;  // queues of answered calls (at most `workers`)
    std::mutex requests_;
    bool stopping_ = false;
    int port_ = 0;
};

// A client channel; `call` makes one unary call and waits for its answer without the GIL.
class Channel {
public:
    // `bdp_probe`: the channel pings its server as answers come in, which lets gRPC grow what it
    // lets the server send ahead (HTTP/2's windows) past the first 64 KiB. Without it, an answer
    // of more than 64 KiB stalls for a round trip: its last bytes wait for this side's window
    // update (0.1 ms more than a lease's answer for a 64 KiB page inline, on loopback, 2 cores).
    // The pings cost the server a wake-up after each answer, so only peers' channels, whose
    // resolves may carry pages, ping; the master's answers are small.
    Channel(const std::string& address, int max_receive_message_bytes, bool bdp_probe) {
        grpc::ChannelArguments args;
        args.SetMaxReceiveMessageSize(max_receive_message_bytes);
        args.SetInt(GRPC_ARG_HTTP2_BDP_PROBE, bdp_probe ? 1 : 0);
        channel_ = grpc::CreateCustomChannel(address, grpc::InsecureChannelCredentials(), args);
        stub_ = std::make_unique<grpc::GenericStub>(channel_);
    }

    Answer call(const std::string& method, const py::bytes& request, double timeout_s) {
        grpc::ByteBuffer body = to_buffer(request);
        grpc::ByteBuffer response;
        grpc::Status status;
        {
            py::gil_scoped_release unlocked;
            grpc::ClientContext ctx;
            ctx.set_deadline(std::chrono::system_clock::now() +
                             std::chrono::microseconds(static_cast<int64_t>(timeout_s * 1e6)));
            grpc::CompletionQueue& cq = thread_queue();
            auto rpc = stub_->PrepareUnaryCall(&ctx, method, body, &cq);
            rpc->StartCall();
            rpc->Finish(&response, &status, this);
            await_one(&cq);
        }
        py::bytes out = status.ok() ? to_bytes(response) : py::bytes();
        return {static_cast<int>(status.error_code()), status.error_message(), out};
    }

private:
    // The calling thread's completion queue, kept for its next calls to any channel (each call's one
    // operation is taken off it before the call returns) and drained when the thread ends: a
    // queue made and drained for every call was work on every call.
    static grpc::CompletionQueue& thread_queue() {
        struct Queue {
            grpc::CompletionQueue cq;
            ~Queue() { drain(&cq); }
        };
        thread_local Queue queue;
        return queue.cq;
    }

    std::shared_ptr<grpc::Channel> channel_;
    std::unique_ptr<grpc::GenericStub> stub_;
};

// The packed key form (each key's UTF-8 followed by a NUL byte) in C loops: split and check on
// the master, pack on the client, about 0.03 ms less each for 1,024 keys than Python's str
// methods. Both answer None for anything but plain keys, and the caller's Python then finds
// the problem and says what it is.

// `packed` → its keys, or None: more than `max_keys` keys, no NUL at the end, an empty key, one
// over `max_key_bytes` bytes, or one that is not UTF-8.
py::object split_keys(const py::bytes& packed, size_t max_keys, size_t max_key_bytes) {
    char* data = nullptr;
    Py_ssize_t size = 0;
    if (PyBytes_AsStringAndSize(packed.ptr(), &data, &size) != 0) throw py::error_already_set();
    const char* end = data + size;
    if (size == 0 || end[-1] != '\0') return py::none();
    size_t count = 0;
    for (const char* at = data; at < end; ++count) {
        const char* nul = static_cast<const char*>(std::memchr(at, '\0', static_cast<size_t>(end - at)));
        const size_t length = static_cast<size_t>(nul - at);
        if (length == 0 || length > max_key_bytes || count == max_keys) return py::none();
        at = nul + 1;
    }
    bool ascii = true;  // then each key is made as str.split makes it: one copy, no decoding
    for (const char* at = data; at < end; ++at) ascii &= static_cast<unsigned char>(*at) < 0x80;
    PyObject* keys = PyList_New(static_cast<Py_ssize_t>(count));
    if (keys == nullptr) throw py::error_already_set();
    py::list out = py::reinterpret_steal<py::list>(keys);
    size_t i = 0;
    for (const char* at = data; at < end; ++i) {
        const size_t length = std::strlen(at);
        PyObject* key = nullptr;
        if (ascii) {
            key = PyUnicode_New(static_cast<Py_ssize_t>(length), 127);
            if (key != nullptr) std::memcpy(PyUnicode_1BYTE_DATA(key), at, length);
        } else {
            key = PyUnicode_DecodeUTF8(at, static_cast<Py_ssize_t>(length), nullptr);
        }
        if (key == nullptr) {
            PyErr_Clear();
            return py::none();
        }
        PyList_SET_ITEM(keys, static_cast<Py_ssize_t>(i), key);
        at += length + 1;
    }
    return std::move(out);
}

// `keys` (a list) packed, or None: an item that is not a str, is empty, holds NUL or a lone
// surrogate, or is over `max_key_bytes` bytes.
py::object pack_keys(const py::list& keys, size_t max_key_bytes) {
    std::string packed;
    for (const py::handle& item : keys) {
        if (!PyUnicode_Check(item.ptr())) return py::none();
        Py_ssize_t length = 0;
        const char* utf8 = PyUnicode_AsUTF8AndSize(item.ptr(), &length);
        if (utf8 == nullptr) {
            PyErr_Clear();
            return py::none();
        }
        const size_t n = static_cast<size_t>(length);
        if (n == 0 || n > max_key_bytes || std::memchr(utf8, '\0', n) != nullptr) return py::none();
        packed.append(utf8, n);
        packed.push_back('\0');
    }
    return py::bytes(packed);
}

}  // namespace

PYBIND11_MODULE(_grpc_native, m) {
    // gRPC C++ of this age reads a connection's close only while a call polls it, so a client idle
    // since its server restarted sends its next call into the dead connection (UNAVAILABLE, "Broken
    // pipe"). Its backup poller looks at idle channels every this many ms (default 5000): at 100 a
    // restarted master is noticed before it can answer (read once, at gRPC's first start).
    setenv("GRPC_CLIENT_CHANNEL_BACKUP_POLL_INTERVAL_MS", "100", /*overwrite=*/0);
    // Debian builds abseil with its lock-order graph on (a debugging aid that release builds leave
    // off): every mutex gRPC takes was recorded in it, a few per cent of a call's time.
    absl::SetMutexDeadlockDetectionMode(absl::OnDeadlockCycle::kIgnore);
    m.doc() = "gRPC C++ transport for the UMBP master and its client (serialized messages only).";
    py::class_<Server>(m, "Server")
        .def(py::init<const std::string&, py::object, int, int, int, std::shared_ptr<umbp::PeerSsdReads>>(),
             py::arg("address"), py::arg("dispatch"), py::arg("workers"), py::arg("max_message_bytes"),
             py::arg("max_streams"), py::arg("ssd_reads") = nullptr)
        .def_property_readonly("port", &Server::port)
        .def("stop", &Server::stop, py::arg("grace_s"));
    py::class_<Channel>(m, "Channel")
        .def(py::init<const std::string&, int, bool>(), py::arg("address"), py::arg("max_receive_message_bytes"),
             py::arg("bdp_probe"))
        .def("call", &Channel::call, py::arg("method"), py::arg("request"), py::arg("timeout_s"));
    py::class_<umbp::PeerSsdReads, std::shared_ptr<umbp::PeerSsdReads>>(m, "PeerSsdReads")
        .def(py::init<uintptr_t, uint64_t, uint64_t, uint64_t, bool>(), py::arg("buffer_address"),
             py::arg("reserve_offset"), py::arg("reserve_bytes"), py::arg("lease_ms"), py::arg("verify_checksum"))
        .def("add", &umbp::PeerSsdReads::add, py::arg("key"), py::arg("fd"), py::arg("offset"), py::arg("size"),
             py::arg("checksum"))
        .def("remove", &umbp::PeerSsdReads::remove, py::arg("key"))
        .def("clear", &umbp::PeerSsdReads::clear)
        .def("release", py::overload_cast<const std::string&, uint64_t>(&umbp::PeerSsdReads::release), py::arg("key"),
             py::arg("lease_id"))
        .def("take_hits", &umbp::PeerSsdReads::take_hits)
        .def_property_readonly("keys", &umbp::PeerSsdReads::keys)
        .def_property_readonly("leases", &umbp::PeerSsdReads::leases)
        .def_property_readonly("reserve_used", &umbp::PeerSsdReads::reserve_used)
        .def_property_readonly("inlined", &umbp::PeerSsdReads::inlined)
        .def_readonly_static("LEASE_BIT", &umbp::PeerSsdReads::kLeaseBit);
    m.def("split_keys", &split_keys, py::arg("packed"), py::arg("max_keys"), py::arg("max_key_bytes"));
    m.def("pack_keys", &pack_keys, py::arg("keys"), py::arg("max_key_bytes"));
}
