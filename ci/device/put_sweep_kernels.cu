// Kernels of put_sweep.py (appended to bench_shmem.py's KERNELS, which defines the device state
// and the reference kernels put_bw and ping_pong). Variants are template parameters so that the
// winner can be folded into copy.cuh / sync.cuh as it is.

// ---------------------------------------------------------------------------------------------
// (a) bandwidth: one 16-byte vector moved with a chosen load / store flavour.
//   kLoad  0: plain load (what copy.cuh does)
//          1: ld.global.nc.L1::no_allocate (read-only path, no L1 line)
//          2: ld.global.L1::no_allocate
//   kStore 0: plain store (what copy.cuh does)
//          1: st.global.cs (streaming, evict-first)
//          2: st.global.L1::no_allocate
template <int kLoad>
__device__ __forceinline__ uint4 SweepLoad(const uint4* p) {
    uint4 v;
    if constexpr (kLoad == 0) {
        v = *p;
    } else if constexpr (kLoad == 1) {
        asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0,%1,%2,%3}, [%4];"
                     : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
                     : "l"(p));
    } else {
        asm volatile("ld.global.L1::no_allocate.v4.u32 {%0,%1,%2,%3}, [%4];"
                     : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
                     : "l"(p));
    }
    return v;
}

template <int kStore>
__device__ __forceinline__ void SweepStore(uint4* p, uint4 v) {
    if constexpr (kStore == 0) {
        *p = v;
    } else if constexpr (kStore == 1) {
        asm volatile("st.global.cs.v4.u32 [%0], {%1,%2,%3,%4};" ::"l"(p), "r"(v.x), "r"(v.y), "r"(v.z), "r"(v.w)
                     : "memory");
    } else {
        asm volatile("st.global.L1::no_allocate.v4.u32 [%0], {%1,%2,%3,%4};" ::"l"(p), "r"(v.x), "r"(v.y), "r"(v.z),
                     "r"(v.w)
                     : "memory");
    }
}

// Thread `rank` of `n` copies `bytes` (a multiple of 16, both pointers 16-aligned). One element is
// kVecs adjacent 16-byte vectors (16 or 32 bytes per thread per step); each thread loads kUnroll
// elements (coalesced across the group) before storing any. The elements after the last whole
// step (fewer than n * kUnroll): kTail 0, one load-store at a time per thread (copy.cuh today:
// the loads cannot move above earlier stores, so each is a round trip); kTail 1, one predicated
// unrolled step (all of a thread's loads before its stores, like a whole step).
template <int kUnroll, int kVecs, int kLoad, int kStore, int kTail>
__device__ __forceinline__ void SweepCopy(char* dst, const char* src, unsigned long long bytes, unsigned rank,
                                          unsigned n) {
    const uint4* s = reinterpret_cast<const uint4*>(src);
    uint4* d = reinterpret_cast<uint4*>(dst);
    const unsigned long long elems = bytes / (16 * kVecs);
    const unsigned long long step = (unsigned long long)n * kUnroll;
    const unsigned long long whole = elems - elems % step;
    for (unsigned long long i = rank; i < whole; i += step) {
        uint4 v[kUnroll][kVecs];
#pragma unroll
        for (int u = 0; u < kUnroll; ++u)
#pragma unroll
            for (int k = 0; k < kVecs; ++k) v[u][k] = SweepLoad<kLoad>(s + (i + (unsigned long long)u * n) * kVecs + k);
#pragma unroll
        for (int u = 0; u < kUnroll; ++u)
#pragma unroll
            for (int k = 0; k < kVecs; ++k)
                SweepStore<kStore>(d + (i + (unsigned long long)u * n) * kVecs + k, v[u][k]);
    }
    unsigned long long rest = whole * kVecs;  // first 16-byte vector not copied yet
    if constexpr (kTail == 1) {
        const unsigned long long i = whole + rank;
        uint4 v[kUnroll][kVecs];
#pragma unroll
        for (int u = 0; u < kUnroll; ++u)
            if (i + (unsigned long long)u * n < elems)
#pragma unroll
                for (int k = 0; k < kVecs; ++k)
                    v[u][k] = SweepLoad<kLoad>(s + (i + (unsigned long long)u * n) * kVecs + k);
#pragma unroll
        for (int u = 0; u < kUnroll; ++u)
            if (i + (unsigned long long)u * n < elems)
#pragma unroll
                for (int k = 0; k < kVecs; ++k)
                    SweepStore<kStore>(d + (i + (unsigned long long)u * n) * kVecs + k, v[u][k]);
        rest = elems * kVecs;
    }
    for (unsigned long long i = rest + rank; i < bytes / 16; i += n) SweepStore<kStore>(d + i, SweepLoad<kLoad>(s + i));
}

