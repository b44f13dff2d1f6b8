// MORI-EP dispatch and combine on the GPU heap, part 3 of 3 (see ep_common.cuh): the kernels of
// IntraNode, IntraNodeLL and AsyncLL, which also move the inter-node types' tokens within a node.
// ================================ dispatch =====================================================
// The whole warp writes token t (row, top-k row, weights, scales, source position) into receive
// slot s of PE destPe.
MORI_DEVICE_INLINE void SendToken(const EpArgs& a, const int32_t* indices, int t, int destPe, size_t s, int lane) {
  if (lane == 0) Peer(reinterpret_cast<int32_t*>(a.dispSrcPos), destPe)[s] = a.rank * a.maxSend + t;
  if (lane < a.k) {
    Peer(reinterpret_cast<int32_t*>(a.dispIndices), destPe)[s * a.k + lane] = indices[(size_t)t * a.k + lane];
    if (a.weights) {
      Peer(reinterpret_cast<float*>(a.dispWeights), destPe)[s * a.k + lane] =
          reinterpret_cast<const float*>(a.weights)[(size_t)t * a.k + lane];
    }
  }
  if (a.scales && a.scaleBytes > 0) {
    WarpCopy(Peer(reinterpret_cast<char*>(a.dispScales), destPe) + s * a.scaleBytes,
             reinterpret_cast<const char*>(a.scales) + (size_t)t * a.scaleBytes, a.scaleBytes, lane);
  }
  WarpCopy(Peer(reinterpret_cast<char*>(a.dispTok), destPe) + s * a.rowBytes,
           reinterpret_cast<const char*>(a.inp) + (size_t)t * a.rowBytes, a.rowBytes, lane);
}

// Data kernel: each warp takes tokens; per destination PE of this node a block reserves its slots
// with one remote atomic, then copies token row, top-k row, weights and scales into the peer's
// buffers and records where each (token, entry) went in destMap (for combine). Tokens for other
// nodes are staged for ep_internode_put; their destMap entries name the combine row coming back.
// A replay (a.replay: a routing handle's map in destMap, its indices checked on the host) reserves
// nothing: every entry goes where destMap says, the rows for other nodes where they went before.
extern "C" __global__ void ep_dispatch_send(EpArgs a) {
  __shared__ int32_t sCount[EP_MAX_PES], sBase[EP_MAX_PES], sRun[EP_MAX_PES];
  // A second dispatch before this round's combine would reserve slots on peers whose counters
  // are still being cleared and overwrite rows they may still read: refused before any write.
  // (The host refuses it too; this catches CUDA graph replays, which bypass the host.)
  if (*Control(a, EP_PHASE) != 0) {
    if (blockIdx.x == 0 && threadIdx.x == 0) {
      MORI_DEVICE_FAIL("%s",
                       "dispatch called twice without a combine in between: every dispatch must be "
                       "followed by one combine on every rank (a CUDA graph replayed a dispatch without its combine?)");
    }
    return;
  }
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
  const int firstToken = blockIdx.x * warps + warp, tokenStride = gridDim.x * warps;
  const int32_t* indices = reinterpret_cast<const int32_t*>(a.indices);
  for (int p = threadIdx.x; p < a.world; p += blockDim.x) sCount[p] = sRun[p] = 0;
  __syncthreads();
  for (int t = firstToken; t < a.numTokens; t += tokenStride) {
    const int pe = SendingPe(a, indices, t, lane);
    if (pe >= 0 && OnMyNode(a, pe)) atomicAdd(&sCount[pe], 1);
  }
  __syncthreads();
  int32_t* recvOffset = Control(a, EP_RECV_OFFSET);
  for (int p = a.nodeFirst + threadIdx.x; p < a.nodeFirst + a.nodeSize; p += blockDim.x) {
    if (sCount[p] == 0) continue;
    if (!a.replay) {
      const int32_t base = ptx::AtomAddSys(Peer(recvOffset, p), sCount[p]);
      if (base + sCount[p] > a.maxRecv) {
        MORI_DEVICE_FAIL(
            "dispatch: PE %d would receive more than max_num_tokens_to_recv=%d tokens "
            "(raise max_total_recv_tokens or leave it 0)",
            p, a.maxRecv);
      }
      sBase[p] = base;
    }
    atomicAdd(Control(a, EP_SENT_COUNT) + p, sCount[p]);
  }
  __syncthreads();
  int32_t* destMap = reinterpret_cast<int32_t*>(a.destMap);
  for (int t = firstToken; t < a.numTokens; t += tokenStride) {
    const int pe = SendingPe(a, indices, t, lane);
    const bool local = pe >= 0 && OnMyNode(a, pe);
    int slot = -1;
    if (a.replay && pe >= 0) {
      slot = destMap[(size_t)t * a.k + lane] % a.maxSend;
    } else if (local) {
      slot = sBase[pe] + atomicAdd(&sRun[pe], 1);
    }
    // Other nodes' PEs: the token is staged for their node's proxy; slot is then its combine row.
    const uint32_t remote = __ballot_sync(0xffffffffu, pe >= 0 && !local);
    if (remote || a.lowLatency) slot = StageForNodes(a, t, pe, remote, lane, slot);
    if (!a.replay && lane < a.k) destMap[(size_t)t * a.k + lane] = pe >= 0 ? pe * a.maxSend + slot : -1;
    uint32_t senders = __ballot_sync(0xffffffffu, local);
    while (senders) {
      const int src = __ffs(senders) - 1;
      senders &= senders - 1;
      SendToken(a, indices, t, __shfl_sync(0xffffffffu, pe, src), (size_t)__shfl_sync(0xffffffffu, slot, src), lane);
    }
  }
  FenceSys();
}

