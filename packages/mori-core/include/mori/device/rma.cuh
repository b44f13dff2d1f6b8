// Remote memory access over P2P: put and get (non-blocking and blocking, thread/warp/block
// scope, untyped and typed), put with signal, and the scalar p and g.
//
// Semantics on the P2P transport:
// - *Nbi: the group's stores to the peer (put) or from it (get) are issued when the call returns;
//   a put is complete (visible at the peer) after ShmemQuiet*, a barrier, or as part of a signal.
// - blocking put/get: the Nbi call, then the group waits for all its threads; the source of a put
//   may be reused, and the destination of a get holds the data for every thread of the group.
// - put with signal: data stores, then the signal as a release operation at system scope
//   (st.release.sys for SET, red.release.sys.add for ADD). A PE that sees the signal with
//   ShmemWaitUntil (acquire) sees the data. In warp/block scope every thread first fences its
//   own stores (fence.acq_rel.sys), the group synchronizes, then thread 0 issues the signal.
// - dest of a put, source of a get, and the signal word are symmetric addresses (this PE's heap);
//   the other buffer may be any memory this GPU can access.
#pragma once

#include "copy.cuh"
#include "group.cuh"
#include "p2p.cuh"
#include "proxy.cuh"

namespace mori {
namespace device {

// Signal operations of put-with-signal: the signal word is set to, or increased by, the value.
// MORI's atomicType values; mori.core.codes.SignalOp defines them for the host (a test checks both).
constexpr int kSignalSet = 9;
constexpr int kSignalAdd = 10;

namespace detail {

MORI_DEVICE_COLD void FailSignalOp(int sigOp) {
  MORI_DEVICE_FAIL("ShmemPutMemNbiSignal: signal op %d is not SET=9 or ADD=10", sigOp);
}

// A put of 1, 2, 4 or 8 naturally aligned bytes by one thread (a scalar) is done inline, and its
// source is loaded before the destination is translated: a scalar put right after a wait is
// latency-bound, and the load then overlaps the translation's loads instead of following them
// (see PeerHeapBase). Peer heaps are mapped at aligned bases, so the peer's copy of `dest` is
// aligned like `dest`.
MORI_DEVICE_INLINE bool IsScalarPut(const void* dest, const void* source, size_t bytes) {
  const uint64_t misaligned = (reinterpret_cast<uint64_t>(dest) | reinterpret_cast<uint64_t>(source)) & (bytes - 1);
  return bytes != 0 && bytes <= 8 && (bytes & (bytes - 1)) == 0 && misaligned == 0;
}

// The data stores of a put to `remote` (already translated): `value` is the source's scalar,
// loaded before the translation, when `scalar`; else the group copies.
template <class G>
MORI_DEVICE_INLINE void PutData(void* remote, const void* source, size_t bytes, bool scalar, uint64_t value) {
  if (scalar) {
    StoreScalar(remote, value, bytes);
  } else {
    GroupCopy(remote, source, bytes, G::Rank(), G::Size());
  }
}

// A PE that is not mapped here goes through the proxy (proxy.cuh) when there is one; kWait makes
// that path wait for completion (the blocking forms).
template <class G, bool kWait = false>
MORI_DEVICE_INLINE void PutMemNbi(void* dest, const void* source, size_t bytes, int pe) {
  const bool scalar = G::kAlone && IsScalarPut(dest, source, bytes);
  const uint64_t value = scalar ? LoadScalar(source, bytes) : 0;
  const PeerView v = ViewPeer(pe);
  if (MORI_DEVICE_UNLIKELY(!v.reachable && HasProxy())) {
    ProxyTransfer<G>(true, const_cast<void*>(source), dest, bytes, pe, kWait, "ShmemPutMem");
    return;
  }
  PutData<G>(PeerAddress(v, dest, pe, "ShmemPutMem"), source, bytes, scalar, value);
}

template <class G, bool kWait = false>
MORI_DEVICE_INLINE void GetMemNbi(void* dest, const void* source, size_t bytes, int pe) {
  const PeerView v = ViewPeer(pe);
  if (MORI_DEVICE_UNLIKELY(!v.reachable && HasProxy())) {
    ProxyTransfer<G>(false, dest, source, bytes, pe, kWait, "ShmemGetMem");
    return;
  }
  GroupCopy(dest, PeerAddress(v, source, pe, "ShmemGetMem"), bytes, G::Rank(), G::Size());
}

template <class G>
MORI_DEVICE_INLINE void PutMemNbiSignal(void* dest, const void* source, size_t bytes, uint64_t* sig, uint64_t sigVal,
                                        int sigOp, int pe) {
  if (MORI_DEVICE_UNLIKELY(sigOp != kSignalSet && sigOp != kSignalAdd)) FailSignalOp(sigOp);
  // Both addresses are checked before any byte moves (a bad one stops the call untouched), with
  // one view of the peer.
  const bool scalar = G::kAlone && IsScalarPut(dest, source, bytes);
  const uint64_t value = scalar ? LoadScalar(source, bytes) : 0;
  const PeerView view = ViewPeer(pe);
  if (MORI_DEVICE_UNLIKELY(!view.reachable && HasProxy())) {
    ProxyPutSignal<G>(dest, source, bytes, sig, sigVal, sigOp == kSignalAdd, pe, "ShmemPutMemNbiSignal");
    return;
  }
  uint64_t* remoteSig = PeerAddress(view, sig, pe, "ShmemPutMemNbiSignal");
  PutData<G>(PeerAddress(view, dest, pe, "ShmemPutMemNbiSignal"), source, bytes, scalar, value);
  if constexpr (!G::kAlone) {
    ptx::FenceAcqRelSys();
    G::Sync();
    if (G::Rank() != 0) return;
  }
  if (sigOp == kSignalSet) {
    ptx::StoreReleaseSys(remoteSig, sigVal);
  } else {
    ptx::RedAddReleaseSys(remoteSig, sigVal);
  }
}

}  // namespace detail

// Untyped put/get/put-with-signal in one scope. The trailing int is MORI's queue-pair id, which
// the P2P transport has no use for; it keeps MORI call sites compiling.
#define MORI_DEVICE_DEFINE_RMA(Scope)                                                                              \
  /* Copies `bytes` from local `source` to symmetric `dest` on PE `pe`; returns once issued. */                    \
  MORI_DEVICE_INLINE void ShmemPutMemNbi##Scope(void* dest, const void* source, size_t bytes, int pe, int = 0) {   \
    detail::PutMemNbi<detail::Scope##Group>(dest, source, bytes, pe);                                              \
  }                                                                                                                \
  /* Put; returns when every thread of the group has issued its stores. */                                         \
  MORI_DEVICE_INLINE void ShmemPutMem##Scope(void* dest, const void* source, size_t bytes, int pe, int = 0) {      \
    detail::PutMemNbi<detail::Scope##Group, true>(dest, source, bytes, pe);                                        \
    detail::Scope##Group::Sync();                                                                                  \
  }                                                                                                                \
  /* Copies `bytes` from symmetric `source` on PE `pe` to local `dest`. */                                         \
  MORI_DEVICE_INLINE void ShmemGetMemNbi##Scope(void* dest, const void* source, size_t bytes, int pe, int = 0) {   \
    detail::GetMemNbi<detail::Scope##Group>(dest, source, bytes, pe);                                              \
  }                                                                                                                \
  /* Get; `dest` holds the data for every thread of the group on return. */                                        \
  MORI_DEVICE_INLINE void ShmemGetMem##Scope(void* dest, const void* source, size_t bytes, int pe, int = 0) {      \
    detail::GetMemNbi<detail::Scope##Group, true>(dest, source, bytes, pe);                                        \
    detail::Scope##Group::Sync();                                                                                  \
  }                                                                                                                \
  /* Put, then signal word `sig` on PE `pe` set to (kSignalSet) or increased by (kSignalAdd)                       \
     `sigVal` with release semantics. */                                                                           \
  MORI_DEVICE_INLINE void ShmemPutMemNbiSignal##Scope(void* dest, const void* source, size_t bytes, uint64_t* sig, \
                                                      uint64_t sigVal, int sigOp, int pe, int = 0) {               \
    detail::PutMemNbiSignal<detail::Scope##Group>(dest, source, bytes, sig, sigVal, sigOp, pe);                    \
  }                                                                                                                \
  /* The same for `nelems` elements of type T. */                                                                  \
  template <class T>                                                                                               \
  MORI_DEVICE_INLINE void ShmemPutTypeNbi##Scope(T* dest, const T* source, size_t nelems, int pe, int = 0) {       \
    ShmemPutMemNbi##Scope(dest, source, nelems * sizeof(T), pe);                                                   \
  }                                                                                                                \
  template <class T>                                                                                               \
  MORI_DEVICE_INLINE void ShmemPutType##Scope(T* dest, const T* source, size_t nelems, int pe, int = 0) {          \
    ShmemPutMem##Scope(dest, source, nelems * sizeof(T), pe);                                                      \
  }                                                                                                                \
  template <class T>                                                                                               \
  MORI_DEVICE_INLINE void ShmemGetTypeNbi##Scope(T* dest, const T* source, size_t nelems, int pe, int = 0) {       \
    ShmemGetMemNbi##Scope(dest, source, nelems * sizeof(T), pe);                                                   \
  }                                                                                                                \
  template <class T>                                                                                               \
  MORI_DEVICE_INLINE void ShmemGetType##Scope(T* dest, const T* source, size_t nelems, int pe, int = 0) {          \
    ShmemGetMem##Scope(dest, source, nelems * sizeof(T), pe);                                                      \
  }                                                                                                                \
  template <class T>                                                                                               \
  MORI_DEVICE_INLINE void ShmemPutTypeNbiSignal##Scope(T* dest, const T* source, size_t nelems, uint64_t* sig,     \
                                                       uint64_t sigVal, int sigOp, int pe, int = 0) {              \
    ShmemPutMemNbiSignal##Scope(dest, source, nelems * sizeof(T), sig, sigVal, sigOp, pe);                         \
  }

