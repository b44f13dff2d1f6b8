// MORI-EP dispatch and combine on the GPU heap, part 1 of 4: the kernel arguments and helpers
// shared by ep_wire.cuh (the combine wires' element work), ep_internode.cu (tokens between nodes)
// and ep_intranode.cu (loads and stores on the symmetric heaps of one node's PEs; every PE with
// IntraNode).
//
// mori/ops/_gpu.py compiles the four parts as one NVRTC source (mori.core.nvrtc, mori's device
// headers), with the EP_* layout constants prepended, and mirrors EpArgs with ctypes. The routing
// rule is the one of mori/ops/_layout.py (MORI's): expert e lives on PE e / expertsPerRank, invalid
// ids are dropped, a token goes once to each distinct destination PE, combine sums in float32 in
// top-k order and rounds once.
//
// Every wait on another PE is in one block that runs after every block of the data kernels has
// finished (a one-block kernel launched after them, or a data kernel's last block to finish), and
// no other block waits on anything: with several PEs sharing one GPU (MPS or time-slicing) the
// spinning blocks never fill the GPU and so can never keep a peer's data kernel from running.
#define MORI_DEVICE_DEFINE_STATE
#include <mori/device/shmem.cuh>

using namespace mori::device;

#ifndef EP_MAX_PES
#error "EP_* constants must be defined by the host (mori/ops/_gpu.py)"
#endif

struct EpArgs {
  // Caller tensors of this call (0 when absent).
  uint64_t inp, weights, scales, indices;
  // Op-owned buffers on the symmetric heap.
  uint64_t dispTok, dispWeights, dispScales, dispIndices, dispSrcPos;
  uint64_t combInp, combInpWeights, combOut, combOutWeights;
  uint64_t control, destMap, expertCount;
  // Inter-node kernel types (0 otherwise): mori/ops/_internode.py's InterNodeBuffers.
  uint64_t stage, inbox, retStage, retInbox, retMap;
  int32_t rank, world, numTokens, k;
  int32_t expertsPerRank, rowBytes, scaleBytes, hidden;
  int32_t maxSend, maxRecv, inpRows, weightRows;
  // Combine: 1 when the caller gave weights (even with no rows, whose data pointer may be 0).
  int32_t hasWeights;
  // This PE's node: PEs [nodeFirst, nodeFirst + nodeSize) (the whole world for IntraNode), node
  // myNode of nNodes; lowLatency: InterNodeV1LL's staging. Token payload layout (_internode.py).
  int32_t nodeFirst, nodeSize, myNode, nNodes, lowLatency, tokCap;
  int32_t xferBytes, scaleOff, idxOff, wOff, combXferBytes, combWOff, combRowBytes;
  // Blockwise combine wires (_quant.py): scales per row, and the bytes of a row's codes (the
  // scales follow them); 0 otherwise.
  int32_t combScaleDim, combCodeBytes;
  // 1 for a dispatch that replays a routing handle (destMap, and retMap across nodes, hold it).
  int32_t replay;
  // One node: the dispatch data kernel's last block does what the one-block kernels after it would
  // (1 publishes the counts, 2 also waits for the peers'); 0: those kernels run.
  int32_t fuseDispatch;
  // Combine: 1 when the rows this PE sent itself are summed from the caller's input as it is
  // (_gpu.py's GpuKernels.combine_send says when): only peers' rows are staged.
  int32_t ownInPlace;
};