// One block, a thread per destination PE: once the previous round's count was consumed there,
// publish how many tokens this PE sent it (count + 1, so 0 means "nothing yet"). Marks the round
// dispatched until its combine.
extern "C" __global__ void ep_dispatch_signal(EpArgs a) {
  FenceSys();
  if (threadIdx.x == 0) *Control(a, EP_PHASE) = 1;
  int32_t* signal = Control(a, EP_RECV_SIGNAL) + a.rank;
  for (int p = a.nodeFirst + threadIdx.x; p < a.nodeFirst + a.nodeSize; p += blockDim.x) {
    int32_t* sent = Control(a, EP_SENT_COUNT) + p;
    int32_t* remote = Peer(signal, p);
    detail::WaitFor<int32_t>(remote, kCmpEq, 0, "dispatch: previous round's count not yet consumed");
    ptx::StoreReleaseSys(remote, *sent + 1);
    *sent = 0;
  }
}

// One block, a thread per source PE: waits for every PE's count, sums them into totalRecv and
// clears the slot counter for the next round.
extern "C" __global__ void ep_dispatch_wait(EpArgs a) {
  __shared__ int32_t sTotal;
  if (threadIdx.x == 0) sTotal = 0;
  __syncthreads();
  for (int p = a.nodeFirst + threadIdx.x; p < a.nodeFirst + a.nodeSize; p += blockDim.x) {
    int32_t* signal = Control(a, EP_RECV_SIGNAL) + p;
    const int32_t v = detail::WaitFor<int32_t>(signal, kCmpGt, 0, "dispatch: waiting for a peer's tokens");
    ptx::StoreRelaxedSys(signal, 0);
    atomicAdd(&sTotal, v - 1);
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    *Control(a, EP_TOTAL_RECV) = sTotal;
    ptx::StoreRelaxedSys(Control(a, EP_RECV_OFFSET), 0);
  }
  FenceSys();
}

// One block: how many received top-k entries name each of this PE's experts.
extern "C" __global__ void ep_local_expert_count(EpArgs a) {
  int32_t* count = reinterpret_cast<int32_t*>(a.expertCount);
  for (int e = threadIdx.x; e < a.expertsPerRank; e += blockDim.x) count[e] = 0;
  __syncthreads();
  const int total = *Control(a, EP_TOTAL_RECV);
  const int32_t* idx = reinterpret_cast<const int32_t*>(a.dispIndices);
  for (int i = threadIdx.x; i < total * a.k; i += blockDim.x) {
    const int32_t e = idx[i];
    if (e >= 0 && e / a.expertsPerRank == a.rank) atomicAdd(&count[e % a.expertsPerRank], 1);
  }
}

