// MORI-EP dispatch and combine on the GPU heap, part 2 of 4 (see ep_common.cuh): the element work
// of the combine wires (mori/ops/_quant.py) for the combine kernels of ep_intranode.cu. A lane
// moves a pack of 8 values with one vector access; the blockwise quantizer takes a block per group
// of lanes (its largest magnitude from a shuffle within the group, one division a block), the
// receiver a pack of codes and its block's scale per source row. Every value goes through the
// float32 operations of the CPU backend (__fdiv_rn, __fmul_rn, __fadd_rn, no fused multiply-add),
// so the results are its results byte for byte.

namespace {

// Eight elements moved with one vector access (16 bytes of bf16, 8 of fp8, 32 of float32).
template <class S>
struct alignas(8 * sizeof(S)) Pack8 {
  S v[8];
};

// Packs a lane loads before it converts and stores any (a cast's loads cannot be moved past the
// stores of the previous pack, which may alias): the lane keeps kBatch * 16 bytes in flight.
constexpr int kBatch = 4;

// A pack in float32, and float32 values stored as a pack; fp8 converts two values an instruction.
template <class Wire>
MORI_DEVICE_INLINE void LoadPack(const Pack8<typename Wire::Storage>& in, float (&f)[8], Wire) {
#pragma unroll
  for (int e = 0; e < 8; ++e) f[e] = Wire::Load(in.v[e]);
}
MORI_DEVICE_INLINE void LoadPack(const Pack8<uint8_t>& in, float (&f)[8], Fp8) {
#pragma unroll
  for (int e = 0; e < 8; e += 2) {
    const float2 x = Fp8x2ToF32x2((uint16_t)(in.v[e] | (in.v[e + 1] << 8)));
    f[e] = x.x;
    f[e + 1] = x.y;
  }
}
template <class Wire>
MORI_DEVICE_INLINE Pack8<typename Wire::Storage> StorePack(const float (&f)[8], Wire) {
  Pack8<typename Wire::Storage> out;
#pragma unroll
  for (int e = 0; e < 8; ++e) out.v[e] = Wire::Store(f[e]);
  return out;
}
MORI_DEVICE_INLINE Pack8<uint8_t> StorePack(const float (&f)[8], Fp8) {
  Pack8<uint8_t> out;
#pragma unroll
  for (int e = 0; e < 8; e += 2) {
    const uint16_t d = F32x2ToFp8x2(f[e], f[e + 1]);
    out.v[e] = (uint8_t)d;
    out.v[e + 1] = (uint8_t)(d >> 8);
  }
  return out;
}

// Warp fill of `bytes` zero bytes, 16 a store where the row allows.
MORI_DEVICE_INLINE void WarpZero(void* dst, size_t bytes, int lane) {
  if (((reinterpret_cast<uint64_t>(dst) | bytes) & 15) == 0) {
    for (size_t i = lane; i < bytes / 16; i += 32) reinterpret_cast<uint4*>(dst)[i] = make_uint4(0, 0, 0, 0);
  } else {
    for (size_t i = lane; i < bytes; i += 32) reinterpret_cast<uint8_t*>(dst)[i] = 0;
  }
}

// Warp cast of `packs` packs of In into Wire (the fp8 direct cast: 16-byte loads, 8-byte stores).
template <class In, class Wire>
MORI_DEVICE_INLINE void CastPacks(Pack8<typename Wire::Storage>* dst, const Pack8<typename In::Storage>* src, int packs,
                                  int lane) {
  for (int base = lane; base < packs; base += 32 * kBatch) {
    Pack8<typename In::Storage> in[kBatch];
#pragma unroll
    for (int j = 0; j < kBatch; ++j) {
      if (base + 32 * j < packs) in[j] = src[base + 32 * j];
    }
#pragma unroll
    for (int j = 0; j < kBatch; ++j) {
      if (base + 32 * j < packs) {
        float f[8];
        LoadPack(in[j], f, In());
        dst[base + 32 * j] = StorePack(f, Wire());
      }
    }
  }
}

// The blockwise wires (_quant.py, MORI's fp8_blockwise / fp4_blockwise): a bf16 row into codes and
// one float32 scale per block of blockElems values, from the block's largest magnitude m:
// inverse scale qmax / m (once per block) times each value, rounded to the code (the float32
// operations of the CPU backend).
template <bool Fp4>
MORI_DEVICE_INLINE float InverseScale(float m) {
  constexpr float qmax = Fp4 ? 6.0f : 448.0f;
  const bool scaled = Fp4 ? m > 0.0f : m > qmax;
  return scaled ? __fdiv_rn(qmax, m) : (Fp4 ? 0.0f : 1.0f);
}
template <bool Fp4>
MORI_DEVICE_INLINE float WireScale(float m) {
  return Fp4 ? (m > 0.0f ? __fdiv_rn(m, 6.0f) : 1.0f) : (m > 448.0f ? __fmul_rn(m, 1.0f / 448.0f) : 1.0f);
}

MORI_DEVICE_INLINE float MaxAbs(const Pack8<uint16_t>& x) {
  float m = 0.0f;
#pragma unroll
  for (int e = 0; e < 8; ++e) m = fmaxf(m, fabsf(Bf16ToF32(x.v[e])));
  return m;
}

// The codes of pack p (8 values) of a row: 8 fp8 bytes, or 8 e2m1 nibbles (low first) in 4 bytes.
template <bool Fp4>
MORI_DEVICE_INLINE void StoreCodes(uint8_t* codes, int p, const Pack8<uint16_t>& x, float inv) {
  float v[8];
#pragma unroll
  for (int e = 0; e < 8; ++e) v[e] = __fmul_rn(Bf16ToF32(x.v[e]), inv);
  if constexpr (Fp4) {
    uint32_t word = 0;
#pragma unroll
    for (int e = 0; e < 8; ++e) word |= F32ToFp4(v[e]) << (4 * e);
    reinterpret_cast<uint32_t*>(codes)[p] = word;
  } else {
    reinterpret_cast<Pack8<uint8_t>*>(codes)[p] = StorePack(v, Fp8());
  }
}

// A warp quantizes one row whose blocks are whole packs: lanes in groups of `group` (a power of
// two, the packs of a block up to 32), a group per block; each lane holds one pack of its block
// in registers, the group's largest magnitude comes from `group` lanes by shuffles, and the lane
// writes its pack's codes from the registers. Narrow blocks (a pack a lane) load kBatch blocks a
// group before reducing the first; blocks wider than 32 packs (kWide) go one at a time, their
// further packs read again (from L1) for the codes. `src` is null for a row of zeros.
template <bool Fp4, bool kWide>
MORI_DEVICE_INLINE void QuantizeRowPacked(const EpArgs& a, const Pack8<uint16_t>* src, uint8_t* dst, int blockElems,
                                          int group, int lane) {
  constexpr int batch = kWide ? 1 : kBatch;
  const int packs = a.hidden / 8, perBlock = blockElems / 8, groups = 32 / group;
  const int member = lane % group, mine = lane / group;
  float* scales = reinterpret_cast<float*>(dst + a.combCodeBytes);
  const Pack8<uint16_t> zero{};
  for (int b0 = 0; b0 < a.combScaleDim; b0 += groups * batch) {  // warp-uniform: the shuffles need every lane
    Pack8<uint16_t> x[batch];
#pragma unroll
    for (int j = 0; j < batch; ++j) {
      const int p = (b0 + j * groups + mine) * perBlock + member;
      x[j] = src && member < perBlock && p < packs ? src[p] : zero;
    }
#pragma unroll
    for (int j = 0; j < batch; ++j) {
      const int b = b0 + j * groups + mine;
      const int first = b * perBlock, end = min(first + perBlock, packs);  // empty past the row
      float m = MaxAbs(x[j]);
      if constexpr (kWide) {
        for (int p = first + member + group; src && p < end; p += group) m = fmaxf(m, MaxAbs(src[p]));
      }
      for (int off = group / 2; off > 0; off >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, off));
      const float inv = InverseScale<Fp4>(m);
      if (first + member < end) StoreCodes<Fp4>(dst, first + member, x[j], inv);
      if constexpr (kWide) {
        for (int p = first + member + group; p < end; p += group) StoreCodes<Fp4>(dst, p, src ? src[p] : zero, inv);
      }
      if (member == 0 && b < a.combScaleDim) scales[b] = WireScale<Fp4>(m);
    }
  }
  // The padding after the codes (whole words: the codes end on a pack).
  const int used = Fp4 ? a.hidden / 2 : a.hidden;
  for (int i = used / 4 + lane; i < a.combCodeBytes / 4; i += 32) reinterpret_cast<uint32_t*>(dst)[i] = 0;
}

