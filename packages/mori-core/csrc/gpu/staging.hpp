// mori::gpu — GPU memory staged through pinned host memory, for every data plane that cannot
// reach CUDA memory itself: the native TCP target and initiator, and the UCX engine over UCX
// transports without GPUDirect (tcp, sm, cma).
//
// A Stager owns CUDA streams (lanes) of one context and a StagingPool of pinned host memory of
// that context. Copies of one lane run in order; callers on different threads take different
// lanes (thread_lane), so that their copies neither queue behind each other nor share a lock.
// `to_host` queues a copy-engine copy of device bytes into memory lent by the pool, `landing`
// lends memory to receive into, `to_device` queues the copy of received bytes to the device.
// Each copy is followed, on its stream, by a write of the lane's count of copies queued into a
// word of pinned host memory (cuStreamWriteValue32), so a caller copies piece k+1 while the wire
// moves piece k and asks Staged::copied() (or waits with Staged::wait()) before it sends or
// answers: a read of that word, no driver call (an event's query takes the driver's lock, and
// the UCX worker polls every copy in flight at each progress).
// Lent memory goes back to the pool when its Staged goes; the pool keeps up to `cacheBytes` of it
// for the next transfer, frees the rest, and never lends memory whose copy may still run.
//
// Every wait is bounded by the config's timeout; after a wait that timed out the Stager refuses
// further work (the stream may still be busy). Driver entry points come in as addresses
// (cuGetProcAddress through cuda-bindings, or the host stand-in of host_standin.hpp that tests
// use on machines with no GPU): no CUDA headers, no toolkit at build time.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