// ================================ combine ======================================================
// Data kernel: copies (or casts to fp8) the caller's combine input rows and weights into the
// registered buffer that peers read. Rows past the caller's tensor are zeros.
template <class In, class Wire>
__device__ void CombineStage(const EpArgs& a) {
  const int lane = threadIdx.x & 31, warps = blockDim.x >> 5;
  const int total = *Control(a, EP_TOTAL_RECV);
  const int firstRow = blockIdx.x * warps + (threadIdx.x >> 5), rowStride = gridDim.x * warps;
  for (int r = firstRow; r < total; r += rowStride) {
    typename Wire::Storage* dst = reinterpret_cast<typename Wire::Storage*>(a.combInp) + (size_t)r * a.hidden;
    const typename In::Storage* src = reinterpret_cast<const typename In::Storage*>(a.inp) + (size_t)r * a.hidden;
    if (r >= a.inpRows) {  // zero is all-zero bytes in every wire dtype
      for (int i = lane; i < a.hidden * (int)sizeof(*dst); i += 32) reinterpret_cast<uint8_t*>(dst)[i] = 0;
    } else if constexpr (sizeof(typename In::Storage) == sizeof(typename Wire::Storage)) {
      if (a.inp != a.combInp) WarpCopy(dst, src, (size_t)a.hidden * sizeof(*src), lane);
    } else {
      for (int i = lane; i < a.hidden; i += 32) dst[i] = Wire::Store(In::Load(src[i]));
    }
    if (a.hasWeights && lane < a.k) {
      const float w = r < a.weightRows ? reinterpret_cast<const float*>(a.weights)[(size_t)r * a.k + lane] : 0.0f;
      reinterpret_cast<float*>(a.combInpWeights)[(size_t)r * a.k + lane] = w;
    }
  }
  FenceSys();
}

extern "C" __global__ void ep_combine_stage_fp8(EpArgs a) { CombineStage<Fp8, Fp8>(a); }
extern "C" __global__ void ep_combine_stage_bf16(EpArgs a) { CombineStage<Bf16, Bf16>(a); }
extern "C" __global__ void ep_combine_stage_f32(EpArgs a) { CombineStage<F32, F32>(a); }
extern "C" __global__ void ep_combine_stage_bf16_fp8(EpArgs a) { CombineStage<Bf16, Fp8>(a); }
extern "C" __global__ void ep_combine_stage_fp8fnuz(EpArgs a) { CombineStage<Fp8Fnuz, Fp8Fnuz>(a); }
extern "C" __global__ void ep_combine_stage_fp4(EpArgs a) { CombineStage<Fp4x2, Fp4x2>(a); }

// The blockwise wires (_quant.py, MORI's fp8_blockwise / fp4_blockwise): one warp quantizes a bf16
// row into codes and one float32 scale per block. The warp first leaves each block's largest
// magnitude in the scale slots, then writes the codes (recomputing the inverse scale from it, the
// same float32 operations as the CPU backend), then the scales.
template <bool Fp4>
__device__ void CombineStageBlockwise(const EpArgs& a) {
  const int lane = threadIdx.x & 31, warps = blockDim.x >> 5;
  const int total = *Control(a, EP_TOTAL_RECV);
  const int firstRow = blockIdx.x * warps + (threadIdx.x >> 5), rowStride = gridDim.x * warps;
  const int blockElems = (a.hidden + a.combScaleDim - 1) / a.combScaleDim;
  const float qmax = Fp4 ? 6.0f : 448.0f;
  for (int r = firstRow; r < total; r += rowStride) {
    uint8_t* dst = reinterpret_cast<uint8_t*>(a.combInp) + (size_t)r * a.combRowBytes;
    float* scales = reinterpret_cast<float*>(dst + a.combCodeBytes);
    const uint16_t* src = reinterpret_cast<const uint16_t*>(a.inp) + (size_t)r * a.hidden;
    const bool zero = r >= a.inpRows;
    for (int sb = 0; sb < a.combScaleDim; ++sb) {
      const int start = sb * blockElems, end = min(start + blockElems, a.hidden);
      float m = 0.0f;
      for (int i = start + lane; i < end; i += 32) m = fmaxf(m, zero ? 0.0f : fabsf(Bf16ToF32(src[i])));
      for (int off = 16; off > 0; off >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, off));
      if (lane == 0) scales[sb] = m;
    }
    __syncwarp();
    for (int b = lane; b < a.combCodeBytes; b += 32) {  // a byte: one fp8 code, or two fp4 codes
      uint32_t byte = 0;
      for (int h = 0; h < (Fp4 ? 2 : 1); ++h) {
        const int i = Fp4 ? 2 * b + h : b;
        if (i >= a.hidden) continue;
        const float m = scales[i / blockElems];
        const bool scaled = Fp4 ? m > 0.0f : m > qmax;
        const float inv = scaled ? __fdiv_rn(qmax, m) : (Fp4 ? 0.0f : 1.0f);
        const float v = __fmul_rn(zero ? 0.0f : Bf16ToF32(src[i]), inv);
        byte |= Fp4 ? (F32ToFp4(v) << (4 * h)) : F32ToFp8(v);
      }
      dst[b] = (uint8_t)byte;
    }
    __syncwarp();
    for (int sb = lane; sb < a.combScaleDim; sb += 32) {
      const float m = scales[sb];
      scales[sb] = Fp4 ? (m > 0.0f ? __fdiv_rn(m, qmax) : 1.0f) : (m > qmax ? __fmul_rn(m, 1.0f / 448.0f) : 1.0f);
    }
    if (a.hasWeights && lane < a.k) {
      const float w = r < a.weightRows ? reinterpret_cast<const float*>(a.weights)[(size_t)r * a.k + lane] : 0.0f;
      reinterpret_cast<float*>(a.combInpWeights)[(size_t)r * a.k + lane] = w;
    }
  }
  FenceSys();
}

