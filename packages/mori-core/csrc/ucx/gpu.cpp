// The UCX engine's target-side operations on GPU memory (see ucx/gpu.hpp).
#include "ucx/gpu.hpp"

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <stdexcept>
#include <string>

#include "base/trace.hpp"
#include "ucx/engine.hpp"

namespace mori::ucx {

namespace {

// Driver entry points (CUresult is an int; handles are pointers).
using LaunchKernelFn = int (*)(void* f, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by, unsigned bz,
                               unsigned shared, void* stream, void** params, void** extra);
using MemcpyHtoDAsyncFn = int (*)(uint64_t dst, const void* src, size_t bytes, void* stream);

void check(int result, const char* call) {
    if (result != 0)
        throw std::runtime_error(std::string(call) + " failed on the target's GPU (CUresult " + std::to_string(result) +
                                 ")");
}

gpu::StagingConfig config_of(const GpuWordsConfig& c) {
    gpu::StagingConfig s;
    s.context = c.context;
    s.streams = {c.stream};
    s.driver = c.driver;
    s.timeout = c.timeout;
    s.timeoutSetting = c.timeoutSetting;
    s.owner = "mori UCX engine";
    return s;
}

}  // namespace

GpuWords::GpuWords(const GpuWordsConfig& c) : c_(c) {
    if (!c.context || !c.function || !c.result || !c.resultDev || !c.bounce || c.bounceBytes == 0 || !c.launchKernel)
        throw std::invalid_argument(
            "GPU word operations need a context, a kernel, cuLaunchKernel, a result word and a bounce buffer");
    stager_ = std::make_shared<gpu::Stager>(config_of(c));  // checks the rest
}

GpuWords::GpuWords(std::shared_ptr<gpu::Stager> stager) : stager_(std::move(stager)), ownsStager_(false) {
    if (!stager_) throw std::invalid_argument("staging GPU memory needs a Stager");
    c_.context = stager_->config().context;
    c_.stream = stager_->config().streams.front();  // lane 0: atomics and staged copies in one order
    c_.stage = true;
}

namespace {

std::vector<gpu::DeviceRange> ranges_of(const std::vector<api::Iov>& blocks) {
    std::vector<gpu::DeviceRange> ranges(blocks.size());
    for (size_t i = 0; i < blocks.size(); ++i)
        ranges[i] = gpu::DeviceRange{reinterpret_cast<uint64_t>(blocks[i].buffer), blocks[i].length};
    return ranges;
}

}  // namespace

Staged GpuWords::to_host(const std::vector<api::Iov>& blocks, bool wait) {
    if (blocks.size() == 1) return to_host(reinterpret_cast<uint64_t>(blocks[0].buffer), blocks[0].length, wait);
    const std::vector<gpu::DeviceRange> ranges = ranges_of(blocks);
    return stager_->to_host(ranges.data(), ranges.size(), wait);
}

void GpuWords::to_device(const std::vector<api::Iov>& blocks, Staged& src, bool wait) {
    if (blocks.size() == 1) return stager_->to_device(reinterpret_cast<uint64_t>(blocks[0].buffer), src, wait);
    const std::vector<gpu::DeviceRange> ranges = ranges_of(blocks);
    stager_->to_device(ranges.data(), ranges.size(), src, wait);
}

void GpuWords::close_staging() {
    if (ownsStager_) stager_->close();
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

void GpuWords::copy_in(gpu::Stager::Op& op, uint64_t dst, const void* src, size_t bytes, bool waitLast) {
    const auto* from = static_cast<const uint8_t*>(src);
    for (size_t done = 0; done < bytes;) {
        const size_t n = std::min(bytes - done, c_.bounceBytes);
        std::memcpy(reinterpret_cast<void*>(c_.bounce), from + done, n);
        check(reinterpret_cast<MemcpyHtoDAsyncFn>(c_.driver.memcpyHtoDAsync)(
                  dst + done, reinterpret_cast<void*>(c_.bounce), n, reinterpret_cast<void*>(op.stream())),
              "cuMemcpyHtoDAsync");
        done += n;
        if (done < bytes || waitLast) op.wait_stream("a copy to the GPU");  // the bounce buffer is reused
    }
}

Staged GpuWords::signal(uint64_t addr, uint64_t value, uint64_t dst, const void* src, size_t bytes, bool wait) {
    if (!serves_words()) throw std::runtime_error("this engine serves no atomics on GPU memory");
    Staged staged;
    if (bytes != 0) {
        staged = stager_->landing(bytes);
        std::memcpy(staged.data(), src, bytes);
    }
    stager_->to_device_then_store(dst, staged, addr, value, wait);  // on lane 0, in order with the rest
    trace::mark('W', wait || staged.empty());
    return staged;
}

uint64_t GpuWords::apply(uint64_t addr, uint8_t op, int width, uint64_t value, uint64_t compare, uint64_t dst,
                         const void* src, size_t bytes) {
    if (!serves_words()) throw std::runtime_error("this engine serves no atomics on GPU memory");
    gpu::Stager::Op stream(*stager_);
    copy_in(stream, dst, src, bytes, addr == 0);  // before the kernel on the same stream
    if (addr == 0) return 0;                      // the copy alone
    // The kernel's parameters: (addr, op, width, value, compare, result), as mori.core.ucx_atomic's source.
    uint64_t a = addr, v = value, cmp = compare, res = c_.resultDev;
    int o = op, w = width;
    void* params[] = {&a, &o, &w, &v, &cmp, &res};
    check(reinterpret_cast<LaunchKernelFn>(c_.launchKernel)(reinterpret_cast<void*>(c_.function), 1, 1, 1, 1, 1, 1, 0,
                                                            reinterpret_cast<void*>(stream.stream()), params, nullptr),
          "cuLaunchKernel");
    stream.wait_stream("an atomic's kernel");
    return *reinterpret_cast<volatile uint64_t*>(c_.result);
}

}  // namespace mori::ucx