namespace mori::gpu {

// Marks the calling thread as one of mori's own (a data plane's sender, receiver or server
// thread), which runs no application code: a Stager then makes its context current there for
// good instead of pushing and popping it around every call.
void own_thread();

// The driver functions a Stager calls, by address.
struct Driver {
    uintptr_t ctxSetCurrent = 0, ctxGetCurrent = 0, ctxPushCurrent = 0, ctxPopCurrent = 0, exchangeCaptureMode = 0;
    uintptr_t streamQuery = 0, memcpyHtoDAsync = 0, memcpyDtoHAsync = 0, memHostAlloc = 0, memFreeHost = 0;
    uintptr_t memHostGetDevicePointer = 0, streamWriteValue32 = 0, streamWriteValue64 = 0, pointerGetAttribute = 0;
    // Optional (0: the driver lacks it): cuMemcpyBatchAsync in its CUDA 13 form (gpu/memcpy_batch.hpp).
    uintptr_t memcpyBatchAsync = 0;
};

// Every entry point of Driver by its driver name (the bindings' STAGING_ENTRY_POINTS).
inline constexpr std::pair<const char*, uintptr_t Driver::*> kDriverEntryPoints[] = {
    {"cuCtxSetCurrent", &Driver::ctxSetCurrent},
    {"cuCtxGetCurrent", &Driver::ctxGetCurrent},
    {"cuCtxPushCurrent", &Driver::ctxPushCurrent},
    {"cuCtxPopCurrent", &Driver::ctxPopCurrent},
    {"cuThreadExchangeStreamCaptureMode", &Driver::exchangeCaptureMode},
    {"cuStreamQuery", &Driver::streamQuery},
    {"cuMemcpyHtoDAsync", &Driver::memcpyHtoDAsync},
    {"cuMemcpyDtoHAsync", &Driver::memcpyDtoHAsync},
    {"cuMemHostAlloc", &Driver::memHostAlloc},
    {"cuMemFreeHost", &Driver::memFreeHost},
    {"cuMemHostGetDevicePointer", &Driver::memHostGetDevicePointer},
    {"cuStreamWriteValue32", &Driver::streamWriteValue32},
    {"cuStreamWriteValue64", &Driver::streamWriteValue64},
    {"cuPointerGetAttribute", &Driver::pointerGetAttribute},
};

// Every optional entry point of Driver by its driver name (the bindings' STAGING_OPTIONAL_ENTRY_POINTS).
inline constexpr std::pair<const char*, uintptr_t Driver::*> kOptionalDriverEntryPoints[] = {
    {"cuMemcpyBatchAsync", &Driver::memcpyBatchAsync},
};

// A range of device memory: `bytes` at `addr`.
struct DeviceRange {
    uint64_t addr, bytes;
};

// Lanes a Stager may have (each has a word its copies' ends are written into).
inline constexpr size_t kMaxLanes = 64;

// Pinned memory the pool keeps between transfers by default.
inline constexpr size_t kDefaultCacheBytes = size_t{256} << 20;

struct StagingConfig {
    uintptr_t context = 0;           // CUcontext, as an address
    std::vector<uintptr_t> streams;  // CUstreams of it (lanes), 1 to kMaxLanes
    Driver driver;
    double timeout = 30.0;                   // seconds a copy may take before it counts as never ending
    std::string timeoutSetting = "timeout";  // the caller's name for it, in messages
    size_t cacheBytes = kDefaultCacheBytes;  // pinned memory kept for reuse between transfers
    std::string owner = "mori";              // who stages, in messages ("mori TCP target")
};

// What a pool has done, for tests and logs.
struct PoolStats {
    size_t lent = 0;         // memory lent now (count)
    size_t cachedBytes = 0;  // pinned memory kept for reuse now
    uint64_t pinned = 0;     // allocations of pinned memory so far
    uint64_t reused = 0;     // loans served from kept memory
    uint64_t freed = 0;      // pinned memory freed (over the cache bound, or at close)
    uint64_t unpinned = 0;   // loans of heap memory because pinning failed
    uint64_t abandoned = 0;  // memory never lent again: its copy may still have been running
    // The copies, for a profile of where a staged transfer's time goes (MORI_STAGING_PROFILE):
    // (A copy of several ranges, gathered or scattered, counts once: it is queued and ends as one.)
    uint64_t toHost = 0, toHostBytes = 0;      // copies out of the GPU queued, and their bytes
    uint64_t toDevice = 0, toDeviceBytes = 0;  // copies into the GPU queued, and their bytes
    uint64_t copyNs = 0;   // summed over queued copies: from queueing to the moment a caller saw it end
    uint64_t waitNs = 0;   // summed time callers spent blocked on a copy (wait(), or a waited copy)
    uint64_t queueNs = 0;  // summed time callers spent queueing copies (the driver's locks included)
};

class StagingPool;
class Stager;

// The context of c current on the calling thread while this lives, with the thread's
// stream-capture mode relaxed: while the application captures a CUDA graph in the global mode,
// the driver refuses these calls from any other thread of the process and invalidates the
// capture. Nothing to do where it is current already for mori (a thread of mori's own,
// own_thread(), keeps it current for good; an enclosing Current of the same thread holds it);
// where the application made it current (its thread on the device's primary context, as
// PyTorch does), only the capture mode is exchanged; else the context is pushed and popped too
// (a pair of driver calls, ~0.5-0.9 us on the H200 machine).
class Current {
public:
    explicit Current(const StagingConfig& c);
    ~Current();
    Current(const Current&) = delete;
    Current& operator=(const Current&) = delete;

private:
    const StagingConfig& c_;
    int mode_;             // the thread's capture mode before
    bool held_ = false;    // this one made it current (or found it so) and exchanged the mode
    bool pushed_ = false;  // ... by a push
    uintptr_t outer_ = 0;  // the context an enclosing Current of this thread holds
};

// Host memory that staged bytes pass through: pinned memory lent by a pool (given back when this
// goes), or heap memory when pinning failed (then copied through with a wait, never async).
class Staged {
public:
    Staged() = default;
    Staged(Staged&& o) noexcept { swap(o); }
    Staged& operator=(Staged&& o) noexcept {
        Staged(std::move(o)).swap(*this);
        return *this;
    }
    Staged(const Staged&) = delete;
    Staged& operator=(const Staged&) = delete;
    ~Staged() { clear(); }
    uint8_t* data() const { return data_; }
    size_t size() const { return size_; }
    // The first n bytes only are what a copy of it takes (a landing filled in part).
    void shrink(size_t n) { size_ = n < size_ ? n : size_; }
    bool empty() const { return size_ == 0; }
    bool pinned() const { return pool_ != nullptr; }
    // Whether the copy queued with it (wait false) has ended: at once for memory copied as it was
    // staged. Throws when the copy failed, or has not ended within the timeout since it started
    // (its memory is then never lent again). A read of the lane's word; the stream is asked (a
    // driver call) only once a millisecond has passed, at most once a millisecond, for the
    // failure that would leave the word unwritten.
    bool copied();
    // Until copied(): polls, then naps, so that a stalled GPU costs no core. Throws as copied().
    void wait();
    void clear();  // gives the memory back (kept from reuse while its copy may still run)

private:
    friend class Stager;
    void swap(Staged& o) noexcept;
    bool ended() const;                  // whether the lane's word has reached this copy's ticket
    std::shared_ptr<StagingPool> pool_;  // set while the memory is the pool's (pinned)
    uint8_t* data_ = nullptr;
    size_t size_ = 0, capacity_ = 0;
    // While its copy may still run: the lane's word, this copy's ticket on it, and the stream.
    const std::atomic<uint32_t>* done_ = nullptr;
    uint32_t ticket_ = 0;
    uintptr_t stream_ = 0;
    int64_t since_ = 0;  // when that copy started (now_ns)
    int64_t askAt_ = 0;  // when copied() next asks the stream (now_ns)
};

class Stager {
public:
    explicit Stager(StagingConfig c);  // std::invalid_argument for a missing handle or entry point
    ~Stager();
    Stager(const Stager&) = delete;
    Stager& operator=(const Stager&) = delete;

