// The UCX engine's target-side operations on GPU memory (see ucx_gpu.hpp).
#include "ucx_gpu.hpp"

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <cstring>
#include <cstdio>
#include <map>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "ucx_engine.hpp"

namespace mori::ucx {

namespace {

// Driver entry points (CUresult is an int; handles are pointers).
using CtxSetCurrentFn = int (*)(void* ctx);
using CtxPopCurrentFn = int (*)(void** ctx);
using ExchangeCaptureModeFn = int (*)(int* mode);
constexpr int kCaptureRelaxed = 2;  // CU_STREAM_CAPTURE_MODE_RELAXED
using LaunchKernelFn = int (*)(void* f, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by, unsigned bz,
                               unsigned shared, void* stream, void** params, void** extra);
using StreamQueryFn = int (*)(void* stream);
constexpr int kNotReady = 600;  // CUDA_ERROR_NOT_READY
using MemcpyHtoDAsyncFn = int (*)(uint64_t dst, const void* src, size_t bytes, void* stream);
using MemcpyDtoHAsyncFn = int (*)(void* dst, uint64_t src, size_t bytes, void* stream);
using MemHostAllocFn = int (*)(void** p, size_t bytes, unsigned flags);
using MemFreeHostFn = int (*)(void* p);
using EventCreateFn = int (*)(void** event, unsigned flags);
using EventRecordFn = int (*)(void* event, void* stream);
using EventQueryFn = int (*)(void* event);
using EventDestroyFn = int (*)(void* event);
constexpr unsigned kEventDisableTiming = 2;  // CU_EVENT_DISABLE_TIMING

// Staged memory comes in powers of two from 64 KiB, so that transfers of about one size reuse
// it; the pool keeps at most kStagingCacheBytes of it between transfers (more is freed).
constexpr size_t kStagingMinBytes = size_t{64} << 10;
constexpr size_t kStagingCacheBytes = size_t{256} << 20;

size_t staging_capacity(size_t bytes) {
    size_t c = kStagingMinBytes;
    while (c < bytes) c <<= 1;
    return c;
}

// The context an engine thread made current for good (GpuWords::make_current, with its
// stream-capture mode relaxed): event queries there need no push (a worker polls one each
// progress while a copy runs; a push and a pop around it slowed the progress it shares a thread with).
thread_local uintptr_t tlsContext = 0;

// Why an operation (what) failed: the GPU did not finish it within the timeout.
std::string never_ended(const std::string& what, const GpuWordsConfig& c) {
    char secs[32];
    std::snprintf(secs, sizeof(secs), "%g", c.timeout);
    return what + " did not finish on the GPU within " + secs + " s (" + c.timeoutSetting +
           "): GPU work ahead of it never ended";
}

void check(int result, const char* call) {
    if (result != 0)
        throw std::runtime_error(std::string(call) + " failed on the target's GPU (CUresult " + std::to_string(result) +
                                 ")");
}

}  // namespace

// Pinned host memory of the engine's context for staged bytes, lent by capacity and kept for
// the next transfer up to kStagingCacheBytes. Allocated and freed with the context pushed (any
// thread may give memory back: a UCX callback, a part that goes).
class StagingPool {
public:
    explicit StagingPool(const GpuWordsConfig& c) : c_(c) {}

    // Memory of `capacity` bytes, or null when pinning failed (context current).
    uint8_t* take(size_t capacity) {
        {
            std::lock_guard lk(mu_);
            if (closed_) return nullptr;
            ++lent_;
            auto it = cached_.find(capacity);
            if (it != cached_.end() && !it->second.empty()) {
                uint8_t* p = it->second.back();
                it->second.pop_back();
                cachedBytes_ -= capacity;
                return p;
            }
        }
        void* p = nullptr;
        if (reinterpret_cast<MemHostAllocFn>(c_.memHostAlloc)(&p, capacity, 0) == 0) return static_cast<uint8_t*>(p);
        std::lock_guard lk(mu_);
        --lent_;
        back_.notify_all();
        return nullptr;
    }

    void give_back(uint8_t* p, size_t capacity) {
        std::unique_lock lk(mu_);
        --lent_;
        back_.notify_all();
        if (closed_) return;  // the context's destruction frees it
        if (cachedBytes_ + capacity <= kStagingCacheBytes) {
            cached_[capacity].push_back(p);
            cachedBytes_ += capacity;
            return;
        }
        lk.unlock();
        free({p});
    }

