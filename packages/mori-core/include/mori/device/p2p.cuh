// The P2P transport: a symmetric address on this PE becomes the same offset in a peer's heap,
// as that heap is mapped in this process (peerHeapBases[pe] + (addr - heapBase)). Every remote
// operation of the device API is a load, store or atomic through such a translated address.
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
  const uint64_t from = myPe == rank ? heapBase : detail::StatePeerBase(myPe);
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
                     reinterpret_cast<const void*>(s.heapBase),
                     static_cast<unsigned long long>(s.heapSize));
  }
  MORI_DEVICE_FAIL("%s: PE %d is not reachable by P2P (%s)", op, pe,
                   (s.flags & kFlagP2pDisabled) ? "MORI_DISABLE_P2P is set" : "heap not mapped");
}

// Base of PE `pe`'s heap in this process, for the remote operations.
MORI_DEVICE_INLINE uint64_t PeerHeapBase(int pe, const char* op) {
  const uint64_t heapBase = StateHeapBase();
  if (pe == StateRank()) return heapBase;
  const void* inHeap = reinterpret_cast<const void*>(heapBase);
  if (MORI_DEVICE_UNLIKELY(pe < 0 || pe >= StateWorldSize())) FailRemote(op, inHeap, pe);
  const uint64_t base = StatePeerBase(pe);
  if (MORI_DEVICE_UNLIKELY(base == 0 || (StateFlags() & kFlagP2pDisabled))) FailRemote(op, inHeap, pe);
  return base;
}

// Symmetric address `sym` (this PE's heap) as seen on PE `pe`; aborts the kernel when `sym` is
// not inside the symmetric heap or `pe` cannot be reached.
template <class T>
MORI_DEVICE_INLINE T* PeerAddress(T* sym, int pe, const char* op) {
  const uint64_t offset = reinterpret_cast<uint64_t>(sym) - StateHeapBase();
  if (MORI_DEVICE_UNLIKELY(offset >= StateHeapSize())) FailRemote(op, sym, pe);
  return reinterpret_cast<T*>(PeerHeapBase(pe, op) + offset);
}

}  // namespace detail
}  // namespace device
}  // namespace mori
