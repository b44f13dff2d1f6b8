// The host stand-in for a Stager's driver (host_standin.cpp): staging tested with no GPU.
#pragma once

#include <cstddef>
#include <cstdint>

#include "gpu/staging.hpp"

namespace mori::gpu::standin {

// How the stand-in misbehaves from now on.
struct Knobs {
    int64_t failCopyIn = -1;   // the copy after this many more fails (0: the next); -1: none fails
    bool failPinning = false;  // every allocation of pinned memory fails
    double delay = 0;          // seconds from a copy's queueing until its end is written
    bool hang = false;         // copies queued from now on never end
    bool failLater = false;    // copies queued from now on fail on the "device": the stream says so
    bool refuseBatch = false;  // cuMemcpyBatchAsync answers CUDA_ERROR_NOT_SUPPORTED
};

// What it has done since the process started.
struct Counters {
    uint64_t copies, batches, largestBatch, copiedBytes, allocations, frees;  // copies: driver calls (a batch is one)
    uint64_t pushes;  // contexts pushed (a Current on a thread that did not have the stand-in's current)
};

// A StagingConfig whose driver is the stand-in's.
StagingConfig config(double timeout, size_t cacheBytes);
void set_knobs(const Knobs& k);
// Makes the stand-in's context current on the calling thread, as an application's
// cuCtxSetCurrent would (a Current there then pushes nothing).
void make_current();
Counters counters();

}  // namespace mori::gpu::standin
