// mori::gpu's staging (see staging.hpp).
#include "gpu/staging.hpp"

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstring>
#include <map>
#include <stdexcept>
#include <thread>
#include <vector>

#include "base/transfer.hpp"
#include "gpu/memcpy_batch.hpp"

namespace mori::gpu {

namespace {

// Driver entry points (CUresult is an int; handles are pointers).
using CtxSetCurrentFn = int (*)(void* ctx);
using CtxGetCurrentFn = int (*)(void** ctx);
using CtxPopCurrentFn = int (*)(void** ctx);
using ExchangeCaptureModeFn = int (*)(int* mode);
constexpr int kCaptureRelaxed = 2;  // CU_STREAM_CAPTURE_MODE_RELAXED
using StreamQueryFn = int (*)(void* stream);
constexpr int kNotReady = 600;  // CUDA_ERROR_NOT_READY
using MemcpyHtoDAsyncFn = int (*)(uint64_t dst, const void* src, size_t bytes, void* stream);
using MemcpyDtoHAsyncFn = int (*)(void* dst, uint64_t src, size_t bytes, void* stream);
using MemHostAllocFn = int (*)(void** p, size_t bytes, unsigned flags);
using MemFreeHostFn = int (*)(void* p);
using MemHostGetDevicePointerFn = int (*)(uint64_t* dptr, void* p, unsigned flags);
using StreamWriteValue32Fn = int (*)(void* stream, uint64_t addr, uint32_t value, unsigned flags);
using StreamWriteValue64Fn = int (*)(void* stream, uint64_t addr, uint64_t value, unsigned flags);
using PointerGetAttributeFn = int (*)(void* data, int attribute, uint64_t ptr);
constexpr int kPointerMemoryType = 2;      // CU_POINTER_ATTRIBUTE_MEMORY_TYPE
constexpr unsigned kMemoryTypeDevice = 2;  // CU_MEMORYTYPE_DEVICE
// CU_MEMHOSTALLOC_PORTABLE | CU_MEMHOSTALLOC_DEVICEMAP: the words are written by the device.
constexpr unsigned kMappedPinned = 0x1 | 0x2;

// The words the copies' ends are written into: one per lane, each on a cache line of its own.
constexpr size_t kWordStride = 64;
constexpr size_t kWordsBytes = kMaxLanes * kWordStride;

// How long copied() reads the word alone before it also asks the stream, and how often after:
// a failed copy never writes it, and the stream's query (a driver call, the driver's lock) tells.
constexpr int64_t kAskStreamNs = 1'000'000;

// Pinned memory comes in powers of two from 64 KiB, so that transfers of about one size reuse it.
constexpr size_t kMinCapacity = size_t{64} << 10;

size_t capacity_for(size_t bytes) {
    size_t c = kMinCapacity;
    while (c < bytes) c <<= 1;
    return c;
}

// The context a thread of the caller made current for good (Stager::make_current): driver calls
// there need no push.
thread_local uintptr_t tlsContext = 0;
thread_local bool ownThread = false;  // own_thread()
thread_local uintptr_t tlsHeld = 0;   // the context a Current of this thread holds current now

// Makes c's context current on the calling thread for good, with its stream-capture mode
// relaxed (a thread of mori's own: Current, Stager::make_current); "" or which call the driver
// refused (a Current then pushes the context instead).
std::string adopt(const StagingConfig& c) {
    tlsContext = 0;
    const Driver& d = c.driver;
    int r = reinterpret_cast<CtxSetCurrentFn>(d.ctxSetCurrent)(reinterpret_cast<void*>(c.context));
    if (r != 0) return "cuCtxSetCurrent failed (CUresult " + std::to_string(r) + ")";
    int mode = kCaptureRelaxed;
    r = reinterpret_cast<ExchangeCaptureModeFn>(d.exchangeCaptureMode)(&mode);
    if (r != 0) return "cuThreadExchangeStreamCaptureMode failed (CUresult " + std::to_string(r) + ")";
    tlsContext = c.context;
    return "";
}

void check(int result, const char* call) {
    if (result != 0)
        throw std::runtime_error(std::string(call) + " failed on the GPU (CUresult " + std::to_string(result) + ")");
}

// How long a wait for a copy polls before it naps: a copy-engine copy of a staged piece (at
// most a few MiB, ~50 GB/s) ends within it. A count of polls is no measure (a yield on an idle
// core returns at once), and a nap lasts far longer than its 20 us (the kernel's timer slack):
// a copy that ends just after the polls stopped is seen late. The data planes' own threads spin
// before they sleep for the same reason (Reader::kSpinNs, the UCX worker's kSpinNs).
constexpr int64_t kCopySpinNs = 500'000;

// Polls `ready` (which throws when it never will be), then naps: a copy takes microseconds, a
// stalled GPU costs no core.
template <class Ready>
void poll_until(Ready ready) {
    const int64_t start = now_ns();
    while (!ready()) {
        if (now_ns() - start < kCopySpinNs)
            std::this_thread::yield();
        else
            std::this_thread::sleep_for(std::chrono::microseconds(20));
    }
}

}  // namespace

void own_thread() { ownThread = true; }

Current::Current(const StagingConfig& c) : c_(c), mode_(kCaptureRelaxed) {
    if (tlsContext == c.context || tlsHeld == c.context || (ownThread && adopt(c).empty())) return;
    const Driver& d = c.driver;
    check(reinterpret_cast<ExchangeCaptureModeFn>(d.exchangeCaptureMode)(&mode_), "cuThreadExchangeStreamCaptureMode");
    void* current = nullptr;
    // The application's thread may have it current already (no push then).
    if (reinterpret_cast<CtxGetCurrentFn>(d.ctxGetCurrent)(&current) != 0 ||
        current != reinterpret_cast<void*>(c.context)) {
        const int r = reinterpret_cast<CtxSetCurrentFn>(d.ctxPushCurrent)(reinterpret_cast<void*>(c.context));
        if (r != 0) {
            reinterpret_cast<ExchangeCaptureModeFn>(d.exchangeCaptureMode)(&mode_);
            check(r, "cuCtxPushCurrent");
        }
        pushed_ = true;
    }
    held_ = true;  // enclosed Currents of this thread have nothing to do
    outer_ = tlsHeld;
    tlsHeld = c.context;
}

Current::~Current() {
    if (!held_) return;
    tlsHeld = outer_;
    if (pushed_) {
        void* popped = nullptr;
        reinterpret_cast<CtxPopCurrentFn>(c_.driver.ctxPopCurrent)(&popped);
    }
    reinterpret_cast<ExchangeCaptureModeFn>(c_.driver.exchangeCaptureMode)(&mode_);  // the thread's own again
}

size_t Stager::thread_lane() {
    static std::atomic<size_t> next{0};
    thread_local const size_t lane = next.fetch_add(1, std::memory_order_relaxed);
    return lane;
}

std::string never_ended(const std::string& what, const StagingConfig& c) {
    return what + " did not finish on the GPU within " + seconds_text(c.timeout) + " s (" + c.timeoutSetting +
           "): GPU work ahead of it never ended";
}

// Pinned host memory of the Stager's context, lent by capacity and kept for the next transfer up
// to cacheBytes. Any thread may give memory back (a UCX callback, a transfer that failed). It
// lives as long as the Stager or memory it lent, whichever goes last.
class StagingPool {
public:
    explicit StagingPool(const StagingConfig& c) : c_(c) {
        void* p = nullptr;
        const Current current(c_);
        check(reinterpret_cast<MemHostAllocFn>(c_.driver.memHostAlloc)(&p, kWordsBytes, kMappedPinned),
              "cuMemHostAlloc (the staging's completion words)");
        words_ = static_cast<uint8_t*>(p);
        std::memset(words_, 0, kWordsBytes);
        const int r =
            reinterpret_cast<MemHostGetDevicePointerFn>(c_.driver.memHostGetDevicePointer)(&wordsDevice_, p, 0);
        if (r != 0) {
            reinterpret_cast<MemFreeHostFn>(c_.driver.memFreeHost)(p);
            check(r, "cuMemHostGetDevicePointer (the staging's completion words)");
        }
    }
    // The words stay while a copy may still write one: a copy given up on (abandon) may.
    ~StagingPool() {
        if (stats_.abandoned == 0) free({words_});
    }
    StagingPool(const StagingPool&) = delete;
    StagingPool& operator=(const StagingPool&) = delete;

