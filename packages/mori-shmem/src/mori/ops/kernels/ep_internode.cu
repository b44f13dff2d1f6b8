// MORI-EP dispatch and combine on the GPU heap, part 3 of 4 (see ep_common.cuh): the inter-node
// kernel types' path between nodes (the design: mori/ops/_internode.py).
//
// Dispatch: ep_dispatch_send stages each token once for each other node it names
// (StageForNodes); ep_internode_put moves each node's block to that node's proxy (the PE with this
// PE's local index there), a share a block of the data kernels between nodes, and
// ep_internode_put_signal then signals it (one block could not move a block of tokens at more than
// one SM's copy rate, ~1/100 of the GPU's); ep_internode_inbox_wait
// waits for every other node's block; ep_internode_forward hands the tokens received to this
// node's PEs by P2P stores, as ep_dispatch_send does with its own. Combine, after this node's
// barrier: ep_internode_return gathers, for every token forwarded, the rows this node's PEs
// produced for it; ep_internode_return_put and ep_internode_return_signal send them back as the
// dispatch's blocks go; ep_internode_return_wait waits for every node's block; the accumulate kernel reads them there.
//
// What a proxy keeps of a round is retMap (per source node and combine row: where it forwarded
// the token) and EP_RETURN_ROWS: a routing handle takes both along (mori/ops/dispatch_combine.py),
// so that a combine along an older handle returns that round's rows, and a replay forwards each
// token to the slots it had, reserving none.
//
// The signals between nodes carry round << 32 | count (round: dispatches done, EP_ROUND, for the
// tokens; combines done, EP_COMBINES, for the rows back, since routing handles may combine a
// round after a later dispatch): never reset (a PE cannot clear a remote word without a round
// trip), and CUDA-graph replays need nothing from the host. No buffer is rewritten before its
// reader is done with it: a sender's next block to a proxy follows the sender's combine, which
// waited for that proxy's rows, which the proxy sends after its last read of the inbox (a routed
// call, which may follow a dispatch with no combine between, starts with a barrier of every PE);
// puts end with quiet before their source is reused.

