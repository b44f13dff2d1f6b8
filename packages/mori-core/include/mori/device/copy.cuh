// Cooperative memory copy: the hot path of every put and get.
//
// A group of `n` threads (one thread, a warp, or a block) copies `bytes` from `src` to `dst`,
// thread `rank` taking every n-th element. The widest element both pointers can share is used:
// 16-byte vectors when dst and src are congruent modulo 16, else 8, 4, 2 or 1 bytes; the few
// bytes before the first aligned element and after the last go as single naturally aligned
// pieces of 1, 2, 4 or 8 bytes (so an 8-byte put is one 8-byte store). The body is
// unrolled so each thread issues kUnroll loads before its first store: with 16-byte vectors that
// is 128 bytes in flight per thread, which is what hides NVLink's latency; the loads of one
// unrolled step are coalesced across the group (consecutive threads, consecutive elements).
//
// The stores are plain weak stores: ordering and visibility are the job of fence, quiet and the
// signal operations (see sync.cuh and rma.cuh).
#pragma once

#include "platform.cuh"

namespace mori {
namespace device {
namespace detail {

constexpr int kCopyUnroll = 8;

// A 16-byte element that every compiler moves with one ld.v4/st.v4 (clang splits a 16-byte
// struct into two 8-byte accesses and spills the unrolled array to local memory).
#if defined(MORI_DEVICE_NVCC) || defined(MORI_DEVICE_NVRTC)
using Vec16 = uint4;
#else
typedef unsigned int Vec16 __attribute__((vector_size(16)));
#endif
static_assert(sizeof(Vec16) == 16 && alignof(Vec16) == 16, "Vec16 must be 16 aligned bytes");

// Copies n elements of type V, both arrays aligned to sizeof(V).
template <class V>
MORI_DEVICE_FUNC void CopyElements(V* dst, const V* src, size_t n, uint32_t rank, uint32_t size) {
  const size_t stride = size;
  const size_t step = stride * kCopyUnroll;
  const size_t whole = n - n % step;  // elements covered by complete unrolled steps
  for (size_t i = rank; i < whole; i += step) {
    V v[kCopyUnroll];
#pragma unroll
    for (int u = 0; u < kCopyUnroll; ++u) v[u] = src[i + u * stride];
#pragma unroll
    for (int u = 0; u < kCopyUnroll; ++u) dst[i + u * stride] = v[u];
  }
  for (size_t i = whole + rank; i < n; i += stride) dst[i] = src[i];
}

// Loads / stores one naturally aligned scalar of `w` (1, 2, 4 or 8) bytes, zero-extended in a
// uint64_t: apart so that a caller can issue the load early (see the scalar put in rma.cuh).
MORI_DEVICE_INLINE uint64_t LoadScalar(const void* p, size_t w) {
  switch (w) {
    case 8: return *static_cast<const uint64_t*>(p);
    case 4: return *static_cast<const uint32_t*>(p);
    case 2: return *static_cast<const uint16_t*>(p);
    default: return *static_cast<const uint8_t*>(p);
  }
}

MORI_DEVICE_INLINE void StoreScalar(void* p, uint64_t v, size_t w) {
  switch (w) {
    case 8: *static_cast<uint64_t*>(p) = v; break;
    case 4: *static_cast<uint32_t*>(p) = static_cast<uint32_t>(v); break;
    case 2: *static_cast<uint16_t*>(p) = static_cast<uint16_t>(v); break;
    default: *static_cast<uint8_t*>(p) = static_cast<uint8_t>(v); break;
  }
}

// Copies one naturally aligned piece of `w` (1, 2, 4 or 8) bytes.
MORI_DEVICE_INLINE void CopyPiece(char* dst, const char* src, size_t w) { StoreScalar(dst, LoadScalar(src, w), w); }

// Copies with elements of type V, given dst and src congruent modulo sizeof(V). The head (until
// dst is aligned to V) and the tail (after the last whole V) are at most one piece of each
// narrower width; piece k is copied by thread k % size of the group.
template <class V>
MORI_DEVICE_FUNC void CopyCongruent(char* dst, const char* src, size_t bytes, uint32_t rank, uint32_t size) {
  uint32_t piece = 0;
#pragma unroll
  for (size_t w = 1; w < sizeof(V); w *= 2) {
    // Adding w to an address whose lower bits are already clear clears bit w: after the loop
    // dst is aligned to sizeof(V), unless the bytes ran out first.
    if ((reinterpret_cast<uint64_t>(dst) & w) && bytes >= w) {
      if (piece++ % size == rank) CopyPiece(dst, src, w);
      dst += w;
      src += w;
      bytes -= w;
    }
  }
  const size_t n = bytes / sizeof(V);
  CopyElements(reinterpret_cast<V*>(dst), reinterpret_cast<const V*>(src), n, rank, size);
  dst += n * sizeof(V);
  src += n * sizeof(V);
  bytes -= n * sizeof(V);
#pragma unroll
  for (size_t w = sizeof(V) / 2; w >= 1; w /= 2) {
    if (bytes >= w) {
      if (piece++ % size == rank) CopyPiece(dst, src, w);
      dst += w;
      src += w;
      bytes -= w;
    }
  }
}

}  // namespace detail

// Public device API: the group copy every put and get uses, for kernels of other packages (the
// NVLink backend's gather kernel). Copies `bytes` from src to dst by thread `rank` of `size`
// threads. Every thread of the group must call it with the same arguments; there is no
// synchronization inside, and the stores are weak (order them with a fence). Not inlined:
// with its five alignment paths unrolled it is large, and a kernel that puts from many call sites
// (or the Triton library, which instantiates every typed put) would otherwise carry one copy per
// call site and take minutes to compile; a call costs nothing next to a copy over NVLink.
__device__ __noinline__ inline void GroupCopy(void* dst, const void* src, size_t bytes, uint32_t rank, uint32_t size) {
  char* d = static_cast<char*>(dst);
  const char* s = static_cast<const char*>(src);
  const uint64_t skew = reinterpret_cast<uint64_t>(d) ^ reinterpret_cast<uint64_t>(s);
  if ((skew & 15) == 0) {
    detail::CopyCongruent<detail::Vec16>(d, s, bytes, rank, size);
  } else if ((skew & 7) == 0) {
    detail::CopyCongruent<uint64_t>(d, s, bytes, rank, size);
  } else if ((skew & 3) == 0) {
    detail::CopyCongruent<uint32_t>(d, s, bytes, rank, size);
  } else if ((skew & 1) == 0) {
    detail::CopyCongruent<uint16_t>(d, s, bytes, rank, size);
  } else {
    detail::CopyCongruent<uint8_t>(d, s, bytes, rank, size);
  }
}

}  // namespace device
}  // namespace mori
