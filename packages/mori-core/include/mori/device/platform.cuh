// Portability layer of the mori device API.
//
// The headers must compile unchanged under three compilers, none of which may rely on CUDA
// headers here: nvcc (which pre-includes cuda_runtime.h), NVRTC (which has the built-in
// variables and __syncthreads but no standard headers), and clang -x cuda -nocudainc -nocudalib
// (which has neither: mori-triton builds its bitcode that way). This file gives the rest of the
// API one spelling for function qualifiers, fixed-width types, thread indices and printf.
#pragma once

#if defined(__CUDACC_RTC__)
#define MORI_DEVICE_NVRTC 1
#elif defined(__NVCC__)
#define MORI_DEVICE_NVCC 1
#elif defined(__clang__) && defined(__CUDA__)
#define MORI_DEVICE_CLANG 1
#elif defined(MORI_DEVICE_HOST_TEST)
// A plain C++ build of the parts that need no GPU (the copy engine), so that the CPU tests can
// run them on random data; it has no PTX and no thread indices.
#define MORI_DEVICE_HOST 1
#define __device__
#define __forceinline__ inline __attribute__((always_inline))
#define __noinline__ __attribute__((noinline))
#else
#error "mori device headers need nvcc, NVRTC or clang in CUDA mode (-x cuda)"
#endif

#if defined(MORI_DEVICE_CLANG)
// With -nocudainc clang defines none of CUDA's qualifiers: spell them with its attributes.
#ifndef __device__
#define __device__ __attribute__((device))
#endif
#ifndef __global__
#define __global__ __attribute__((global))
#endif
#ifndef __host__
#define __host__ __attribute__((host))
#endif
#ifndef __shared__
#define __shared__ __attribute__((shared))
#endif
#ifndef __constant__
#define __constant__ __attribute__((constant))
#endif
#ifndef __forceinline__
#define __forceinline__ __inline__ __attribute__((always_inline))
#endif
#ifndef __noinline__
#define __noinline__ __attribute__((noinline))
#endif
// clang lowers a device-side call of the C library's printf to the driver's vprintf.
extern "C" __device__ int printf(const char*, ...);
#endif

// Small API functions: always inlined, so the signal/flag paths cost no call.
#define MORI_DEVICE_INLINE __device__ __forceinline__
// The copy engine and slow paths: left to the compiler, so that a kernel with many call
// sites does not grow a copy of every alignment path at each one.
#define MORI_DEVICE_FUNC __device__ inline

#if defined(__has_builtin)
#if __has_builtin(__builtin_expect)
#define MORI_DEVICE_UNLIKELY(x) __builtin_expect(!!(x), 0)
#endif
#endif
#ifndef MORI_DEVICE_UNLIKELY
#define MORI_DEVICE_UNLIKELY(x) (x)
#endif

namespace mori {
namespace device {

namespace detail {
template <bool C, class A, class B>
struct Conditional {
  using type = A;
};
template <class A, class B>
struct Conditional<false, A, B> {
  using type = B;
};
// Keeps a parameter out of template argument deduction: ShmemWaitUntil(p, kCmpEq, 1) then
// takes T from the pointer alone instead of failing on `int` against `uint64_t`.
template <class T>
struct TypeIdentity {
  using type = T;
};
template <class T>
using NonDeduced = typename TypeIdentity<T>::type;
template <class T>
struct RemoveConst {
  using type = T;
};
template <class T>
struct RemoveConst<const T> {
  using type = T;
};
}  // namespace detail

// Fixed-width types without <cstdint> (absent under -nocudainc and NVRTC). The 64-bit types
// are `long` where long has 64 bits, as <cstdint> makes them on Linux, so that a caller's
// uint64_t* converts to ours without a cast.
using int8_t = signed char;
using uint8_t = unsigned char;
using int16_t = short;
using uint16_t = unsigned short;
using int32_t = int;
using uint32_t = unsigned int;
using int64_t = detail::Conditional<sizeof(long) == 8, long, long long>::type;
using uint64_t = detail::Conditional<sizeof(long) == 8, unsigned long, unsigned long long>::type;
using size_t = decltype(sizeof(0));
static_assert(sizeof(int64_t) == 8 && sizeof(uint64_t) == 8 && sizeof(void*) == 8,
              "the mori device API needs a 64-bit target");

constexpr uint32_t kWarpSize = 32;
constexpr uint32_t kFullWarpMask = 0xffffffffu;

// Reinterprets the bits of a value as another type of the same size.
template <class To, class From>
MORI_DEVICE_INLINE To BitCast(From v) {
  static_assert(sizeof(To) == sizeof(From), "BitCast needs types of one size");
  return __builtin_bit_cast(To, v);
}

#if defined(MORI_DEVICE_HOST)
// (no thread indices in the host test build)
#elif defined(MORI_DEVICE_CLANG)
MORI_DEVICE_INLINE uint32_t ThreadIdxX() { return __nvvm_read_ptx_sreg_tid_x(); }
MORI_DEVICE_INLINE uint32_t ThreadIdxY() { return __nvvm_read_ptx_sreg_tid_y(); }
MORI_DEVICE_INLINE uint32_t ThreadIdxZ() { return __nvvm_read_ptx_sreg_tid_z(); }
MORI_DEVICE_INLINE uint32_t BlockDimX() { return __nvvm_read_ptx_sreg_ntid_x(); }
MORI_DEVICE_INLINE uint32_t BlockDimY() { return __nvvm_read_ptx_sreg_ntid_y(); }
MORI_DEVICE_INLINE uint32_t BlockDimZ() { return __nvvm_read_ptx_sreg_ntid_z(); }
MORI_DEVICE_INLINE uint32_t BlockIdxX() { return __nvvm_read_ptx_sreg_ctaid_x(); }
MORI_DEVICE_INLINE void SyncWarp(uint32_t mask) { __nvvm_bar_warp_sync(mask); }
#else
MORI_DEVICE_INLINE uint32_t ThreadIdxX() { return threadIdx.x; }
MORI_DEVICE_INLINE uint32_t ThreadIdxY() { return threadIdx.y; }
MORI_DEVICE_INLINE uint32_t ThreadIdxZ() { return threadIdx.z; }
MORI_DEVICE_INLINE uint32_t BlockDimX() { return blockDim.x; }
MORI_DEVICE_INLINE uint32_t BlockDimY() { return blockDim.y; }
MORI_DEVICE_INLINE uint32_t BlockDimZ() { return blockDim.z; }
MORI_DEVICE_INLINE uint32_t BlockIdxX() { return blockIdx.x; }
MORI_DEVICE_INLINE void SyncWarp(uint32_t mask) { __syncwarp(mask); }
#endif

#if !defined(MORI_DEVICE_HOST)
// __syncthreads is a builtin of all three compilers (bar.sync 0), and marked convergent there.
MORI_DEVICE_INLINE void SyncBlock() { __syncthreads(); }

// Linear index of this thread in its block, and the number of threads in the block.
MORI_DEVICE_INLINE uint32_t FlatThreadId() {
  return ThreadIdxX() + BlockDimX() * (ThreadIdxY() + BlockDimY() * ThreadIdxZ());
}
MORI_DEVICE_INLINE uint32_t BlockThreads() { return BlockDimX() * BlockDimY() * BlockDimZ(); }
#endif

}  // namespace device
}  // namespace mori