// kQuiet 0: ShmemQuietBlock (every thread fence.sc.sys, then bar.sync); 1: bar.sync, then thread 0
// alone fence.sc.sys (enough in the PTX model: the barrier puts the block's stores in causality
// order before thread 0's fence, and the fence is cumulative); 2: none (the kernel's end drains
// the stores; timing only: the quiet's cost, not a put API).
// The put: chunk == 0: block b copies the b-th contiguous 256-byte-aligned slice (as put_bw);
// chunk > 0: chunks of `chunk` bytes dealt round-robin to the blocks. Then the block's quiet.
template <int kUnroll, int kVecs, int kLoad, int kStore, int kTail, int kQuiet = 0>
__device__ __forceinline__ void SweepPut(char* dst, const char* src, unsigned long long bytes,
                                         unsigned long long chunk) {
    if (chunk == 0) {
        unsigned long long per = (bytes + gridDim.x - 1) / gridDim.x;
        per = (per + 255) & ~255ull;
        const unsigned long long off = per * blockIdx.x;
        if (off < bytes) {
            const unsigned long long len = bytes - off < per ? bytes - off : per;
            SweepCopy<kUnroll, kVecs, kLoad, kStore, kTail>(dst + off, src + off, len, threadIdx.x, blockDim.x);
        }
    } else {
        for (unsigned long long off = chunk * blockIdx.x; off < bytes; off += chunk * gridDim.x) {
            const unsigned long long len = bytes - off < chunk ? bytes - off : chunk;
            SweepCopy<kUnroll, kVecs, kLoad, kStore, kTail>(dst + off, src + off, len, threadIdx.x, blockDim.x);
        }
    }
    if constexpr (kQuiet == 0) {
        ShmemQuietBlock();
    } else if constexpr (kQuiet == 1) {
        __syncthreads();
        if (threadIdx.x == 0) asm volatile("fence.sc.sys;" ::: "memory");
        __syncthreads();
    }
}

// name, unroll, 16-byte vectors per element, load flavour, store flavour, launch bound (threads),
// minimum resident blocks per SM, tail mode.
#define SWEEP_BW_TAIL(name, U, V, L, S, T, M, K)                                               \
    extern "C" __global__ void __launch_bounds__(T, M)                                         \
        name(char* dst, const char* src, unsigned long long bytes, unsigned long long chunk) { \
        SweepPut<U, V, L, S, K>(dst, src, bytes, chunk);                                       \
    }
