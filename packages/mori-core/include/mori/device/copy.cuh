// Cooperative memory copy: the hot path of every put and get.
//
// A group of `n` threads (one thread, a warp, or a block) copies `bytes` from `src` to `dst`,
// thread `rank` taking every n-th element. The widest element both pointers can share is used:
// 16-byte vectors when dst and src are congruent modulo 16, else 8, 4, 2 or 1 bytes; the few
// bytes before the first aligned element and after the last are copied one by one. The body is
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
#if defined(MORI_DEVICE_CLANG)
typedef unsigned int Vec16 __attribute__((ext_vector_type(4)));
#else
using Vec16 = uint4;
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

// Copies bytes one by one over [begin, end).
MORI_DEVICE_INLINE void CopyBytes(char* dst, const char* src, size_t begin, size_t end,
                                  uint32_t rank, uint32_t size) {
  for (size_t i = begin + rank; i < end; i += size) dst[i] = src[i];
}

// Copies with elements of type V, given dst and src congruent modulo sizeof(V).
template <class V>
MORI_DEVICE_FUNC void CopyCongruent(char* dst, const char* src, size_t bytes, uint32_t rank,
                                    uint32_t size) {
  size_t head = (0 - reinterpret_cast<uint64_t>(dst)) & (sizeof(V) - 1);
  if (head > bytes) head = bytes;
  const size_t n = (bytes - head) / sizeof(V);
  const size_t tail = head + n * sizeof(V);
  CopyBytes(dst, src, 0, head, rank, size);
  CopyElements(reinterpret_cast<V*>(dst + head), reinterpret_cast<const V*>(src + head), n, rank,
               size);
  CopyBytes(dst, src, tail, bytes, rank, size);
}

// Group copy of `bytes` from src to dst by thread `rank` of `size` threads. Every thread of the
// group must call it with the same arguments; there is no synchronization inside. Not inlined:
// with its five alignment paths unrolled it is large, and a kernel that puts from many call sites
// (or the Triton library, which instantiates every typed put) would otherwise carry one copy per
// call site and take minutes to compile; a call costs nothing next to a copy over NVLink.
__device__ __noinline__ inline void GroupCopy(void* dst, const void* src, size_t bytes, uint32_t rank,
                                uint32_t size) {
  char* d = static_cast<char*>(dst);
  const char* s = static_cast<const char*>(src);
  const uint64_t skew = reinterpret_cast<uint64_t>(d) ^ reinterpret_cast<uint64_t>(s);
  if ((skew & 15) == 0) {
    CopyCongruent<Vec16>(d, s, bytes, rank, size);
  } else if ((skew & 7) == 0) {
    CopyCongruent<uint64_t>(d, s, bytes, rank, size);
  } else if ((skew & 3) == 0) {
    CopyCongruent<uint32_t>(d, s, bytes, rank, size);
  } else if ((skew & 1) == 0) {
    CopyCongruent<uint16_t>(d, s, bytes, rank, size);
  } else {
    CopyCongruent<uint8_t>(d, s, bytes, rank, size);
  }
}

}  // namespace detail
}  // namespace device
}  // namespace mori
