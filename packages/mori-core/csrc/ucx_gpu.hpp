// How the UCX engine touches GPU memory on its checked path where UCX does not move the bytes
// itself: remote atomics and signal puts on a region registered as GPU memory, and, when it
// stages GPU memory (GpuWordsConfig::stage), every byte of it that a transfer moves.
//
// - an atomic is a one-thread kernel (the caller compiles it: mori.core.ucx_atomic) that applies
//   the operation with a system-scope atomic on the device, so it is atomic with the device's own
//   atomics and with peers' over P2P, as a host atomic on host memory is with host code; it leaves
//   the old value in host-mapped memory;
// - a signal put's bytes are a copy-engine copy on the same stream, before that kernel, so whoever
//   sees the signal sees the data;
// - staged bytes are one copy-engine copy between the GPU and pinned host memory of a pool
//   (Staged), which UCX then sends from or receives into: UCX moves host memory only. A transfer's
//   pieces are copied asynchronously (an event after each), so that the copy of one piece runs
//   while the network moves another (the worker polls Staged::copied, Worker::after_copy_locked).
// All of it runs in a CUDA context of mori's own (not the device's primary context, which the
// application's kernels use), on one non-blocking stream, through pinned memory: the primary
// context's lock is held while its thread lazily loads a kernel or copies to pageable memory
// behind a running kernel, and a kernel of the application that waits on this engine (a device
// proxy's put) would then never see its data if the engine needed that lock (seen on the H100:
// mori.ops' InterNodeV1 through the proxy). Each operation is waited for before the answer is
// sent: at most `timeout` seconds (the engine's), as every wait of the engine. The handler that
// waits holds its worker, so GPU work that never finishes would stall every peer of this engine;
// after a second the wait says so on stderr, after the timeout the operation fails (and every
// later one: the stream and the result word may still be in use). Driver entry points come in as
// addresses (cuGetProcAddress through cuda-bindings): no CUDA headers, no toolkit at build time.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <utility>

namespace mori::ucx {

// Handles and entry points (CUcontext, CUfunction, CUstream as addresses).
struct GpuWordsConfig {
    uintptr_t context = 0, function = 0, stream = 0;
    uintptr_t result = 0;     // 8 bytes of host-mapped pinned memory: host address
    uintptr_t resultDev = 0;  // its device address (the kernel's last argument)
    uintptr_t ctxSetCurrent = 0, ctxPushCurrent = 0, ctxPopCurrent = 0, exchangeCaptureMode = 0;
    uintptr_t launchKernel = 0, streamQuery = 0, memcpyHtoDAsync = 0, memcpyDtoHAsync = 0;
    uintptr_t memHostAlloc = 0, memFreeHost = 0;
    uintptr_t eventCreate = 0, eventRecord = 0, eventQuery = 0, eventDestroy = 0;
    uintptr_t bounce = 0;    // pinned host memory of the context: small copies go through it
    size_t bounceBytes = 0;
    bool stage = false;      // transfers of GPU memory go through here, UCX sees host memory only
    double timeout = 30.0;  // seconds an operation may wait for the GPU
    std::string timeoutSetting = "timeout";
};

// Every driver entry point of GpuWordsConfig by its driver name: mori.core.ucx_atomic passes each
// one's address (cuGetProcAddress) under that name (UCX_GPU_ENTRY_POINTS).
inline constexpr std::pair<const char*, uintptr_t GpuWordsConfig::*> kGpuEntryPoints[] = {
    {"cuCtxSetCurrent", &GpuWordsConfig::ctxSetCurrent},
    {"cuCtxPushCurrent", &GpuWordsConfig::ctxPushCurrent},
    {"cuCtxPopCurrent", &GpuWordsConfig::ctxPopCurrent},
    {"cuThreadExchangeStreamCaptureMode", &GpuWordsConfig::exchangeCaptureMode},
    {"cuLaunchKernel", &GpuWordsConfig::launchKernel},
    {"cuStreamQuery", &GpuWordsConfig::streamQuery},
    {"cuMemcpyHtoDAsync", &GpuWordsConfig::memcpyHtoDAsync},
    {"cuMemcpyDtoHAsync", &GpuWordsConfig::memcpyDtoHAsync},
    {"cuMemHostAlloc", &GpuWordsConfig::memHostAlloc},
    {"cuMemFreeHost", &GpuWordsConfig::memFreeHost},
    {"cuEventCreate", &GpuWordsConfig::eventCreate},
    {"cuEventRecord", &GpuWordsConfig::eventRecord},
    {"cuEventQuery", &GpuWordsConfig::eventQuery},
    {"cuEventDestroy", &GpuWordsConfig::eventDestroy},
};

class StagingPool;

// Host memory that one transfer's staged bytes pass through, what UCX sends from or receives into:
// pinned memory of the engine's context lent by a pool (GpuWords::to_host, landing) and given back
// when this goes, so that one copy-engine copy moves the bytes between it and the GPU. Before the
// pool, each transfer filled a fresh zeroed vector and copied through the 1 MiB bounce buffer:
// at each end an allocation, its page faults and two more passes over the bytes (64 MiB puts of
// mori.shmem's GPU heap moved 0.6 GB/s where host memory moved 4.5). Heap memory, copied through
// the bounce buffer, when pinning fails.
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
    bool empty() const { return size_ == 0; }
    // Whether the copy started with it (GpuWords::to_host/to_device, wait false) has ended: at
    // once for memory copied as it was staged. Throws when the copy failed, or has not ended
    // within the engine's timeout since it started (its memory is then never lent again).
    bool copied();
    void clear();  // gives the memory back (kept from reuse while its copy may still run)

private:
    friend class GpuWords;
    void swap(Staged& o) noexcept;
    std::shared_ptr<StagingPool> pool_;  // set while the memory is the pool's (pinned)
    uint8_t* data_ = nullptr;
    size_t size_ = 0, capacity_ = 0;
    void* event_ = nullptr;  // recorded after its copy while that may still run (CUevent)
    int64_t since_ = 0;      // when that copy started (now_ns)
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

