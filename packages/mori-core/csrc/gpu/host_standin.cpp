// A host stand-in for the driver entry points of a Stager (staging.hpp), so that machines with no
// GPU (CI) run the staging code itself: the "device" is host memory, a copy is a memcpy made when
// it is queued, the words written after it (cuStreamWriteValue32 and 64) are written `delay`
// seconds later (by a thread of the stand-in, in the order queued), pinned memory is heap memory.
// Its batch call copies every range at once, last to first. Knobs make it fail: the n-th copy from now (its
// CUresult is 999, CUDA_ERROR_UNKNOWN; a batch call is one copy), the batch call itself, every
// allocation of pinned memory, every copy's end (its word never written, its stream never
// idle, so waits run into their timeout), or every copy later, as the device runs it (its word
// never written, its stream's query answers 999).
// One stand-in per process: tests set its knobs and read its counters through
// mori.core._native.gpu (host_standin_*), wrapped by mori.core.testing.HostStandin.
#include "gpu/host_standin.hpp"

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <mutex>
#include <thread>
#include <vector>

#include "base/transfer.hpp"

namespace mori::gpu::standin {

namespace {

constexpr int kUnknown = 999;                     // CUDA_ERROR_UNKNOWN
constexpr int kNotReady = 600;                    // CUDA_ERROR_NOT_READY
constexpr int kOutOfMemory = 2;                   // CUDA_ERROR_OUT_OF_MEMORY
constexpr int kNotSupported = 801;                // CUDA_ERROR_NOT_SUPPORTED
constexpr uintptr_t kContext = 0x5354414e44494e;  // "STANDIN": the context and stream handles
constexpr uintptr_t kStream = kContext + 1;       // four lanes from here

std::atomic<int64_t> failCopyIn{-1};  // copies left before one fails; -1: none fails
std::atomic<bool> failPinning{false};
std::atomic<int64_t> delayNs{0};
std::atomic<bool> hang{false};
std::atomic<bool> failLater{false};
std::atomic<bool> refuseBatch{false};
std::atomic<uint64_t> copies{0}, batches{0}, largestBatch{0}, copiedBytes{0}, allocations{0}, frees{0}, pushes{0};

// Words to write once their time has come (delay), in the order queued, and whether one was
// queued while the stand-in hung (never written: its stream never becomes idle).
struct Write {
    int64_t atNs;
    uint64_t addr;
    uint64_t value;
    bool wide;  // 64 bits, else 32

