// cuMemcpyBatchAsync in its CUDA 13 form, called by address (no CUDA headers): many copy-engine
// copies on one stream in one driver call, each copy's source read in stream order. Used by
// mori.core.gpu.BatchMemcpy (gpu/copy.cpp) and by the staging's gathered and scattered copies.
#pragma once

#include <cstddef>
#include <cstdint>

namespace mori::gpu {

// CUmemcpyAttributes of cuda.h (CUDA 12.8+): source access order, source and destination
// location hints (type, id; ignored for memory that is not managed), flags.
struct MemcpyAttributes {
    int32_t srcAccessOrder;
    int32_t srcLocType, srcLocId;
    int32_t dstLocType, dstLocId;
    uint32_t flags;
};
static_assert(sizeof(MemcpyAttributes) == 24, "CUmemcpyAttributes layout");
static_assert(sizeof(size_t) == sizeof(uint64_t), "sizes pass as size_t");

// The driver's answers that mean "this driver will not take these as a batch", not "a copy is
// wrong": CUDA_ERROR_INVALID_VALUE, CUDA_ERROR_NOT_SUPPORTED. The copies then go one call each.
// (mori.core.gpu reads them as BATCH_REFUSALS.)
inline constexpr int kBatchRefusals[] = {1, 801};
inline bool batch_refused(int result) {
    for (const int refusal : kBatchRefusals)
        if (result == refusal) return true;
    return false;
}

// Queues dsts[i] <- srcs[i] (sizes[i] bytes, unified addresses) on stream with one call of the
// entry point `entry` (cuMemcpyBatchAsync, CUDA 13 form). Returns the CUresult.
inline int memcpy_batch(uintptr_t entry, uint64_t* dsts, uint64_t* srcs, size_t* sizes, size_t count,
                        uintptr_t stream) {
    using BatchFn = int (*)(uint64_t* dsts, uint64_t* srcs, size_t* sizes, size_t count, MemcpyAttributes* attrs,
                            size_t* attrsIdxs, size_t numAttrs, void* stream);
    constexpr int32_t kSrcAccessOrderStream = 1;  // CU_MEMCPY_SRC_ACCESS_ORDER_STREAM
    MemcpyAttributes attr{kSrcAccessOrderStream, 0, 0, 0, 0, 0};
    size_t attrIdx = 0;
    return reinterpret_cast<BatchFn>(entry)(dsts, srcs, sizes, count, &attr, &attrIdx, 1,
                                            reinterpret_cast<void*>(stream));
}

}  // namespace mori::gpu