extern "C" __global__ void ep_combine_stage_bf16_bw8(EpArgs a) { CombineStageBlockwise<false>(a); }
extern "C" __global__ void ep_combine_stage_bf16_bw4(EpArgs a) { CombineStageBlockwise<true>(a); }

// One block: this PE's registered combine input is complete; tell every PE (epoch numbered, so
// graph replays and repeated calls need no reset).
extern "C" __global__ void ep_combine_barrier_signal(EpArgs a) {
  __shared__ uint32_t sEpoch;
  if (threadIdx.x == 0) {
    if (*Control(a, EP_PHASE) != 1) {
      MORI_DEVICE_FAIL("%s",
                       "combine called without a preceding dispatch (a CUDA graph replayed a combine "
                       "without its dispatch?)");
    }
    uint32_t* epoch = reinterpret_cast<uint32_t*>(Control(a, EP_EPOCH));
    sEpoch = *epoch + 1;
    *epoch = sEpoch;
  }
  __syncthreads();
  FenceSys();
  uint32_t* flag = reinterpret_cast<uint32_t*>(Control(a, EP_BARRIER)) + a.rank;
  for (int p = a.nodeFirst + threadIdx.x; p < a.nodeFirst + a.nodeSize; p += blockDim.x) {
    ptx::StoreReleaseSys(Peer(flag, p), sEpoch);
  }
}

// One block: waits until every PE's registered combine input of this round is complete; the
// round is then combined (peers may send the next dispatch once they passed this barrier too).
extern "C" __global__ void ep_combine_barrier_wait(EpArgs a) {
  const uint32_t epoch = *reinterpret_cast<uint32_t*>(Control(a, EP_EPOCH));
  uint32_t* flags = reinterpret_cast<uint32_t*>(Control(a, EP_BARRIER));
  for (int p = a.nodeFirst + threadIdx.x; p < a.nodeFirst + a.nodeSize; p += blockDim.x) {
    detail::WaitFor<uint32_t>(flags + p, kCmpGe, epoch, "combine: waiting for a peer's expert outputs");
  }
  if (threadIdx.x == 0) *Control(a, EP_PHASE) = 0;
  FenceSys();
}

// Eight elements moved with one vector access (16 bytes of bf16, 8 of fp8, 32 of float32).
template <class S>
struct alignas(8 * sizeof(S)) Pack8 {
  S v[8];
};