    // Staged host memory holding bytes copied from device address src; host memory to receive
    // bytes into (landing); those bytes copied to device address dst. With wait, the copy is
    // waited for; else it runs on while the caller polls the Staged's copied(). Throw as apply.
    Staged to_host(uint64_t src, size_t bytes, bool wait = true);
    Staged landing(size_t bytes);
    void to_device(uint64_t dst, Staged& src, bool wait = true);
    bool stages() const { return c_.stage; }
    // Before the context goes: waits (at most the timeout) for staged memory still lent, frees the
    // pool's. Memory given back later is left to the context's destruction.
    void close_staging();

    // Makes the context current on the calling thread (one of the engine's own), with its
    // stream-capture mode relaxed (see Current); false (and why, in `why`) if the driver refused.
    bool make_current(std::string& why) const;

private:
    // For one operation (lock held): refuses after a failed wait, else pushes the context on the
    // calling thread (any thread that progresses the engine, an application's too) and pops it
    // after, with the thread's stream-capture mode relaxed meanwhile: while the application
    // captures a CUDA graph in the default (global) mode, the driver refuses these calls from any
    // other thread of the process (CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED) and invalidates the
    // capture (seen: mori.ops' graph replays through the proxy).
    class Current {
    public:
        explicit Current(const GpuWordsConfig& c);
        ~Current();
        Current(const Current&) = delete;
        Current& operator=(const Current&) = delete;

    private:
        const GpuWordsConfig& c_;
        int mode_;  // the thread's capture mode before
    };
    friend class StagingPool;
    void check_healthy() const;  // throws after a wait that timed out (lock held)
    Staged staging(size_t bytes);  // lock held, context current
    // After a copy into or out of s (pool memory) was queued: waits for it, or records an event
    // after it for s.copied() (lock held, context current).
    void follow(Staged& s, bool waitNow, const char* what);
    void wait(const char* what);  // until the stream is idle (bounded, see above)
    // Host to device through the bounce buffer; the last piece is left in flight when !waitLast.
    void copy_in(uint64_t dst, const void* src, size_t bytes, bool waitLast);
    GpuWordsConfig c_;
    std::shared_ptr<StagingPool> pool_;
    std::mutex mu_;       // one operation at a time: they share the result word and the stream
    std::string broken_;  // why an earlier operation never finished ("" while none did)
};

}  // namespace mori::ucx