// Any other row (blocks or rows that are not whole packs, unaligned tensors): the warp takes one
// block at a time, an element a lane.
template <bool Fp4>
MORI_DEVICE_INLINE void QuantizeRowScalar(const EpArgs& a, const uint16_t* src, uint8_t* dst, int blockElems,
                                          int lane) {
  float* scales = reinterpret_cast<float*>(dst + a.combCodeBytes);
  for (int sb = 0; sb < a.combScaleDim; ++sb) {  // the largest magnitudes, left in the scale slots
    const int start = sb * blockElems, end = min(start + blockElems, a.hidden);
    float m = 0.0f;
    for (int i = start + lane; src && i < end; i += 32) m = fmaxf(m, fabsf(Bf16ToF32(src[i])));
    for (int off = 16; off > 0; off >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, off));
    if (lane == 0) scales[sb] = m;
  }
  __syncwarp();
  for (int b = lane; b < a.combCodeBytes; b += 32) {  // a byte: one fp8 code, or two fp4 codes
    uint32_t byte = 0;
    for (int h = 0; h < (Fp4 ? 2 : 1); ++h) {
      const int i = Fp4 ? 2 * b + h : b;
      if (i >= a.hidden) continue;
      const float v = __fmul_rn(src ? Bf16ToF32(src[i]) : 0.0f, InverseScale<Fp4>(scales[i / blockElems]));
      byte |= Fp4 ? (F32ToFp4(v) << (4 * h)) : F32ToFp8(v);
    }
    dst[b] = (uint8_t)byte;
  }
  __syncwarp();
  for (int sb = lane; sb < a.combScaleDim; sb += 32) scales[sb] = WireScale<Fp4>(scales[sb]);
}

