// Remote atomics on the UCX engine: the initiator's request and wait, the target's checks and
// the operation itself (see ucx/atomic.hpp).
#include "ucx/atomic.hpp"

#include <chrono>
#include <condition_variable>
#include <cstring>
#include <mutex>
#include <stdexcept>
#include <unordered_map>
#include <vector>

#include "base/trace.hpp"
#include "ucx/wire.hpp"

namespace mori::ucx {

namespace {

#pragma pack(push, 1)
struct AtomicRequest {
    uint32_t magic;
    uint8_t op;
    uint8_t width;  // bits: 32 or 64
    uint16_t reserved;
    uint64_t ticket;  // what the target issued to the initiator
    uint64_t id;      // the initiator's id of this request, echoed in the reply
    uint64_t memId, offset, value, compare;
};
struct AtomicReply {
    uint32_t magic;
    int32_t code;
    uint64_t ticket;  // the request's: replies are authenticated too
    uint64_t id;
    uint64_t old;
    uint32_t reason;
    uint32_t reserved;
};
#pragma pack(pop)
static_assert(sizeof(AtomicRequest) == 56 && sizeof(AtomicReply) == 40, "wire layout");

// A signal put: the data's place (its bytes are the message's data), then the signal's atomic.
struct SignalPutRequest {
    AtomicRequest signal;  // the atomic applied after the data is written (op store or fetch_add)
    uint64_t dataMemId, dataOffset, dataSize;
};
static_assert(sizeof(SignalPutRequest) == 80, "wire layout");

// One request in flight, shared by its waiter and the reply handler.
struct Pending {
    SignalPutRequest request{};  // sent from here (an atomic sends its first part): alive until the send completes
    std::vector<uint8_t> data;   // a signal put's bytes, likewise
    std::mutex mu;
    std::condition_variable cv;
    std::atomic<bool> done{false};
    int code = kInProgress;
    uint32_t reason = 0;
    uint64_t old = 0;
};

std::mutex gPendingMu;
std::unordered_map<uint64_t, std::shared_ptr<Pending>> gPending;
std::atomic<uint64_t> gNextId{1};

// Applies op to a word of host memory; returns its old value, its new one in `now`. One
// compare-and-swap loop over value_after, so that what is applied and what is logged cannot differ.
template <class T>
T apply(T* word, uint8_t op, int width, uint64_t value, uint64_t compare, uint64_t& now) {
    T old = __atomic_load_n(word, __ATOMIC_SEQ_CST);
    do {
        now = value_after(op, width, old, value, compare);
    } while (!__atomic_compare_exchange_n(word, &old, static_cast<T>(now), true, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST));
    return old;
}

void on_reply_sent(void* request, api::Status, void* user) {
    fn().request_free(request);
    delete static_cast<AtomicReply*>(user);
}

struct SendHold {
    std::shared_ptr<Pending> pending;
};

void on_request_sent(void* request, api::Status, void* user) {
    // A failed send fails the endpoint, and so the peer: the waiter sees it there.
    fn().request_free(request);
    delete static_cast<SendHold*>(user);
}

}  // namespace

namespace {

// Checks a request's atomic (magic, op, width) without touching memory; false when malformed.
bool well_formed(const AtomicRequest& h) {
    return h.magic == kMagic && h.op >= kAtomicFetchAdd && h.op <= kAtomicLast && (h.width == 32 || h.width == 64) &&
           h.reserved == 0;
}

bool serves_gpu(const GpuWords* gpu) { return gpu != nullptr && gpu->serves_words(); }

// The word of h checked: the request check (Engine::acquire), then an atomic's own: the word
// aligned, GPU memory only where the engine serves it (gpu). Its region, pinned when there is one
// (the caller unpins it), and why it may not be touched (kReasonNone when it may).
std::shared_ptr<Region> acquire_word(Engine& eng, const AtomicRequest& h, const GpuWords* gpu, uint32_t& reason) {
    const uint64_t bytes = h.width / 8;
    std::shared_ptr<Region> r = eng.acquire(RequestEntry{h.memId, h.offset, bytes}, reason);
    if (r && (r->addr + h.offset) % bytes != 0)
        reason = kReasonAlign;
    else if (r && r->gpu() && !serves_gpu(gpu))
        reason = kReasonGpu;
    return r;
}

// Applies h to its word (checked by word_reason): on GPU memory through the engine's GPU
// operations, after copying a signal put's bytes (data, bytes) to device address dst when given.
// The word's new value goes into the engine's store log. A driver failure sets reason to
// kReasonFailed.
uint64_t apply_word(Engine& eng, const std::shared_ptr<Region>& r, const AtomicRequest& h, GpuWords* gpu,
                    uint32_t& reason, uint64_t dst = 0, const void* data = nullptr, size_t bytes = 0) {
    const uint64_t addr = r->addr + h.offset;
    uint64_t old, now;
    if (r->gpu()) {
        try {
            old = gpu->apply(addr, h.op, h.width, h.value, h.compare, dst, data, bytes);
        } catch (const std::exception&) {
            reason = kReasonFailed;
            return 0;
        }
        now = value_after(h.op, h.width, old, h.value, h.compare);
    } else {
        old = h.width == 64 ? apply(reinterpret_cast<uint64_t*>(addr), h.op, h.width, h.value, h.compare, now)
                            : apply(reinterpret_cast<uint32_t*>(addr), h.op, h.width, h.value, h.compare, now);
    }
    eng.stores().record(addr, h.width, now);
    return old;
}

// Applies a signal put's signal h to its word (checked by word_reason), after copying the put's
// bytes (data, bytes) to device address dst when given: a store on GPU memory through
// GpuWords::signal, waited for unless !wait, when the copy and the store may run on: the result
// then tells their end (empty: nothing runs, and the store is in the engine's store log). A
// driver failure sets reason to kReasonFailed. (The answer's old value is 0: no initiator reads
// a signal put's.)
Staged signal_word(Engine& eng, const std::shared_ptr<Region>& r, const AtomicRequest& h, GpuWords* gpu,
                   uint32_t& reason, bool wait = true, uint64_t dst = 0, const void* data = nullptr, size_t bytes = 0) {
    if (!r->gpu() || h.op != kAtomicStore) {  // host memory, or an add (the atomics' kernel): waited for
        apply_word(eng, r, h, gpu, reason, dst, data, bytes);
        return Staged();
    }
    try {
        Staged running = gpu->signal(r->addr + h.offset, h.value, dst, data, bytes, wait);
        if (running.empty()) eng.stores().record(r->addr + h.offset, 64, h.value);
        return running;
    } catch (const std::exception&) {
        reason = kReasonFailed;
        return Staged();
    }
}

void unpin(const std::shared_ptr<Region>& r) {
    if (r) r->unpin();
}

// A signal put into GPU memory whose copy and store run on after its handler returned: the
// worker takes the next messages meanwhile (the answer does not hold it for the GPU), and the
// regions stay pinned, so that a deregistration waits for the store, until it ended.
struct RunningSignal {
    Staged staged;
    std::shared_ptr<Region> data, word;
    void release() {
        unpin(data);
        unpin(word);
        data.reset();
        word.reset();
    }
    ~RunningSignal() { release(); }  // also where the worker drops it unanswered (closed)
};

// Answers on the request's endpoint pair; a refusal is counted.
void answer(Engine& eng, api::Endpoint* ep, const AtomicRequest& h, uint32_t reason, uint64_t old) {
    auto reply = std::make_unique<AtomicReply>(AtomicReply{kMagic, kSuccess, h.ticket, h.id, old, reason, 0});
    if (reason != kReasonNone) {
        eng.count(&EngineStats::refused);
        reply->code = reason_code(reason);
    }
    api::RequestParam p{};
    p.opAttrMask = api::kOpCallback | api::kOpUserData | api::kOpFlags;
    p.flags = api::kAmSendEager;
    p.cb = reinterpret_cast<void*>(&on_reply_sent);
    p.userData = reply.get();
    api::StatusPtr s = fn().am_send_nbx(ep, kAmAtomicReply, reply.get(), sizeof(AtomicReply), nullptr, 0, &p);
    if (s != nullptr && !api::is_error_ptr(s)) reply.release();  // on_reply_sent frees it
}

// The shape and ticket checks every request passes first; false (counted) when it is dropped.
bool admitted(Engine& eng, const AtomicRequest& h, const api::AmRecvParam* param) {
    if (!well_formed(h) || (param->recvAttr & api::kAmRecvReplyEp) == 0 || param->replyEp == nullptr) {
        eng.count(&EngineStats::malformed);
        return false;
    }
    return !eng.tickets().admit(h.ticket).empty();  // no valid ticket: counted
}

}  // namespace

api::Status on_atomic_request(void* arg, const void* header, size_t headerLength, void*, size_t length,
                              const api::AmRecvParam* param) {
    Engine& eng = static_cast<Worker*>(arg)->engine();
    AtomicRequest h;
    if (headerLength != sizeof(h) || length != 0) {
        eng.count(&EngineStats::malformed);
        return api::kOk;
    }
    std::memcpy(&h, header, sizeof(h));
    if (!admitted(eng, h, param)) return api::kOk;
    // Checked while pinned: a deregistration waits for the operation.
    const std::shared_ptr<GpuWords> gpu = eng.gpu_words();
    uint32_t reason = kReasonNone;
    std::shared_ptr<Region> r = acquire_word(eng, h, gpu.get(), reason);
    const uint64_t old = reason == kReasonNone ? apply_word(eng, r, h, gpu.get(), reason) : 0;
    unpin(r);
    answer(eng, param->replyEp, h, reason, old);
    return api::kOk;
}

api::Status on_signal_put_request(void* arg, const void* header, size_t headerLength, void* data, size_t length,
                                  const api::AmRecvParam* param) {
    trace::mark('R', length);
    Engine& eng = static_cast<Worker*>(arg)->engine();
    SignalPutRequest h;
    // The data travels eagerly (the initiator asks so and bounds it): here it is, whole.
    if (headerLength != sizeof(h) || (param->recvAttr & api::kAmRecvRndv) != 0) {
        eng.count(&EngineStats::malformed);
        return api::kOk;
    }
    std::memcpy(&h, header, sizeof(h));
    if (!admitted(eng, h.signal, param)) return api::kOk;
    if (h.signal.op != kAtomicStore && h.signal.op != kAtomicFetchAdd) {
        eng.count(&EngineStats::malformed);
        return api::kOk;
    }
    // Both places are checked, and pinned, before either is touched: a refusal writes nothing.
    const std::shared_ptr<GpuWords> gpu = eng.gpu_words();
    uint32_t reason = kReasonNone;
    std::shared_ptr<Region> dr = eng.acquire(RequestEntry{h.dataMemId, h.dataOffset, h.dataSize}, reason);
    if (reason == kReasonNone && dr->gpu() && !serves_gpu(gpu.get()))
        reason = kReasonGpu;
    else if (reason == kReasonNone && length != h.dataSize)
        reason = kReasonShape;
    std::shared_ptr<Region> sr;
    if (reason == kReasonNone) sr = acquire_word(eng, h.signal, gpu.get(), reason);
    if (reason == kReasonNone) {
        const uint64_t dst = dr->addr + h.dataOffset;
        if (!dr->gpu()) {
            if (length != 0) std::memcpy(reinterpret_cast<void*>(dst), data, length);
            // sequentially consistent (host) or after the copy's end (GPU): after the data for any observer
            signal_word(eng, sr, h.signal, gpu.get(), reason);
        } else if (sr->gpu()) {
            // The copy, then the signal, answered once both ended (a later progress of this worker).
            auto run = std::make_shared<RunningSignal>();
            run->staged = signal_word(eng, sr, h.signal, gpu.get(), reason, false, dst, data, length);
            if (!run->staged.empty()) {
                const uint64_t word = sr->addr + h.signal.offset;
                run->data = std::move(dr);
                run->word = std::move(sr);
                Engine* e = &eng;
                api::Endpoint* ep = param->replyEp;
                const AtomicRequest sig = h.signal;
                static_cast<Worker*>(arg)->after_copy_locked(
                    run->staged, [run, e, ep, sig, word](const std::string& error) {
                        run->release();
                        trace::mark('D');
                        const uint32_t why = error.empty() ? kReasonNone : kReasonFailed;
                        if (why == kReasonNone) e->stores().record(word, 64, sig.value);
                        answer(*e, ep, sig, why, 0);
                        trace::mark('A', why);
                    });
                return api::kOk;
            }
        } else {
            try {
                gpu->apply(0, 0, 0, 0, 0, dst, data, length);
                signal_word(eng, sr, h.signal, gpu.get(), reason);
            } catch (const std::exception&) {
                reason = kReasonFailed;
            }
        }
    }
    unpin(dr);
    unpin(sr);
    answer(eng, param->replyEp, h.signal, reason, 0);
    trace::mark('A', reason);
    return api::kOk;
}

api::Status on_atomic_reply(void* arg, const void* header, size_t headerLength, void*, size_t length,
                            const api::AmRecvParam*) {
    trace::mark('Y');
    Engine& eng = static_cast<Worker*>(arg)->engine();
    AtomicReply h;
    if (headerLength != sizeof(h) || length != 0) {
        eng.count(&EngineStats::malformed);
        return api::kOk;
    }
    std::memcpy(&h, header, sizeof(h));
    std::shared_ptr<Pending> pending;
    {
        std::lock_guard lk(gPendingMu);
        auto found = gPending.find(h.id);
        if (h.magic == kMagic && found != gPending.end()) pending = found->second;
    }
    if (!pending || pending->done.load()) {
        eng.count(&EngineStats::lateReplies);
        return api::kOk;
    }
    if (h.ticket != pending->request.signal.ticket) {  // not from the engine we asked
        eng.tickets().count_bad();
        return api::kOk;
    }
    {
        std::lock_guard lk(pending->mu);
        pending->code = is_final_code(h.code) ? h.code : kErrBadState;
        pending->reason = h.reason;
        pending->old = h.old;
        pending->done.store(true);
    }
    pending->cv.notify_all();
    return api::kOk;
}

namespace {

// Sends pending's request (an atomic; with signalPut, a signal put and its data) to the peer;
// returns the request's id. Throws std::runtime_error when the peer cannot be reached.
uint64_t send_request(Engine& engine, Peer& peer, const std::shared_ptr<Pending>& pending, bool signalPut,
                      double timeout) {
    if (!(timeout > 0)) throw std::invalid_argument("timeout must be > 0 seconds");
    if (engine.worker_count() == 0) throw std::runtime_error("the engine is closed");
    const uint64_t id = gNextId.fetch_add(1);
    Worker& w = engine.worker(0);
    auto lk = w.claim();
    // A peer that failed or closed may have had its link freed: ask the peer, under the lock
    // that its link's failure and reaping take.
    if (!w.alive() || !peer.healthy()) {
        const std::string why = peer.failure();
        throw std::runtime_error("engine '" + peer.key() + "' cannot be reached: " +
                                 (why.empty() ? std::string("the engine or the peer was closed") : why));
    }
    Link* link = peer.link(0);
    if (link->worker != &w) throw std::invalid_argument("the peer '" + peer.key() + "' belongs to another engine");
    if (link->eps.empty()) throw std::runtime_error("engine '" + peer.key() + "' has no endpoint");
    pending->request.signal.ticket = link->peer->ticket;
    pending->request.signal.id = id;
    {
        std::lock_guard pk(gPendingMu);
        gPending[id] = pending;
    }
    auto hold = std::make_unique<SendHold>(SendHold{pending});
    api::RequestParam p{};
    p.opAttrMask = api::kOpCallback | api::kOpUserData | api::kOpFlags;
    p.flags = api::kAmSendReply | api::kAmSendEager;
    p.cb = reinterpret_cast<void*>(&on_request_sent);
    p.userData = hold.get();
    api::StatusPtr s = signalPut
                           ? fn().am_send_nbx(link->eps[0], kAmSignalPut, &pending->request, sizeof(SignalPutRequest),
                                              pending->data.data(), pending->data.size(), &p)
                           : fn().am_send_nbx(link->eps[0], kAmAtomic, &pending->request.signal, sizeof(AtomicRequest),
                                              nullptr, 0, &p);
    if (api::is_error_ptr(s)) {
        w.link_failed_locked(*link,
                             "sending to engine '" + peer.key() + "' failed: " + status_text(api::ptr_status(s)));
    } else if (s != nullptr) {
        hold.release();  // on_request_sent frees it
    }
    return id;
}

void forget(uint64_t id) {
    std::lock_guard pk(gPendingMu);
    gPending.erase(id);
}

std::string no_answer(Engine& engine, Peer& peer, const char* what, double timeout) {
    return "engine '" + peer.key() + "' did not answer " + what + " within " + seconds_text(timeout) + " s (" +
           engine.options().timeoutSetting + ")";
}

// Sends pending's request and waits for the answer; throws std::runtime_error when the peer
// failed or did not answer in time.
void exchange(Engine& engine, Peer& peer, const std::shared_ptr<Pending>& pending, bool signalPut, double timeout,
              const char* what) {
    const uint64_t id = send_request(engine, peer, pending, signalPut, timeout);
    Worker& w = engine.worker(0);
    const int64_t deadline = now_ns() + static_cast<int64_t>(timeout * 1e9);
    // A small round trip is answered while the caller progresses the worker itself.
    w.lead([&] { return pending->done.load() || !peer.healthy(); }, 100'000);
    while (!pending->done.load()) {
        if (!peer.healthy()) {
            forget(id);
            throw std::runtime_error("engine '" + peer.key() + "' failed: " + peer.failure());
        }
        if (now_ns() >= deadline) {
            forget(id);
            throw std::runtime_error(no_answer(engine, peer, what, timeout));
        }
        w.wake();
        std::unique_lock lk(pending->mu);
        pending->cv.wait_for(lk, std::chrono::milliseconds(2), [&] { return pending->done.load(); });
    }
    forget(id);
}

// An operation's place, in messages.
std::string atomic_place(uint64_t memId, uint64_t offset) {
    return "atomic on memory id " + std::to_string(memId) + ", offset " + std::to_string(offset);
}
std::string signal_put_place(const SignalPut& put) {
    return "signal put of " + std::to_string(put.size) + " bytes at memory id " + std::to_string(put.memId) +
           ", offset " + std::to_string(put.offset) + " (signal at offset " + std::to_string(put.sigOffset) + ")";
}
std::string refusal(const std::string& what, const std::string& key, uint32_t reason) {
    return what + " at engine '" + key + "': " + reason_text(reason);
}

std::shared_ptr<Pending> atomic_request(AtomicOp op, uint64_t memId, uint64_t offset, uint64_t value, uint64_t compare,
                                        int width) {
    if (width != 32 && width != 64) throw std::invalid_argument("width must be 32 or 64, got " + std::to_string(width));
    if (op < kAtomicFetchAdd || op > kAtomicLast)
        throw std::invalid_argument("unknown atomic operation " + std::to_string(op));
    if (width == 32 && (value >> 32 != 0 || compare >> 32 != 0))
        throw std::invalid_argument("value and compare must fit in 32 bits");
    auto pending = std::make_shared<Pending>();
    pending->request.signal = AtomicRequest{
        kMagic, static_cast<uint8_t>(op), static_cast<uint8_t>(width), 0, 0, 0, memId, offset, value, compare};
    return pending;
}

// A signal put's request, its bytes copied in; throws std::invalid_argument for a bad op or size.
std::shared_ptr<Pending> signal_put_request(const SignalPut& put) {
    if (put.op != kAtomicStore && put.op != kAtomicFetchAdd)
        throw std::invalid_argument("a signal put's signal is set (store) or added to (fetch_add)");
    if (put.size > kMaxSignalPutBytes)
        throw std::invalid_argument("a signal put carries at most " + std::to_string(kMaxSignalPutBytes) +
                                    " bytes, got " + std::to_string(put.size));
    auto pending = std::make_shared<Pending>();
    const auto* bytes = static_cast<const uint8_t*>(put.src);
    pending->data.assign(bytes, bytes + put.size);
    pending->request = SignalPutRequest{
        AtomicRequest{kMagic, static_cast<uint8_t>(put.op), 64, 0, 0, 0, put.sigMemId, put.sigOffset, put.value, 0},
        put.memId, put.offset, put.size};
    return pending;
}

}  // namespace

// ---- AtomicInFlight ----------------------------------------------------------------------------

struct AtomicInFlight::State {
    std::shared_ptr<Pending> pending;
    uint64_t id = 0;
};

AtomicInFlight::AtomicInFlight(Engine& engine, std::shared_ptr<Peer> peer, AtomicOp op, uint64_t memId, uint64_t offset,
                               uint64_t value, uint64_t compare, int width, double timeout)
    : engine_(engine),
      peer_(std::move(peer)),
      what_(atomic_place(memId, offset)),
      timeout_(timeout),
      deadlineNs_(now_ns() + static_cast<int64_t>(timeout * 1e9)),
      state_(std::make_shared<State>()) {
    state_->pending = atomic_request(op, memId, offset, value, compare, width);
    state_->id = send_request(engine, *peer_, state_->pending, false, timeout);
    // Its answer wakes the progress thread (an event on the worker), which records it.
    engine.worker(0).wake();
}

AtomicInFlight::AtomicInFlight(Engine& engine, std::shared_ptr<Peer> peer, const SignalPut& put, double timeout)
    : engine_(engine),
      peer_(std::move(peer)),
      what_(signal_put_place(put)),
      timeout_(timeout),
      deadlineNs_(now_ns() + static_cast<int64_t>(timeout * 1e9)),
      state_(std::make_shared<State>()) {
    state_->pending = signal_put_request(put);
    state_->id = send_request(engine, *peer_, state_->pending, true, timeout);
    engine.worker(0).wake();
}

AtomicInFlight::~AtomicInFlight() {
    if (!finished_) forget(state_->id);
}

bool AtomicInFlight::poll() {
    if (finished_) return true;
    const Pending& p = *state_->pending;
    if (p.done.load()) {
        if (p.code != kSuccess) error_ = refusal(what_, peer_->key(), p.reason);
        old_ = p.old;
    } else if (!peer_->healthy()) {
        error_ = "engine '" + peer_->key() + "' failed: " + peer_->failure();
    } else if (now_ns() >= deadlineNs_) {
        error_ = no_answer(engine_, *peer_, ("the " + what_).c_str(), timeout_);
    } else {
        return false;
    }
    forget(state_->id);
    finished_ = true;
    return true;
}

uint64_t remote_atomic(Engine& engine, Peer& peer, AtomicOp op, uint64_t memId, uint64_t offset, uint64_t value,
                       uint64_t compare, int width, double timeout) {
    auto pending = atomic_request(op, memId, offset, value, compare, width);
    exchange(engine, peer, pending, false, timeout, "an atomic operation");
    if (pending->code != kSuccess)
        throw std::invalid_argument(refusal(atomic_place(memId, offset), peer.key(), pending->reason));
    return pending->old;
}

void remote_signal_put(Engine& engine, Peer& peer, const SignalPut& put, double timeout) {
    trace::mark('H', put.size);
    auto pending = signal_put_request(put);
    exchange(engine, peer, pending, true, timeout, "a signal put");
    trace::mark('h');
    if (pending->code != kSuccess)
        throw std::invalid_argument(refusal(signal_put_place(put), peer.key(), pending->reason));
}

}  // namespace mori::ucx
