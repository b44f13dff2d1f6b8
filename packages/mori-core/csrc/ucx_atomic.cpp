// Remote atomics on the UCX engine: the initiator's request and wait, the target's checks and
// the operation itself (see ucx_atomic.hpp).
#include "ucx_atomic.hpp"

#include <chrono>
#include <condition_variable>
#include <cstring>
#include <mutex>
#include <stdexcept>
#include <unordered_map>

#include "ucx_wire.hpp"

namespace mori::ucx {

namespace {

// Why a target refused beyond the engine's own reasons (ucx_wire.hpp).
constexpr uint32_t kReasonAlign = 100;

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

// One request in flight, shared by its waiter and the reply handler.
struct Pending {
    AtomicRequest request{};  // sent from here: alive until the send completes
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

std::string refusal(uint32_t reason) {
    return reason == kReasonAlign ? "the word is not aligned to its width (ERR_INVALID_ARGS)" : reason_text(reason);
}

template <class T>
T apply(T* word, uint8_t op, T value, T compare) {
    switch (op) {
        case kAtomicFetchAdd: return __atomic_fetch_add(word, value, __ATOMIC_SEQ_CST);
        case kAtomicCompareSwap:
            __atomic_compare_exchange_n(word, &compare, value, false, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST);
            return compare;  // the old value, whether or not it was replaced
        default: return __atomic_exchange_n(word, value, __ATOMIC_SEQ_CST);  // swap, store
    }
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

std::string seconds(double s) {
    char buf[32];
    std::snprintf(buf, sizeof(buf), "%g", s);
    return buf;
}

}  // namespace

api::Status on_atomic_request(void* arg, const void* header, size_t headerLength, void*, size_t length,
                              const api::AmRecvParam* param) {
    Worker& w = *static_cast<Worker*>(arg);
    Engine& eng = w.engine();
    AtomicRequest h;
    if (headerLength != sizeof(h) || length != 0 || (param->recvAttr & api::kAmRecvReplyEp) == 0 ||
        param->replyEp == nullptr) {
        eng.count(&EngineStats::malformed);
        return api::kOk;
    }
    std::memcpy(&h, header, sizeof(h));
    if (h.magic != kMagic || h.op < kAtomicFetchAdd || h.op > kAtomicStore || (h.width != 32 && h.width != 64) ||
        h.reserved != 0) {
        eng.count(&EngineStats::malformed);
        return api::kOk;
    }
    if (eng.admitted(h.ticket).empty()) {
        eng.count(&EngineStats::badTickets);
        return api::kOk;
    }
    auto reply = std::make_unique<AtomicReply>(AtomicReply{kMagic, kSuccess, h.ticket, h.id, 0, kReasonNone, 0});
    const uint64_t bytes = h.width / 8;
    if (std::shared_ptr<Region> r = eng.pin_region(h.memId)) {
        // Checked while pinned: a deregistration waits for the operation.
        const uint64_t addr = r->addr + h.offset;
        reply->reason = !r->contains(h.offset, bytes)    ? kReasonRange
                        : addr % bytes != 0              ? kReasonAlign
                        : r->memType != api::kMemoryHost ? kReasonGpu
                                                         : kReasonNone;
        if (reply->reason == kReasonNone) {
            reply->old = h.width == 64 ? apply(reinterpret_cast<uint64_t*>(addr), h.op, h.value, h.compare)
                                       : apply(reinterpret_cast<uint32_t*>(addr), h.op, static_cast<uint32_t>(h.value),
                                               static_cast<uint32_t>(h.compare));
        }
        --r->pins;
    } else {
        reply->reason = kReasonMemory;
    }
    if (reply->reason != kReasonNone) {
        eng.count(&EngineStats::refused);
        reply->code = reply->reason == kReasonMemory ? kErrNotFound : kErrInvalidArgs;
    }
    api::RequestParam p{};
    p.opAttrMask = api::kOpCallback | api::kOpUserData | api::kOpFlags;
    p.flags = api::kAmSendEager;
    p.cb = reinterpret_cast<void*>(&on_reply_sent);
    p.userData = reply.get();
    api::StatusPtr s = fn().am_send_nbx(param->replyEp, kAmAtomicReply, reply.get(), sizeof(AtomicReply), nullptr, 0, &p);
    if (s != nullptr && !api::is_error_ptr(s)) reply.release();  // on_reply_sent frees it
    return api::kOk;
}

api::Status on_atomic_reply(void* arg, const void* header, size_t headerLength, void*, size_t length,
                            const api::AmRecvParam*) {
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
    if (h.ticket != pending->request.ticket) {  // not from the engine we asked
        eng.count(&EngineStats::badTickets);
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

uint64_t remote_atomic(Engine& engine, Peer& peer, AtomicOp op, uint64_t memId, uint64_t offset, uint64_t value,
                       uint64_t compare, int width, double timeout) {
    if (width != 32 && width != 64) throw std::invalid_argument("width must be 32 or 64, got " + std::to_string(width));
    if (op < kAtomicFetchAdd || op > kAtomicStore)
        throw std::invalid_argument("unknown atomic operation " + std::to_string(op));
    if (!(timeout > 0)) throw std::invalid_argument("timeout must be > 0 seconds");
    if (engine.worker_count() == 0) throw std::runtime_error("the engine is closed");
    if (width == 32 && (value >> 32 != 0 || compare >> 32 != 0))
        throw std::invalid_argument("value and compare must fit in 32 bits");
    auto pending = std::make_shared<Pending>();
    const uint64_t id = gNextId.fetch_add(1);
    Worker& w = engine.worker(0);
    {
        std::lock_guard lk(w.mutex());
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
        pending->request = AtomicRequest{kMagic, static_cast<uint8_t>(op), static_cast<uint8_t>(width), 0,
                                         link->peer->ticket, id, memId, offset, value, compare};
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
        api::StatusPtr s =
            fn().am_send_nbx(link->eps[0], kAmAtomic, &pending->request, sizeof(AtomicRequest), nullptr, 0, &p);
        if (api::is_error_ptr(s)) {
            w.link_failed_locked(*link, "sending to engine '" + peer.key() + "' failed: " +
                                            status_text(api::ptr_status(s)));
        } else if (s != nullptr) {
            hold.release();  // on_request_sent frees it
        }
    }
    auto forget = [&] {
        std::lock_guard pk(gPendingMu);
        gPending.erase(id);
    };
    const int64_t deadline = now_ns() + static_cast<int64_t>(timeout * 1e9);
    // A small round trip is answered while the caller progresses the worker itself.
    w.lead([&] { return pending->done.load() || !peer.healthy(); }, 100'000);
    while (!pending->done.load()) {
        if (!peer.healthy()) {
            forget();
            throw std::runtime_error("engine '" + peer.key() + "' failed: " + peer.failure());
        }
        if (now_ns() >= deadline) {
            forget();
            throw std::runtime_error("engine '" + peer.key() + "' did not answer an atomic operation within " +
                                     seconds(timeout) + " s (" + engine.options().timeoutSetting + ")");
        }
        w.wake();
        std::unique_lock lk(pending->mu);
        pending->cv.wait_for(lk, std::chrono::milliseconds(2), [&] { return pending->done.load(); });
    }
    forget();
    if (pending->code != kSuccess)
        throw std::invalid_argument("atomic on memory id " + std::to_string(memId) + ", offset " +
                                    std::to_string(offset) + " at engine '" + peer.key() +
                                    "': " + refusal(pending->reason));
    return pending->old;
}

}  // namespace mori::ucx
