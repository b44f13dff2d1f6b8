// The live blocks of a symmetric heap, by offset (mori.core.memory.LiveRanges): what an
// allocator has handed out and not taken back, and for each block the size its caller asked
// for. Native so that a host put's check (does the range lie in one live block?) is one lookup
// inside the call that moves its bytes (mori.core.ucx.UcxHeapWindow), not a Python step of its own.
// Used under the GIL only: Python holds it while it changes the blocks or asks.
#pragma once
#include <cstdint>
#include <map>
#include <optional>
#include <utility>

namespace mori::memory {

class LiveRanges {
public:
    // Adds the block [start, start + size); false (nothing changed) when one starts there already.
    bool add(uint64_t start, uint64_t size) { return blocks_.emplace(start, size).second; }
    // Removes the block that starts at start; its size, or nullopt when none does.
    std::optional<uint64_t> remove(uint64_t start) {
        auto it = blocks_.find(start);
        if (it == blocks_.end()) return std::nullopt;
        const uint64_t size = it->second;
        blocks_.erase(it);
        return size;
    }
    // The block holding [offset, offset + n) whole, as (start, size); nullopt when none does.
    std::optional<std::pair<uint64_t, uint64_t>> find(uint64_t offset, uint64_t n) const {
        auto it = blocks_.upper_bound(offset);
        if (it == blocks_.begin()) return std::nullopt;
        --it;
        const uint64_t end = it->first + it->second;
        if (offset > end || n > end - offset) return std::nullopt;
        return *it;
    }
    size_t count() const { return blocks_.size(); }

private:
    std::map<uint64_t, uint64_t> blocks_;  // start -> size asked for
};

}  // namespace mori::memory
