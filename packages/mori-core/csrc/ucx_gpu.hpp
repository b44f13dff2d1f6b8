// How the UCX engine's target touches GPU memory on its checked path where UCX does not move the
// bytes itself: remote atomics and signal puts on a region registered as GPU memory.
//
// - an atomic is a one-thread kernel (the caller compiles it: mori.core.ucx_atomic) that applies
//   the operation with a system-scope atomic on the device, so it is atomic with the device's own
//   atomics and with peers' over P2P, as a host atomic on host memory is with host code; it leaves
//   the old value in host-mapped memory;
// - a signal put's bytes are a copy-engine copy on the same stream, before that kernel, so whoever
//   sees the signal sees the data.
// Both run on one non-blocking stream of the target's context (a kernel of the target that spins
// on the word, on any stream, does not hold them back) and are waited for before the answer is
// sent: at most `timeout` seconds (the engine's), as every wait of the engine. The handler that
// waits holds its worker, so GPU work that never finishes would stall every peer of this engine;
// after a second the wait says so on stderr, after the timeout the operation fails (and every
// later one: the stream and the result word may still be in use). Driver entry points come in as
// addresses (cuGetProcAddress through cuda-bindings): no CUDA headers, no toolkit at build time.
#pragma once

#include <cstddef>
#include <cstdint>
#include <mutex>
#include <string>

namespace mori::ucx {

// Handles and entry points (CUcontext, CUfunction, CUstream as addresses).
struct GpuWordsConfig {
    uintptr_t context = 0, function = 0, stream = 0;
    uintptr_t result = 0;     // 8 bytes of host-mapped pinned memory: host address
    uintptr_t resultDev = 0;  // its device address (the kernel's last argument)
    uintptr_t ctxSetCurrent = 0, launchKernel = 0, streamQuery = 0, memcpyHtoDAsync = 0;
    double timeout = 30.0;  // seconds an operation may wait for the GPU
    std::string timeoutSetting = "timeout";
};

class GpuWords {
public:
    explicit GpuWords(const GpuWordsConfig& c);
    // Applies op (AtomicOp) to the width-bit word at device address addr; returns its old value.
    // With bytes != 0, first copies bytes from host src to device address dst (stream order);
    // addr 0 makes it that copy alone.
    // Throws std::runtime_error naming the driver call that failed, or the wait that timed out.
    uint64_t apply(uint64_t addr, uint8_t op, int width, uint64_t value, uint64_t compare, uint64_t dst = 0,
                   const void* src = nullptr, size_t bytes = 0);

    // Makes the context current on the calling thread; false (and why, in `why`) if the driver refused.
    bool make_current(std::string& why) const;

private:
    void wait(const char* what);  // until the stream is idle (bounded, see above)
    GpuWordsConfig c_;
    std::mutex mu_;       // one operation at a time: they share the result word and the stream
    std::string broken_;  // why an earlier operation never finished ("" while none did)
};

}  // namespace mori::ucx
