// The three execution scopes of the device API. A Thread-scope call is made by one thread on
// its own; a Warp-scope call by all 32 lanes of a warp together (converged, same arguments); a
// Block-scope call by every thread of the block together. Each scope says which share of the
// work a thread takes (Rank of Size), how its threads wait for one another, and which one acts
// alone when one must (a signal store). kAlone marks the scope whose single thread is the group.
#pragma once

#include "platform.cuh"
#include "ptx.cuh"

namespace mori {
namespace device {
namespace detail {

struct ThreadGroup {
  static constexpr bool kAlone = true;
  static MORI_DEVICE_INLINE uint32_t Rank() { return 0; }
  static MORI_DEVICE_INLINE uint32_t Size() { return 1; }
  static MORI_DEVICE_INLINE void Sync() {}
};

struct WarpGroup {
  static constexpr bool kAlone = false;
  static MORI_DEVICE_INLINE uint32_t Rank() { return ptx::LaneId(); }
  static MORI_DEVICE_INLINE uint32_t Size() { return kWarpSize; }
  static MORI_DEVICE_INLINE void Sync() { SyncWarp(kFullWarpMask); }
};

struct BlockGroup {
  static constexpr bool kAlone = false;
  static MORI_DEVICE_INLINE uint32_t Rank() { return FlatThreadId(); }
  static MORI_DEVICE_INLINE uint32_t Size() { return BlockThreads(); }
  static MORI_DEVICE_INLINE void Sync() { SyncBlock(); }
};

}  // namespace detail
}  // namespace device
}  // namespace mori
