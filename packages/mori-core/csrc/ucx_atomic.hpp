// Remote atomics on the UCX engine (what OpenSHMEM-style callers need beyond bulk puts and gets):
// fetch-add, compare-swap, swap and store on a 32- or 64-bit word of a peer engine's registered
// host memory, each returning the word's old value.
//
// They travel on the engine's checked path: an active message (kAmAtomic) names (remote memory
// id, offset, width) and carries the ticket the target issued; the target checks it against its
// live registrations (the region pinned meanwhile, the word inside it and aligned, host memory)
// before it touches a byte, applies the operation with a sequentially consistent atomic, and
// answers on the same endpoint pair (kAmAtomicReply) with the old value, or why it refused.
// Transports whose NICs do atomics in hardware could use UCX's own AMOs instead; this path is
// the one that is safe on every transport (tcp, sm, cma).
#pragma once

#include <cstdint>

#include "ucx_engine.hpp"

namespace mori::ucx {

constexpr unsigned kAmAtomic = 0x4d38, kAmAtomicReply = 0x4d39;

enum AtomicOp : uint8_t { kAtomicFetchAdd = 1, kAtomicCompareSwap = 2, kAtomicSwap = 3, kAtomicStore = 4 };

// Applies op to the width-bit (32 or 64) word at offset of the peer's memory memId and returns
// its old value. Blocks the caller (GIL released by the bindings) until the target answered,
// the peer failed, or timeout seconds passed; throws std::invalid_argument when the target
// refused (the message names the reason) and std::runtime_error on failure or timeout.
uint64_t remote_atomic(Engine& engine, Peer& peer, AtomicOp op, uint64_t memId, uint64_t offset, uint64_t value,
                       uint64_t compare, int width, double timeout);

// The active-message handlers (registered on every worker; worker lock held).
api::Status on_atomic_request(void* worker, const void* header, size_t headerLength, void* data, size_t length,
                              const api::AmRecvParam* param);
api::Status on_atomic_reply(void* worker, const void* header, size_t headerLength, void* data, size_t length,
                            const api::AmRecvParam* param);

}  // namespace mori::ucx