namespace {

MORI_DEVICE_INLINE int32_t* Control(const EpArgs& a, int off) { return reinterpret_cast<int32_t*>(a.control) + off; }

// Whether PE `pe` is in this PE's node (reached by P2P stores; every PE with IntraNode).
MORI_DEVICE_INLINE bool OnMyNode(const EpArgs& a, int pe) { return pe >= a.nodeFirst && pe < a.nodeFirst + a.nodeSize; }

template <class T>
MORI_DEVICE_INLINE T* Peer(T* local, int pe) {
  return detail::PeerAddress(local, pe, "mori.ops");
}

// Warp copy of `bytes` (all threads of the warp call it with the same arguments).
MORI_DEVICE_INLINE void WarpCopy(void* dst, const void* src, size_t bytes, int lane) {
  GroupCopy(dst, src, bytes, lane, 32);
}

// Destination PE of top-k entry `lane` of token `t`, -1 when the entry sends nothing (invalid id,
// or an earlier entry of the row names the same PE). Every lane of the warp must call it.
MORI_DEVICE_INLINE int SendingPe(const EpArgs& a, const int32_t* indices, int t, int lane) {
  int pe = -1;
  if (lane < a.k) {
    const int32_t e = indices[(size_t)t * a.k + lane];
    if (e >= 0 && e / a.expertsPerRank < a.world) pe = e / a.expertsPerRank;
  }
  bool duplicate = false;
  for (int m = 0; m < a.k - 1; ++m) {
    const int other = __shfl_sync(0xffffffffu, pe, m);
    if (m < lane && pe >= 0 && other == pe) duplicate = true;
  }
  return duplicate ? -1 : pe;
}

MORI_DEVICE_INLINE void FenceSys() { ptx::FenceAcqRelSys(); }

// The combine data kernels run with up to 32 warps a block (warp_per_block): bounded to the
// 64 registers a thread that lets every such launch fit an SM.
#define EP_DATA_KERNEL extern "C" __global__ void __launch_bounds__(1024)

// ---- element conversions (round to nearest even, as torch's casts) ----------------------------
MORI_DEVICE_INLINE float Bf16ToF32(uint16_t h) { return __uint_as_float(((uint32_t)h) << 16); }
MORI_DEVICE_INLINE uint16_t F32ToBf16(float f) {
  uint16_t h;
  asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(h) : "f"(f));
  return h;
}
#if __CUDA_ARCH__ >= 890
MORI_DEVICE_INLINE float Fp8ToF32(uint8_t b) {
  uint32_t h2;
  uint16_t in = b;
  asm("cvt.rn.f16x2.e4m3x2 %0, %1;" : "=r"(h2) : "h"(in));
  float f;
  asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"((uint16_t)(h2 & 0xffff)));
  return f;
}
MORI_DEVICE_INLINE uint8_t F32ToFp8(float f) {
  uint16_t d;
  asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(d) : "f"(0.0f), "f"(f));
  return (uint8_t)(d & 0xff);
}
// Two values with one instruction each way, each rounded as by the scalar forms: `lo` is the
// first byte in memory (the low byte of the pair).
MORI_DEVICE_INLINE uint16_t F32x2ToFp8x2(float lo, float hi) {
  uint16_t d;
  asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(d) : "f"(hi), "f"(lo));
  return d;
}
MORI_DEVICE_INLINE float2 Fp8x2ToF32x2(uint16_t pair) {
  uint32_t h2;
  asm("cvt.rn.f16x2.e4m3x2 %0, %1;" : "=r"(h2) : "h"(pair));
  float2 f;
  asm("cvt.f32.f16 %0, %1;" : "=f"(f.x) : "h"((uint16_t)(h2 & 0xffff)));
  asm("cvt.f32.f16 %0, %1;" : "=f"(f.y) : "h"((uint16_t)(h2 >> 16)));
  return f;
}
#else
MORI_DEVICE_INLINE float Fp8ToF32(uint8_t) {
  MORI_DEVICE_FAIL("%s", "mori.ops: fp8 e4m3 needs compute capability 8.9 or newer");
}
MORI_DEVICE_INLINE uint8_t F32ToFp8(float) {
  MORI_DEVICE_FAIL("%s", "mori.ops: fp8 e4m3 needs compute capability 8.9 or newer");
}
MORI_DEVICE_INLINE uint16_t F32x2ToFp8x2(float, float) {
  MORI_DEVICE_FAIL("%s", "mori.ops: fp8 e4m3 needs compute capability 8.9 or newer");
}
MORI_DEVICE_INLINE float2 Fp8x2ToF32x2(uint16_t) {
  MORI_DEVICE_FAIL("%s", "mori.ops: fp8 e4m3 needs compute capability 8.9 or newer");
}
#endif