// A lane's packs [u0, u0 + 32, ...) of one token's row, kUnits of them at once: the source rows
// in top-k order two at a time, their 2 * kUnits loads first (they never wait on a store: a pack's
// sum is stored after every row was read), then the additions, so each lane keeps that many loads
// in flight rather than one. `load(row, u)` reads pack u of source row `row`, `add(acc, in)` adds
// it into float32 sums, `store(u, acc)` writes pack u of the output.
template <int kUnits, class Load, class Add, class Store>
MORI_DEVICE_INLINE void SumPacks(const uint8_t* const* rows, int count, int begin, int end, int lane, Load load,
                                 Add add, Store store) {
  for (int u0 = begin + lane; u0 < end; u0 += 32 * kUnits) {
    float acc[kUnits][8];
#pragma unroll
    for (int j = 0; j < kUnits; ++j) {
#pragma unroll
      for (int e = 0; e < 8; ++e) acc[j][e] = 0.0f;
    }
    // Two source rows at a time: the second row's loads are in flight with the first's (a row
    // on a peer costs an NVLink round trip); the additions keep top-k order.
    for (int p = 0; p < count; p += 2) {
      const bool second = p + 1 < count;
      decltype(load(rows[0], 0)) in[2][kUnits];
#pragma unroll
      for (int j = 0; j < kUnits; ++j) {
        if (u0 + 32 * j < end) {
          in[0][j] = load(rows[p], u0 + 32 * j);
          if (second) in[1][j] = load(rows[p + 1], u0 + 32 * j);
        }
      }
#pragma unroll
      for (int j = 0; j < kUnits; ++j) {
        if (u0 + 32 * j < end) {
          add(acc[j], in[0][j]);
          if (second) add(acc[j], in[1][j]);
        }
      }
    }
#pragma unroll
    for (int j = 0; j < kUnits; ++j) {
      if (u0 + 32 * j < end) store(u0 + 32 * j, acc[j]);
    }
  }
}