#define SWEEP_BW(name, U, V, L, S, T, M) SWEEP_BW_TAIL(name, U, V, L, S, T, M, 0)
SWEEP_BW(bw_base, 8, 1, 0, 0, 512, 1)
SWEEP_BW(bw_u4, 4, 1, 0, 0, 512, 1)
SWEEP_BW(bw_u16, 16, 1, 0, 0, 512, 1)
SWEEP_BW(bw_v32u4, 4, 2, 0, 0, 512, 1)
SWEEP_BW(bw_v32u8, 8, 2, 0, 0, 512, 1)
SWEEP_BW(bw_ldnc, 8, 1, 1, 0, 512, 1)
SWEEP_BW(bw_ldna, 8, 1, 2, 0, 512, 1)
SWEEP_BW(bw_stcs, 8, 1, 0, 1, 512, 1)
SWEEP_BW(bw_stna, 8, 1, 0, 2, 512, 1)
SWEEP_BW(bw_ldnc_stcs, 8, 1, 1, 1, 512, 1)
SWEEP_BW(bw_u16_stcs, 16, 1, 0, 1, 512, 1)
SWEEP_BW(bw_occ2, 8, 1, 0, 0, 512, 2)
SWEEP_BW(bw_t256, 8, 1, 0, 0, 256, 1)
SWEEP_BW(bw_t256u16, 16, 1, 0, 0, 256, 1)
SWEEP_BW(bw_t1024, 8, 1, 0, 0, 1024, 1)
SWEEP_BW(bw_t1024u4, 4, 1, 0, 0, 1024, 1)
SWEEP_BW_TAIL(bw_tail, 8, 1, 0, 0, 512, 1, 1)
SWEEP_BW_TAIL(bw_u16_tail, 16, 1, 0, 0, 512, 1, 1)
SWEEP_BW_TAIL(bw_t1024_tail, 8, 1, 0, 0, 1024, 1, 1)
SWEEP_BW_TAIL(bw_t256_tail, 8, 1, 0, 0, 256, 1, 1)
SWEEP_BW_TAIL(bw_stcs_tail, 8, 1, 0, 1, 512, 1, 1)
SWEEP_BW_TAIL(bw_tail_occ2, 8, 1, 0, 0, 512, 2, 1)
extern "C" __global__ void __launch_bounds__(512, 1)
    bw_tail_quiet1(char* dst, const char* src, unsigned long long bytes, unsigned long long chunk) {
    SweepPut<8, 1, 0, 0, 1, 1>(dst, src, bytes, chunk);
}
extern "C" __global__ void __launch_bounds__(512, 1)
    bw_tail_noquiet(char* dst, const char* src, unsigned long long bytes, unsigned long long chunk) {
    SweepPut<8, 1, 0, 0, 1, 2>(dst, src, bytes, chunk);
}
#undef SWEEP_BW
#undef SWEEP_BW_TAIL

// Verification: mismatches of dst[0, n) against src, plus non-zero bytes of dst[n, n + guard)
// (a put that wrote past its end), added to *out. n and guard are multiples of 16.
extern "C" __global__ void sweep_count_diff(const uint4* src, const uint4* dst, unsigned long long n,
                                            unsigned long long guard, unsigned long long* out) {
    unsigned long long bad = 0;
    const unsigned long long stride = (unsigned long long)gridDim.x * blockDim.x;
    for (unsigned long long i = blockIdx.x * (unsigned long long)blockDim.x + threadIdx.x; i < (n + guard) / 16;
         i += stride) {
        const uint4 d = dst[i];
        if (i < n / 16) {
            const uint4 s = src[i];
            bad += (d.x != s.x) + (d.y != s.y) + (d.z != s.z) + (d.w != s.w);
        } else {
            bad += (d.x != 0) + (d.y != 0) + (d.z != 0) + (d.w != 0);
        }
    }
    if (bad) atomicAdd(out, bad);
}

// Zeroes n bytes (a multiple of 16) at p (a peer address: the destination before each variant).
extern "C" __global__ void sweep_zero(uint4* p, unsigned long long n) {
    const unsigned long long stride = (unsigned long long)gridDim.x * blockDim.x;
    for (unsigned long long i = blockIdx.x * (unsigned long long)blockDim.x + threadIdx.x; i < n / 16; i += stride)
        p[i] = make_uint4(0, 0, 0, 0);
}