MORI_DEVICE_DEFINE_RMA(Thread)
MORI_DEVICE_DEFINE_RMA(Warp)
MORI_DEVICE_DEFINE_RMA(Block)
#undef MORI_DEVICE_DEFINE_RMA

// The element types of the typed API: MORI's eleven, plus half and bfloat16 carried as their
// 16-bit storage (uint16_t), which is all a copy needs.
#define MORI_DEVICE_FOR_EACH_RMA_TYPE(X, Scope) \
  X(Uint8, uint8_t, Scope)                      \
  X(Int8, int8_t, Scope)                        \
  X(Schar, signed char, Scope)                  \
  X(Uint16, uint16_t, Scope)                    \
  X(Int16, int16_t, Scope)                      \
  X(Uint32, uint32_t, Scope)                    \
  X(Int32, int32_t, Scope)                      \
  X(Uint64, uint64_t, Scope)                    \
  X(Int64, int64_t, Scope)                      \
  X(Float, float, Scope)                        \
  X(Double, double, Scope)                      \
  X(Half, uint16_t, Scope)                      \
  X(Bfloat16, uint16_t, Scope)

// Typed put/get per scope: ShmemPut<Type>Nbi<Scope>, ShmemPut<Type><Scope>, ShmemGet<Type>Nbi<Scope>,
// ShmemGet<Type><Scope>, ShmemPut<Type>NbiSignal<Scope>, counted in elements.
#define MORI_DEVICE_DEFINE_TYPED_RMA(Name, T, Scope)                                                               \
  MORI_DEVICE_INLINE void ShmemPut##Name##Nbi##Scope(T* dest, const T* source, size_t nelems, int pe, int = 0) {   \
    ShmemPutTypeNbi##Scope<T>(dest, source, nelems, pe);                                                           \
  }                                                                                                                \
  MORI_DEVICE_INLINE void ShmemPut##Name##Scope(T* dest, const T* source, size_t nelems, int pe, int = 0) {        \
    ShmemPutType##Scope<T>(dest, source, nelems, pe);                                                              \
  }                                                                                                                \
  MORI_DEVICE_INLINE void ShmemGet##Name##Nbi##Scope(T* dest, const T* source, size_t nelems, int pe, int = 0) {   \
    ShmemGetTypeNbi##Scope<T>(dest, source, nelems, pe);                                                           \
  }                                                                                                                \
  MORI_DEVICE_INLINE void ShmemGet##Name##Scope(T* dest, const T* source, size_t nelems, int pe, int = 0) {        \
    ShmemGetType##Scope<T>(dest, source, nelems, pe);                                                              \
  }                                                                                                                \
  MORI_DEVICE_INLINE void ShmemPut##Name##NbiSignal##Scope(T* dest, const T* source, size_t nelems, uint64_t* sig, \
                                                           uint64_t sigVal, int sigOp, int pe, int = 0) {          \
    ShmemPutTypeNbiSignal##Scope<T>(dest, source, nelems, sig, sigVal, sigOp, pe);                                 \
  }

