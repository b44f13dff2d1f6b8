// The device-side state of one PE (GpuStates), the global that holds it (globalGpuStates), the
// layout of the internal area at the start of every heap, and device-side error reporting.
//
// The host (mori.shmem) fills a GpuStates and copies its 64 bytes into the `globalGpuStates`
// global of every loaded module (shmem_module_init), so the layout below is a contract with the
// host's ctypes mirror: change nothing without changing both.
#pragma once

#include "platform.cuh"
#include "ptx.cuh"

namespace mori {
namespace device {

// Largest world the device API supports: sizes the barrier slot array of the internal area.
constexpr int kMaxPes = 64;

// The first 64 KiB of every heap belong to mori; the host allocator starts after them.
constexpr uint64_t kInternalBytes = 64 * 1024;
// Internal area, as offsets from a heap's base:
// [0, 8): barrier epoch of this PE (read and written only by this PE's own device barrier).
constexpr uint64_t kBarrierEpochOffset = 0;
// [64, 64 + 8 * kMaxPes): barrier arrival slots; slot[p] is written only by PE p.
constexpr uint64_t kBarrierSlotsOffset = 64;
// [4096, 4096 + 8 * kMaxPes): scratch words for g and atomics where a transport needs them.
constexpr uint64_t kScratchOffset = 4096;
static_assert(kBarrierSlotsOffset + 8 * kMaxPes <= kScratchOffset, "internal area overlaps");
static_assert(kScratchOffset + 8 * kMaxPes <= kInternalBytes, "internal area overflows");

// GpuStates.flags bit 0: MORI_DISABLE_P2P is set, so no peer heap may be reached by load/store.
constexpr uint32_t kFlagP2pDisabled = 1u << 0;
// GpuStates.flags bit 1: a proxy serves the PEs that are not mapped here (proxy.cuh): proxyRing
// and proxyTickets are set, and quiet, fence and the barrier also wait for the proxy's commands.
constexpr uint32_t kFlagProxy = 1u << 1;

// Everything device code knows about the symmetric heap. 64 bytes, 64-bit layout.
struct GpuStates {
  int32_t rank;            // this PE
  int32_t worldSize;       // number of PEs
  uint64_t heapBase;       // base virtual address of this PE's heap (device pointer)
  uint64_t heapSize;       // bytes in every PE's heap (symmetric)
  uint64_t peerHeapBases;  // device pointer to uint64_t[worldSize]: PE p's heap base as mapped
                           // in this process; 0 = not reachable by P2P; own entry = heapBase
  uint32_t flags;          // kFlag* bits
  uint32_t reserved0;
  uint64_t proxyRing;     // device address of the proxy's ring (proxy_ring.cuh's ProxyHeader, then
                          // its slots) in host-mapped memory; 0 = no proxy
  uint64_t proxyTickets;  // device address of the ring's ticket counter (GPU memory)
  uint64_t reserved;
};

static_assert(sizeof(GpuStates) == 64, "GpuStates must be 64 bytes");
// NVRTC before 13.5 has no __builtin_offsetof (nvcc and clang always do): there only the size is
// checked here; the offsets are checked by the tests, which compile with all three compilers.
#if defined(MORI_DEVICE_NVRTC) && defined(__has_builtin)
#if !__has_builtin(__builtin_offsetof)
#define MORI_DEVICE_NO_OFFSETOF 1
#endif
#endif
#if !defined(MORI_DEVICE_NO_OFFSETOF)
static_assert(__builtin_offsetof(GpuStates, rank) == 0, "GpuStates.rank offset");
static_assert(__builtin_offsetof(GpuStates, worldSize) == 4, "GpuStates.worldSize offset");
static_assert(__builtin_offsetof(GpuStates, heapBase) == 8, "GpuStates.heapBase offset");
static_assert(__builtin_offsetof(GpuStates, heapSize) == 16, "GpuStates.heapSize offset");
static_assert(__builtin_offsetof(GpuStates, peerHeapBases) == 24, "GpuStates.peerHeapBases offset");
static_assert(__builtin_offsetof(GpuStates, flags) == 32, "GpuStates.flags offset");
static_assert(__builtin_offsetof(GpuStates, reserved0) == 36, "GpuStates.reserved0 offset");
static_assert(__builtin_offsetof(GpuStates, proxyRing) == 40, "GpuStates.proxyRing offset");
static_assert(__builtin_offsetof(GpuStates, proxyTickets) == 48, "GpuStates.proxyTickets offset");
static_assert(__builtin_offsetof(GpuStates, reserved) == 56, "GpuStates.reserved offset");
#endif

// What the hot paths read, mirrored from GpuStates and the peer-base table into constant memory
// (globalGpuStatesFast, written by shmem_module_init next to globalGpuStates). A remote operation
// often runs right after a wait, whose acquire loads invalidate L1: the state read from global
// memory then costs L2 round trips, while the constant cache is not invalidated. 544 bytes.
struct GpuFastStates {
  uint64_t heapBase;
  uint64_t heapSize;
  int32_t rank;
  int32_t worldSize;
  uint32_t flags;
  uint32_t reserved;
  uint64_t peerBases[kMaxPes];  // PE p's heap base as mapped here; 0 = not reachable; own = heapBase
};

static_assert(sizeof(GpuFastStates) == 32 + 8 * kMaxPes, "GpuFastStates must be 544 bytes");
#if !defined(MORI_DEVICE_NO_OFFSETOF)
static_assert(__builtin_offsetof(GpuFastStates, rank) == 16, "GpuFastStates.rank offset");
static_assert(__builtin_offsetof(GpuFastStates, flags) == 24, "GpuFastStates.flags offset");
static_assert(__builtin_offsetof(GpuFastStates, peerBases) == 32, "GpuFastStates.peerBases offset");
#endif

}  // namespace device
}  // namespace mori

