// The request entry every plane's wire carries: one block of the target's registered memory.
// A target checks each one against its region table (base/regions.hpp, RegionTable::acquire)
// before a byte of its memory is touched.
#pragma once

#include <cstdint>

namespace mori {

#pragma pack(push, 1)
struct RequestEntry {
    uint64_t memId, offset, size;
};
#pragma pack(pop)
static_assert(sizeof(RequestEntry) == 24, "wire layout");

}  // namespace mori
