// The ranges one scattered copy takes into device memory (Stager::to_device of several ranges):
// its copies run in no set order, so no two may land on the same bytes, where in host memory the
// later block wins. The data planes that gather small blocks into one such copy (the TCP plane's
// landing runs, the UCX engine's groups) ask here before a block joins, and start a new copy, or
// refuse, where it would land on an earlier block's bytes.
#pragma once

#include <algorithm>
#include <cstdint>
#include <utility>
#include <vector>

namespace mori::gpu {

// Blocks in either order, one after another, cost one comparison each; others are compared
// with every range so far.
class DisjointRanges {
public:
    // Whether [at, at + bytes) overlaps none of the ranges added; added when it does not.
    bool add(uint64_t at, uint64_t bytes) {
        const uint64_t end = at + bytes;
        if (!ranges_.empty() && at < hi_ && end > lo_)
            for (const auto& [a, e] : ranges_)
                if (at < e && a < end) return false;
        lo_ = ranges_.empty() ? at : std::min(lo_, at);
        hi_ = ranges_.empty() ? end : std::max(hi_, end);
        ranges_.emplace_back(at, end);
        return true;
    }
    void clear() { ranges_.clear(); }

private:
    std::vector<std::pair<uint64_t, uint64_t>> ranges_;
    uint64_t lo_ = 0, hi_ = 0;
};

}  // namespace mori::gpu
