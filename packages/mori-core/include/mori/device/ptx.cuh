// Inline PTX used by the mori device API: memory operations with explicit semantics and scope,
// fences, atomics, and a few special registers.
//
// Everything that crosses GPUs runs at .sys scope: a peer GPU reached over NVLink (and the CPU,
// for host-visible heaps) is outside the .gpu scope, so .gpu-scope acquire/release would not
// order anything for it. Addresses are generic (no .global): a peer heap mapped through CUDA VMM
// is ordinary global memory seen through a generic pointer.
#pragma once

#include "platform.cuh"

namespace mori {
namespace device {
namespace ptx {

// ld.<sem>.sys / st.<sem>.sys for 1-, 2-, 4- and 8-byte values. PTX lets an 8-bit access use a
// 32-bit register (zero-extended on load, truncated on store), so bytes go through "r".
#define MORI_PTX_DEFINE_LOAD(Name, sem)                                             \
  template <class T>                                                                \
  MORI_DEVICE_INLINE T Name(const T* p) {                                           \
    if constexpr (sizeof(T) == 8) {                                                 \
      uint64_t r;                                                                   \
      asm volatile("ld." sem ".sys.b64 %0, [%1];" : "=l"(r) : "l"(p) : "memory");   \
      return BitCast<T>(r);                                                         \
    } else if constexpr (sizeof(T) == 4) {                                          \
      uint32_t r;                                                                   \
      asm volatile("ld." sem ".sys.b32 %0, [%1];" : "=r"(r) : "l"(p) : "memory");   \
      return BitCast<T>(r);                                                         \
    } else if constexpr (sizeof(T) == 2) {                                          \
      uint16_t r;                                                                   \
      asm volatile("ld." sem ".sys.b16 %0, [%1];" : "=h"(r) : "l"(p) : "memory");   \
      return BitCast<T>(r);                                                         \
    } else {                                                                        \
      static_assert(sizeof(T) == 1, #Name " supports 1-, 2-, 4- and 8-byte types"); \
      uint32_t r;                                                                   \
      asm volatile("ld." sem ".sys.u8 %0, [%1];" : "=r"(r) : "l"(p) : "memory");    \
      return BitCast<T>(static_cast<uint8_t>(r));                                   \
    }                                                                               \
  }

#define MORI_PTX_DEFINE_STORE(Name, sem)                                                           \
  template <class T>                                                                               \
  MORI_DEVICE_INLINE void Name(T* p, T v) {                                                        \
    if constexpr (sizeof(T) == 8) {                                                                \
      asm volatile("st." sem ".sys.b64 [%0], %1;" ::"l"(p), "l"(BitCast<uint64_t>(v)) : "memory"); \
    } else if constexpr (sizeof(T) == 4) {                                                         \
      asm volatile("st." sem ".sys.b32 [%0], %1;" ::"l"(p), "r"(BitCast<uint32_t>(v)) : "memory"); \
    } else if constexpr (sizeof(T) == 2) {                                                         \
      asm volatile("st." sem ".sys.b16 [%0], %1;" ::"l"(p), "h"(BitCast<uint16_t>(v)) : "memory"); \
    } else {                                                                                       \
      static_assert(sizeof(T) == 1, #Name " supports 1-, 2-, 4- and 8-byte types");                \
      uint32_t w = BitCast<uint8_t>(v);                                                            \
      asm volatile("st." sem ".sys.u8 [%0], %1;" ::"l"(p), "r"(w) : "memory");                     \
    }                                                                                              \
  }

// Acquire load: later accesses of this thread are ordered after it, and it synchronizes with a
// release store/atomic it reads from (wait_until, barrier).
MORI_PTX_DEFINE_LOAD(LoadAcquireSys, "acquire")
// Relaxed load: a single-copy-atomic read of the current value, without ordering (g, fetch).
MORI_PTX_DEFINE_LOAD(LoadRelaxedSys, "relaxed")
// Release store: all earlier accesses of this thread (and, cumulatively, all it has observed)
// become visible before the stored value (signal SET, barrier arrival).
MORI_PTX_DEFINE_STORE(StoreReleaseSys, "release")
// Relaxed store: a single-copy-atomic write without ordering (atomic set).
MORI_PTX_DEFINE_STORE(StoreRelaxedSys, "relaxed")

#undef MORI_PTX_DEFINE_LOAD
#undef MORI_PTX_DEFINE_STORE

// Sequentially consistent system fence (what __threadfence_system() is): everything this thread
// wrote before it is visible system-wide before anything it does after. Used by quiet.
MORI_DEVICE_INLINE void FenceScSys() { asm volatile("fence.sc.sys;" ::: "memory"); }
// Acquire-release system fence: the lighter fence that turns a later strong write into a release
// pattern and orders earlier writes before later ones. Used by fence and group signals.
MORI_DEVICE_INLINE void FenceAcqRelSys() { asm volatile("fence.acq_rel.sys;" ::: "memory"); }
// The same at GPU scope: enough where the writes it orders are to this GPU's own memory (peers
// read them there, after a system-scope release by one thread), and far cheaper than .sys.
MORI_DEVICE_INLINE void FenceAcqRelGpu() { asm volatile("fence.acq_rel.gpu;" ::: "memory"); }

// Fetching atomics (atom.relaxed.sys) on 4- and 8-byte integers. Integer add is the same bit
// operation for signed and unsigned operands, so .u32/.u64 serve both.
#define MORI_PTX_DEFINE_ATOM(Name, op, t32, t64)                               \
  template <class T>                                                           \
  MORI_DEVICE_INLINE T Name(T* p, T v) {                                       \
    if constexpr (sizeof(T) == 8) {                                            \
      uint64_t r;                                                              \
      asm volatile("atom.relaxed.sys." op "." t64 " %0, [%1], %2;"             \
                   : "=l"(r)                                                   \
                   : "l"(p), "l"(BitCast<uint64_t>(v))                         \
                   : "memory");                                                \
      return BitCast<T>(r);                                                    \
    } else {                                                                   \
      static_assert(sizeof(T) == 4, #Name " supports 4- and 8-byte integers"); \
      uint32_t r;                                                              \
      asm volatile("atom.relaxed.sys." op "." t32 " %0, [%1], %2;"             \
                   : "=r"(r)                                                   \
                   : "l"(p), "r"(BitCast<uint32_t>(v))                         \
                   : "memory");                                                \
      return BitCast<T>(r);                                                    \
    }                                                                          \
  }

// Non-fetching reductions (red.<sem>.sys): the same operations without a result, so the issuing
// thread does not wait for the round trip to the peer.
#define MORI_PTX_DEFINE_RED(Name, sem, op, t32, t64)                                                           \
  template <class T>                                                                                           \
  MORI_DEVICE_INLINE void Name(T* p, T v) {                                                                    \
    if constexpr (sizeof(T) == 8) {                                                                            \
      asm volatile("red." sem ".sys." op "." t64 " [%0], %1;" ::"l"(p), "l"(BitCast<uint64_t>(v)) : "memory"); \
    } else {                                                                                                   \
      static_assert(sizeof(T) == 4, #Name " supports 4- and 8-byte integers");                                 \
      asm volatile("red." sem ".sys." op "." t32 " [%0], %1;" ::"l"(p), "r"(BitCast<uint32_t>(v)) : "memory"); \
    }                                                                                                          \
  }

MORI_PTX_DEFINE_ATOM(AtomAddSys, "add", "u32", "u64")
MORI_PTX_DEFINE_ATOM(AtomAndSys, "and", "b32", "b64")
MORI_PTX_DEFINE_ATOM(AtomOrSys, "or", "b32", "b64")
MORI_PTX_DEFINE_ATOM(AtomXorSys, "xor", "b32", "b64")
MORI_PTX_DEFINE_ATOM(AtomExchSys, "exch", "b32", "b64")
MORI_PTX_DEFINE_RED(RedAddSys, "relaxed", "add", "u32", "u64")
MORI_PTX_DEFINE_RED(RedAndSys, "relaxed", "and", "b32", "b64")
MORI_PTX_DEFINE_RED(RedOrSys, "relaxed", "or", "b32", "b64")
MORI_PTX_DEFINE_RED(RedXorSys, "relaxed", "xor", "b32", "b64")
// Release add: the signal ADD of put-with-signal (data first, then the count).
MORI_PTX_DEFINE_RED(RedAddReleaseSys, "release", "add", "u32", "u64")

#undef MORI_PTX_DEFINE_ATOM
#undef MORI_PTX_DEFINE_RED

// Compare-and-swap: stores `desired` if the value equals `expected`; returns the old value.
template <class T>
MORI_DEVICE_INLINE T AtomCasSys(T* p, T expected, T desired) {
  if constexpr (sizeof(T) == 8) {
    uint64_t r;
    asm volatile("atom.relaxed.sys.cas.b64 %0, [%1], %2, %3;"
                 : "=l"(r)
                 : "l"(p), "l"(BitCast<uint64_t>(expected)), "l"(BitCast<uint64_t>(desired))
                 : "memory");
    return BitCast<T>(r);
  } else {
    static_assert(sizeof(T) == 4, "AtomCasSys supports 4- and 8-byte integers");
    uint32_t r;
    asm volatile("atom.relaxed.sys.cas.b32 %0, [%1], %2, %3;"
                 : "=r"(r)
                 : "l"(p), "r"(BitCast<uint32_t>(expected)), "r"(BitCast<uint32_t>(desired))
                 : "memory");
    return BitCast<T>(r);
  }
}

// Suspends the thread for about `ns` nanoseconds (sm_70+): polling loops back off with it so a
// waiting warp leaves issue slots to the warps doing work.
MORI_DEVICE_INLINE void Nanosleep(uint32_t ns) { asm volatile("nanosleep.u32 %0;" ::"r"(ns)); }

// Nanoseconds of the GPU's global timer: the clock of every device-side timeout.
MORI_DEVICE_INLINE uint64_t GlobalTimerNs() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

// This thread's lane in its warp.
MORI_DEVICE_INLINE uint32_t LaneId() {
  uint32_t lane;
  asm("mov.u32 %0, %%laneid;" : "=r"(lane));
  return lane;
}

// Aborts the kernel: the launch fails with an error the host sees at its next synchronization,
// instead of a hang or silent corruption.
MORI_DEVICE_INLINE void Trap() { asm volatile("trap;" ::: "memory"); }

}  // namespace ptx
}  // namespace device
}  // namespace mori
