// Point-to-point synchronization (wait_until, test), ordering (fence, quiet) and the device
// barrier across all PEs.
//
// Memory ordering, in terms of the PTX memory model:
// - puts are weak stores (copy.cuh) and are not ordered by themselves;
// - ShmemFence orders: a fence.acq_rel.sys between two puts makes the first visible to any PE
//   before the second, in particular before a flag written after it;
// - ShmemQuiet completes: after fence.sc.sys every earlier put of the calling thread(s) is
//   visible system-wide, to every PE and to the host;
// - waits read with ld.acquire.sys, which synchronizes with the release store or release atomic
//   of a signal or barrier arrival: what the signalling PE wrote before its release is visible
//   to the waiter after the wait returns.
#pragma once

#include "group.cuh"
#include "p2p.cuh"
#include "proxy.cuh"

namespace mori {
namespace device {

// Comparisons of wait_until and test (EQ=0, NE=1, GT=2, GE=3, LT=4, LE=5): mori.core.codes.Cmp
// defines them for the host API and the Triton externs (a test checks both agree).
constexpr int kCmpEq = 0;
constexpr int kCmpNe = 1;
constexpr int kCmpGt = 2;
constexpr int kCmpGe = 3;
constexpr int kCmpLt = 4;
constexpr int kCmpLe = 5;

namespace detail {

// Names of the comparisons, for error messages.
MORI_DEVICE_INLINE const char* CmpName(int cmp) {
  switch (cmp) {
    case kCmpEq: return "EQ";
    case kCmpNe: return "NE";
    case kCmpGt: return "GT";
    case kCmpGe: return "GE";
    case kCmpLt: return "LT";
    default: return "LE";
  }
}

MORI_DEVICE_COLD void FailCmp(int cmp, const char* op) {
  MORI_DEVICE_FAIL("%s: comparison %d is not one of EQ=0 NE=1 GT=2 GE=3 LT=4 LE=5", op, cmp);
}

MORI_DEVICE_INLINE void CheckCmp(int cmp, const char* op) {
  if (MORI_DEVICE_UNLIKELY(cmp < kCmpEq || cmp > kCmpLe)) FailCmp(cmp, op);
}

MORI_DEVICE_COLD void FailTimeout(const char* op, const void* addr, int cmp, long long value, long long seen) {
  MORI_DEVICE_FAIL("%s: timed out after %llu ns waiting for *%p %s %lld (last seen %lld)", op,
                   static_cast<unsigned long long>(MORI_DEVICE_WAIT_TIMEOUT_NS), addr, CmpName(cmp), value, seen);
}

template <class T>
MORI_DEVICE_INLINE bool Compare(T seen, int cmp, T value) {
  switch (cmp) {
    case kCmpEq: return seen == value;
    case kCmpNe: return seen != value;
    case kCmpGt: return seen > value;
    case kCmpGe: return seen >= value;
    case kCmpLt: return seen < value;
    default: return seen <= value;
  }
}

// Polls `addr` with acquire loads until `cmp` holds against `value`; returns the value seen.
// Busy-polls first (a signal usually lands within microseconds), then backs off with nanosleep
// up to kMaxSleepNs so that a long wait leaves the SM to other warps without adding much
// latency. Gives up after MORI_DEVICE_WAIT_TIMEOUT_NS with a report naming what it waited for.
template <class T>
MORI_DEVICE_FUNC T WaitFor(const T* addr, int cmp, T value, const char* op) {
  constexpr int kBusyPolls = 128;
  constexpr uint32_t kMaxSleepNs = 256;
  T seen = ptx::LoadAcquireSys(addr);
#pragma unroll 1
  for (int i = 0; i < kBusyPolls; ++i) {
    if (Compare(seen, cmp, value)) return seen;
    seen = ptx::LoadAcquireSys(addr);
  }
  const uint64_t start = ptx::GlobalTimerNs();
  uint32_t sleep = 32;
  while (!Compare(seen, cmp, value)) {
    ptx::Nanosleep(sleep);
    if (sleep < kMaxSleepNs) sleep *= 2;
    if (MORI_DEVICE_WAIT_TIMEOUT_NS != 0 &&
        MORI_DEVICE_UNLIKELY(ptx::GlobalTimerNs() - start > MORI_DEVICE_WAIT_TIMEOUT_NS)) {
      FailTimeout(op, addr, cmp, static_cast<long long>(value), static_cast<long long>(seen));
    }
    seen = ptx::LoadAcquireSys(addr);
  }
  return seen;
}

}  // namespace detail

// Waits until `*ivar cmp value` holds (ivar: a symmetric address on this PE, updated by other
// PEs); returns the value that satisfied it. Acquire: data written by the PE whose signal made
// the comparison true (before its release) is visible once this returns.
template <class T>
MORI_DEVICE_INLINE T ShmemWaitUntil(T* ivar, int cmp, detail::NonDeduced<T> value) {
  detail::CheckCmp(cmp, "ShmemWaitUntil");
  return detail::WaitFor<T>(ivar, cmp, value, "ShmemWaitUntil");
}

// Tests once whether `*ivar cmp value` holds (acquire load): 1 if it does, 0 if not.
template <class T>
MORI_DEVICE_INLINE int ShmemTest(T* ivar, int cmp, detail::NonDeduced<T> value) {
  detail::CheckCmp(cmp, "ShmemTest");
  return detail::Compare<T>(ptx::LoadAcquireSys(ivar), cmp, value) ? 1 : 0;
}

// MORI's named waits for the integer types: until equal, and until greater (returning the value).
#define MORI_DEVICE_DEFINE_WAITS(Name, T)                                               \
  MORI_DEVICE_INLINE void Shmem##Name##WaitUntilEquals(T* addr, T val) {                \
    detail::WaitFor<T>(addr, kCmpEq, val, "Shmem" #Name "WaitUntilEquals");             \
  }                                                                                     \
  MORI_DEVICE_INLINE T Shmem##Name##WaitUntilGreaterThan(T* addr, T val) {              \
    return detail::WaitFor<T>(addr, kCmpGt, val, "Shmem" #Name "WaitUntilGreaterThan"); \
  }
MORI_DEVICE_DEFINE_WAITS(Uint8, uint8_t)
MORI_DEVICE_DEFINE_WAITS(Int8, int8_t)
MORI_DEVICE_DEFINE_WAITS(Schar, signed char)
MORI_DEVICE_DEFINE_WAITS(Uint16, uint16_t)
MORI_DEVICE_DEFINE_WAITS(Int16, int16_t)
MORI_DEVICE_DEFINE_WAITS(Uint32, uint32_t)
MORI_DEVICE_DEFINE_WAITS(Int32, int32_t)
MORI_DEVICE_DEFINE_WAITS(Uint64, uint64_t)
MORI_DEVICE_DEFINE_WAITS(Int64, int64_t)
#undef MORI_DEVICE_DEFINE_WAITS

// Orders the calling thread's earlier puts, atomics and signals to each PE before its later ones
// (with a proxy and commands in flight, also posts a fence command: the proxy starts nothing
// more to a PE before that PE's earlier commands are complete).
MORI_DEVICE_INLINE void ShmemFenceThread() {
  ptx::FenceAcqRelSys();
  if (MORI_DEVICE_UNLIKELY(detail::HasProxy())) detail::ProxyFence("ShmemFence");
}
// Same for the operations to PE `pe` (MORI's per-destination form; over P2P one fence covers
// every PE, through the proxy only commands to `pe` wait).
MORI_DEVICE_INLINE void ShmemFenceThread(int pe) {
  ptx::FenceAcqRelSys();
  if (MORI_DEVICE_UNLIKELY(detail::HasProxy())) detail::ProxyFence("ShmemFence", pe);
}
// OpenSHMEM's name for ShmemFenceThread.
MORI_DEVICE_INLINE void ShmemFence() { ShmemFenceThread(); }

// Completes the calling thread's earlier puts: visible at every PE and the host on return (with
// a proxy, every command this PE posted is complete too).
MORI_DEVICE_INLINE void ShmemQuietThread() {
  ptx::FenceScSys();
  if (MORI_DEVICE_UNLIKELY(detail::HasProxy())) detail::ProxyQuiet("ShmemQuiet");
}
// Same; the PE argument is MORI's per-destination form.
MORI_DEVICE_INLINE void ShmemQuietThread(int) { ShmemQuietThread(); }
// OpenSHMEM's name for ShmemQuietThread.
MORI_DEVICE_INLINE void ShmemQuiet() { ShmemQuietThread(); }

namespace detail {
// Quiet of a group: each thread fences its own stores; one thread waits for the proxy once every
// thread of the group has posted.
template <class G>
MORI_DEVICE_INLINE void GroupQuiet() {
  ptx::FenceScSys();
  G::Sync();
  if (MORI_DEVICE_UNLIKELY(HasProxy())) {
    if (G::Rank() == 0) ProxyQuiet("ShmemQuiet");
    G::Sync();
  }
}
}  // namespace detail

// Completes the earlier puts of every lane of the warp (all lanes call).
MORI_DEVICE_INLINE void ShmemQuietWarp() { detail::GroupQuiet<detail::WarpGroup>(); }
// Completes the earlier puts of every thread of the block (all threads call). Each thread fences
// its own stores, so the result does not rest on fence cumulativity across warps.
MORI_DEVICE_INLINE void ShmemQuietBlock() { detail::GroupQuiet<detail::BlockGroup>(); }

namespace detail {

// The barrier's exchange for PEs first, first + step, ...: tell each of them that this PE reached
// `epoch` (release store into slot[myPe] of its heap), then wait until each of them told this PE
// the same (acquire loads of this heap's slot[pe]). Epochs only grow, so `>=` lets a fast PE run
// ahead into the next barrier without confusing this one.
MORI_DEVICE_FUNC void BarrierExchange(uint64_t epoch, uint32_t first, uint32_t step) {
  const int world = StateWorldSize();
  if (MORI_DEVICE_UNLIKELY(world > kMaxPes)) {
    MORI_DEVICE_FAIL("ShmemBarrierAll: world size %d exceeds kMaxPes %d", world, kMaxPes);
  }
  const uint64_t slotOffset = kBarrierSlotsOffset + 8 * static_cast<uint64_t>(StateRank());
  for (uint32_t pe = first; pe < static_cast<uint32_t>(world); pe += step) {
    if (MORI_DEVICE_UNLIKELY(!ViewPeer(static_cast<int>(pe)).reachable && HasProxy())) {
      ProxyArrive(static_cast<int>(pe), slotOffset, epoch, "ShmemBarrierAll");  // a remote PE: through the proxy
      continue;
    }
    uint64_t* slot = reinterpret_cast<uint64_t*>(PeerHeapBase(static_cast<int>(pe), "ShmemBarrierAll") + slotOffset);
    ptx::StoreReleaseSys(slot, epoch);
  }
  const uint64_t* mySlots = reinterpret_cast<const uint64_t*>(StateHeapBase() + kBarrierSlotsOffset);
  for (uint32_t pe = first; pe < static_cast<uint32_t>(world); pe += step) {
    WaitFor<uint64_t>(mySlots + pe, kCmpGe, epoch, "ShmemBarrierAll");
  }
}

MORI_DEVICE_INLINE uint64_t* BarrierEpoch() {
  return reinterpret_cast<uint64_t*>(StateHeapBase() + kBarrierEpochOffset);
}

}  // namespace detail

// Barrier across all PEs, called by one thread of each PE (one barrier at a time per PE). It
// includes quiet: the arrival is a release store, so every earlier put of this thread is visible
// at each PE before that PE leaves the barrier.
MORI_DEVICE_INLINE void ShmemBarrierAllThread() {
  if (MORI_DEVICE_UNLIKELY(detail::HasProxy())) detail::ProxyQuiet("ShmemBarrierAll");
  uint64_t* epochWord = detail::BarrierEpoch();
  const uint64_t epoch = *epochWord + 1;
  *epochWord = epoch;
  detail::BarrierExchange(epoch, 0, 1);
}

// Barrier across all PEs, called by every thread of one block of each PE. The threads share out
// the peers (thread t signals and waits for PEs t, t + blockSize, ...). Each thread first fences
// its own earlier puts, so whichever thread publishes an arrival, the whole block's puts precede
// it; the second __syncthreads holds the block until every peer has arrived; the epoch word is
// written only after it, so all threads read the same old epoch.
MORI_DEVICE_INLINE void ShmemBarrierAllBlock() {
  using G = detail::BlockGroup;
  uint64_t* epochWord = detail::BarrierEpoch();
  ptx::FenceAcqRelSys();
  G::Sync();
  if (MORI_DEVICE_UNLIKELY(detail::HasProxy())) {  // the proxy's commands complete before any arrival
    if (G::Rank() == 0) detail::ProxyQuiet("ShmemBarrierAll");
    G::Sync();
  }
  const uint64_t epoch = *epochWord + 1;
  detail::BarrierExchange(epoch, G::Rank(), G::Size());
  G::Sync();
  if (G::Rank() == 0) *epochWord = epoch;
}

}  // namespace device
}  // namespace mori
