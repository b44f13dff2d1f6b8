// The one table of operation codes of mori-core's native planes: what a request asks of its
// target (Op) and which atomic it applies (AtomicOp). Every plane carries these values on its wire
// (the TCP data plane, the UCX engine's messages, the same-host ring, the device proxy's ring);
// codes_bindings.cpp exports both tables (mori.core.codes checks its enums against them), and the
// device constants (include/mori/device/proxy_ring.cuh) are checked against them below.
#pragma once

#include <cstdint>

#include "mori/device/proxy_ring.cuh"

namespace mori {

enum Op : uint8_t {
    kOpRead = 1,    // bytes from the target's memory
    kOpWrite = 2,   // bytes into the target's memory
    kOpNotify = 3,  // a transfer's final status, for the target's completion records
    kOpRegion = 4,  // what the target tells of one of its regions (the UCX engine's RMA path)
};

enum AtomicOp : uint8_t {
    kAtomicFetchAdd = 1,
    kAtomicCompareSwap = 2,
    kAtomicSwap = 3,
    kAtomicStore = 4,
    kAtomicFetchAnd = 5,
    kAtomicFetchOr = 6,
    kAtomicFetchXor = 7,
    kAtomicLast = kAtomicFetchXor,
};

// The value a width-bit (32 or 64) word holds after op with value and compare turned `old` into
// it: what each atomic does, stated once for the host (the engines apply it with a compare-and-
// swap and log the result; device code has its own, in CUDA's atomics).
inline uint64_t value_after(uint8_t op, int width, uint64_t old, uint64_t value, uint64_t compare) {
    if (width == 32) {  // as the operation saw them
        old &= 0xffffffffull;
        value &= 0xffffffffull;
        compare &= 0xffffffffull;
    }
    uint64_t v;
    switch (op) {
        case kAtomicFetchAdd: v = old + value; break;
        case kAtomicCompareSwap: v = old == compare ? value : old; break;
        case kAtomicFetchAnd: v = old & value; break;
        case kAtomicFetchOr: v = old | value; break;
        case kAtomicFetchXor: v = old ^ value; break;
        default: v = value;  // swap, store
    }
    return width == 32 ? v & 0xffffffffull : v;
}

// The tables as (name, code), the names mori.core.codes uses.
struct OpName {
    const char* name;
    uint8_t code;
};
inline constexpr OpName kOpNames[] = {
    {"READ", kOpRead}, {"WRITE", kOpWrite}, {"NOTIFY", kOpNotify}, {"REGION", kOpRegion}};
inline constexpr OpName kAtomicNames[] = {
    {"FETCH_ADD", kAtomicFetchAdd}, {"COMPARE_SWAP", kAtomicCompareSwap}, {"SWAP", kAtomicSwap},
    {"STORE", kAtomicStore},        {"FETCH_AND", kAtomicFetchAnd},       {"FETCH_OR", kAtomicFetchOr},
    {"FETCH_XOR", kAtomicFetchXor},
};

// A kernel names its atomic (ProxySlot::op) with the device constants: the same codes.
static_assert(device::kProxyAmoFetchAdd == kAtomicFetchAdd && device::kProxyAmoCompareSwap == kAtomicCompareSwap &&
                  device::kProxyAmoSwap == kAtomicSwap && device::kProxyAmoStore == kAtomicStore &&
                  device::kProxyAmoFetchAnd == kAtomicFetchAnd && device::kProxyAmoFetchOr == kAtomicFetchOr &&
                  device::kProxyAmoFetchXor == kAtomicFetchXor,
              "include/mori/device/proxy_ring.cuh's kProxyAmo* differ from mori::AtomicOp");

}  // namespace mori