namespace {

// The head of a staged token (PayloadLayout in _internode.py: the row starts at byte 32).
struct TokenHeader {
  int32_t srcPos;      // rank * maxSend + token, as dispSrcPos records it
  int32_t rowBase;     // first of the combine rows the sender expects back from the node
  int32_t rowBytes;    // bytes of the token row
  int32_t scaleBytes;  // bytes of its scales (0: none)
  int32_t hasWeights;  // 1 when the sender gave weights
  int32_t pad[3];
};
static_assert(sizeof(TokenHeader) == 32, "a staged token's row starts at byte 32");

constexpr uint32_t kFullMask = 0xffffffffu;

MORI_DEVICE_INLINE uint64_t* Signal64(const EpArgs& a, int off) { return reinterpret_cast<uint64_t*>(Control(a, off)); }

MORI_DEVICE_INLINE uint32_t LanesBelow(int lane) { return (1u << lane) - 1; }

// Staged token j of block `block` in `buf` (stage: one block per destination node; inbox: one per
// source node).
MORI_DEVICE_INLINE char* Payload(uint64_t buf, const EpArgs& a, int block, int j) {
  return reinterpret_cast<char*>(buf) + ((size_t)block * a.tokCap + j) * a.xferBytes;
}

// Combine row `row` of node `node`'s block in `buf` (retStage or retInbox).
MORI_DEVICE_INLINE char* CombineRow(uint64_t buf, const EpArgs& a, int node, int row) {
  return reinterpret_cast<char*>(buf) + ((size_t)node * a.tokCap * a.nodeSize + row) * a.combXferBytes;
}

MORI_DEVICE_INLINE const char* ReturnedRow(const EpArgs& a, int node, int row) {
  return CombineRow(a.retInbox, a, node, row);
}

// Where this PE, as node `node`'s proxy, forwarded the token whose combine row `row` it sends back
// (pe * maxRecv + slot; -1 for none).
MORI_DEVICE_INLINE int32_t* RetMap(const EpArgs& a, int node, int row) {
  return reinterpret_cast<int32_t*>(a.retMap) + (size_t)node * a.tokCap * a.nodeSize + row;
}

// The whole warp writes token t's payload (header, row, scales, top-k ids, weights) at `dst`.
MORI_DEVICE_INLINE void StageToken(const EpArgs& a, char* dst, int t, int rowBase, int lane) {
  const bool scales = a.scales && a.scaleBytes > 0;
  if (lane == 0) {
    *reinterpret_cast<TokenHeader*>(dst) =
        TokenHeader{a.rank * a.maxSend + t, rowBase, a.rowBytes, scales ? a.scaleBytes : 0, a.weights != 0, {0, 0, 0}};
  }
  WarpCopy(dst + sizeof(TokenHeader), reinterpret_cast<const char*>(a.inp) + (size_t)t * a.rowBytes, a.rowBytes, lane);
  if (scales) {
    WarpCopy(dst + a.scaleOff, reinterpret_cast<const char*>(a.scales) + (size_t)t * a.scaleBytes, a.scaleBytes, lane);
  }
  if (lane < a.k) {
    const size_t e = (size_t)t * a.k + lane;
    reinterpret_cast<int32_t*>(dst + a.idxOff)[lane] = reinterpret_cast<const int32_t*>(a.indices)[e];
    reinterpret_cast<float*>(dst + a.wOff)[lane] = a.weights ? reinterpret_cast<const float*>(a.weights)[e] : 0.0f;
  }
}

// Token t (every lane of the warp calls) names, in the lanes of `remote`, PEs of other nodes (the
// lane's `pe`, each PE once): stages the token for each of those nodes and returns, in those lanes,
// the combine row the node's proxy will send back for that PE; other lanes get `slot` back.
// InterNodeV1LL stages every token once, at its own index, with rows t * nodeSize + position. A
// replay's `slot` is already its row (the handle's): the rows are the ones of the first dispatch.
MORI_DEVICE_INLINE int StageForNodes(const EpArgs& a, int t, int pe, uint32_t remote, int lane, int slot) {
  const bool mine = (remote >> lane) & 1u;
  const int node = mine ? pe / a.nodeSize : -1;
  const uint32_t members = __match_any_sync(kFullMask, node) & remote;  // this lane's node's PEs
  const int position = __popc(members & LanesBelow(lane));              // in top-k order
  if (a.lowLatency) {
    StageToken(a, Payload(a.stage, a, 0, t), t, t * a.nodeSize, lane);
    return mine ? t * a.nodeSize + position : slot;
  }
  const bool leader = mine && position == 0;
  int j = 0, rowBase = 0;
  if (leader) {
    j = atomicAdd(Control(a, EP_NODE_TOKENS) + node, 1);
    rowBase = a.replay ? slot : atomicAdd(Control(a, EP_NODE_ROWS) + node, __popc(members));
  }
  const int leaderLane = mine ? __ffs(members) - 1 : lane;
  j = __shfl_sync(kFullMask, j, leaderLane);
  rowBase = __shfl_sync(kFullMask, rowBase, leaderLane);
  uint32_t leaders = __ballot_sync(kFullMask, leader);
  while (leaders) {
    const int l = __ffs(leaders) - 1;
    leaders &= leaders - 1;
    StageToken(a, Payload(a.stage, a, __shfl_sync(kFullMask, node, l), __shfl_sync(kFullMask, j, l)), t,
               __shfl_sync(kFullMask, rowBase, l), lane);
  }
  return mine ? rowBase + position : slot;
}

// The PEs of this node a received token goes to: the lanes whose entry names one (each PE once).
MORI_DEVICE_INLINE uint32_t NodeTargets(const EpArgs& a, const char* tok, int lane, int* pe) {
  *pe = SendingPe(a, reinterpret_cast<const int32_t*>(tok + a.idxOff), 0, lane);
  return __ballot_sync(kFullMask, *pe >= 0 && OnMyNode(a, *pe));
}

// Waits (one block, a thread per other node) for the signal `off` of this round; returns nothing,
// leaves each node's count in `countOff` when it is >= 0.
MORI_DEVICE_INLINE void WaitNodes(const EpArgs& a, int off, uint32_t round, int countOff, const char* what) {
  for (int n = threadIdx.x; n < a.nNodes; n += blockDim.x) {
    if (n == a.myNode) continue;
    const uint64_t v = detail::WaitFor<uint64_t>(Signal64(a, off) + n, kCmpGe, (uint64_t)round << 32, what);
    if ((v >> 32) != round) {
      MORI_DEVICE_FAIL("%s: node %d signalled round %u during round %u (a dispatch or combine missing on some PE?)",
                       what, n, (uint32_t)(v >> 32), round);
    }
    if (countOff >= 0) Control(a, countOff)[n] = (int32_t)(uint32_t)v;
  }
}

}  // namespace

