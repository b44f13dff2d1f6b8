// MORI-EP dispatch and combine on the GPU heap, part 4 of 4 (see ep_common.cuh): the kernels of
// IntraNode, IntraNodeLL and AsyncLL, which also move the inter-node types' tokens within a node.
// ================================ dispatch =====================================================
// A row of rowBytes copied by several warps (dispatch's sends, combine's stage): as many parts as
// `warps` warps give each of `rows` rows, each of at least 1 KiB, 16-byte aligned (1: a warp a row).
struct CopyParts {
  int parts;
  size_t chunk;
  MORI_DEVICE_INLINE CopyParts(size_t rowBytes, int warps, int rows) {
    const int most = (int)((rowBytes + 1023) / 1024);
    parts = rows > 0 ? max(1, min(most, warps / rows)) : 1;
    chunk = ((rowBytes + parts - 1) / parts + 15) & ~(size_t)15;
  }
};

// The whole warp writes part `part` of token t into receive slot s of PE destPe: the bytes
// [part * chunk, (part + 1) * chunk) of the row, and with part 0 the rest (top-k row, weights,
// scales, source position).
MORI_DEVICE_INLINE void SendTokenPart(const EpArgs& a, const int32_t* indices, int t, int destPe, size_t s, int part,
                                      size_t chunk, int lane) {
  if (part == 0) {
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
  }
  const size_t begin = part * chunk;
  if (begin >= (size_t)a.rowBytes) return;
  const size_t bytes = min(chunk, (size_t)a.rowBytes - begin);
  WarpCopy(Peer(reinterpret_cast<char*>(a.dispTok), destPe) + s * a.rowBytes + begin,
           reinterpret_cast<const char*>(a.inp) + (size_t)t * a.rowBytes + begin, bytes, lane);
}

// The whole warp writes token t into receive slot s of PE destPe.
MORI_DEVICE_INLINE void SendToken(const EpArgs& a, const int32_t* indices, int t, int destPe, size_t s, int lane) {
  SendTokenPart(a, indices, t, destPe, s, 0, (size_t)a.rowBytes, lane);
}

// One block, a thread per destination PE: once the previous round's count was consumed there,
// publish how many tokens this PE sent it (count + 1, so 0 means "nothing yet"). Marks the round
// dispatched until its combine. Within one node the wait for "consumed" is left out
// (waitConsumed false): a PE consumes its counts before it stages its combine input, and every PE
// passes that combine's barrier before its next dispatch (a routed call, which may skip the
// combine, starts with a barrier of every PE), so the count is always consumed by then and the
// wait would only add a round trip to every dispatch.
MORI_DEVICE_INLINE void DispatchSignal(const EpArgs& a, bool waitConsumed) {
  FenceSys();
  if (threadIdx.x == 0) *Control(a, EP_PHASE) = 1;
  int32_t* signal = Control(a, EP_RECV_SIGNAL) + a.rank;
  for (int p = a.nodeFirst + threadIdx.x; p < a.nodeFirst + a.nodeSize; p += blockDim.x) {
    int32_t* sent = Control(a, EP_SENT_COUNT) + p;
    int32_t* remote = Peer(signal, p);
    if (waitConsumed) detail::WaitFor<int32_t>(remote, kCmpEq, 0, "dispatch: previous round's count not yet consumed");
    ptx::StoreReleaseSys(remote, *sent + 1);
    *sent = 0;
  }
}

// One block, a thread per source PE: waits for every PE's count, sums them into totalRecv and
// clears the slot counter for the next round.
MORI_DEVICE_INLINE void DispatchWait(const EpArgs& a) {
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
  // The peers' rows are in this GPU's memory, and the counter cleared here is next touched by a
  // peer after this PE's next system-scope release (its combine's signal): a GPU-scope fence does.
  ptx::FenceAcqRelGpu();
}