// The state lives in an un-mangled global so that the host can find it by name in any module
// (cuModuleGetGlobal(module, "globalGpuStates")). Exactly one translation unit of a module
// defines it: the one compiled with MORI_DEVICE_DEFINE_STATE (a single-file NVRTC kernel, or
// mori-triton's bitcode library); others, in relocatable-device-code builds, only declare it.
#if defined(MORI_DEVICE_DEFINE_STATE)
extern "C" {
__device__ mori::device::GpuStates globalGpuStates;
__constant__ mori::device::GpuFastStates globalGpuStatesFast;
}
#else
extern "C" __device__ mori::device::GpuStates globalGpuStates;
extern "C" __constant__ mori::device::GpuFastStates globalGpuStatesFast;
#endif

namespace mori {
namespace device {
namespace detail {

// The state on the hot paths, from the constant-memory mirror.
MORI_DEVICE_INLINE int32_t StateRank() { return globalGpuStatesFast.rank; }
MORI_DEVICE_INLINE int32_t StateWorldSize() { return globalGpuStatesFast.worldSize; }
MORI_DEVICE_INLINE uint64_t StateHeapBase() { return globalGpuStatesFast.heapBase; }
MORI_DEVICE_INLINE uint64_t StateHeapSize() { return globalGpuStatesFast.heapSize; }
MORI_DEVICE_INLINE uint32_t StateFlags() { return globalGpuStatesFast.flags; }
// PE `pe`'s heap base as mapped here (0: not reachable); `pe` must be in [0, kMaxPes).
MORI_DEVICE_INLINE uint64_t StatePeerBase(int pe) { return globalGpuStatesFast.peerBases[pe]; }

}  // namespace detail
}  // namespace device
}  // namespace mori

// Longest a device-side wait (wait_until, barrier) polls before it reports and aborts the
// kernel, in nanoseconds of the global timer. A wait that cannot finish (a peer that never
// signals) then fails the launch with a message instead of hanging the GPU. Define it to 0
// before including mori to wait forever, or to another value to change the limit.
#ifndef MORI_DEVICE_WAIT_TIMEOUT_NS
#define MORI_DEVICE_WAIT_TIMEOUT_NS 60000000000ull
#endif

// Reports a device-side error (printf to the host's stdout, prefixed with PE, block and thread)
// and aborts the kernel with trap; the host sees the launch fail at its next synchronization.
#define MORI_DEVICE_FAIL(fmt, ...)                                                          \
  do {                                                                                      \
    printf("mori device error [pe %d block %u thread %u]: " fmt "\n", globalGpuStates.rank, \
           ::mori::device::BlockIdxX(), ::mori::device::FlatThreadId(), __VA_ARGS__);       \
    ::mori::device::ptx::Trap();                                                            \
    __builtin_unreachable();                                                                \
  } while (0)

// Functions that only report an error: kept out of line, so that the many checks inlined into
// kernels cost a compare and a call instead of a printf each.
#define MORI_DEVICE_COLD __device__ __noinline__ inline
