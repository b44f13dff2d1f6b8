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

// Warps are cut from the block's linear thread index, so only the last warp of a block whose
// size is not a multiple of 32 has fewer lanes: Size() and the sync mask count those that exist.
struct WarpGroup {
  static constexpr bool kAlone = false;
  static MORI_DEVICE_INLINE uint32_t Rank() { return ptx::LaneId(); }
  static MORI_DEVICE_INLINE uint32_t Size() {
    const uint32_t left = BlockThreads() - (FlatThreadId() & ~(kWarpSize - 1));
    return left < kWarpSize ? left : kWarpSize;
  }
  static MORI_DEVICE_INLINE void Sync() {
    const uint32_t lanes = Size();
    SyncWarp(lanes == kWarpSize ? kFullWarpMask : (1u << lanes) - 1);
  }
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