    // Lane `lane`'s word, as the host reads it and as the device writes it.
    const std::atomic<uint32_t>* word(size_t lane) const {
        return reinterpret_cast<const std::atomic<uint32_t>*>(words_ + lane * kWordStride);
    }
    uint64_t word_device(size_t lane) const { return wordsDevice_ + lane * kWordStride; }

    // Memory of `capacity` bytes, or null when pinning failed or the pool is closed.
    uint8_t* take(size_t capacity) {
        {
            std::lock_guard lk(mu_);
            if (closed_) return nullptr;
            ++stats_.lent;
            auto it = cached_.find(capacity);
            if (it != cached_.end() && !it->second.empty()) {
                uint8_t* p = it->second.back();
                it->second.pop_back();
                stats_.cachedBytes -= capacity;
                ++stats_.reused;
                return p;
            }
        }
        void* p = nullptr;
        int r = 0;
        try {
            const Current current(c_);
            r = reinterpret_cast<MemHostAllocFn>(c_.driver.memHostAlloc)(&p, capacity, 0);
        } catch (const std::exception&) {
            r = -1;
        }
        std::lock_guard lk(mu_);
        if (r == 0) {
            ++stats_.pinned;
            return static_cast<uint8_t*>(p);
        }
        --stats_.lent;
        ++stats_.unpinned;
        back_.notify_all();
        return nullptr;
    }

