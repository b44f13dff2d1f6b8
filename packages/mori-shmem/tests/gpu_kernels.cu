// Device-API checks run by gpu_worker.py: each kernel exercises one part of mori's device API
// on the symmetric heap; the host checks the bytes afterwards.
#define MORI_DEVICE_DEFINE_STATE
#include <mori/device/shmem.cuh>
using namespace mori::device;

__device__ inline void Slice(size_t bytes, size_t* off, size_t* len) {
    size_t per = (bytes + gridDim.x - 1) / gridDim.x;
    *off = per * blockIdx.x;
    *len = *off < bytes ? (bytes - *off < per ? bytes - *off : per) : 0;
}

// Every block puts its slice of `src` into `dest` on the right neighbour.
extern "C" __global__ void put_ring(char* dest, const char* src, unsigned long long bytes) {
    size_t off, len;
    Slice(bytes, &off, &len);
    int right = (ShmemMyPe() + 1) % ShmemNPes();
    if (len) ShmemPutMemNbiBlock(dest + off, src + off, len, right);
    ShmemQuietBlock();
}

// Every block gets its slice of the right neighbour's symmetric `src` into local `dest`.
extern "C" __global__ void get_ring(char* dest, const char* src, unsigned long long bytes) {
    size_t off, len;
    Slice(bytes, &off, &len);
    int right = (ShmemMyPe() + 1) % ShmemNPes();
    if (len) ShmemGetMemBlock(dest + off, src + off, len, right);
}

// One block: put `src` with a signal (SET to `round`) to the right neighbour, wait for the left
// neighbour's signal, then copy what arrived into `out` (only correct if the signal orders it).
extern "C" __global__ void put_signal_ring(char* dest, const char* src, unsigned long long bytes, uint64_t* sig,
                                           uint64_t round, char* out) {
    int right = (ShmemMyPe() + 1) % ShmemNPes();
    ShmemPutMemNbiSignalBlock(dest, src, bytes, sig, round, kSignalSet, right);
    if (threadIdx.x == 0) ShmemWaitUntil<uint64_t>(sig, kCmpEq, round);
    __syncthreads();
    for (size_t i = threadIdx.x; i < bytes; i += blockDim.x) out[i] = dest[i];
}

// Every thread adds 1 to the 64-bit and the 32-bit counter of every PE; olds[] keeps what this
// thread saw on PE 0 so the host can check they are all distinct.
extern "C" __global__ void fetch_add_all(uint64_t* c64, uint32_t* c32, uint64_t* olds) {
    int n = ShmemNPes();
    size_t tid = blockIdx.x * (size_t)blockDim.x + threadIdx.x;
    for (int k = 0; k < n; ++k) {
        int pe = (ShmemMyPe() + k) % n;
        uint64_t old = ShmemAtomicFetchAdd<uint64_t>(c64, 1, pe);
        ShmemAtomicAdd<uint32_t>(c32, 1u, pe);
        if (pe == 0) olds[tid] = old;
    }
}

// `rounds` times: write `round` into slot me of every PE's `slots`, barrier, then check that
// every slot of this PE holds `round`. errors[0] counts mismatches.
extern "C" __global__ void barrier_rounds(uint64_t* slots, int rounds, unsigned int* errors) {
    int me = ShmemMyPe(), n = ShmemNPes();
    for (int r = 1; r <= rounds; ++r) {
        if (threadIdx.x == 0) {
            for (int pe = 0; pe < n; ++pe) ShmemP<uint64_t>(slots + me, (uint64_t)r, pe);
        }
        ShmemBarrierAllBlock();
        if (threadIdx.x < n && ShmemAtomicFetch<uint64_t>(slots + threadIdx.x, me) != (uint64_t)r) {
            atomicAdd(errors, 1u);
        }
        ShmemBarrierAllBlock();
    }
}

// The scalar p/g and ShmemPtr: write my rank+1 into the right neighbour's word, barrier, read the
// left neighbour's word back with g through the pointer API.
extern "C" __global__ void p_g_ptr(uint64_t* word, uint64_t* out) {
    int me = ShmemMyPe(), n = ShmemNPes();
    ShmemP<uint64_t>(word, (uint64_t)me + 1, (me + 1) % n);
    ShmemBarrierAllThread();
    out[0] = ShmemG<uint64_t>(word, me);
    uint64_t* leftView = static_cast<uint64_t*>(ShmemPtr(word, (me + n - 1) % n));
    out[1] = leftView ? *reinterpret_cast<volatile uint64_t*>(leftView) : ~0ull;
}

// One thread writes `value` into `word` on the right neighbour (ordered by a later barrier).
extern "C" __global__ void p_right(uint64_t* word, uint64_t value) {
    ShmemP<uint64_t>(word, value, (ShmemMyPe() + 1) % ShmemNPes());
}