// Element i of a coded source row as the receiver adds it: the blockwise wires' code times its
// block's scale (a multiply rounded to float32, as the CPU backend).
template <int Kind>
MORI_DEVICE_INLINE float CodedTerm(const EpArgs& a, const uint8_t* row, int i, int blockElems) {
  const float scale = reinterpret_cast<const float*>(row + a.combCodeBytes)[i / blockElems];
  const float v = Kind == 0 ? Fp8ToF32(row[i]) : Fp4ToF32((row[i >> 1] >> (4 * (i & 1))) & 15);
  return __fmul_rn(v, scale);
}

// Pack u (elements 8u .. 8u + 7, one block: blocks are whole packs) of a coded source row: the
// codes in one 8-byte (fp8) or 4-byte (fp4) load, the block's scale in one more.
template <int Kind>
struct CodedPack {
  Pack8<uint8_t> codes;
  float scale;
};
template <>
struct CodedPack<1> {
  uint32_t codes;
  float scale;
};
template <int Kind>
MORI_DEVICE_INLINE CodedPack<Kind> LoadCodedPack(const EpArgs& a, const uint8_t* row, int u, int blockElems) {
  using Codes = decltype(CodedPack<Kind>::codes);
  return {reinterpret_cast<const Codes*>(row)[u],
          reinterpret_cast<const float*>(row + a.combCodeBytes)[8 * u / blockElems]};
}
template <int Kind>
MORI_DEVICE_INLINE void AddCodedPack(float (&acc)[8], const CodedPack<Kind>& in) {
  float v[8];
  if constexpr (Kind == 0) {
    LoadPack(in.codes, v, Fp8());
  } else {
#pragma unroll
    for (int e = 0; e < 8; ++e) v[e] = Fp4ToF32((in.codes >> (4 * e)) & 15);
  }
#pragma unroll
  for (int e = 0; e < 8; ++e) acc[e] = __fadd_rn(acc[e], __fmul_rn(v[e], in.scale));
}

// Bytes [n u, n u + n) of packed fp4 input summed over `count` source rows: per nibble in float32,
// in top-k order, rounded once to e2m1.
template <int n>
struct alignas(n) ByteRun {
  uint8_t v[n];
};
template <int n>
MORI_DEVICE_INLINE void SumFp4Bytes(const uint8_t* const* rows, int count, int u, uint8_t* out) {
  float lo[n], hi[n];
#pragma unroll
  for (int e = 0; e < n; ++e) lo[e] = hi[e] = 0.0f;
  for (int p = 0; p < count; ++p) {
    const ByteRun<n> in = reinterpret_cast<const ByteRun<n>*>(rows[p])[u];
#pragma unroll
    for (int e = 0; e < n; ++e) {
      lo[e] += Fp4ToF32(in.v[e] & 15);
      hi[e] += Fp4ToF32(in.v[e] >> 4);
    }
  }
  ByteRun<n> o;
#pragma unroll
  for (int e = 0; e < n; ++e) o.v[e] = (uint8_t)(F32ToFp4(lo[e]) | (F32ToFp4(hi[e]) << 4));
  reinterpret_cast<ByteRun<n>*>(out)[u] = o;
}

}  // namespace
