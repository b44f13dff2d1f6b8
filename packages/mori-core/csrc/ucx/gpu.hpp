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
// - staged bytes go through mori-core's GPU staging (gpu/staging.hpp: one copy-engine copy between
//   the GPU and pinned host memory lent by its pool), which UCX then sends from or receives into:
//   UCX moves host memory only. A transfer's pieces are copied asynchronously (a completion
//   word written after each), so that the copy of one piece runs while the network moves
//   another (the worker polls Staged::copied, Worker::after_copy_locked). An engine may also
//   stage without serving atomics (mori-io's RDMA backend: GpuWords over a Stager of the
//   application's context).
// All of it runs in a CUDA context of mori's own (not the device's primary context, which the
// application's kernels use), on one non-blocking stream, through pinned memory: the primary
// context's lock is held while its thread lazily loads a kernel or copies to pageable memory
// behind a running kernel, and a kernel of the application that waits on this engine (a device
// proxy's put) would then never see its data if the engine needed that lock (seen on the H100:
// mori.ops' InterNodeV1 through the proxy). Each operation ends before the answer is sent, within
// at most `timeout` seconds (the engine's), as every wait of the engine. A signal put's store with
// bytes runs on while the worker takes the next messages (answered from a later progress); the
// rest are waited for in the handler, which holds its worker, so GPU work that never finishes
// would stall every peer of this engine; after a second the wait says so on stderr, after the
// timeout the operation fails (and every later one: the stream and the result word may still be
// in use). Driver entry points come in as addresses (cuGetProcAddress through cuda-bindings): no
// CUDA headers, no toolkit at build time.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "gpu/staging.hpp"
#include "ucx/api.hpp"

namespace mori::ucx {

using gpu::Staged;

// Handles and entry points (CUcontext, CUfunction, CUstream as addresses).
struct GpuWordsConfig {
    uintptr_t context = 0, function = 0, stream = 0;
    uintptr_t result = 0;        // 8 bytes of host-mapped pinned memory: host address
    uintptr_t resultDev = 0;     // its device address (the kernel's last argument)
    gpu::Driver driver;          // the staging's entry points
    uintptr_t launchKernel = 0;  // kGpuWordsEntryPoints
    uintptr_t bounce = 0;        // pinned host memory of the context: small copies go through it
    size_t bounceBytes = 0;
    bool stage = false;     // transfers of GPU memory go through here, UCX sees host memory only
    double timeout = 30.0;  // seconds an operation may wait for the GPU
    std::string timeoutSetting = "timeout";
};

// An initiator's staged copy out of this size or less, of a transfer's only part, is waited for
// where it is queued (a few microseconds, on the caller's thread, which posts next); a transfer
// whose parts are all this small queues all their copies first and waits for them in order. Every
// other staged copy goes to the worker's progress loop (Worker::after_copy_locked), so that a
// batch's copies overlap.
inline constexpr size_t kCopyInPlaceBytes = size_t{32} << 10;

// The entry points GpuWords needs beyond the staging's (gpu::kDriverEntryPoints), by driver name.
inline constexpr std::pair<const char*, uintptr_t GpuWordsConfig::*> kGpuWordsEntryPoints[] = {
    {"cuLaunchKernel", &GpuWordsConfig::launchKernel},
};

class GpuWords {
public:
    // Serves atomics with c.function, and stages transfers of GPU memory when c.stage.
    explicit GpuWords(const GpuWordsConfig& c);
    // Stages transfers of GPU memory through `stager` (the caller's, shared with its other data
    // planes); atomics and signal puts on GPU memory are refused (serves_words() is false).
    explicit GpuWords(std::shared_ptr<gpu::Stager> stager);
    // Applies op (AtomicOp) to the width-bit word at device address addr; returns its old value.
    // With bytes != 0, first copies bytes from host src to device address dst (stream order);
    // addr 0 makes it that copy alone.
    // Throws std::runtime_error naming the driver call that failed, or the wait that timed out.
    uint64_t apply(uint64_t addr, uint8_t op, int width, uint64_t value, uint64_t compare, uint64_t dst = 0,
                   const void* src = nullptr, size_t bytes = 0);
    // A signal put's store of value into the 64-bit word at device address addr, after its bytes
    // (src, bytes) are copied to dst: written by the stream itself once the copy is visible
    // (Stager::to_device_then_store, the bytes staged in memory of the pool; no kernel: a launch
    // costs several microseconds more; an add is apply()'s). With wait, or with no bytes, waited
    // for here and the result is empty; else the copy and the store run on and the result tells
    // their end (Staged::copied: the worker answers then, Worker::after_copy_locked). Throws as apply().
    Staged signal(uint64_t addr, uint64_t value, uint64_t dst, const void* src, size_t bytes, bool wait);
    bool serves_words() const { return c_.function != 0; }

    // The staging's (gpu::Stager), on its first lane (one stream: the engine's atomics and staged
    // copies keep their order): see there.
    Staged to_host(uint64_t src, size_t bytes, bool wait = true) { return stager_->to_host(src, bytes, wait); }
    Staged landing(size_t bytes) { return stager_->landing(bytes); }
    // The blocks of one message (device addresses): one block, or a group of small ones as one
    // gathered copy out, one scattered copy in (their bytes one after another in the staged
    // memory; blocks copied in must not overlap).
    Staged to_host(const std::vector<api::Iov>& blocks, bool wait);
    void to_device(const std::vector<api::Iov>& blocks, Staged& src, bool wait);
    bool stages() const { return c_.stage; }
    const gpu::StagingConfig& staging_config() const { return stager_->config(); }
    // Before the context goes: waits (at most the timeout) for staged memory still lent, frees the
    // pool's; a caller's Stager is the caller's to close.
    void close_staging();

    // Makes the context current on the calling thread (one of the engine's own), with its
    // stream-capture mode relaxed; false (and why, in `why`) if the driver refused.
    bool make_current(std::string& why) const { return stager_->make_current(why); }

private:
    // Host to device through the bounce buffer; the last piece is left in flight when !waitLast.
    void copy_in(gpu::Stager::Op& op, uint64_t dst, const void* src, size_t bytes, bool waitLast);
    GpuWordsConfig c_;
    std::shared_ptr<gpu::Stager> stager_;
    bool ownsStager_ = true;
};

}  // namespace mori::ucx
