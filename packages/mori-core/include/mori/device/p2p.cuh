// The P2P transport: a symmetric address on this PE becomes the same offset in a peer's heap,
// as that heap is mapped in this process (peerBases[pe] + (addr - heapBase), read from the
// constant-memory state globalGpuStatesFast). Every remote operation of the device API is a load,
// store or atomic through such a translated address.
#pragma once

#include "state.cuh"

namespace mori {
namespace device {

// This PE's rank.
MORI_DEVICE_INLINE int ShmemMyPe() { return detail::StateRank(); }

// Number of PEs.
MORI_DEVICE_INLINE int ShmemNPes() { return detail::StateWorldSize(); }

// Translates `ptr`, an address in PE `myPe`'s heap as mapped in this process, to the address of
// the same symmetric object on PE `destPe`, usable with plain loads and stores. Returns 0 when
// either PE is out of range, `ptr` is not inside that heap, or `destPe` is not reachable by
// P2P (not mapped here, or MORI_DISABLE_P2P).
MORI_DEVICE_INLINE uint64_t ShmemPtrP2p(uint64_t ptr, int myPe, int destPe) {
  const int world = detail::StateWorldSize(), rank = detail::StateRank();
  if (myPe < 0 || myPe >= world || destPe < 0 || destPe >= world) return 0;
  const uint64_t heapBase = detail::StateHeapBase();
  const uint64_t from = detail::StatePeerBase(myPe);
  if (from == 0 || ptr < from || ptr - from >= detail::StateHeapSize()) return 0;
  if (destPe == rank) return heapBase + (ptr - from);
  const uint64_t to = detail::StatePeerBase(destPe);
  if (to == 0 || (detail::StateFlags() & kFlagP2pDisabled)) return 0;
  return to + (ptr - from);
}

// Address of symmetric object `dest` (in this PE's heap) on PE `pe`, or nullptr when PE `pe`
// cannot be reached by loads and stores (OpenSHMEM shmem_ptr).
MORI_DEVICE_INLINE void* ShmemPtr(const void* dest, int pe) {
  return reinterpret_cast<void*>(ShmemPtrP2p(reinterpret_cast<uint64_t>(dest), ShmemMyPe(), pe));
}

namespace detail {

// Slow path of the remote operations: works out what was wrong with (`sym`, `pe`), reports it
// and aborts the kernel, instead of letting it write through a wild pointer.
MORI_DEVICE_COLD void FailRemote(const char* op, const void* sym, int pe) {
  const GpuStates& s = globalGpuStates;
  if (pe < 0 || pe >= s.worldSize) {
    MORI_DEVICE_FAIL("%s: PE %d out of range (world size %d)", op, pe, s.worldSize);
  }
  if (reinterpret_cast<uint64_t>(sym) - s.heapBase >= s.heapSize) {
    MORI_DEVICE_FAIL("%s: address %p is not in the symmetric heap [%p, +%llu)", op, sym,
                     reinterpret_cast<const void*>(s.heapBase), static_cast<unsigned long long>(s.heapSize));
  }
  MORI_DEVICE_FAIL("%s: PE %d is not reachable by P2P (%s)", op, pe,
                   (s.flags & kFlagP2pDisabled) ? "MORI_DISABLE_P2P is set" : "heap not mapped");
}

// What a remote operation needs to reach PE `pe`, read from the constant-memory state before any
// branch (the table entry of `pe`, or of entry 0 while `pe` is out of range).
struct PeerView {
  uint64_t heapBase;  // this PE's heap
  uint64_t heapSize;
  uint64_t peerBase;  // PE pe's heap as mapped here; meaningful only when reachable
  bool reachable;     // pe is in range, mapped, and P2P is allowed
};

MORI_DEVICE_INLINE PeerView ViewPeer(int pe) {
  PeerView v;
  v.heapBase = StateHeapBase();
  v.heapSize = StateHeapSize();
  const int world = StateWorldSize(), rank = StateRank();
  const uint32_t flags = StateFlags();
  const bool inRange = static_cast<uint32_t>(pe) < static_cast<uint32_t>(world);
  v.peerBase = StatePeerBase(inRange ? pe : 0);
  // Bitwise, not short-circuit: a branch here would put the rank and flags loads behind it.
  v.reachable = inRange & (v.peerBase != 0) & ((pe == rank) | ((flags & kFlagP2pDisabled) == 0));
  return v;
}

// Base of PE `pe`'s heap in this process; aborts the kernel when `pe` cannot be reached.
MORI_DEVICE_INLINE uint64_t PeerHeapBase(int pe, const char* op) {
  const PeerView v = ViewPeer(pe);
  if (MORI_DEVICE_UNLIKELY(!v.reachable)) FailRemote(op, reinterpret_cast<const void*>(v.heapBase), pe);
  return v.peerBase;
}

// Symmetric address `sym` (this PE's heap) as seen on PE `pe`, translated with `v`; aborts the
// kernel when `sym` is not inside the symmetric heap or `pe` cannot be reached.
template <class T>
MORI_DEVICE_INLINE T* PeerAddress(const PeerView& v, T* sym, int pe, const char* op) {
  const uint64_t offset = reinterpret_cast<uint64_t>(sym) - v.heapBase;
  if (MORI_DEVICE_UNLIKELY(offset >= v.heapSize || !v.reachable)) FailRemote(op, sym, pe);
  return reinterpret_cast<T*>(v.peerBase + offset);
}

template <class T>
MORI_DEVICE_INLINE T* PeerAddress(T* sym, int pe, const char* op) {
  return PeerAddress(ViewPeer(pe), sym, pe, op);
}

}  // namespace detail
}  // namespace device
}  // namespace mori