// Data kernel: for each of this PE's tokens (split along hidden when warps outnumber tokens),
// reads the rows its destinations hold for it and sums them in float32 in top-k order. The
// source rows of a token are listed in shared memory first, so that the element loops (whose trip
// counts differ between lanes) need no warp shuffles.
template <class Out, class Wire>
__device__ void CombineAccum(const EpArgs& a) {
  using WS = typename Wire::Storage;
  using OS = typename Out::Storage;
  __shared__ const WS* sRows[32][32];
  __shared__ const float* sWeights[32][32];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
  const int globalWarp = blockIdx.x * warps + warp, globalWarps = gridDim.x * warps;
  if (a.numTokens == 0) return;
  // Vector path: rows of whole 8-element packs (every row start is then aligned, the buffers being
  // 256-byte aligned); chunks of a row are whole packs too.
  const bool packed = a.hidden % 8 == 0;
  const int unit = packed ? 8 : 1;
  const int units = a.hidden / unit;
  int parts = globalWarps / a.numTokens;
  const int maxParts = (a.hidden + 255) / 256;
  parts = parts < 1 ? 1 : (parts > maxParts ? maxParts : parts);
  const int chunk = (units + parts - 1) / parts;  // in units
  const int32_t* destMap = reinterpret_cast<const int32_t*>(a.destMap);
  for (int item = globalWarp; item < a.numTokens * parts; item += globalWarps) {
    const int t = item / parts, part = item % parts;
    const int32_t d = lane < a.k ? destMap[(size_t)t * a.k + lane] : -1;
    const uint32_t valid = __ballot_sync(0xffffffffu, d >= 0);
    const int count = __popc(valid);
    if (d >= 0) {
      const int pe = d / a.maxSend;
      const size_t slot = d % a.maxSend;
      const int pos = __popc(valid & ((1u << lane) - 1));  // keeps top-k order
      if (OnMyNode(a, pe)) {
        sRows[warp][pos] = Peer(reinterpret_cast<WS*>(a.combInp), pe) + slot * a.hidden;
        sWeights[warp][pos] = Peer(reinterpret_cast<float*>(a.combInpWeights), pe) + slot * a.k;
      } else {  // sent back by pe's node proxy: row `slot` of that node's block
        const char* row = ReturnedRow(a, pe / a.nodeSize, slot);
        sRows[warp][pos] = reinterpret_cast<const WS*>(row);
        sWeights[warp][pos] = reinterpret_cast<const float*>(row + a.combWOff);
      }
    }
    __syncwarp();
    OS* out = reinterpret_cast<OS*>(a.combOut) + (size_t)t * a.hidden;
    const int begin = part * chunk, end = begin + chunk < units ? begin + chunk : units;
    for (int u = begin + lane; u < end; u += 32) {
      if (packed) {
        float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
        for (int p = 0; p < count; ++p) {
          const Pack8<WS> in = reinterpret_cast<const Pack8<WS>*>(sRows[warp][p])[u];
#pragma unroll
          for (int e = 0; e < 8; ++e) acc[e] += Wire::Load(in.v[e]);
        }
        Pack8<OS> o;
#pragma unroll
        for (int e = 0; e < 8; ++e) o.v[e] = Out::Store(acc[e]);
        reinterpret_cast<Pack8<OS>*>(out)[u] = o;
      } else {
        float acc = 0.0f;
        for (int p = 0; p < count; ++p) acc += Wire::Load(sRows[warp][p][u]);
        out[u] = Out::Store(acc);
      }
    }
    if (a.hasWeights && part == 0 && lane < a.k) {
      float acc = 0.0f;
      for (int p = 0; p < count; ++p) acc += sWeights[warp][p][lane];
      reinterpret_cast<float*>(a.combOutWeights)[(size_t)t * a.k + lane] = acc;
    }
    __syncwarp();  // the lists are rewritten by the warp's next item
  }
}

extern "C" __global__ void ep_combine_accum_bf16(EpArgs a) { CombineAccum<Bf16, Bf16>(a); }
extern "C" __global__ void ep_combine_accum_f32(EpArgs a) { CombineAccum<F32, F32>(a); }
extern "C" __global__ void ep_combine_accum_fp8(EpArgs a) { CombineAccum<Fp8, Fp8>(a); }
extern "C" __global__ void ep_combine_accum_bf16_fp8(EpArgs a) { CombineAccum<Bf16, Fp8>(a); }
extern "C" __global__ void ep_combine_accum_fp8fnuz(EpArgs a) { CombineAccum<Fp8Fnuz, Fp8Fnuz>(a); }

