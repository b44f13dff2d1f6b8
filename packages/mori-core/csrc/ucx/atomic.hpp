// Remote atomics on the UCX engine (what OpenSHMEM-style callers need beyond bulk puts and gets):
// fetch-add, compare-swap, swap, store, fetch-and, fetch-or and fetch-xor on a 32- or 64-bit word
// of a peer engine's registered memory, each returning the word's old value; and signal puts (a
// small put, then an atomic on a signal word, in one message).
//
// They travel on the engine's checked path: an active message (kAmAtomic) names (remote memory
// id, offset, width) and carries the ticket the target issued; the target checks it against its
// live registrations (the region pinned meanwhile, the word inside it and aligned) before it
// touches a byte, applies the operation with a sequentially consistent atomic (host memory) or a
// system-scope atomic on the device (GPU memory, where the engine serves it: ucx/gpu.hpp; else
// refused), and answers on the same endpoint pair (kAmAtomicReply) with the old value, or why it
// refused. Transports whose NICs do atomics in hardware could use UCX's own AMOs instead; this
// path is the one that is safe on every transport (tcp, sm, cma).
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

#include "base/ops.hpp"
#include "ucx/engine.hpp"

namespace mori::ucx {

constexpr unsigned kAmAtomic = 0x4d38, kAmAtomicReply = 0x4d39, kAmSignalPut = 0x4d3a;
// Most bytes a signal put carries: they travel in the request itself (eagerly); larger puts go
// as an engine transfer followed by the signal's atomic.
constexpr size_t kMaxSignalPutBytes = 16 << 10;

// The operations (AtomicOp) are base/ops.hpp's, the device proxy's codes too.

// Applies op to the width-bit (32 or 64) word at offset of the peer's memory memId and returns
// its old value. Blocks the caller (GIL released by the bindings) until the target answered,
// the peer failed, or timeout seconds passed; throws std::invalid_argument when the target
// refused (the message names the reason) and std::runtime_error on failure or timeout.
uint64_t remote_atomic(Engine& engine, Peer& peer, AtomicOp op, uint64_t memId, uint64_t offset, uint64_t value,
                       uint64_t compare, int width, double timeout);

// A signal put's places and bytes (remote_signal_put's arguments): size bytes from host memory
// src at offset of memory memId, then op with value on the 64-bit word at sigOffset of sigMemId.
struct SignalPut {
    uint64_t memId = 0, offset = 0;
    const void* src = nullptr;
    size_t size = 0;
    uint64_t sigMemId = 0, sigOffset = 0;
    AtomicOp op = kAtomicStore;
    uint64_t value = 0;
};

// A remote atomic, or a signal put, sent and not waited for (what the device proxy keeps in
// flight beside its puts): the constructor sends the request (throwing as remote_atomic and
// remote_signal_put do when the peer cannot be reached or the arguments are wrong; a signal put's
// bytes are copied into the request); poll() is true once the answer came, the peer failed or
// timeout seconds passed, and then error() says why it failed ("" when it did not) and old() is
// the word's old value. Only the answer's arrival needs the worker's progress thread.
class AtomicInFlight {
public:
    AtomicInFlight(Engine& engine, std::shared_ptr<Peer> peer, AtomicOp op, uint64_t memId, uint64_t offset,
                   uint64_t value, uint64_t compare, int width, double timeout);
    AtomicInFlight(Engine& engine, std::shared_ptr<Peer> peer, const SignalPut& put, double timeout);
    ~AtomicInFlight();
    AtomicInFlight(const AtomicInFlight&) = delete;
    AtomicInFlight& operator=(const AtomicInFlight&) = delete;
    bool poll();
    const std::string& error() const { return error_; }
    uint64_t old() const { return old_; }

private:
    struct State;
    Engine& engine_;
    std::shared_ptr<Peer> peer_;
    std::string what_;  // the operation, in messages ("an atomic on memory id 3, offset 64")
    double timeout_;
    int64_t deadlineNs_;
    std::shared_ptr<State> state_;
    bool finished_ = false;
    std::string error_;
    uint64_t old_ = 0;
};

// Writes size bytes from src (host memory, kept by the call) at offset of the peer's memory memId,
// then applies op (store or fetch_add) with value to the 64-bit signal word at sigOffset of its
// memory sigMemId: one message, so a PE that sees the signal sees the data. The target checks both
// places before it touches either. Errors as remote_atomic's; size at most kMaxSignalPutBytes.
void remote_signal_put(Engine& engine, Peer& peer, const SignalPut& put, double timeout);

// The active-message handlers (registered on every worker; worker lock held).
api::Status on_atomic_request(void* worker, const void* header, size_t headerLength, void* data, size_t length,
                              const api::AmRecvParam* param);
api::Status on_signal_put_request(void* worker, const void* header, size_t headerLength, void* data, size_t length,
                                  const api::AmRecvParam* param);
api::Status on_atomic_reply(void* worker, const void* header, size_t headerLength, void* data, size_t length,
                            const api::AmRecvParam* param);

}  // namespace mori::ucx