// ---------------------------------------------------------------------------------------------
// (b) latency of an 8-byte put with signal, one thread each side, peer addresses translated on
// the host. Publish (kPub):
//   0 API     ShmemPutMemNbiSignalThread(SET) from a local source word (whatever copy/rma.cuh are)
//   1 REL     st data; st.release.sys signal                     (the bench's raw floor)
//   2 FSC     st data; fence.sc.sys; st.relaxed.sys signal
//   3 FAR     st data; fence.acq_rel.sys; st.relaxed.sys signal  (release pattern, = REL in the model)
//   4 RED     st data; red.release.sys.add signal, 1              (signal ADD; counts to the same value)
//   5 LL8     no separate signal: the 8 bytes go as two 8-byte words (4 data bytes | 4-byte flag),
//             each word single-copy atomic; the reader waits until both flags are current. Legal,
//             but a different protocol from put+signal (a reference for the cost of the release).
// Wait (kWait):
//   0 API     ShmemWaitUntil(EQ)
//   1 ACQ     ld.acquire.sys each poll
//   2 RLX     ld.relaxed.sys each poll, one fence.acq_rel.sys after the match (acquire pattern)
//   3 VOL     ld.volatile each poll, one fence.acq_rel.sys after the match
// kSleep: nanosleep(kSleep ns) between polls (0: none).
// Not here on purpose: the 8-byte payload and the 8-byte signal written by one st.v2.u64 (or
// st.v4.u32, or a .b128 store). The PTX memory model treats a vector access as a set of scalar
// accesses in unspecified order, and makes no single-copy-atomicity promise for a 16-byte
// ld/st, so a reader may see the new signal beside the old payload; that NVLink happens to carry
// an aligned 16-byte store in one packet is hardware behaviour, not a guarantee. The legal
// fence-free form is LL8: each 8-byte word carries its own flag (8-byte accesses are
// single-copy atomic), which is a different protocol from put+signal.
// Every received payload is checked (bad[0] counts wrong ones); a wait that runs past 2 s gives
// up (bad[1] = 1) rather than trapping, so one failing variant does not kill the run.
__device__ __forceinline__ unsigned long long SweepPayload(unsigned long long v) { return v * 0x9E3779B97F4A7C15ull; }

template <int kWait, int kSleep>
__device__ __forceinline__ bool SweepWait(unsigned long long* sig, unsigned long long v) {
    const unsigned long long start = GlobalTimer();
    unsigned polls = 0;
    unsigned long long seen;
    for (;;) {
        if constexpr (kWait == 1) {
            asm volatile("ld.acquire.sys.global.u64 %0, [%1];" : "=l"(seen) : "l"(sig) : "memory");
        } else if constexpr (kWait == 2) {
            asm volatile("ld.relaxed.sys.global.u64 %0, [%1];" : "=l"(seen) : "l"(sig) : "memory");
        } else {
            asm volatile("ld.volatile.global.u64 %0, [%1];" : "=l"(seen) : "l"(sig) : "memory");
        }
        if (seen == v) break;
        if (kSleep) asm volatile("nanosleep.u32 %0;" ::"r"(kSleep));
        if ((++polls & 1023) == 0 && GlobalTimer() - start > 2000000000ull) return false;
    }
    if constexpr (kWait != 1) asm volatile("fence.acq_rel.sys;" ::: "memory");
    return true;
}

// LL8: waits until both words carry flag v; returns the 8 payload bytes.
template <int kSleep>
__device__ __forceinline__ bool SweepWaitLL(unsigned long long* words, unsigned long long v, unsigned long long* out) {
    const unsigned long long start = GlobalTimer();
    unsigned polls = 0;
    unsigned long long a, b;
    for (;;) {
        asm volatile("ld.relaxed.sys.global.v2.u64 {%0,%1}, [%2];" : "=l"(a), "=l"(b) : "l"(words) : "memory");
        if ((unsigned)a == (unsigned)v && (unsigned)b == (unsigned)v) break;
        if (kSleep) asm volatile("nanosleep.u32 %0;" ::"r"(kSleep));
        if ((++polls & 1023) == 0 && GlobalTimer() - start > 2000000000ull) return false;
    }
    *out = (a >> 32) | (b & 0xffffffff00000000ull);
    return true;
}