// Whether this block is the data kernel's last to finish (counted in the control word `off`,
// cleared again by that block): every block's writes are then complete, so that it may signal
// the round on the kernel's behalf (its signal functions start with a system fence). Every thread
// of every block calls it once, after its writes; `sys`: they include writes to peers' memory
// (else only this GPU's own, which a GPU-scope fence completes).
MORI_DEVICE_INLINE bool LastBlockDone(const EpArgs& a, int off, bool sys) {
  __shared__ bool sLast;
  if (sys) {
    FenceSys();
  } else {
    ptx::FenceAcqRelGpu();
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    sLast = atomicAdd(Control(a, off), 1) == (int32_t)gridDim.x - 1;
    if (sLast) {
      ptx::FenceAcqRelGpu();
      *Control(a, off) = 0;
    }
  }
  __syncthreads();
  return sLast;
}

// Data kernel: each warp takes a token at a time; per destination PE of this node a block reserves
// its slots with one remote atomic, records where each (token, entry) went in destMap (for
// combine), and its warps then copy the token rows, top-k rows, weights and scales into the peers'
// buffers. Tokens for other nodes are staged for ep_internode_put; their destMap entries name the
// combine row coming back. Within one node (a.fuseDispatch) the last block to finish also does
// what ep_dispatch_signal and ep_dispatch_wait would.
// A replay (a.replay: a routing handle's map in destMap, its indices checked on the host) reserves
// nothing: every entry goes where destMap says, the rows for other nodes where they went before.
extern "C" __global__ void ep_dispatch_send(EpArgs a) {
  __shared__ int32_t sCount[EP_MAX_PES], sBase[EP_MAX_PES], sRun[EP_MAX_PES];
  // A round's sends to this node's PEs: (token, PE, slot), at most one per PE per warp.
  __shared__ int3 sSend[32 * 32];
  __shared__ int sSends;
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
  // Token i of this block is t = blockIdx.x + i * gridDim.x: a decode step's few tokens are spread
  // over every block's SMs rather than packed into the first blocks.
  const int32_t* indices = reinterpret_cast<const int32_t*>(a.indices);
  for (int p = threadIdx.x; p < a.world; p += blockDim.x) sCount[p] = sRun[p] = 0;
  __syncthreads();
  for (int t = blockIdx.x + warp * gridDim.x; t < a.numTokens; t += warps * gridDim.x) {
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
  int32_t* destMap = reinterpret_cast<int32_t*>(a.destMap);
  // Rounds of one token a warp: each warp reserves its token's slots and lists its sends to this
  // node's PEs; then the block's warps share the listed rows, cut into parts, so that a decode
  // step's one or two tokens a block still keep every warp copying.
  for (int first = blockIdx.x; first < a.numTokens; first += warps * gridDim.x) {
    if (threadIdx.x == 0) sSends = 0;
    __syncthreads();
    const int t = first + warp * gridDim.x;
    if (t < a.numTokens) {
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
      if (local) sSend[atomicAdd(&sSends, 1)] = make_int3(t, pe, slot);
    }
    __syncthreads();
    const int sends = sSends;
    const CopyParts cut((size_t)a.rowBytes, warps, sends);
    for (int item = warp; item < sends * cut.parts; item += warps) {
      const int3 e = sSend[item / cut.parts];
      SendTokenPart(a, indices, e.x, e.y, (size_t)e.z, item % cut.parts, cut.chunk, lane);
    }
    __syncthreads();  // sSend is rewritten by the next round
  }
  if (!a.fuseDispatch) {
    FenceSys();
    return;
  }
  // One node (a.fuseDispatch): the block that finishes last publishes this PE's counts, and, unless
  // the receiving half is a call of its own (2; AsyncLL's dispatch_recv: 1), waits for every peer's.
  if (LastBlockDone(a, EP_SEND_DONE, true)) {
    DispatchSignal(a, false);
    if (a.fuseDispatch > 1) DispatchWait(a);
  }
}

extern "C" __global__ void ep_dispatch_signal(EpArgs a) { DispatchSignal(a, true); }

extern "C" __global__ void ep_dispatch_wait(EpArgs a) { DispatchWait(a); }

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
// The last block of a stage kernel: this PE's registered combine input is complete; tell every PE
// (epoch numbered, so graph replays and repeated calls need no reset).
MORI_DEVICE_INLINE void CombineSignal(const EpArgs& a) {
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

// The end of every stage kernel: the block that finishes last tells every PE (the rows are in
// this GPU's memory, where peers read them).
MORI_DEVICE_INLINE void CombineStageDone(const EpArgs& a) {
  if (LastBlockDone(a, EP_STAGE_DONE, false)) CombineSignal(a);
}

// Whether received row r, which this PE sent itself, is read from the caller's input in place
// by its accumulate (a.ownInPlace; rows past the input are staged zeros).
MORI_DEVICE_INLINE bool OwnRowInPlace(const EpArgs& a, int r) { return a.ownInPlace && r < a.inpRows; }

// Data kernel: copies (or casts to fp8) the caller's combine input rows and weights into the
// registered buffer that peers read, then its last block tells them. Rows past the caller's
// tensor are zeros; rows this PE sent itself are left out where it reads them in place.
template <class In, class Wire>
__device__ void CombineStage(const EpArgs& a) {
  using IS = typename In::Storage;
  using WS = typename Wire::Storage;
  constexpr bool kCopy = sizeof(IS) == sizeof(WS);
  const int lane = threadIdx.x & 31, warps = blockDim.x >> 5;
  const int total = *Control(a, EP_TOTAL_RECV);
  const size_t rowBytes = (size_t)a.hidden * sizeof(WS);
  // Item i of this block is blockIdx.x + i * gridDim.x: few rows still reach every block's SM. A
  // plain copy cuts rows into parts where warps outnumber rows (decode); a cast goes a warp a row.
  const CopyParts cut(rowBytes, kCopy ? (int)(gridDim.x * warps) : 1, total);
  const int parts = cut.parts;
  const size_t chunk = cut.chunk;
  const int firstItem = blockIdx.x + (threadIdx.x >> 5) * gridDim.x, itemStride = gridDim.x * warps;
  // A cast goes a pack at a time where rows are whole packs of an aligned tensor.
  const bool packed = a.hidden % 8 == 0 && a.inp % sizeof(Pack8<IS>) == 0;
  for (int item = firstItem; item < total * parts; item += itemStride) {
    const int r = item / parts, part = item % parts;
    WS* dst = reinterpret_cast<WS*>(a.combInp) + (size_t)r * a.hidden;
    const IS* src = reinterpret_cast<const IS*>(a.inp) + (size_t)r * a.hidden;
    const size_t begin = min(part * chunk, rowBytes), bytes = min(chunk, rowBytes - begin);
    if (r >= a.inpRows) {  // zero is all-zero bytes in every wire dtype
      WarpZero(reinterpret_cast<char*>(dst) + begin, bytes, lane);
    } else if constexpr (kCopy) {
      // The source position tells a row this PE sent itself (the accumulate knows it from destMap).
      const bool own = OwnRowInPlace(a, r) && reinterpret_cast<const int32_t*>(a.dispSrcPos)[r] / a.maxSend == a.rank;
      if (a.inp != a.combInp && !own) {
        WarpCopy(reinterpret_cast<char*>(dst) + begin, reinterpret_cast<const char*>(src) + begin, bytes, lane);
      }
    } else if (packed) {
      CastPacks<In, Wire>(reinterpret_cast<Pack8<WS>*>(dst), reinterpret_cast<const Pack8<IS>*>(src), a.hidden / 8,
                          lane);
    } else {
      for (int i = lane; i < a.hidden; i += 32) dst[i] = Wire::Store(In::Load(src[i]));
    }
    if (part == 0 && a.hasWeights && lane < a.k) {
      const float w = r < a.weightRows ? reinterpret_cast<const float*>(a.weights)[(size_t)r * a.k + lane] : 0.0f;
      reinterpret_cast<float*>(a.combInpWeights)[(size_t)r * a.k + lane] = w;
    }
  }
  CombineStageDone(a);
}

EP_DATA_KERNEL ep_combine_stage_fp8(EpArgs a) { CombineStage<Fp8, Fp8>(a); }
EP_DATA_KERNEL ep_combine_stage_bf16(EpArgs a) { CombineStage<Bf16, Bf16>(a); }
EP_DATA_KERNEL ep_combine_stage_f32(EpArgs a) { CombineStage<F32, F32>(a); }
EP_DATA_KERNEL ep_combine_stage_bf16_fp8(EpArgs a) { CombineStage<Bf16, Fp8>(a); }
EP_DATA_KERNEL ep_combine_stage_fp8fnuz(EpArgs a) { CombineStage<Fp8Fnuz, Fp8Fnuz>(a); }
EP_DATA_KERNEL ep_combine_stage_fp4(EpArgs a) { CombineStage<Fp4x2, Fp4x2>(a); }

// Data kernel of the blockwise wires: a warp a row (rows past the caller's tensor are zeros).
template <bool Fp4>
__device__ void CombineStageBlockwise(const EpArgs& a) {
  const int lane = threadIdx.x & 31, warps = blockDim.x >> 5;
  const int total = *Control(a, EP_TOTAL_RECV);
  // Row i of this block is blockIdx.x + i * gridDim.x: few rows still reach every block's SM.
  const int firstRow = blockIdx.x + (threadIdx.x >> 5) * gridDim.x, rowStride = gridDim.x * warps;
  const int blockElems = (a.hidden + a.combScaleDim - 1) / a.combScaleDim;
  // Packs never straddle a block, and rows start aligned for their stores (8 fp8 / 4 fp4 bytes).
  const bool packed =
      a.hidden % 8 == 0 && blockElems % 8 == 0 && a.combRowBytes % (Fp4 ? 4 : 8) == 0 && a.inp % 16 == 0;
  int group = 1;
  while (group < blockElems / 8 && group < 32) group <<= 1;
  for (int r = firstRow; r < total; r += rowStride) {
    uint8_t* dst = reinterpret_cast<uint8_t*>(a.combInp) + (size_t)r * a.combRowBytes;
    const uint16_t* src = r < a.inpRows ? reinterpret_cast<const uint16_t*>(a.inp) + (size_t)r * a.hidden : nullptr;
    const Pack8<uint16_t>* packs = reinterpret_cast<const Pack8<uint16_t>*>(src);
    if (packed && blockElems <= 256) {
      QuantizeRowPacked<Fp4, false>(a, packs, dst, blockElems, group, lane);
    } else if (packed) {
      QuantizeRowPacked<Fp4, true>(a, packs, dst, blockElems, group, lane);
    } else {
      QuantizeRowScalar<Fp4>(a, src, dst, blockElems, lane);
    }
    if (a.hasWeights && lane < a.k) {
      const float w = r < a.weightRows ? reinterpret_cast<const float*>(a.weights)[(size_t)r * a.k + lane] : 0.0f;
      reinterpret_cast<float*>(a.combInpWeights)[(size_t)r * a.k + lane] = w;
    }
  }
  CombineStageDone(a);
}

EP_DATA_KERNEL ep_combine_stage_bf16_bw8(EpArgs a) { CombineStageBlockwise<false>(a); }
EP_DATA_KERNEL ep_combine_stage_bf16_bw4(EpArgs a) { CombineStageBlockwise<true>(a); }

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

// The source rows of this PE's token t in top-k order, as a warp's list in shared memory (so that
// the element loops, whose trip counts differ between lanes, need no warp shuffles): rows of
// combRowBytes bytes; returns how many.
MORI_DEVICE_INLINE int ListRows(const EpArgs& a, int t, int lane, const uint8_t** rows, const float** weights) {
  const int32_t* destMap = reinterpret_cast<const int32_t*>(a.destMap);
  const int32_t d = lane < a.k ? destMap[(size_t)t * a.k + lane] : -1;
  const uint32_t valid = __ballot_sync(0xffffffffu, d >= 0);
  if (d >= 0) {
    const int pe = d / a.maxSend;
    const size_t slot = d % a.maxSend;
    const int pos = __popc(valid & ((1u << lane) - 1));  // keeps top-k order
    if (pe == a.rank && OwnRowInPlace(a, (int)slot)) {
      rows[pos] = reinterpret_cast<const uint8_t*>(a.inp) + slot * a.combRowBytes;
      weights[pos] = reinterpret_cast<const float*>(a.combInpWeights) + slot * a.k;
    } else if (OnMyNode(a, pe)) {
      rows[pos] = Peer(reinterpret_cast<const uint8_t*>(a.combInp), pe) + slot * a.combRowBytes;
      weights[pos] = Peer(reinterpret_cast<const float*>(a.combInpWeights), pe) + slot * a.k;
    } else {  // sent back by pe's node proxy: row `slot` of that node's block
      const char* row = ReturnedRow(a, pe / a.nodeSize, slot);
      rows[pos] = reinterpret_cast<const uint8_t*>(row);
      weights[pos] = reinterpret_cast<const float*>(row + a.combWOff);
    }
  }
  __syncwarp();
  return __popc(valid);
}

// The accumulate kernels give each warp items: a token, or a part of its row (contiguous runs of
// `units`) when warps outnumber tokens (decode), parts of at least 256 elements.
struct RowSplit {
  int parts, chunk;
  MORI_DEVICE_INLINE RowSplit(const EpArgs& a, int units, int globalWarps) {
    const int maxParts = (a.hidden + 255) / 256;
    parts = globalWarps / a.numTokens;
    parts = parts < 1 ? 1 : (parts > maxParts ? maxParts : parts);
    chunk = (units + parts - 1) / parts;
  }
};

// The weights of token t: the sum of its rows' weights (part 0 of the token writes them).
MORI_DEVICE_INLINE void SumWeights(const EpArgs& a, int t, int count, const float* const* weights, int lane) {
  if (a.hasWeights && lane < a.k) {
    float acc = 0.0f;
    for (int p = 0; p < count; ++p) acc += weights[p][lane];
    reinterpret_cast<float*>(a.combOutWeights)[(size_t)t * a.k + lane] = acc;
  }
}

// Data kernel: for each of this PE's tokens, reads the rows its destinations hold for it and sums
// them in float32 in top-k order (a pack of 8 elements a lane where rows are whole packs: every
// row start is then aligned, the buffers being 256-byte aligned).
template <class Out, class Wire>
__device__ void CombineAccum(const EpArgs& a) {
  constexpr int kAccumUnits = 2;
  using WS = typename Wire::Storage;
  using OS = typename Out::Storage;
  __shared__ const uint8_t* sRows[32][32];
  __shared__ const float* sWeights[32][32];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
  const int globalWarp = blockIdx.x * warps + warp, globalWarps = gridDim.x * warps;
  if (a.numTokens == 0) return;
  const bool packed = a.hidden % 8 == 0;
  const int units = packed ? a.hidden / 8 : a.hidden;
  const RowSplit split(a, units, globalWarps);
  for (int item = globalWarp; item < a.numTokens * split.parts; item += globalWarps) {
    const int t = item / split.parts, part = item % split.parts;
    const int count = ListRows(a, t, lane, sRows[warp], sWeights[warp]);
    OS* out = reinterpret_cast<OS*>(a.combOut) + (size_t)t * a.hidden;
    const int begin = part * split.chunk, end = min(begin + split.chunk, units);
    if (packed) {
      SumPacks<kAccumUnits>(
          sRows[warp], count, begin, end, lane,
          [](const uint8_t* row, int u) { return reinterpret_cast<const Pack8<WS>*>(row)[u]; },
          [](float(&acc)[8], const Pack8<WS>& in) {
            float f[8];
            LoadPack(in, f, Wire());
#pragma unroll
            for (int e = 0; e < 8; ++e) acc[e] += f[e];
          },
          [&](int u, const float(&acc)[8]) { reinterpret_cast<Pack8<OS>*>(out)[u] = StorePack(acc, Out()); });
    } else {
      for (int u = begin + lane; u < end; u += 32) {
        float acc = 0.0f;
        for (int p = 0; p < count; ++p) acc += Wire::Load(reinterpret_cast<const WS*>(sRows[warp][p])[u]);
        out[u] = Out::Store(acc);
      }
    }
    if (part == 0) SumWeights(a, t, count, sWeights[warp], lane);
    __syncwarp();  // the lists are rewritten by the warp's next item
  }
}

EP_DATA_KERNEL ep_combine_accum_bf16(EpArgs a) { CombineAccum<Bf16, Bf16>(a); }
EP_DATA_KERNEL ep_combine_accum_f32(EpArgs a) { CombineAccum<F32, F32>(a); }
EP_DATA_KERNEL ep_combine_accum_fp8(EpArgs a) { CombineAccum<Fp8, Fp8>(a); }
EP_DATA_KERNEL ep_combine_accum_bf16_fp8(EpArgs a) { CombineAccum<Bf16, Fp8>(a); }
EP_DATA_KERNEL ep_combine_accum_fp8fnuz(EpArgs a) { CombineAccum<Fp8Fnuz, Fp8Fnuz>(a); }

// Combine of byte-coded wires, split as CombineAccum: the blockwise wires into bf16 (each code
// times its block's scale, a multiply and an add each rounded, as the CPU backend), or packed fp4
// input into packed fp4 (two sums a byte). A lane takes a pack of 8 elements (8 bytes of packed
// fp4 input) where blocks and rows are whole packs, else an element (a byte).
template <int Kind>  // 0: fp8 blockwise, 1: fp4 blockwise, 2: fp4 input
__device__ void CombineAccumCoded(const EpArgs& a) {
  __shared__ const uint8_t* sRows[32][32];
  __shared__ const float* sWeights[32][32];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
  const int globalWarp = blockIdx.x * warps + warp, globalWarps = gridDim.x * warps;
  if (a.numTokens == 0) return;
  const int blockElems = a.combScaleDim > 0 ? (a.hidden + a.combScaleDim - 1) / a.combScaleDim : 8;
  const bool packed = a.hidden % 8 == 0 && blockElems % 8 == 0 && a.combRowBytes % (Kind == 1 ? 4 : 8) == 0;
  const int units = packed ? a.hidden / 8 : a.hidden;
  const RowSplit split(a, units, globalWarps);
  for (int item = globalWarp; item < a.numTokens * split.parts; item += globalWarps) {
    const int t = item / split.parts, part = item % split.parts;
    const int count = ListRows(a, t, lane, sRows[warp], sWeights[warp]);
    const int begin = part * split.chunk, end = min(begin + split.chunk, units);
    if constexpr (Kind == 2) {
      uint8_t* out = reinterpret_cast<uint8_t*>(a.combOut) + (size_t)t * a.hidden;
      for (int u = begin + lane; u < end; u += 32) {
        if (packed) {
          SumFp4Bytes<8>(sRows[warp], count, u, out);
        } else {
          SumFp4Bytes<1>(sRows[warp], count, u, out);
        }
      }
    } else {
      uint16_t* out = reinterpret_cast<uint16_t*>(a.combOut) + (size_t)t * a.hidden;
      if (packed) {
        SumPacks<2>(
            sRows[warp], count, begin, end, lane,
            [&](const uint8_t* row, int u) { return LoadCodedPack<Kind>(a, row, u, blockElems); },
            [](float(&acc)[8], const CodedPack<Kind>& in) { AddCodedPack<Kind>(acc, in); },
            [&](int u, const float(&acc)[8]) { reinterpret_cast<Pack8<uint16_t>*>(out)[u] = StorePack(acc, Bf16()); });
      } else {
        for (int u = begin + lane; u < end; u += 32) {
          float acc = 0.0f;
          for (int p = 0; p < count; ++p) acc = __fadd_rn(acc, CodedTerm<Kind>(a, sRows[warp][p], u, blockElems));
          out[u] = F32ToBf16(acc);
        }
      }
    }
    if (part == 0) SumWeights(a, t, count, sWeights[warp], lane);
    __syncwarp();  // the lists are rewritten by the warp's next item
  }
}

EP_DATA_KERNEL ep_combine_accum_bf16_bw8(EpArgs a) { CombineAccumCoded<0>(a); }
EP_DATA_KERNEL ep_combine_accum_bf16_bw4(EpArgs a) { CombineAccumCoded<1>(a); }
EP_DATA_KERNEL ep_combine_accum_fp4(EpArgs a) { CombineAccumCoded<2>(a); }