    void give_back(uint8_t* p, size_t capacity) {
        std::unique_lock lk(mu_);
        --stats_.lent;
        back_.notify_all();
        if (!closed_ && stats_.cachedBytes + capacity <= c_.cacheBytes) {
            cached_[capacity].push_back(p);
            stats_.cachedBytes += capacity;
            return;
        }
        ++stats_.freed;
        lk.unlock();
        free({p});
    }

    // Memory lent whose copy may still run: never lent again (the context's destruction frees it).
    void abandon() {
        std::lock_guard lk(mu_);
        --stats_.lent;
        ++stats_.abandoned;
        back_.notify_all();
    }

    // 0 when `stream` is idle, kNotReady while it runs, else the CUresult of its failure.
    int query_stream(uintptr_t stream) const {
        const Current current(c_);  // nothing to do where the context is current already
        return reinterpret_cast<StreamQueryFn>(c_.driver.streamQuery)(reinterpret_cast<void*>(stream));
    }
    const StagingConfig& config() const { return c_; }
    // Why a copy that started at `since` has not ended, once the timeout passed; "" before.
    std::string late(int64_t since) const {
        if (now_ns() - since < static_cast<int64_t>(c_.timeout * 1e9)) return "";
        return never_ended("a copy of staged bytes", c_);
    }
    PoolStats stats() {
        PoolStats s;
        {
            std::lock_guard lk(mu_);
            s = stats_;
        }
        s.toHost = copies_[0].count.load(std::memory_order_relaxed);
        s.toHostBytes = copies_[0].bytes.load(std::memory_order_relaxed);
        s.toDevice = copies_[1].count.load(std::memory_order_relaxed);
        s.toDeviceBytes = copies_[1].bytes.load(std::memory_order_relaxed);
        s.copyNs = copyNs_.load(std::memory_order_relaxed);
        s.waitNs = waitNs_.load(std::memory_order_relaxed);
        s.queueNs = queueNs_.load(std::memory_order_relaxed);
        return s;
    }
    // The profile's counters: atomics beside the lock, as each copy of every lane counts itself.
    void count_copy(bool toDevice, size_t bytes) {
        Copies& c = copies_[toDevice ? 1 : 0];
        c.count.fetch_add(1, std::memory_order_relaxed);
        c.bytes.fetch_add(bytes, std::memory_order_relaxed);
    }
    void count_copy_ended(int64_t since) { copyNs_.fetch_add(now_ns() - since, std::memory_order_relaxed); }
    void count_wait(int64_t since) { waitNs_.fetch_add(now_ns() - since, std::memory_order_relaxed); }
    void count_queue(int64_t since) { queueNs_.fetch_add(now_ns() - since, std::memory_order_relaxed); }

