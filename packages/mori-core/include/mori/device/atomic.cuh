// Remote atomics over P2P (NVLink carries them natively), or through the proxy for PEs that are
// not mapped here (proxy.cuh: a fetching atomic waits for the proxy's answer, a non-fetching one is
// complete after quiet): fetching and non-fetching add, inc, and, or, xor; swap, compare-swap,
// fetch and set, on 32- and 64-bit integers.
//
// All are relaxed at system scope: atomic with respect to every other mori atomic on the same
// word from any PE, but unordered with respect to puts; order them with ShmemFence/ShmemQuiet,
// as OpenSHMEM does. Non-fetching forms use red, so the issuing thread does not wait for the
// reply from the peer. `dest`/`source` are symmetric addresses (this PE's heap); the trailing int
// is MORI's queue-pair id, unused on P2P.
#pragma once

#include "p2p.cuh"
#include "proxy.cuh"
#include "rma.cuh"

namespace mori {
namespace device {
namespace detail {

// The integer types the atomics accept: every 32- and 64-bit integer type of the language, so
// that int32_t, uint64_t, long and unsigned long long all work.
template <class T>
struct IsAmoType {
  static constexpr bool value = false;
};
#define MORI_DEVICE_AMO_TYPE(T)         \
  template <>                           \
  struct IsAmoType<T> {                 \
    static constexpr bool value = true; \
  };
MORI_DEVICE_AMO_TYPE(int)
MORI_DEVICE_AMO_TYPE(unsigned int)
MORI_DEVICE_AMO_TYPE(long)
MORI_DEVICE_AMO_TYPE(unsigned long)
MORI_DEVICE_AMO_TYPE(long long)
MORI_DEVICE_AMO_TYPE(unsigned long long)
#undef MORI_DEVICE_AMO_TYPE

// Whether PE pe is reached through the proxy (not mapped here, and a proxy serves it).
MORI_DEVICE_INLINE bool ViaProxy(int pe) { return !ViewPeer(pe).reachable && HasProxy(); }

template <class T>
MORI_DEVICE_INLINE T* AmoAddress(T* sym, int pe, const char* op) {
  static_assert(IsAmoType<typename RemoveConst<T>::type>::value && (sizeof(T) == 4 || sizeof(T) == 8),
                "mori atomics take 32- or 64-bit integers");
  return PeerAddress(sym, pe, op);
}

}  // namespace detail

// Reads symmetric `source` on PE `pe` atomically.
template <class T>
MORI_DEVICE_INLINE T ShmemAtomicFetch(const T* source, int pe, int = 0) {
  if (MORI_DEVICE_UNLIKELY(detail::ViaProxy(pe))) {
    return detail::ProxyAtomic<T>(const_cast<T*>(source), pe, kProxyAmoFetchAdd, T(0), T(0), true, "ShmemAtomicFetch");
  }
  return ptx::LoadRelaxedSys(detail::AmoAddress(source, pe, "ShmemAtomicFetch"));
}

// Writes `value` to symmetric `dest` on PE `pe` atomically.
template <class T>
MORI_DEVICE_INLINE void ShmemAtomicSet(T* dest, detail::NonDeduced<T> value, int pe, int = 0) {
  if (MORI_DEVICE_UNLIKELY(detail::ViaProxy(pe))) {
    detail::ProxyAtomic<T>(dest, pe, kProxyAmoStore, value, T(0), false, "ShmemAtomicSet");
    return;
  }
  ptx::StoreRelaxedSys(detail::AmoAddress(dest, pe, "ShmemAtomicSet"), value);
}

// Replaces `dest` on PE `pe` with `value`; returns the old value.
template <class T>
MORI_DEVICE_INLINE T ShmemAtomicSwap(T* dest, detail::NonDeduced<T> value, int pe, int = 0) {
  if (MORI_DEVICE_UNLIKELY(detail::ViaProxy(pe))) {
    return detail::ProxyAtomic<T>(dest, pe, kProxyAmoSwap, value, T(0), true, "ShmemAtomicSwap");
  }
  return ptx::AtomExchSys(detail::AmoAddress(dest, pe, "ShmemAtomicSwap"), value);
}

// Replaces `dest` on PE `pe` with `value` if it equals `cond`; returns the old value either way.
template <class T>
MORI_DEVICE_INLINE T ShmemAtomicCompareSwap(T* dest, detail::NonDeduced<T> cond, detail::NonDeduced<T> value, int pe,
                                            int = 0) {
  if (MORI_DEVICE_UNLIKELY(detail::ViaProxy(pe))) {
    return detail::ProxyAtomic<T>(dest, pe, kProxyAmoCompareSwap, value, cond, true, "ShmemAtomicCompareSwap");
  }
  return ptx::AtomCasSys(detail::AmoAddress(dest, pe, "ShmemAtomicCompareSwap"), cond, value);
}

// Adds 1 to `dest` on PE `pe`; the Fetch form returns the old value.
template <class T>
MORI_DEVICE_INLINE T ShmemAtomicFetchInc(T* dest, int pe, int = 0) {
  if (MORI_DEVICE_UNLIKELY(detail::ViaProxy(pe))) {
    return detail::ProxyAtomic<T>(dest, pe, kProxyAmoFetchAdd, T(1), T(0), true, "ShmemAtomicFetchInc");
  }
  return ptx::AtomAddSys(detail::AmoAddress(dest, pe, "ShmemAtomicFetchInc"), T(1));
}
template <class T>
MORI_DEVICE_INLINE void ShmemAtomicInc(T* dest, int pe, int = 0) {
  if (MORI_DEVICE_UNLIKELY(detail::ViaProxy(pe))) {
    detail::ProxyAtomic<T>(dest, pe, kProxyAmoFetchAdd, T(1), T(0), false, "ShmemAtomicInc");
    return;
  }
  ptx::RedAddSys(detail::AmoAddress(dest, pe, "ShmemAtomicInc"), T(1));
}

// ShmemAtomicFetch<Op> returns the old value of `dest` on PE `pe` and stores old <op> value;
// ShmemAtomic<Op> does the same without the result.
#define MORI_DEVICE_DEFINE_AMO(Op, atom, red, amo)                                                   \
  template <class T>                                                                                 \
  MORI_DEVICE_INLINE T ShmemAtomicFetch##Op(T* dest, detail::NonDeduced<T> value, int pe, int = 0) { \
    if (MORI_DEVICE_UNLIKELY(detail::ViaProxy(pe))) {                                                \
      return detail::ProxyAtomic<T>(dest, pe, amo, value, T(0), true, "ShmemAtomicFetch" #Op);       \
    }                                                                                                \
    return ptx::atom(detail::AmoAddress(dest, pe, "ShmemAtomicFetch" #Op), value);                   \
  }                                                                                                  \
  template <class T>                                                                                 \
  MORI_DEVICE_INLINE void ShmemAtomic##Op(T* dest, detail::NonDeduced<T> value, int pe, int = 0) {   \
    if (MORI_DEVICE_UNLIKELY(detail::ViaProxy(pe))) {                                                \
      detail::ProxyAtomic<T>(dest, pe, amo, value, T(0), false, "ShmemAtomic" #Op);                  \
      return;                                                                                        \
    }                                                                                                \
    ptx::red(detail::AmoAddress(dest, pe, "ShmemAtomic" #Op), value);                                \
  }
MORI_DEVICE_DEFINE_AMO(Add, AtomAddSys, RedAddSys, kProxyAmoFetchAdd)
MORI_DEVICE_DEFINE_AMO(And, AtomAndSys, RedAndSys, kProxyAmoFetchAnd)
MORI_DEVICE_DEFINE_AMO(Or, AtomOrSys, RedOrSys, kProxyAmoFetchOr)
MORI_DEVICE_DEFINE_AMO(Xor, AtomXorSys, RedXorSys, kProxyAmoFetchXor)
#undef MORI_DEVICE_DEFINE_AMO

// MORI's typed add conveniences: Shmem<Type>AtomicAddThread and Shmem<Type>AtomicFetchAddThread.
#define MORI_DEVICE_DEFINE_TYPED_ADD(Name, T)                                                 \
  MORI_DEVICE_INLINE void Shmem##Name##AtomicAddThread(T* dest, T value, int pe, int = 0) {   \
    ShmemAtomicAdd<T>(dest, value, pe);                                                       \
  }                                                                                           \
  MORI_DEVICE_INLINE T Shmem##Name##AtomicFetchAddThread(T* dest, T value, int pe, int = 0) { \
    return ShmemAtomicFetchAdd<T>(dest, value, pe);                                           \
  }
MORI_DEVICE_DEFINE_TYPED_ADD(Uint32, uint32_t)
MORI_DEVICE_DEFINE_TYPED_ADD(Int32, int32_t)
MORI_DEVICE_DEFINE_TYPED_ADD(Uint64, uint64_t)
MORI_DEVICE_DEFINE_TYPED_ADD(Int64, int64_t)
#undef MORI_DEVICE_DEFINE_TYPED_ADD

// MORI's atomicType values (the NVSHMEM AMO numbering), taken by the generic forms below; its
// signal set/add (9/10) are rma.cuh's kSignalSet/kSignalAdd.
enum AmoType : int {
  kAmoInc = 2,
  kAmoSet = 3,
  kAmoAdd = 4,
  kAmoAnd = 5,
  kAmoOr = 6,
  kAmoXor = 7,
  kAmoFetch = 12,
  kAmoFetchInc = 13,
  kAmoFetchAdd = 14,
  kAmoFetchAnd = 15,
  kAmoFetchOr = 16,
  kAmoFetchXor = 17,
  kAmoSwap = 18,
  kAmoCompareSwap = 19,
};

// MORI's generic non-fetching atomic: `op` is inc, set, add, and, or, xor, or signal set/add
// (set/add); any other value aborts the kernel naming it.
template <class T>
MORI_DEVICE_INLINE void ShmemAtomicNonFetchThread(T* dest, detail::NonDeduced<T> value, int op, int pe, int = 0) {
  switch (op) {
    case kAmoInc: ShmemAtomicInc<T>(dest, pe); return;
    case kAmoSet:
    case kSignalSet: ShmemAtomicSet<T>(dest, value, pe); return;
    case kAmoAdd:
    case kSignalAdd: ShmemAtomicAdd<T>(dest, value, pe); return;
    case kAmoAnd: ShmemAtomicAnd<T>(dest, value, pe); return;
    case kAmoOr: ShmemAtomicOr<T>(dest, value, pe); return;
    case kAmoXor: ShmemAtomicXor<T>(dest, value, pe); return;
    default: MORI_DEVICE_FAIL("ShmemAtomicNonFetchThread: atomic type %d is not a non-fetching one", op);
  }
}

// MORI's generic fetching atomic: `op` is fetch, fetch-inc/add/and/or/xor, swap or compare-swap
// (which stores `value` where `dest` holds `compare`); returns the old value.
template <class T>
MORI_DEVICE_INLINE T ShmemAtomicFetchThread(T* dest, detail::NonDeduced<T> value, detail::NonDeduced<T> compare, int op,
                                            int pe, int = 0) {
  switch (op) {
    case kAmoFetch: return ShmemAtomicFetch<T>(dest, pe);
    case kAmoFetchInc: return ShmemAtomicFetchInc<T>(dest, pe);
    case kAmoFetchAdd: return ShmemAtomicFetchAdd<T>(dest, value, pe);
    case kAmoFetchAnd: return ShmemAtomicFetchAnd<T>(dest, value, pe);
    case kAmoFetchOr: return ShmemAtomicFetchOr<T>(dest, value, pe);
    case kAmoFetchXor: return ShmemAtomicFetchXor<T>(dest, value, pe);
    case kAmoSwap: return ShmemAtomicSwap<T>(dest, value, pe);
    case kAmoCompareSwap: return ShmemAtomicCompareSwap<T>(dest, compare, value, pe);
    default: MORI_DEVICE_FAIL("ShmemAtomicFetchThread: atomic type %d is not a fetching one", op);
  }
}

// MORI's size-generic non-fetching atomic: `bytes` (4 or 8) is the width of `dest` and of the
// operand `*value`.
MORI_DEVICE_INLINE void ShmemAtomicSizeNonFetchThread(void* dest, const void* value, size_t bytes, int op, int pe,
                                                      int = 0) {
  if (bytes == 4) {
    ShmemAtomicNonFetchThread<uint32_t>(static_cast<uint32_t*>(dest), *static_cast<const uint32_t*>(value), op, pe);
  } else if (bytes == 8) {
    ShmemAtomicNonFetchThread<uint64_t>(static_cast<uint64_t*>(dest), *static_cast<const uint64_t*>(value), op, pe);
  } else {
    MORI_DEVICE_FAIL("ShmemAtomicSizeNonFetchThread: %llu bytes; atomics are 4 or 8 bytes wide",
                     static_cast<unsigned long long>(bytes));
  }
}

}  // namespace device
}  // namespace mori
