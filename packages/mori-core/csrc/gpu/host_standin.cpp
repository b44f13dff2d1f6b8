// A host stand-in for the driver entry points of a Stager (staging.hpp), so that machines with no
// GPU (CI) run the staging code itself: the "device" is host memory, a copy is a memcpy made when
// it is queued, an event ends `delay` seconds after it is recorded, pinned memory is heap memory.
// Knobs make it fail: the n-th copy from now (its CUresult is 999, CUDA_ERROR_UNKNOWN), every
// allocation of pinned memory, or every event (never ends, so waits run into their timeout).
// One stand-in per process: tests set its knobs and read its counters through
// mori.core._native.gpu (host_standin_*), wrapped by mori.core.testing.HostStandin.
#include "gpu/host_standin.hpp"

#include <atomic>
#include <cstdlib>
#include <cstring>

#include "base/transfer.hpp"

namespace mori::gpu::standin {

namespace {

constexpr int kUnknown = 999;                     // CUDA_ERROR_UNKNOWN
constexpr int kNotReady = 600;                    // CUDA_ERROR_NOT_READY
constexpr int kOutOfMemory = 2;                   // CUDA_ERROR_OUT_OF_MEMORY
constexpr uintptr_t kContext = 0x5354414e44494e;  // "STANDIN": the context and stream handles
constexpr uintptr_t kStream = kContext + 1;       // four lanes from here

std::atomic<int64_t> failCopyIn{-1};  // copies left before one fails; -1: none fails
std::atomic<bool> failPinning{false};
std::atomic<int64_t> delayNs{0};
std::atomic<bool> hang{false};
std::atomic<uint64_t> copies{0}, copiedBytes{0}, allocations{0}, frees{0}, liveEvents{0};

struct Event {
    int64_t readyNs = 0;
    bool never = false;
};

// Whether this copy is the one told to fail (counting it down).
bool copy_fails() {
    int64_t left = failCopyIn.load();
    while (left >= 0) {
        if (failCopyIn.compare_exchange_weak(left, left - 1)) return left == 0;
    }
    return false;
}

int copy(void* dst, const void* src, size_t bytes) {
    if (copy_fails()) return kUnknown;
    std::memcpy(dst, src, bytes);
    copies.fetch_add(1);
    copiedBytes.fetch_add(bytes);
    return 0;
}

int ctx_set(void*) { return 0; }
int ctx_pop(void** ctx) {
    if (ctx) *ctx = reinterpret_cast<void*>(kContext);
    return 0;
}
int exchange_capture_mode(int*) { return 0; }
int stream_query(void*) { return 0; }
int htod(uint64_t dst, const void* src, size_t bytes, void*) { return copy(reinterpret_cast<void*>(dst), src, bytes); }
int dtoh(void* dst, uint64_t src, size_t bytes, void*) { return copy(dst, reinterpret_cast<const void*>(src), bytes); }
int host_alloc(void** p, size_t bytes, unsigned) {
    if (failPinning.load()) return kOutOfMemory;
    *p = std::malloc(bytes);
    if (*p == nullptr) return kOutOfMemory;
    allocations.fetch_add(1);
    return 0;
}
int free_host(void* p) {
    std::free(p);
    frees.fetch_add(1);
    return 0;
}
int event_create(void** e, unsigned) {
    *e = new Event;
    liveEvents.fetch_add(1);
    return 0;
}
int event_record(void* e, void*) {
    auto* ev = static_cast<Event*>(e);
    ev->readyNs = now_ns() + delayNs.load();
    ev->never = hang.load();
    return 0;
}
int event_query(void* e) {
    const auto* ev = static_cast<const Event*>(e);
    return ev->never || now_ns() < ev->readyNs ? kNotReady : 0;
}
int pointer_attribute(void* data, int, uint64_t) {
    *static_cast<unsigned*>(data) = 2;  // CU_MEMORYTYPE_DEVICE: host memory stands in for the GPU's
    return 0;
}
int event_destroy(void* e) {
    delete static_cast<Event*>(e);
    liveEvents.fetch_sub(1);
    return 0;
}

}  // namespace

StagingConfig config(double timeout, size_t cacheBytes) {
    StagingConfig c;
    c.context = kContext;
    c.streams = {kStream, kStream + 1, kStream + 2, kStream + 3};
    Driver& d = c.driver;
    d.ctxSetCurrent = reinterpret_cast<uintptr_t>(&ctx_set);
    d.ctxPushCurrent = reinterpret_cast<uintptr_t>(&ctx_set);
    d.ctxPopCurrent = reinterpret_cast<uintptr_t>(&ctx_pop);
    d.exchangeCaptureMode = reinterpret_cast<uintptr_t>(&exchange_capture_mode);
    d.streamQuery = reinterpret_cast<uintptr_t>(&stream_query);
    d.memcpyHtoDAsync = reinterpret_cast<uintptr_t>(&htod);
    d.memcpyDtoHAsync = reinterpret_cast<uintptr_t>(&dtoh);
    d.memHostAlloc = reinterpret_cast<uintptr_t>(&host_alloc);
    d.memFreeHost = reinterpret_cast<uintptr_t>(&free_host);
    d.eventCreate = reinterpret_cast<uintptr_t>(&event_create);
    d.eventRecord = reinterpret_cast<uintptr_t>(&event_record);
    d.eventQuery = reinterpret_cast<uintptr_t>(&event_query);
    d.eventDestroy = reinterpret_cast<uintptr_t>(&event_destroy);
    d.pointerGetAttribute = reinterpret_cast<uintptr_t>(&pointer_attribute);
    c.timeout = timeout;
    c.cacheBytes = cacheBytes;
    c.owner = "mori GPU staging (host stand-in)";
    return c;
}

void set_knobs(const Knobs& k) {
    failCopyIn.store(k.failCopyIn);
    failPinning.store(k.failPinning);
    delayNs.store(static_cast<int64_t>(k.delay * 1e9));
    hang.store(k.hang);
}

Counters counters() {
    return Counters{copies.load(), copiedBytes.load(), allocations.load(), frees.load(), liveEvents.load()};
}

}  // namespace mori::gpu::standin