    // Staged host memory holding `bytes` copied from device address src; host memory to receive
    // bytes into; those bytes copied to device address dst. With wait, the copy is waited for;
    // else it runs on while the caller polls Staged::copied(). Throw std::runtime_error naming
    // the driver call that failed, or the wait that timed out.
    // `lane` picks the stream (modulo their count): thread_lane() for a data plane's thread.
    Staged to_host(uint64_t src, size_t bytes, bool wait = true, size_t lane = 0);
    Staged landing(size_t bytes);
    void to_device(uint64_t dst, Staged& src, bool wait = true, size_t lane = 0);
    // The same for several ranges of device memory at once, their bytes one after another in the
    // staged memory (KV pages scattered in the GPU, back to back in pinned memory): one copy as the
    // caller sees it (one completion, one Staged), queued in one driver call (cuMemcpyBatchAsync
    // where the driver has it, else one call per range under one lock); ranges that continue one
    // another in device memory are copied as one. to_device copies the first bytes of src, as
    // many as the ranges hold, into ranges that must not overlap (the copies of one batch call
    // run in no set order).
    Staged to_host(const DeviceRange* ranges, size_t count, bool wait = true, size_t lane = 0);
    void to_device(const DeviceRange* ranges, size_t count, Staged& src, bool wait = true, size_t lane = 0);
    // to_device of src's bytes (none when src is empty), then a store of the 64-bit `value` at
    // device address `word` (8-byte aligned) behind the copy on the same stream
    // (cuStreamWriteValue64, which makes the copy's bytes visible first): whoever sees the word
    // sees the bytes, as a signal after its data. src tells the end of both; with no bytes (src
    // empty) the store is waited for here whatever `wait` says.
    void to_device_then_store(uint64_t dst, Staged& src, uint64_t word, uint64_t value, bool wait = true,
                              size_t lane = 0);
    // The calling thread's lane: threads take lanes in turn as they first ask.
    static size_t thread_lane();
    // Waits (at most the timeout) for memory still lent, then frees what the pool keeps; later
    // loans get heap memory, and memory given back after this is freed (if the context still
    // lives; its destruction frees the rest). Going without close() is the same without the wait.
    void close();
    PoolStats stats() const;
    const StagingConfig& config() const { return c_; }
    // Whether copies of several ranges go in one batch call (false where the driver lacks
    // cuMemcpyBatchAsync or refused it: one call per range).
    bool batched() const { return c_.driver.memcpyBatchAsync != 0 && !batchRefused_.load(); }
    // Throws std::invalid_argument unless [addr, addr + bytes) is CUDA device memory (its first
    // and last byte), so that a region registered as GPU memory is one the copies can reach.
    void check_device_memory(uint64_t addr, uint64_t bytes) const;

    // Makes the context current on the calling thread for good (a thread of the caller's own),
    // with its stream-capture mode relaxed; false (and why) if the driver refused.
    bool make_current(std::string& why) const;

    // One operation on a lane's stream, for callers that queue work of their own on it (the UCX
    // engine's atomic kernels): holds the lane's lock, refuses after a timed-out wait, and keeps
    // the context current on the calling thread (any thread) until it goes (Current).
    class Op {
    public:
        explicit Op(Stager& s, size_t lane = 0);
        Op(const Op&) = delete;
        Op& operator=(const Op&) = delete;
        // Until the stream is idle: bounded by the timeout, after which this and every later
        // operation fail. `what` names the work in messages.
        void wait_stream(const char* what);

        size_t lane() const { return lane_; }  // the lane's index, modulo their count
        uintptr_t stream() const { return s_.lanes_[lane_]->stream; }

    private:
        Stager& s_;
        size_t lane_;
        std::lock_guard<std::mutex> lock_;
        Current current_;
    };

private:
    friend class StagingPool;
    friend class Staged;
    Staged staging(size_t bytes);  // inside an Op
    // Queues the copies between staged memory `host` (the ranges' bytes one after another) and the
    // ranges, as to_host/to_device of several ranges say.
    void queue_copies(Op& op, bool toDevice, Staged& host, const DeviceRange* ranges, size_t count);
    // A 64-bit store queued behind a copy to the device (to_device_then_store).
    struct WordStore {
        uint64_t word, value;
    };
    // to_device and to_device_then_store: the copies of src into the ranges (none when count is 0;
    // `bytes` their sum, which the caller has checked), then the store when given, then follow.
    void queue_to_device(const DeviceRange* ranges, size_t count, uint64_t bytes, Staged& src, const WordStore* store,
                         bool wait, size_t lane, const char* what);
    // After a copy into or out of s was queued: waits for it, or queues the write of the lane's
    // word that s.copied() reads.
    void follow(Op& op, Staged& s, bool waitNow, const char* what);
    struct Lane {
        uintptr_t stream;
        std::mutex mu;        // one operation on the stream at a time
        uint32_t issued = 0;  // copies followed by a write of the lane's word (under mu)
    };
    void check_healthy() const;  // throws after a wait that timed out
    StagingConfig c_;
    std::shared_ptr<StagingPool> pool_;
    std::vector<std::unique_ptr<Lane>> lanes_;
    std::atomic<bool> batchRefused_{false};  // the driver refused a batch call: one call per range from then on
    mutable std::mutex brokenMu_;
    std::string broken_;  // why an earlier wait never finished ("" while none did)
};

// Why `what` failed: the GPU did not finish it within the config's timeout.
std::string never_ended(const std::string& what, const StagingConfig& c);

}  // namespace mori::gpu