MORI_DEVICE_FOR_EACH_RMA_TYPE(MORI_DEVICE_DEFINE_TYPED_RMA, Thread)
MORI_DEVICE_FOR_EACH_RMA_TYPE(MORI_DEVICE_DEFINE_TYPED_RMA, Warp)
MORI_DEVICE_FOR_EACH_RMA_TYPE(MORI_DEVICE_DEFINE_TYPED_RMA, Block)
#undef MORI_DEVICE_DEFINE_TYPED_RMA

// Writes one value to symmetric `dest` on PE `pe` (OpenSHMEM p): a put of one element, ordered by
// fence/quiet like any put.
template <class T>
MORI_DEVICE_INLINE void ShmemP(T* dest, detail::NonDeduced<T> value, int pe) {
  const detail::PeerView v = detail::ViewPeer(pe);
  if (MORI_DEVICE_UNLIKELY(!v.reachable && detail::HasProxy())) {
    detail::ProxyTransfer<detail::ThreadGroup>(true, &value, dest, sizeof(T), pe, false, "ShmemP");
    return;
  }
  *detail::PeerAddress(v, dest, pe, "ShmemP") = value;
}

// Reads one value of symmetric `source` on PE `pe` (OpenSHMEM g): a relaxed system-scope load, so
// it returns the peer's current value rather than a line cached earlier.
template <class T>
MORI_DEVICE_INLINE T ShmemG(const T* source, int pe) {
  const detail::PeerView v = detail::ViewPeer(pe);
  if (MORI_DEVICE_UNLIKELY(!v.reachable && detail::HasProxy())) return detail::ProxyG(source, pe, "ShmemG");
  return ptx::LoadRelaxedSys(detail::PeerAddress(v, source, pe, "ShmemG"));
}