    void store() const {
        if (wide)
            reinterpret_cast<std::atomic<uint64_t>*>(addr)->store(value, std::memory_order_release);
        else
            reinterpret_cast<std::atomic<uint32_t>*>(addr)->store(static_cast<uint32_t>(value),
                                                                  std::memory_order_release);
    }
};
struct Writes {
    std::mutex mu;
    std::condition_variable cv;
    std::deque<Write> queued;
    bool hung = false;    // a write was queued while the stand-in hung
    bool failed = false;  // a copy was queued while copies failed later
};
// Never destroyed: the thread that makes the writes waits on it until the process ends.
Writes& writes() {
    static Writes* w = new Writes;
    return *w;
}

void write_later() {
    Writes& w = writes();
    std::unique_lock lk(w.mu);
    for (;;) {
        w.cv.wait(lk, [&] { return !w.queued.empty(); });
        const Write next = w.queued.front();
        if (now_ns() < next.atNs) {
            w.cv.wait_for(lk, std::chrono::nanoseconds(next.atNs - now_ns()));
            continue;
        }
        next.store();
        w.queued.pop_front();
    }
}

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

// cuMemcpyBatchAsync, CUDA 13 form (gpu/memcpy_batch.hpp): one copy as far as the knobs and the
// counters go. Its copies run last to first: a batch's copies run in no set order, and a caller
// that counts on theirs (overlapping destinations) is caught.
int memcpy_batch(uint64_t* dsts, uint64_t* srcs, size_t* sizes, size_t count, void*, size_t*, size_t, void*) {
    if (refuseBatch.load()) return kNotSupported;
    if (copy_fails()) return kUnknown;
    uint64_t bytes = 0;
    for (size_t i = count; i-- > 0; bytes += sizes[i])
        std::memcpy(reinterpret_cast<void*>(dsts[i]), reinterpret_cast<const void*>(srcs[i]), sizes[i]);
    copies.fetch_add(1);
    batches.fetch_add(1);
    for (uint64_t most = largestBatch.load(); count > most && !largestBatch.compare_exchange_weak(most, count);) {
    }
    copiedBytes.fetch_add(bytes);
    return 0;
}

// The calling thread's contexts, as the driver keeps them (the last is current).
thread_local std::vector<void*> contexts;
int ctx_set(void* ctx) {
    if (contexts.empty())
        contexts.push_back(ctx);
    else
        contexts.back() = ctx;
    return 0;
}
int ctx_get(void** ctx) {
    *ctx = contexts.empty() ? nullptr : contexts.back();
    return 0;
}
int ctx_push(void* ctx) {
    contexts.push_back(ctx);
    pushes.fetch_add(1);
    return 0;
}
int ctx_pop(void** ctx) {
    if (ctx) *ctx = contexts.empty() ? nullptr : contexts.back();
    if (!contexts.empty()) contexts.pop_back();
    return 0;
}
int exchange_capture_mode(int*) { return 0; }
int stream_query(void*) {
    Writes& w = writes();
    std::lock_guard lk(w.mu);
    if (w.failed) return kUnknown;
    return w.hung || !w.queued.empty() ? kNotReady : 0;
}
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
int host_device_pointer(uint64_t* dptr, void* p, unsigned) {
    *dptr = reinterpret_cast<uint64_t>(p);
    return 0;
}
// Both widths of cuStreamWriteValue: in order with every other write, after the delay.
int write_value(uint64_t addr, uint64_t value, bool wide) {
    const Write write{now_ns() + delayNs.load(), addr, value, wide};
    Writes& w = writes();
    std::lock_guard lk(w.mu);
    if (hang.load()) {
        w.hung = true;
        return 0;
    }
    if (failLater.load()) {
        w.failed = true;
        return 0;
    }
    if (delayNs.load() == 0 && w.queued.empty()) {
        write.store();
        return 0;
    }
    static std::once_flag started;
    std::call_once(started, [] { std::thread(write_later).detach(); });
    w.queued.push_back(write);
    w.cv.notify_all();
    return 0;
}
int write_value32(void*, uint64_t addr, uint32_t value, unsigned) { return write_value(addr, value, false); }
int write_value64(void*, uint64_t addr, uint64_t value, unsigned) { return write_value(addr, value, true); }
int pointer_attribute(void* data, int, uint64_t) {
    *static_cast<unsigned*>(data) = 2;  // CU_MEMORYTYPE_DEVICE: host memory stands in for the GPU's
    return 0;
}
}  // namespace

StagingConfig config(double timeout, size_t cacheBytes) {
    StagingConfig c;
    c.context = kContext;
    c.streams = {kStream, kStream + 1, kStream + 2, kStream + 3};
    Driver& d = c.driver;
    d.ctxSetCurrent = reinterpret_cast<uintptr_t>(&ctx_set);
    d.ctxGetCurrent = reinterpret_cast<uintptr_t>(&ctx_get);
    d.ctxPushCurrent = reinterpret_cast<uintptr_t>(&ctx_push);
    d.ctxPopCurrent = reinterpret_cast<uintptr_t>(&ctx_pop);
    d.exchangeCaptureMode = reinterpret_cast<uintptr_t>(&exchange_capture_mode);
    d.streamQuery = reinterpret_cast<uintptr_t>(&stream_query);
    d.memcpyHtoDAsync = reinterpret_cast<uintptr_t>(&htod);
    d.memcpyDtoHAsync = reinterpret_cast<uintptr_t>(&dtoh);
    d.memHostAlloc = reinterpret_cast<uintptr_t>(&host_alloc);
    d.memFreeHost = reinterpret_cast<uintptr_t>(&free_host);
    d.memHostGetDevicePointer = reinterpret_cast<uintptr_t>(&host_device_pointer);
    d.streamWriteValue32 = reinterpret_cast<uintptr_t>(&write_value32);
    d.streamWriteValue64 = reinterpret_cast<uintptr_t>(&write_value64);
    d.pointerGetAttribute = reinterpret_cast<uintptr_t>(&pointer_attribute);
    d.memcpyBatchAsync = reinterpret_cast<uintptr_t>(&memcpy_batch);
    c.timeout = timeout;
    c.cacheBytes = cacheBytes;
    c.owner = "mori GPU staging (host stand-in)";
    return c;
}

void make_current() { ctx_set(reinterpret_cast<void*>(kContext)); }

void set_knobs(const Knobs& k) {
    failCopyIn.store(k.failCopyIn);
    failPinning.store(k.failPinning);
    delayNs.store(static_cast<int64_t>(k.delay * 1e9));
    hang.store(k.hang);
    failLater.store(k.failLater);
    refuseBatch.store(k.refuseBatch);
    Writes& w = writes();
    std::lock_guard lk(w.mu);
    w.hung = w.failed = false;  // behaving again: a stream is idle once its writes are made
}

Counters counters() {
    return Counters{copies.load(),      batches.load(), largestBatch.load(), copiedBytes.load(),
                    allocations.load(), frees.load(),   pushes.load()};
}

}  // namespace mori::gpu::standin