// The source rows of this PE's token t in top-k order (a warp's list in shared memory, as in
// CombineAccum), rows of `rowBytes` bytes; returns how many.
MORI_DEVICE_INLINE int ListRows(const EpArgs& a, int t, int lane, const uint8_t** rows, const float** weights) {
  const int32_t* destMap = reinterpret_cast<const int32_t*>(a.destMap);
  const int32_t d = lane < a.k ? destMap[(size_t)t * a.k + lane] : -1;
  const uint32_t valid = __ballot_sync(0xffffffffu, d >= 0);
  if (d >= 0) {
    const int pe = d / a.maxSend;
    const size_t slot = d % a.maxSend;
    const int pos = __popc(valid & ((1u << lane) - 1));
    if (OnMyNode(a, pe)) {
      rows[pos] = Peer(reinterpret_cast<const uint8_t*>(a.combInp), pe) + slot * a.combRowBytes;
      weights[pos] = Peer(reinterpret_cast<const float*>(a.combInpWeights), pe) + slot * a.k;
    } else {
      const char* row = ReturnedRow(a, pe / a.nodeSize, slot);
      rows[pos] = reinterpret_cast<const uint8_t*>(row);
      weights[pos] = reinterpret_cast<const float*>(row + a.combWOff);
    }
  }
  __syncwarp();
  return __popc(valid);
}

// Combine of byte-coded wires (one warp per token): the blockwise wires into bf16 (each code times
// its block's scale, a multiply and an add each rounded, as the CPU backend), or packed fp4 input
// into packed fp4 (two sums a byte).
template <int Kind>  // 0: fp8 blockwise, 1: fp4 blockwise, 2: fp4 input
__device__ void CombineAccumCoded(const EpArgs& a) {
  __shared__ const uint8_t* sRows[32][32];
  __shared__ const float* sWeights[32][32];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
  const int blockElems = a.combScaleDim > 0 ? (a.hidden + a.combScaleDim - 1) / a.combScaleDim : 1;
  for (int t = blockIdx.x * warps + warp; t < a.numTokens; t += gridDim.x * warps) {
    const int count = ListRows(a, t, lane, sRows[warp], sWeights[warp]);
    if (Kind == 2) {
      uint8_t* out = reinterpret_cast<uint8_t*>(a.combOut) + (size_t)t * a.hidden;
      for (int b = lane; b < a.hidden; b += 32) {
        float lo = 0.0f, hi = 0.0f;
        for (int p = 0; p < count; ++p) {
          const uint32_t byte = sRows[warp][p][b];
          lo += Fp4ToF32(byte & 15);
          hi += Fp4ToF32(byte >> 4);
        }
        out[b] = (uint8_t)(F32ToFp4(lo) | (F32ToFp4(hi) << 4));
      }
    } else {
      uint16_t* out = reinterpret_cast<uint16_t*>(a.combOut) + (size_t)t * a.hidden;
      for (int i = lane; i < a.hidden; i += 32) {
        float acc = 0.0f;
        for (int p = 0; p < count; ++p) {
          const uint8_t* row = sRows[warp][p];
          const float scale = reinterpret_cast<const float*>(row + a.combCodeBytes)[i / blockElems];
          const float v = Kind == 0 ? Fp8ToF32(row[i]) : Fp4ToF32((row[i >> 1] >> (4 * (i & 1))) & 15);
          acc = __fadd_rn(acc, __fmul_rn(v, scale));
        }
        out[i] = F32ToBf16(acc);
      }
    }
    if (a.hasWeights && lane < a.k) {
      float acc = 0.0f;
      for (int p = 0; p < count; ++p) acc += sWeights[warp][p][lane];
      reinterpret_cast<float*>(a.combOutWeights)[(size_t)t * a.k + lane] = acc;
    }
    __syncwarp();  // the lists are rewritten by the warp's next token
  }
}

extern "C" __global__ void ep_combine_accum_bf16_bw8(EpArgs a) { CombineAccumCoded<0>(a); }
extern "C" __global__ void ep_combine_accum_bf16_bw4(EpArgs a) { CombineAccumCoded<1>(a); }
extern "C" __global__ void ep_combine_accum_fp4(EpArgs a) { CombineAccumCoded<2>(a); }