// Typed p and g (Shmem<Type>P, Shmem<Type>G), and MORI's name for a one-element put,
// ShmemPut<Type>ImmNbiThread.
#define MORI_DEVICE_DEFINE_TYPED_PG(Name, T, Scope)                                                \
  MORI_DEVICE_INLINE void Shmem##Name##P(T* dest, T value, int pe) { ShmemP<T>(dest, value, pe); } \
  MORI_DEVICE_INLINE T Shmem##Name##G(const T* source, int pe) { return ShmemG<T>(source, pe); }   \
  MORI_DEVICE_INLINE void ShmemPut##Name##ImmNbi##Scope(T* dest, T value, int pe, int = 0) {       \
    ShmemP<T>(dest, value, pe);                                                                    \
  }

MORI_DEVICE_FOR_EACH_RMA_TYPE(MORI_DEVICE_DEFINE_TYPED_PG, Thread)
#undef MORI_DEVICE_DEFINE_TYPED_PG

// MORI's put of one immediate of `bytes` bytes (1, 2, 4, 8 or 16) read from `value`: one
// single-copy-atomic store up to 8 bytes, one 16-byte vector store at 16 (both addresses aligned
// to the size). Ordered by fence/quiet like any put; other sizes abort the kernel.
MORI_DEVICE_INLINE void ShmemPutSizeImmNbiThread(void* dest, const void* value, size_t bytes, int pe, int = 0) {
  struct alignas(16) Bytes16 {
    uint64_t lo, hi;
  };
  if (MORI_DEVICE_UNLIKELY(!detail::ViewPeer(pe).reachable && detail::HasProxy()) &&
      (bytes == 1 || bytes == 2 || bytes == 4 || bytes == 8 || bytes == 16)) {
    detail::ProxyTransfer<detail::ThreadGroup>(true, const_cast<void*>(value), dest, bytes, pe, false,
                                               "ShmemPutSizeImmNbiThread");
    return;
  }
  switch (bytes) {
    case 1:
      ptx::StoreRelaxedSys(detail::PeerAddress(static_cast<uint8_t*>(dest), pe, "ShmemPutSizeImmNbiThread"),
                           *static_cast<const uint8_t*>(value));
      return;
    case 2:
      ptx::StoreRelaxedSys(detail::PeerAddress(static_cast<uint16_t*>(dest), pe, "ShmemPutSizeImmNbiThread"),
                           *static_cast<const uint16_t*>(value));
      return;
    case 4:
      ptx::StoreRelaxedSys(detail::PeerAddress(static_cast<uint32_t*>(dest), pe, "ShmemPutSizeImmNbiThread"),
                           *static_cast<const uint32_t*>(value));
      return;
    case 8:
      ptx::StoreRelaxedSys(detail::PeerAddress(static_cast<uint64_t*>(dest), pe, "ShmemPutSizeImmNbiThread"),
                           *static_cast<const uint64_t*>(value));
      return;
    case 16:
      *detail::PeerAddress(static_cast<Bytes16*>(dest), pe, "ShmemPutSizeImmNbiThread") =
          *static_cast<const Bytes16*>(value);
      return;
    default:
      MORI_DEVICE_FAIL("ShmemPutSizeImmNbiThread: %llu bytes; immediates are 1, 2, 4, 8 or 16 bytes",
                       static_cast<unsigned long long>(bytes));
  }
}

}  // namespace device
}  // namespace mori
