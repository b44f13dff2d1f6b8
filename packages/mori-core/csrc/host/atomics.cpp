// Host atomics on raw addresses (shared mappings between processes): the primitives CPU PEs use
// for signals, counters and barriers. Every operation is sequentially consistent and lock-free
// on 32/64-bit aligned words, so processes that map the same memory see one order of updates.
//
// Values cross the boundary as unsigned words of the given width; mori.core.atomics maps Python
// ints (signed or not) onto them. wait_until releases the GIL while it waits.
#include <pybind11/pybind11.h>
#include <sched.h>

#include <chrono>
#include <cinttypes>
#include <cstdint>
#include <cstdio>
#include <string>
#include <thread>
#include <type_traits>

#include "base/registry.hpp"

namespace py = pybind11;

namespace mori::atomics {
namespace {

enum Cmp { kEq = 0, kNe = 1, kGt = 2, kGe = 3, kLt = 4, kLe = 5 };
const char* const kCmpNames[] = {"eq", "ne", "gt", "ge", "lt", "le"};

// Validates the address for a `width`-bit atomic and returns it; raises ValueError otherwise.
void check(uintptr_t addr, int width) {
    if (width != 32 && width != 64) {
        throw py::value_error("atomic width must be 32 or 64 bits, got " + std::to_string(width));
    }
    if (addr == 0) throw py::value_error("atomic on a null address");
    const uintptr_t align = static_cast<uintptr_t>(width / 8);
    if (addr % align != 0) {
        char buf[128];
        std::snprintf(buf, sizeof buf, "address 0x%" PRIxPTR " is not %d-byte aligned for a %d-bit atomic", addr,
                      static_cast<int>(align), width);
        throw py::value_error(buf);
    }
}

// Runs `op` on the word at `addr` as uint32_t or uint64_t.
template <typename Op>
uint64_t dispatch(uintptr_t addr, int width, Op op) {
    check(addr, width);
    if (width == 32) return op(reinterpret_cast<uint32_t*>(addr));
    return op(reinterpret_cast<uint64_t*>(addr));
}

enum FetchOp { kAdd, kAnd, kOr, kXor };

// fetch_add / fetch_and / fetch_or / fetch_xor: apply Op with `value`, return the previous word.
template <FetchOp Op>
uint64_t fetch_op(uintptr_t addr, uint64_t value, int width) {
    return dispatch(addr, width, [value](auto* p) -> uint64_t {
        using T = std::remove_pointer_t<decltype(p)>;
        const T v = static_cast<T>(value);
        if constexpr (Op == kAdd) return __atomic_fetch_add(p, v, __ATOMIC_SEQ_CST);
        if constexpr (Op == kAnd) return __atomic_fetch_and(p, v, __ATOMIC_SEQ_CST);
        if constexpr (Op == kOr) return __atomic_fetch_or(p, v, __ATOMIC_SEQ_CST);
        if constexpr (Op == kXor) return __atomic_fetch_xor(p, v, __ATOMIC_SEQ_CST);
    });
}

uint64_t swap(uintptr_t addr, uint64_t value, int width) {
    return dispatch(addr, width, [value](auto* p) -> uint64_t {
        using T = std::remove_pointer_t<decltype(p)>;
        return __atomic_exchange_n(p, static_cast<T>(value), __ATOMIC_SEQ_CST);
    });
}

// Returns the value found at addr (== expected when the swap happened), as OpenSHMEM's cswap.
uint64_t compare_swap(uintptr_t addr, uint64_t expected, uint64_t desired, int width) {
    return dispatch(addr, width, [expected, desired](auto* p) -> uint64_t {
        using T = std::remove_pointer_t<decltype(p)>;
        T old = static_cast<T>(expected);
        __atomic_compare_exchange_n(p, &old, static_cast<T>(desired), false, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST);
        return old;
    });
}

uint64_t load(uintptr_t addr, int width) {
    return dispatch(addr, width, [](auto* p) -> uint64_t { return __atomic_load_n(p, __ATOMIC_SEQ_CST); });
}

void store(uintptr_t addr, uint64_t value, int width) {
    dispatch(addr, width, [value](auto* p) -> uint64_t {
        using T = std::remove_pointer_t<decltype(p)>;
        __atomic_store_n(p, static_cast<T>(value), __ATOMIC_SEQ_CST);
        return 0;
    });
}

// Interprets a width-bit word as signed when asked, for ordered comparisons.
int64_t as_signed(uint64_t v, int width) {
    return width == 32 ? static_cast<int64_t>(static_cast<int32_t>(static_cast<uint32_t>(v))) : static_cast<int64_t>(v);
}

template <typename T>
bool compare(T seen, int cmp, T value) {
    switch (cmp) {
        case kEq: return seen == value;
        case kNe: return seen != value;
        case kGt: return seen > value;
        case kGe: return seen >= value;
        case kLt: return seen < value;
        default: return seen <= value;
    }
}

bool satisfied(uint64_t seen, int cmp, uint64_t value, int width, bool is_signed) {
    if (is_signed) return compare(as_signed(seen, width), cmp, as_signed(value, width));
    return compare(seen, cmp, value);
}

// Waits until the word at addr compares `cmp` to value; returns the word that satisfied it.
// Spins briefly (the common case: the peer is about to write), then yields, then sleeps with a
// growing interval capped at 100 us, so a long wait costs little CPU. Every 50 ms it takes the
// GIL back to let Ctrl-C through. Raises TimeoutError naming address, condition and last value.
uint64_t wait_until(uintptr_t addr, int cmp, uint64_t value, double timeout, int width, bool is_signed) {
    check(addr, width);
    if (cmp < kEq || cmp > kLe) throw py::value_error("wait_until: unknown comparison code " + std::to_string(cmp));
    if (!(timeout >= 0.0) || timeout > 1e9) {
        throw py::value_error("wait_until: timeout must be a finite number of seconds >= 0, got " +
                              std::to_string(timeout));
    }
    using clock = std::chrono::steady_clock;
    const auto start = clock::now();
    const auto deadline = start + std::chrono::duration_cast<clock::duration>(std::chrono::duration<double>(timeout));
    auto next_signal_check = start + std::chrono::milliseconds(50);
    uint64_t seen = load(addr, width);
    long iteration = 0;
    std::chrono::microseconds nap(1);
    for (;;) {
        {
            py::gil_scoped_release release;
            for (;;) {
                seen = width == 32 ? __atomic_load_n(reinterpret_cast<uint32_t*>(addr), __ATOMIC_SEQ_CST)
                                   : __atomic_load_n(reinterpret_cast<uint64_t*>(addr), __ATOMIC_SEQ_CST);
                if (satisfied(seen, cmp, value, width, is_signed)) return seen;
                ++iteration;
                if (iteration < 2000) continue;  // spin: cheapest when the answer is close
                const auto now = clock::now();
                if (now >= deadline || now >= next_signal_check) break;
                if (iteration < 4000) {
                    sched_yield();
                } else {
                    std::this_thread::sleep_for(nap);
                    if (nap < std::chrono::microseconds(100)) nap *= 2;
                }
            }
        }
        if (clock::now() >= deadline) break;
        next_signal_check = clock::now() + std::chrono::milliseconds(50);
        if (PyErr_CheckSignals() != 0) throw py::error_already_set();
    }
    // One last look after the deadline, so a store that raced the clock still counts.
    seen = load(addr, width);
    if (satisfied(seen, cmp, value, width, is_signed)) return seen;
    char buf[320];
    const double waited = std::chrono::duration<double>(clock::now() - start).count();
    if (is_signed) {
        std::snprintf(buf, sizeof buf,
                      "wait_until timed out after %.3f s: the %d-bit value at 0x%" PRIxPTR " never became %s %" PRId64
                      "; last seen %" PRId64,
                      waited, width, addr, kCmpNames[cmp], as_signed(value, width), as_signed(seen, width));
    } else {
        std::snprintf(buf, sizeof buf,
                      "wait_until timed out after %.3f s: the %d-bit value at 0x%" PRIxPTR " never became %s %" PRIu64
                      "; last seen %" PRIu64,
                      waited, width, addr, kCmpNames[cmp], value, seen);
    }
    PyErr_SetString(PyExc_TimeoutError, buf);
    throw py::error_already_set();
}

const native::Registration reg([](py::module_& m) {
    auto a = native::submodule(m, "atomics", "sequentially consistent host atomics on raw addresses");
    a.def("fetch_add", &fetch_op<kAdd>, py::arg("addr"), py::arg("value"), py::arg("width"));
    a.def("fetch_and", &fetch_op<kAnd>, py::arg("addr"), py::arg("value"), py::arg("width"));
    a.def("fetch_or", &fetch_op<kOr>, py::arg("addr"), py::arg("value"), py::arg("width"));
    a.def("fetch_xor", &fetch_op<kXor>, py::arg("addr"), py::arg("value"), py::arg("width"));
    a.def("swap", &swap, py::arg("addr"), py::arg("value"), py::arg("width"));
    a.def("compare_swap", &compare_swap, py::arg("addr"), py::arg("expected"), py::arg("desired"), py::arg("width"));
    a.def("load", &load, py::arg("addr"), py::arg("width"));
    a.def("store", &store, py::arg("addr"), py::arg("value"), py::arg("width"));
    a.def("wait_until", &wait_until, py::arg("addr"), py::arg("cmp"), py::arg("value"), py::arg("timeout"),
          py::arg("width"), py::arg("signed"));
});

}  // namespace
}  // namespace mori::atomics