// ================================ dispatch between nodes =======================================
// A put between nodes is spread over gridDim.x / nNodes blocks a node (block b serves node b /
// that), each putting its share, in whole 256-byte runs, of the `bytes` for PE `pe`, then quiet;
// the signal follows in a one-block kernel, once every share is complete.
MORI_DEVICE_INLINE void PutShare(const EpArgs& a, char* dst, const char* src, size_t bytes, int pe) {
  const int shares = gridDim.x / a.nNodes, share = blockIdx.x % shares;
  const size_t per = ((bytes + shares - 1) / shares + 255) / 256 * 256;
  const size_t begin = min(bytes, per * share), end = min(bytes, begin + per);
  if (end > begin) ShmemPutMemNbiBlock(dst + begin, src + begin, end - begin, pe);
  ShmemQuietBlock();
}

// The PE of node n that this PE's blocks go to (and come back from): the one with its local index.
MORI_DEVICE_INLINE int NodePeer(const EpArgs& a, int n) { return n * a.nodeSize + (a.rank - a.nodeFirst); }

// The tokens staged for node n, and where they are.
MORI_DEVICE_INLINE int StagedTokens(const EpArgs& a, int n) {
  return a.lowLatency ? a.numTokens : Control(a, EP_NODE_TOKENS)[n];
}
MORI_DEVICE_INLINE const char* StagedBlock(const EpArgs& a, int n) {
  return Payload(a.stage, a, a.lowLatency ? 0 : n, 0);
}

// Data kernel, blocks a node (this node's do nothing): the tokens staged for each other node into
// this PE's block of its proxy's inbox (the stage is rewritten next round, hence the quiet).
extern "C" __global__ void ep_internode_put(EpArgs a) {
  const int n = blockIdx.x / (gridDim.x / a.nNodes);
  if (n == a.myNode) return;
  PutShare(a, Payload(a.inbox, a, a.myNode, 0), StagedBlock(a, n), (size_t)StagedTokens(a, n) * a.xferBytes,
           NodePeer(a, n));
}

// One block, a thread per other node: signals its proxy that this round's tokens are there (an
// empty put-with-signal: the bytes went before), and clears the node's counters.
extern "C" __global__ void ep_internode_put_signal(EpArgs a) {
  FenceSys();
  const uint64_t round = (uint32_t)*Control(a, EP_ROUND) + 1u;
  for (int n = threadIdx.x; n < a.nNodes; n += blockDim.x) {
    if (n == a.myNode) continue;
    const int count = StagedTokens(a, n);
    ShmemPutMemNbiSignalThread(Payload(a.inbox, a, a.myNode, 0), StagedBlock(a, n), 0,
                               Signal64(a, EP_INBOX_SIGNAL) + a.myNode, round << 32 | (uint32_t)count, kSignalSet,
                               NodePeer(a, n));
    Control(a, EP_NODE_TOKENS)[n] = Control(a, EP_NODE_ROWS)[n] = 0;
  }
  ShmemQuietBlock();
}