template <int kPub>
__device__ __forceinline__ void SweepPublish(unsigned long long* peerBuf, unsigned long long* peerSig,
                                             unsigned long long* buf, unsigned long long* sig,
                                             unsigned long long* srcWord, unsigned long long v, int peer) {
    const unsigned long long data = SweepPayload(v);
    if constexpr (kPub == 0) {
        *srcWord = data;
        ShmemPutMemNbiSignalThread(buf, srcWord, 8, reinterpret_cast<uint64_t*>(sig), v, kSignalSet, peer);
    } else if constexpr (kPub == 5) {
        const unsigned long long w0 = (data << 32) | (v & 0xffffffffull);
        const unsigned long long w1 = (data & 0xffffffff00000000ull) | (v & 0xffffffffull);
        asm volatile("st.relaxed.sys.global.v2.u64 [%0], {%1,%2};" ::"l"(peerBuf), "l"(w0), "l"(w1) : "memory");
    } else {
        *reinterpret_cast<volatile unsigned long long*>(peerBuf) = data;
        if constexpr (kPub == 1) {
            asm volatile("st.release.sys.global.u64 [%0], %1;" ::"l"(peerSig), "l"(v) : "memory");
        } else if constexpr (kPub == 2) {
            asm volatile("fence.sc.sys;" ::: "memory");
            asm volatile("st.relaxed.sys.global.u64 [%0], %1;" ::"l"(peerSig), "l"(v) : "memory");
        } else if constexpr (kPub == 3) {
            asm volatile("fence.acq_rel.sys;" ::: "memory");
            asm volatile("st.relaxed.sys.global.u64 [%0], %1;" ::"l"(peerSig), "l"(v) : "memory");
        } else {
            asm volatile("red.release.sys.global.add.u64 [%0], %1;" ::"l"(peerSig), "l"(1ull) : "memory");
        }
    }
}

template <int kPub, int kWait, int kSleep>
__device__ __forceinline__ void SweepPingPong(unsigned long long* sig, unsigned long long* buf,
                                              unsigned long long* srcWord, int iters, int peer, int initiator,
                                              unsigned long long* elapsed, unsigned long long* bad,
                                              unsigned long long* peerSig, unsigned long long* peerBuf) {
    unsigned long long t0 = 0, wrong = 0;
    for (int i = 0; i <= iters; ++i) {
        if (i == 1) t0 = GlobalTimer();
        const unsigned long long v = (unsigned long long)i + 1;
        if (initiator) SweepPublish<kPub>(peerBuf, peerSig, buf, sig, srcWord, v, peer);
        unsigned long long got;
        if constexpr (kPub == 5) {
            if (!SweepWaitLL<kSleep>(buf, v, &got)) {
                bad[1] = 1;
                return;
            }
        } else {
            if constexpr (kWait == 0) {
                ShmemWaitUntil<uint64_t>(reinterpret_cast<uint64_t*>(sig), kCmpEq, v);
            } else if (!SweepWait<kWait, kSleep>(sig, v)) {
                bad[1] = 1;
                return;
            }
            got = *reinterpret_cast<volatile unsigned long long*>(buf);
        }
        if (!initiator) SweepPublish<kPub>(peerBuf, peerSig, buf, sig, srcWord, v, peer);
        wrong += got != SweepPayload(v);  // after the publish: the check is off the critical path
    }
    elapsed[0] = GlobalTimer() - t0;
    bad[0] = wrong;
}

#define SWEEP_LAT(name, P, W, S)                                                                                   \
    extern "C" __global__ void name(unsigned long long* sig, unsigned long long* buf, unsigned long long* srcWord, \
                                    int iters, int peer, int initiator, unsigned long long* elapsed,               \
                                    unsigned long long* bad, unsigned long long* peerSig,                          \
                                    unsigned long long* peerBuf) {                                                 \
        SweepPingPong<P, W, S>(sig, buf, srcWord, iters, peer, initiator, elapsed, bad, peerSig, peerBuf);         \
    }
SWEEP_LAT(lat_api, 0, 0, 0)
SWEEP_LAT(lat_api_put_rlx_wait, 0, 2, 0)
SWEEP_LAT(lat_rel_acq, 1, 1, 0)
SWEEP_LAT(lat_rel_acq_sleep, 1, 1, 32)
SWEEP_LAT(lat_rel_rlx, 1, 2, 0)
SWEEP_LAT(lat_rel_vol, 1, 3, 0)
SWEEP_LAT(lat_fsc_acq, 2, 1, 0)
SWEEP_LAT(lat_fsc_rlx, 2, 2, 0)
SWEEP_LAT(lat_far_acq, 3, 1, 0)
SWEEP_LAT(lat_far_rlx, 3, 2, 0)
SWEEP_LAT(lat_red_acq, 4, 1, 0)
SWEEP_LAT(lat_red_rlx, 4, 2, 0)
SWEEP_LAT(lat_ll8, 5, 0, 0)
SWEEP_LAT(lat_ll8_sleep, 5, 0, 32)
#undef SWEEP_LAT