    // Frees what the pool keeps; from now on memory given back is freed (while the context lives:
    // after, its destruction has freed it) and none is lent. With wait, first waits (at most the
    // timeout) for memory still lent.
    void close(bool wait) {
        std::vector<uint8_t*> all;
        {
            std::unique_lock lk(mu_);
            if (closed_) return;
            closed_ = true;
            const auto timeout = std::chrono::duration<double>(c_.timeout);
            if (wait && !back_.wait_for(lk, timeout, [&] { return stats_.lent == 0; }))
                std::fprintf(stderr,
                             "%s: staged GPU bytes of %zu transfers were still in use when the staging "
                             "closed (%s)\n",
                             c_.owner.c_str(), stats_.lent, c_.timeoutSetting.c_str());
            for (auto& [capacity, ps] : cached_) all.insert(all.end(), ps.begin(), ps.end());
            stats_.freed += all.size();
            cached_.clear();
            stats_.cachedBytes = 0;
        }
        free(all);
    }

private:
    void free(const std::vector<uint8_t*>& ps) {
        if (ps.empty()) return;
        try {
            const Current current(c_);
            for (uint8_t* p : ps) reinterpret_cast<MemFreeHostFn>(c_.driver.memFreeHost)(p);
        } catch (const std::exception&) {  // the context is gone: it freed them
        }
    }
    const StagingConfig c_;  // a copy: memory given back may outlive the Stager
    std::mutex mu_;
    std::condition_variable back_;
    std::map<size_t, std::vector<uint8_t*>> cached_;  // by capacity
    uint8_t* words_ = nullptr;                        // the lanes' words (kWordsBytes, mapped pinned)
    uint64_t wordsDevice_ = 0;                        // their address on the device
    PoolStats stats_;
    bool closed_ = false;
    struct Copies {
        std::atomic<uint64_t> count{0}, bytes{0};
    };
    Copies copies_[2];  // to the host, to the device
    std::atomic<uint64_t> copyNs_{0}, waitNs_{0}, queueNs_{0};
};

void Staged::swap(Staged& o) noexcept {
    std::swap(pool_, o.pool_);
    std::swap(data_, o.data_);
    std::swap(size_, o.size_);
    std::swap(capacity_, o.capacity_);
    std::swap(done_, o.done_);
    std::swap(ticket_, o.ticket_);
    std::swap(stream_, o.stream_);
    std::swap(since_, o.since_);
    std::swap(askAt_, o.askAt_);
}

// Tickets count on in a lane's word, wrapping: reached while fewer than 2^31 copies of the lane
// lie between the two.
bool Staged::ended() const { return static_cast<int32_t>(done_->load(std::memory_order_acquire) - ticket_) >= 0; }

bool Staged::copied() {
    if (done_ == nullptr) return true;
    if (!ended()) {
        const int64_t now = now_ns();
        if (now < askAt_) return false;
        askAt_ = now + kAskStreamNs;
        const int r = pool_->query_stream(stream_);
        if (r != 0 && r != kNotReady) {
            done_ = nullptr;  // the copy runs no more: its memory may be lent again
            check(r, "a copy of staged bytes (cuStreamQuery)");
        }
        if (!ended()) {  // (an idle stream has written the word: read again)
            const std::string late = pool_->late(since_);
            if (late.empty()) return false;
            throw std::runtime_error(late);
        }
    }
    done_ = nullptr;
    pool_->count_copy_ended(since_);
    return true;
}

void Staged::wait() {
    if (done_ == nullptr) return;
    const int64_t start = now_ns();
    poll_until([this] { return copied(); });
    pool_->count_wait(start);
}

void Staged::clear() {
    if (pool_) {
        if (done_ != nullptr && !ended())
            pool_->abandon();  // its copy may still run into or out of it
        else
            pool_->give_back(data_, capacity_);
    } else {
        delete[] data_;
    }
    pool_.reset();
    data_ = nullptr;
    done_ = nullptr;
    size_ = capacity_ = 0;
}

Stager::Stager(StagingConfig c) : c_(std::move(c)) {
    if (!c_.context || c_.streams.empty())
        throw std::invalid_argument("GPU staging needs a CUDA context and a stream of it");
    if (c_.streams.size() > kMaxLanes)
        throw std::invalid_argument("GPU staging takes at most " + std::to_string(kMaxLanes) + " streams, got " +
                                    std::to_string(c_.streams.size()));
    for (const uintptr_t stream : c_.streams) {
        if (!stream) throw std::invalid_argument("GPU staging: a null stream");
        lanes_.push_back(std::make_unique<Lane>());
        lanes_.back()->stream = stream;
    }
    for (const auto& [name, field] : kDriverEntryPoints)
        if (c_.driver.*field == 0) throw std::invalid_argument(std::string("GPU staging needs the driver's ") + name);
    if (!(c_.timeout > 0)) throw std::invalid_argument("GPU staging: timeout must be > 0 seconds");
    pool_ = std::make_shared<StagingPool>(c_);
}

Stager::~Stager() { pool_->close(false); }  // memory still lent is freed as it comes back

void Stager::close() { pool_->close(true); }

PoolStats Stager::stats() const { return pool_->stats(); }

void Stager::check_device_memory(uint64_t addr, uint64_t bytes) const {
    if (addr == 0 || bytes == 0) throw std::invalid_argument("GPU memory to stage must be a non-empty range");
    const Current current(c_);
    for (const uint64_t p : {addr, addr + bytes - 1}) {
        unsigned type = 0;
        const auto getAttribute = reinterpret_cast<PointerGetAttributeFn>(c_.driver.pointerGetAttribute);
        const int r = getAttribute(&type, kPointerMemoryType, p);
        if (r != 0 || type != kMemoryTypeDevice) {
            char where[64];
            std::snprintf(where, sizeof(where), "0x%llx", static_cast<unsigned long long>(p));
            throw std::invalid_argument(std::string("memory at ") + where + " is not CUDA device memory (" +
                                        (r != 0 ? "cuPointerGetAttribute: CUresult " + std::to_string(r)
                                                : "memory type " + std::to_string(type)) +
                                        "): register it as CPU memory, or pass GPU memory");
        }
    }
}

bool Stager::make_current(std::string& why) const {
    why = adopt(c_);
    return why.empty();
}

void Stager::check_healthy() const {
    std::lock_guard lk(brokenMu_);
    if (!broken_.empty()) throw std::runtime_error("an earlier GPU copy never finished: " + broken_);
}

Stager::Op::Op(Stager& s, size_t lane)
    : s_(s), lane_(lane % s.lanes_.size()), lock_(s.lanes_[lane_]->mu), current_(s.c_) {
    s.check_healthy();
}

void Stager::Op::wait_stream(const char* what) {
    const StagingConfig& c = s_.c_;
    void* const queried = reinterpret_cast<void*>(stream());
    const int64_t start = now_ns();
    bool told = false;
    poll_until([&] {
        const int r = reinterpret_cast<StreamQueryFn>(c.driver.streamQuery)(queried);
        if (r == 0) return true;
        if (r != kNotReady) check(r, "cuStreamQuery");
        const double waited = (now_ns() - start) * 1e-9;
        if (waited >= c.timeout) {
            const std::string why = never_ended(what, c);
            std::lock_guard lk(s_.brokenMu_);
            s_.broken_ = why;
            throw std::runtime_error(why);
        }
        if (!told && waited >= 1.0) {
            told = true;
            std::fprintf(stderr, "%s: %s has waited 1 s for the GPU\n", c.owner.c_str(), what);
        }
        return false;
    });
}

Staged Stager::staging(size_t bytes) {
    Staged s;
    const size_t capacity = capacity_for(bytes);
    s.data_ = pool_->take(capacity);
    if (s.data_ != nullptr) {
        s.pool_ = pool_;
        s.capacity_ = capacity;
    } else {
        s.data_ = new uint8_t[bytes];
        s.capacity_ = bytes;
    }
    s.size_ = bytes;
    return s;
}

Staged Stager::landing(size_t bytes) {
    check_healthy();
    return staging(bytes);  // the pool makes the context current for an allocation
}

void Stager::follow(Op& op, Staged& s, bool waitNow, const char* what) {
    if (waitNow || !s.pool_) {  // heap memory is copied through at once: the driver waits for pageable copies
        const int64_t start = now_ns();
        op.wait_stream(what);
        pool_->count_wait(start);
        pool_->count_copy_ended(start);
        return;
    }
    Lane& lane = *lanes_[op.lane()];
    const uint32_t ticket = lane.issued + 1;
    // Before the word is queued: the word cannot be written before this, however late this thread runs on.
    const int64_t queued = now_ns();
    const int r = reinterpret_cast<StreamWriteValue32Fn>(c_.driver.streamWriteValue32)(
        reinterpret_cast<void*>(op.stream()), pool_->word_device(op.lane()), ticket, 0);
    if (r != 0) {  // the copy runs without a word to tell its end: waited for here
        try {
            op.wait_stream(what);
        } catch (const std::exception&) {  // the Stager is broken: this ticket is never written
            s.done_ = pool_->word(op.lane());
            s.ticket_ = ticket;  // so s's memory, which the copy may still use, is never lent again
        }
        check(r, "cuStreamWriteValue32");
    }
    lane.issued = ticket;
    s.done_ = pool_->word(op.lane());
    s.ticket_ = ticket;
    s.stream_ = op.stream();
    s.since_ = queued;
    s.askAt_ = queued + kAskStreamNs;
}

void Stager::queue_copies(Op& op, bool toDevice, Staged& host, const DeviceRange* ranges, size_t count) {
    void* const stream = reinterpret_cast<void*>(op.stream());
    auto copy = [&](uint64_t device, uint8_t* at, size_t bytes) {
        if (toDevice)
            check(reinterpret_cast<MemcpyHtoDAsyncFn>(c_.driver.memcpyHtoDAsync)(device, at, bytes, stream),
                  "cuMemcpyHtoDAsync");
        else
            check(reinterpret_cast<MemcpyDtoHAsyncFn>(c_.driver.memcpyDtoHAsync)(at, device, bytes, stream),
                  "cuMemcpyDtoHAsync");
    };
    if (count == 1) return copy(ranges[0].addr, host.data(), ranges[0].bytes);
    // One copy per run of ranges that continue one another in device memory (their bytes follow
    // on in host memory too).
    std::vector<uint64_t> devices, hosts;
    std::vector<size_t> sizes;
    uint64_t total = 0;
    for (size_t i = 0; i < count; total += ranges[i++].bytes) {
        const DeviceRange& r = ranges[i];
        if (r.bytes == 0) continue;
        if (!sizes.empty() && devices.back() + sizes.back() == r.addr) {
            sizes.back() += r.bytes;
            continue;
        }
        devices.push_back(r.addr);
        hosts.push_back(reinterpret_cast<uint64_t>(host.data() + total));
        sizes.push_back(r.bytes);
    }
    // (Heap memory, where pinning failed, goes one call each: the driver copies it through at once.)
    const bool batch = sizes.size() > 1 && host.pinned() && batched();
    if (batch) {
        std::vector<uint64_t>& dsts = toDevice ? devices : hosts;
        std::vector<uint64_t>& srcs = toDevice ? hosts : devices;
        const int r =
            memcpy_batch(c_.driver.memcpyBatchAsync, dsts.data(), srcs.data(), sizes.data(), sizes.size(), op.stream());
        if (r == 0) return;
        if (!batch_refused(r)) check(r, "cuMemcpyBatchAsync");
    }
    for (size_t i = 0; i < sizes.size(); ++i) copy(devices[i], reinterpret_cast<uint8_t*>(hosts[i]), sizes[i]);
    // The same copies went one call each: the batch form, not a copy, was what the driver refused.
    if (batch && !batchRefused_.exchange(true))
        std::fprintf(stderr, "%s: the driver refuses cuMemcpyBatchAsync; copies of several ranges go one call each\n",
                     c_.owner.c_str());
}

void Stager::to_device(uint64_t dst, Staged& src, bool wait, size_t lane) {
    const DeviceRange range{dst, src.size()};
    to_device(&range, 1, src, wait, lane);
}

void Stager::to_device(const DeviceRange* ranges, size_t count, Staged& src, bool wait, size_t lane) {
    uint64_t bytes = 0;
    for (size_t i = 0; i < count; ++i) bytes += ranges[i].bytes;
    if (count == 0 || bytes > src.size())
        throw std::invalid_argument("a copy to the GPU needs ranges that the staged bytes fill");
    queue_to_device(ranges, count, bytes, src, nullptr, wait, lane, "a copy to the GPU");
}

void Stager::to_device_then_store(uint64_t dst, Staged& src, uint64_t word, uint64_t value, bool wait, size_t lane) {
    if (word % 8 != 0) throw std::invalid_argument("a 64-bit store needs an 8-byte aligned device address");
    const DeviceRange range{dst, src.size()};
    const WordStore store{word, value};
    queue_to_device(&range, src.empty() ? 0 : 1, src.size(), src, &store, wait || src.empty(), lane,
                    "a copy to the GPU and a store behind it");
}

void Stager::queue_to_device(const DeviceRange* ranges, size_t count, uint64_t bytes, Staged& src,
                             const WordStore* store, bool wait, size_t lane, const char* what) {
    const int64_t start = now_ns();
    Op op(*this, lane);
    if (count > 0) {
        queue_copies(op, true, src, ranges, count);
        pool_->count_copy(true, bytes);
    }
    // Flags 0: the store waits for the stream's earlier writes (the bytes) to be visible.
    if (store != nullptr)
        check(reinterpret_cast<StreamWriteValue64Fn>(c_.driver.streamWriteValue64)(reinterpret_cast<void*>(op.stream()),
                                                                                   store->word, store->value, 0),
              "cuStreamWriteValue64");
    pool_->count_queue(start);
    follow(op, src, wait, what);
}

Staged Stager::to_host(uint64_t src, size_t bytes, bool wait, size_t lane) {
    const DeviceRange range{src, bytes};
    return to_host(&range, 1, wait, lane);
}

Staged Stager::to_host(const DeviceRange* ranges, size_t count, bool wait, size_t lane) {
    uint64_t bytes = 0;
    for (size_t i = 0; i < count; ++i) bytes += ranges[i].bytes;
    if (count == 0) throw std::invalid_argument("a copy from the GPU needs a range");
    Staged s = staging(bytes);  // before the lane's lock: a new allocation may take a while
    const int64_t start = now_ns();
    Op op(*this, lane);
    queue_copies(op, false, s, ranges, count);
    pool_->count_copy(false, bytes);
    pool_->count_queue(start);
    follow(op, s, wait, "a copy from the GPU");
    return s;
}

}  // namespace mori::gpu