// One block: waits for every other node's tokens of this round, then counts the round done.
extern "C" __global__ void ep_internode_inbox_wait(EpArgs a) {
  const uint32_t round = (uint32_t)*Control(a, EP_ROUND) + 1u;
  WaitNodes(a, EP_INBOX_SIGNAL, round, EP_INBOX_COUNT, "dispatch: waiting for another node's tokens");
  __syncthreads();
  if (threadIdx.x == 0) *Control(a, EP_ROUND) = (int32_t)round;
  FenceSys();
}

// Data kernel: a warp per received token hands it to each PE of this node it names (slot reserved
// with an atomic on that PE's counter, as ep_dispatch_send does; a replay's from retMap), counts it
// in EP_SENT_COUNT for ep_dispatch_signal, and records where it went (retMap) and how many rows go
// back (EP_RETURN_ROWS).
extern "C" __global__ void ep_internode_forward(EpArgs a) {
  const int lane = threadIdx.x & 31, warps = blockDim.x >> 5;
  const int firstWarp = blockIdx.x * warps + (threadIdx.x >> 5), warpStride = gridDim.x * warps;
  int32_t* recvOffset = Control(a, EP_RECV_OFFSET);
  for (int n = 0; n < a.nNodes; ++n) {
    if (n == a.myNode) continue;
    const int count = Control(a, EP_INBOX_COUNT)[n];
    for (int j = firstWarp; j < count; j += warpStride) {
      const char* tok = Payload(a.inbox, a, n, j);
      const TokenHeader h = *reinterpret_cast<const TokenHeader*>(tok);
      int pe;
      const uint32_t targets = NodeTargets(a, tok, lane, &pe);
      if (!targets) continue;
      int slot = -1;
      if ((targets >> lane) & 1u) {
        int32_t* where = RetMap(a, n, h.rowBase + __popc(targets & LanesBelow(lane)));
        if (a.replay) {
          const int32_t d = *where;
          if (d < 0 || d / a.maxRecv != pe) {
            MORI_DEVICE_FAIL("replay dispatch: node %d's token for PE %d went elsewhere in the handle's dispatch", n,
                             pe);
          }
          slot = d % a.maxRecv;
        } else {
          slot = ptx::AtomAddSys(Peer(recvOffset, pe), 1);
          if (slot >= a.maxRecv) {
            MORI_DEVICE_FAIL(
                "dispatch: PE %d would receive more than max_num_tokens_to_recv=%d tokens "
                "(raise max_total_recv_tokens or leave it 0)",
                pe, a.maxRecv);
          }
          *where = pe * a.maxRecv + slot;
        }
        atomicAdd(Control(a, EP_SENT_COUNT) + pe, 1);
      }
      if (lane == 0) atomicMax(Control(a, EP_RETURN_ROWS) + n, h.rowBase + __popc(targets));
      uint32_t left = targets;
      while (left) {
        const int src = __ffs(left) - 1;
        left &= left - 1;
        const int destPe = __shfl_sync(kFullMask, pe, src);
        const size_t s = (size_t)__shfl_sync(kFullMask, slot, src);
        if (lane == 0) Peer(reinterpret_cast<int32_t*>(a.dispSrcPos), destPe)[s] = h.srcPos;
        if (lane < a.k) {
          Peer(reinterpret_cast<int32_t*>(a.dispIndices), destPe)[s * a.k + lane] =
              reinterpret_cast<const int32_t*>(tok + a.idxOff)[lane];
          if (h.hasWeights) {
            Peer(reinterpret_cast<float*>(a.dispWeights), destPe)[s * a.k + lane] =
                reinterpret_cast<const float*>(tok + a.wOff)[lane];
          }
        }
        if (h.scaleBytes > 0) {
          WarpCopy(Peer(reinterpret_cast<char*>(a.dispScales), destPe) + s * h.scaleBytes, tok + a.scaleOff,
                   h.scaleBytes, lane);
        }
        WarpCopy(Peer(reinterpret_cast<char*>(a.dispTok), destPe) + s * h.rowBytes, tok + sizeof(TokenHeader),
                 h.rowBytes, lane);
      }
    }
  }
  FenceSys();
}