// e4m3fnuz (bias 8, no infinities, no negative zero, 0x80 is NaN) in software, as NVIDIA has no
// instruction for it: round to nearest even, saturated at +-240.
MORI_DEVICE_INLINE float FnuzToF32(uint8_t b) {
  if (b == 0x80) return __int_as_float(0x7fc00000);
  const int field = (b >> 3) & 15, m = b & 7;
  const float mag = field == 0 ? ldexpf((float)m, -10) : ldexpf((float)(8 + m), field - 11);
  return (b & 0x80) ? -mag : mag;
}
MORI_DEVICE_INLINE uint8_t F32ToFnuz(float f) {
  if (isnan(f)) return 0x80;
  const float a = fabsf(f);
  uint8_t code;
  if (a < ldexpf(1.0f, -7)) {  // subnormal: multiples of 2^-10 (8 rounds up to the smallest normal)
    code = (uint8_t)rintf(ldexpf(a, 10));
  } else {
    int e;
    frexpf(a, &e);  // a = f * 2^e, f in [0.5, 1): a's exponent is e - 1
    int exp = e - 1;
    float m8 = rintf(ldexpf(a, 3 - exp));  // 8..16: the significand in eighths, rounded
    if (m8 >= 16.0f) {
      m8 = 8.0f;
      ++exp;
    }
    const int field = exp + 8;
    code = field > 15 ? 0x7f : (uint8_t)((field << 3) | ((int)m8 - 8));
  }
  return code == 0 ? 0 : (uint8_t)(code | (signbit(f) ? 0x80 : 0));
}

// e2m1 (fp4): codes 0..7 are 0, 0.5, 1, 1.5, 2, 3, 4, 6, bit 3 the sign. Round to nearest even
// (a tie goes to the even code), saturated at +-6: the thresholds of _quant.fp4_encode.
// Decoded from the bits (a table indexed at run time would live in local memory): exponent field
// e = code >> 1 & 3 and mantissa bit m; e > 0 is (1 + m / 2) * 2^(e - 1), e == 0 is m / 2.
MORI_DEVICE_INLINE float Fp4ToF32(uint32_t code) {
  const uint32_t e = (code >> 1) & 3u, m = code & 1u;
  const uint32_t mag = e ? ((e + 126u) << 23) | (m << 22) : (m ? 0x3f000000u : 0u);
  return __uint_as_float(mag | ((code & 8u) << 28));
}
MORI_DEVICE_INLINE uint32_t F32ToFp4(float f) {
  const float a = fabsf(f);
  const uint32_t code = (a > 0.25f) + (a >= 0.75f) + (a > 1.25f) + (a >= 1.75f) + (a > 2.5f) + (a >= 3.5f) + (a > 5.0f);
  return code | (signbit(f) ? 8u : 0u);
}

struct Bf16 {
  using Storage = uint16_t;
  static MORI_DEVICE_INLINE float Load(Storage v) { return Bf16ToF32(v); }
  static MORI_DEVICE_INLINE Storage Store(float f) { return F32ToBf16(f); }
};
struct F32 {
  using Storage = float;
  static MORI_DEVICE_INLINE float Load(Storage v) { return v; }
  static MORI_DEVICE_INLINE Storage Store(float f) { return f; }
};
struct Fp8 {
  using Storage = uint8_t;
  static MORI_DEVICE_INLINE float Load(Storage v) { return Fp8ToF32(v); }
  static MORI_DEVICE_INLINE Storage Store(float f) { return F32ToFp8(f); }
};
struct Fp8Fnuz {
  using Storage = uint8_t;
  static MORI_DEVICE_INLINE float Load(Storage v) { return FnuzToF32(v); }
  static MORI_DEVICE_INLINE Storage Store(float f) { return F32ToFnuz(f); }
};
// Two e2m1 values a byte: staged as bytes, summed by CombineAccumFp4.
struct Fp4x2 {
  using Storage = uint8_t;
};

}  // namespace
