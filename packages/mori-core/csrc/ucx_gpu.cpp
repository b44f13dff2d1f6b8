// The UCX engine's target-side operations on GPU memory (see ucx_gpu.hpp).
#include "ucx_gpu.hpp"

#include <algorithm>
#include <chrono>
#include <cstring>
#include <cstdio>
#include <stdexcept>
#include <string>
#include <thread>

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

void check(int result, const char* call) {
    if (result != 0)
        throw std::runtime_error(std::string(call) + " failed on the target's GPU (CUresult " + std::to_string(result) +
                                 ")");
}

}  // namespace

GpuWords::GpuWords(const GpuWordsConfig& c) : c_(c) {
    if (!c.context || !c.function || !c.result || !c.resultDev || !c.ctxSetCurrent || !c.launchKernel ||
        !c.ctxPushCurrent || !c.ctxPopCurrent || !c.exchangeCaptureMode || !c.streamQuery || !c.memcpyHtoDAsync ||
        !c.memcpyDtoHAsync || !c.bounce || c.bounceBytes == 0)
        throw std::invalid_argument("GPU word operations need a context, a kernel, a result word, a bounce buffer "
                                    "and eight entry points");
    if (!(c.timeout > 0)) throw std::invalid_argument("timeout must be > 0 seconds");
}

bool GpuWords::make_current(std::string& why) const {
    int r = reinterpret_cast<CtxSetCurrentFn>(c_.ctxSetCurrent)(reinterpret_cast<void*>(c_.context));
    if (r != 0) {
        why = "cuCtxSetCurrent failed (CUresult " + std::to_string(r) + ")";
        return false;
    }
    int mode = kCaptureRelaxed;
    r = reinterpret_cast<ExchangeCaptureModeFn>(c_.exchangeCaptureMode)(&mode);
    if (r != 0) why = "cuThreadExchangeStreamCaptureMode failed (CUresult " + std::to_string(r) + ")";
    return r == 0;
}

void Engine::apply_cuda_context(uint64_t& seen) const {
    const uint64_t epoch = gpuEpoch_.load(std::memory_order_acquire);
    if (epoch == seen) return;
    seen = epoch;
    const std::shared_ptr<GpuWords> g = gpu_words();
    std::string why;
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
            char secs[32];
            std::snprintf(secs, sizeof(secs), "%g", c_.timeout);
            broken_ = std::string(what) + " did not finish on the target's GPU within " + secs + " s (" +
                      c_.timeoutSetting + "): GPU work ahead of it never ended";
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

GpuWords::Current::Current(const GpuWords& g) : g_(g), mode_(kCaptureRelaxed) {
    if (!g.broken_.empty()) throw std::runtime_error("an earlier GPU operation never finished: " + g.broken_);
    check(reinterpret_cast<ExchangeCaptureModeFn>(g.c_.exchangeCaptureMode)(&mode_), "cuThreadExchangeStreamCaptureMode");
    const int r = reinterpret_cast<CtxSetCurrentFn>(g.c_.ctxPushCurrent)(reinterpret_cast<void*>(g.c_.context));
    if (r != 0) {
        reinterpret_cast<ExchangeCaptureModeFn>(g.c_.exchangeCaptureMode)(&mode_);
        check(r, "cuCtxPushCurrent");
    }
}

GpuWords::Current::~Current() {
    void* popped = nullptr;
    reinterpret_cast<CtxPopCurrentFn>(g_.c_.ctxPopCurrent)(&popped);
    reinterpret_cast<ExchangeCaptureModeFn>(g_.c_.exchangeCaptureMode)(&mode_);  // the thread's own again
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

void GpuWords::to_device(uint64_t dst, const void* src, size_t bytes) {
    std::lock_guard lk(mu_);
    const Current current(*this);
    copy_in(dst, src, bytes, true);
}

void GpuWords::to_host(void* dst, uint64_t src, size_t bytes) {
    std::lock_guard lk(mu_);
    const Current current(*this);
    auto* to = static_cast<uint8_t*>(dst);
    for (size_t done = 0; done < bytes;) {
        const size_t n = std::min(bytes - done, c_.bounceBytes);
        check(reinterpret_cast<MemcpyDtoHAsyncFn>(c_.memcpyDtoHAsync)(reinterpret_cast<void*>(c_.bounce), src + done,
                                                                      n, reinterpret_cast<void*>(c_.stream)),
              "cuMemcpyDtoHAsync");
        wait("a copy from the GPU");
        std::memcpy(to + done, reinterpret_cast<const void*>(c_.bounce), n);
        done += n;
    }
}

uint64_t GpuWords::apply(uint64_t addr, uint8_t op, int width, uint64_t value, uint64_t compare, uint64_t dst,
                         const void* src, size_t bytes) {
    std::lock_guard lk(mu_);
    const Current current(*this);
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