// ================================ combine between nodes ========================================
// Data kernel, after this node's combine barrier: a warp per combine row going back to a node
// copies the combine input row (and weights) of the PE retMap names into that node's block, at
// the row the sender expects (rowBase + position among the node's PEs, in top-k order), and
// clears the retMap entry for the next round (rows no token fills stay -1: InterNodeV1LL's).
extern "C" __global__ void ep_internode_return(EpArgs a) {
  const int lane = threadIdx.x & 31, warps = blockDim.x >> 5;
  const int firstWarp = blockIdx.x * warps + (threadIdx.x >> 5), warpStride = gridDim.x * warps;
  for (int n = 0; n < a.nNodes; ++n) {
    if (n == a.myNode) continue;
    const int rows = Control(a, EP_RETURN_ROWS)[n];
    for (int r = firstWarp; r < rows; r += warpStride) {
      int32_t* where = RetMap(a, n, r);
      const int32_t d = *where;
      __syncwarp();  // every lane read the entry before lane 0 clears it
      if (d < 0) continue;
      const int destPe = d / a.maxRecv;
      const size_t s = d % a.maxRecv;
      char* dst = CombineRow(a.retStage, a, n, r);
      WarpCopy(dst, Peer(reinterpret_cast<const char*>(a.combInp), destPe) + s * a.combRowBytes, a.combRowBytes, lane);
      if (lane < a.k) {
        reinterpret_cast<float*>(dst + a.combWOff)[lane] =
            Peer(reinterpret_cast<const float*>(a.combInpWeights), destPe)[s * a.k + lane];
      }
      if (lane == 0) *where = -1;
    }
  }
  FenceSys();
}

// Data kernel, blocks a node as ep_internode_put: the rows gathered for each other node into this
// node's block of the return inbox of the PE there with this PE's local index (the sender).
extern "C" __global__ void ep_internode_return_put(EpArgs a) {
  const int n = blockIdx.x / (gridDim.x / a.nNodes);
  if (n == a.myNode) return;
  PutShare(a, CombineRow(a.retInbox, a, a.myNode, 0), CombineRow(a.retStage, a, n, 0),
           (size_t)Control(a, EP_RETURN_ROWS)[n] * a.combXferBytes, NodePeer(a, n));
}

// One block, a thread per other node: signals the sender that this round's rows are there.
extern "C" __global__ void ep_internode_return_signal(EpArgs a) {
  FenceSys();
  const uint64_t round = (uint32_t)*Control(a, EP_COMBINES) + 1u;
  for (int n = threadIdx.x; n < a.nNodes; n += blockDim.x) {
    if (n == a.myNode) continue;
    int32_t* rows = Control(a, EP_RETURN_ROWS) + n;
    ShmemPutMemNbiSignalThread(CombineRow(a.retInbox, a, a.myNode, 0), CombineRow(a.retStage, a, n, 0), 0,
                               Signal64(a, EP_RETURN_SIGNAL) + a.myNode, round << 32 | (uint32_t)*rows, kSignalSet,
                               NodePeer(a, n));
    *rows = 0;
  }
  ShmemQuietBlock();
}

// One block: waits for every other node's combine rows of this combine, then counts it done.
extern "C" __global__ void ep_internode_return_wait(EpArgs a) {
  const uint32_t round = (uint32_t)*Control(a, EP_COMBINES) + 1u;
  WaitNodes(a, EP_RETURN_SIGNAL, round, -1, "combine: waiting for another node's expert outputs");
  __syncthreads();
  if (threadIdx.x == 0) *Control(a, EP_COMBINES) = (int32_t)round;
  FenceSys();
}