    // Memory lent whose copy may still run: never lent again (the context's destruction frees it).
    void abandon() {
        std::lock_guard lk(mu_);
        --lent_;
        back_.notify_all();
    }

    // An event to record after one copy (context current), and given back once that ended.
    void* take_event() {
        {
            std::lock_guard lk(mu_);
            if (!events_.empty()) {
                void* e = events_.back();
                events_.pop_back();
                return e;
            }
        }
        void* e = nullptr;
        check(reinterpret_cast<EventCreateFn>(c_.eventCreate)(&e, kEventDisableTiming), "cuEventCreate");
        return e;
    }
    void give_event(void* e) {
        std::lock_guard lk(mu_);
        if (!closed_) events_.push_back(e);  // else the context's destruction frees it
    }
    // 0 once the copy event follows has ended, kNotReady before, else the CUresult of its failure.
    int query(void* event) const {
        const auto eventQuery = reinterpret_cast<EventQueryFn>(c_.eventQuery);
        if (tlsContext == c_.context) return eventQuery(event);
        const GpuWords::Current current(c_);
        return eventQuery(event);
    }
    // Why a copy that started at `since` has not ended, once the timeout passed; "" before.
    std::string late(int64_t since) const {
        if (now_ns() - since < static_cast<int64_t>(c_.timeout * 1e9)) return "";
        return never_ended("a copy of staged bytes", c_);
    }

