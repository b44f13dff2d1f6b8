// The UCX engine's target-side operations on GPU memory (see ucx_gpu.hpp).
#include "ucx_gpu.hpp"

#include <stdexcept>
#include <string>

namespace mori::ucx {

namespace {

// Driver entry points (CUresult is an int; handles are pointers).
using CtxSetCurrentFn = int (*)(void* ctx);
using LaunchKernelFn = int (*)(void* f, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by, unsigned bz,
                               unsigned shared, void* stream, void** params, void** extra);
using StreamSynchronizeFn = int (*)(void* stream);
using MemcpyHtoDAsyncFn = int (*)(uint64_t dst, const void* src, size_t bytes, void* stream);

void check(int result, const char* call) {
    if (result != 0)
        throw std::runtime_error(std::string(call) + " failed on the target's GPU (CUresult " + std::to_string(result) +
                                 ")");
}

}  // namespace

GpuWords::GpuWords(const GpuWordsConfig& c) : c_(c) {
    if (!c.context || !c.function || !c.result || !c.resultDev || !c.ctxSetCurrent || !c.launchKernel ||
        !c.streamSynchronize || !c.memcpyHtoDAsync)
        throw std::invalid_argument("GPU word operations need a context, a kernel, a result word and four entry points");
}

uint64_t GpuWords::apply(uint64_t addr, uint8_t op, int width, uint64_t value, uint64_t compare, uint64_t dst,
                         const void* src, size_t bytes) {
    std::lock_guard lk(mu_);
    void* stream = reinterpret_cast<void*>(c_.stream);
    check(reinterpret_cast<CtxSetCurrentFn>(c_.ctxSetCurrent)(reinterpret_cast<void*>(c_.context)), "cuCtxSetCurrent");
    if (bytes != 0)
        check(reinterpret_cast<MemcpyHtoDAsyncFn>(c_.memcpyHtoDAsync)(dst, src, bytes, stream), "cuMemcpyHtoDAsync");
    if (addr == 0) {  // the copy alone
        check(reinterpret_cast<StreamSynchronizeFn>(c_.streamSynchronize)(stream), "cuStreamSynchronize");
        return 0;
    }
    // The kernel's parameters: (addr, op, width, value, compare, result), as mori.core.ucx_atomic's source.
    uint64_t a = addr, v = value, cmp = compare, res = c_.resultDev;
    int o = op, w = width;
    void* params[] = {&a, &o, &w, &v, &cmp, &res};
    check(reinterpret_cast<LaunchKernelFn>(c_.launchKernel)(reinterpret_cast<void*>(c_.function), 1, 1, 1, 1, 1, 1, 0,
                                                            stream, params, nullptr),
          "cuLaunchKernel");
    check(reinterpret_cast<StreamSynchronizeFn>(c_.streamSynchronize)(stream), "cuStreamSynchronize");
    return *reinterpret_cast<volatile uint64_t*>(c_.result);
}

}  // namespace mori::ucx