    void close() {
        std::vector<uint8_t*> all;
        std::vector<void*> events;
        {
            std::unique_lock lk(mu_);
            if (closed_) return;
            closed_ = true;
            if (!back_.wait_for(lk, std::chrono::duration<double>(c_.timeout), [&] { return lent_ == 0; }))
                std::fprintf(stderr, "mori UCX engine: staged GPU bytes of %zu transfers were still in use when the "
                                     "GPU's context was about to go\n", lent_);
            for (auto& [capacity, ps] : cached_) all.insert(all.end(), ps.begin(), ps.end());
            cached_.clear();
            cachedBytes_ = 0;
            events.swap(events_);
        }
        free(all, events);
    }

private:
    void free(const std::vector<uint8_t*>& ps, const std::vector<void*>& events = {}) {
        if (ps.empty() && events.empty()) return;
        try {
            const GpuWords::Current current(c_);
            for (uint8_t* p : ps) reinterpret_cast<MemFreeHostFn>(c_.memFreeHost)(p);
            for (void* e : events) reinterpret_cast<EventDestroyFn>(c_.eventDestroy)(e);
        } catch (const std::exception&) {  // the context is gone: it freed them
        }
    }
    const GpuWordsConfig c_;  // a copy: memory given back may outlive the GpuWords
    std::mutex mu_;
    std::condition_variable back_;
    std::map<size_t, std::vector<uint8_t*>> cached_;  // by capacity
    std::vector<void*> events_;                       // events free for the next copy
    size_t cachedBytes_ = 0, lent_ = 0;
    bool closed_ = false;
};

void Staged::swap(Staged& o) noexcept {
    std::swap(pool_, o.pool_);
    std::swap(data_, o.data_);
    std::swap(size_, o.size_);
    std::swap(capacity_, o.capacity_);
    std::swap(event_, o.event_);
    std::swap(since_, o.since_);
}

bool Staged::copied() {
    if (event_ == nullptr) return true;
    const int r = pool_->query(event_);
    if (r == kNotReady) {
        const std::string late = pool_->late(since_);
        if (late.empty()) return false;
        throw std::runtime_error(late);
    }
    pool_->give_event(event_);
    event_ = nullptr;
    check(r, "a copy of staged bytes (cuEventQuery)");
    return true;
}

void Staged::clear() {
    if (pool_) {
        int r = 0;  // the copy's state: 0 (none, or ended), kNotReady (may still run into or out of it)
        if (event_ != nullptr) {
            try {
                r = pool_->query(event_);
            } catch (const std::exception&) {
                r = kNotReady;
            }
            if (r != kNotReady) pool_->give_event(event_);  // else the context's destruction frees it
        }
        if (r == kNotReady) pool_->abandon();
        else pool_->give_back(data_, capacity_);
    } else {
        delete[] data_;
    }
    pool_.reset();
    data_ = nullptr;
    event_ = nullptr;
    size_ = capacity_ = 0;
}

GpuWords::GpuWords(const GpuWordsConfig& c) : c_(c) {
    if (!c.context || !c.function || !c.result || !c.resultDev || !c.bounce || c.bounceBytes == 0)
        throw std::invalid_argument("GPU word operations need a context, a kernel, a result word and a bounce buffer");
    for (const auto& [name, field] : kGpuEntryPoints)
        if (c.*field == 0) throw std::invalid_argument(std::string("GPU word operations need the driver's ") + name);
    if (!(c.timeout > 0)) throw std::invalid_argument("timeout must be > 0 seconds");
    pool_ = std::make_shared<StagingPool>(c_);
}

bool GpuWords::make_current(std::string& why) const {
    tlsContext = 0;
    int r = reinterpret_cast<CtxSetCurrentFn>(c_.ctxSetCurrent)(reinterpret_cast<void*>(c_.context));
    if (r != 0) {
        why = "cuCtxSetCurrent failed (CUresult " + std::to_string(r) + ")";
        return false;
    }
    int mode = kCaptureRelaxed;
    r = reinterpret_cast<ExchangeCaptureModeFn>(c_.exchangeCaptureMode)(&mode);
    if (r != 0) why = "cuThreadExchangeStreamCaptureMode failed (CUresult " + std::to_string(r) + ")";
    else tlsContext = c_.context;
    return r == 0;
}

void Engine::apply_cuda_context(uint64_t& seen) const {
    const uint64_t epoch = gpuEpoch_.load(std::memory_order_acquire);
    if (epoch == seen) return;
    seen = epoch;
    const std::shared_ptr<GpuWords> g = gpu_words();
    std::string why;
    if (!g) tlsContext = 0;
    if (g && !g->make_current(why))
        std::fprintf(stderr, "mori UCX engine '%s': a thread of the engine cannot use the GPU's context: %s\n",
                     opts_.name.c_str(), why.c_str());
}

void GpuWords::wait(const char* what) {
    void* stream = reinterpret_cast<void*>(c_.stream);
    const int64_t start = now_ns();
    bool told = false;
    for (int polls = 0;; ++polls) {
        const int r = reinterpret_cast<StreamQueryFn>(c_.streamQuery)(stream);
        if (r == 0) break;
        if (r != kNotReady) check(r, "cuStreamQuery");
        const double waited = (now_ns() - start) * 1e-9;
        if (waited >= c_.timeout) {
            broken_ = never_ended(what, c_);
            throw std::runtime_error(broken_);
        }
        if (!told && waited >= 1.0) {
            told = true;
            std::fprintf(stderr, "mori UCX engine: %s for a peer has waited 1 s for this GPU (every peer of the "
                                 "engine waits meanwhile)\n", what);
        }
        // An operation takes microseconds: poll, then nap so a stalled GPU costs no core.
        if (polls < 200)
            std::this_thread::yield();
        else
            std::this_thread::sleep_for(std::chrono::microseconds(50));
    }
}

void GpuWords::check_healthy() const {
    if (!broken_.empty()) throw std::runtime_error("an earlier GPU operation never finished: " + broken_);
}

GpuWords::Current::Current(const GpuWordsConfig& c) : c_(c), mode_(kCaptureRelaxed) {
    check(reinterpret_cast<ExchangeCaptureModeFn>(c.exchangeCaptureMode)(&mode_), "cuThreadExchangeStreamCaptureMode");
    const int r = reinterpret_cast<CtxSetCurrentFn>(c.ctxPushCurrent)(reinterpret_cast<void*>(c.context));
    if (r != 0) {
        reinterpret_cast<ExchangeCaptureModeFn>(c.exchangeCaptureMode)(&mode_);
        check(r, "cuCtxPushCurrent");
    }
}

GpuWords::Current::~Current() {
    void* popped = nullptr;
    reinterpret_cast<CtxPopCurrentFn>(c_.ctxPopCurrent)(&popped);
    reinterpret_cast<ExchangeCaptureModeFn>(c_.exchangeCaptureMode)(&mode_);  // the thread's own again
}

void GpuWords::copy_in(uint64_t dst, const void* src, size_t bytes, bool waitLast) {
    const auto* from = static_cast<const uint8_t*>(src);
    for (size_t done = 0; done < bytes;) {
        const size_t n = std::min(bytes - done, c_.bounceBytes);
        std::memcpy(reinterpret_cast<void*>(c_.bounce), from + done, n);
        check(reinterpret_cast<MemcpyHtoDAsyncFn>(c_.memcpyHtoDAsync)(dst + done, reinterpret_cast<void*>(c_.bounce),
                                                                      n, reinterpret_cast<void*>(c_.stream)),
              "cuMemcpyHtoDAsync");
        done += n;
        if (done < bytes || waitLast) wait("a copy to the GPU");  // the bounce buffer is reused
    }
}

Staged GpuWords::staging(size_t bytes) {
    Staged s;
    const size_t capacity = staging_capacity(bytes);
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

Staged GpuWords::landing(size_t bytes) {
    std::lock_guard lk(mu_);
    check_healthy();
    const Current current(c_);
    return staging(bytes);
}

void GpuWords::follow(Staged& s, bool waitNow, const char* what) {
    if (waitNow) {
        wait(what);
        return;
    }
    void* event = pool_->take_event();
    const int r = reinterpret_cast<EventRecordFn>(c_.eventRecord)(event, reinterpret_cast<void*>(c_.stream));
    if (r != 0) {
        pool_->give_event(event);
        check(r, "cuEventRecord");
    }
    s.event_ = event;
    s.since_ = now_ns();
}

void GpuWords::to_device(uint64_t dst, Staged& src, bool wait) {
    std::lock_guard lk(mu_);
    check_healthy();
    const Current current(c_);
    if (!src.pool_) {
        copy_in(dst, src.data(), src.size(), true);
        return;
    }
    check(reinterpret_cast<MemcpyHtoDAsyncFn>(c_.memcpyHtoDAsync)(dst, src.data(), src.size(),
                                                                  reinterpret_cast<void*>(c_.stream)),
          "cuMemcpyHtoDAsync");
    follow(src, wait, "a copy to the GPU");
}

Staged GpuWords::to_host(uint64_t src, size_t bytes, bool wait) {
    std::lock_guard lk(mu_);
    check_healthy();
    const Current current(c_);
    Staged s = staging(bytes);
    void* stream = reinterpret_cast<void*>(c_.stream);
    const auto dtoh = reinterpret_cast<MemcpyDtoHAsyncFn>(c_.memcpyDtoHAsync);
    if (s.pool_) {
        check(dtoh(s.data(), src, bytes, stream), "cuMemcpyDtoHAsync");
        follow(s, wait, "a copy from the GPU");
        return s;
    }
    for (size_t done = 0; done < bytes;) {  // heap memory: through the bounce buffer
        const size_t n = std::min(bytes - done, c_.bounceBytes);
        check(dtoh(reinterpret_cast<void*>(c_.bounce), src + done, n, stream), "cuMemcpyDtoHAsync");
        this->wait("a copy from the GPU");
        std::memcpy(s.data() + done, reinterpret_cast<const void*>(c_.bounce), n);
        done += n;
    }
    return s;
}

void GpuWords::close_staging() { pool_->close(); }

uint64_t GpuWords::apply(uint64_t addr, uint8_t op, int width, uint64_t value, uint64_t compare, uint64_t dst,
                         const void* src, size_t bytes) {
    std::lock_guard lk(mu_);
    check_healthy();
    const Current current(c_);
    copy_in(dst, src, bytes, addr == 0);  // before the kernel on the same stream
    if (addr == 0) return 0;              // the copy alone
    // The kernel's parameters: (addr, op, width, value, compare, result), as mori.core.ucx_atomic's source.
    uint64_t a = addr, v = value, cmp = compare, res = c_.resultDev;
    int o = op, w = width;
    void* params[] = {&a, &o, &w, &v, &cmp, &res};
    check(reinterpret_cast<LaunchKernelFn>(c_.launchKernel)(reinterpret_cast<void*>(c_.function), 1, 1, 1, 1, 1, 1, 0,
                                                            reinterpret_cast<void*>(c_.stream), params, nullptr),
          "cuLaunchKernel");
    wait("an atomic's kernel");
    return *reinterpret_cast<volatile uint64_t*>(c_.result);
}

}  // namespace mori::ucx
