// What every native transport of mori-core shares: the outcome codes of a transfer and the clock
// its deadlines are measured on.
#pragma once

#include <chrono>
#include <cstdint>

namespace mori {

// A transfer's outcome: the values of mori.core.codes.TransferCode (the bindings export this enum
// as TRANSFER_CODES and a test compares the two), which transports built on the native data
// planes report under their own names.
enum Code : int32_t {
    kSuccess = 0,
    kNotStarted = 1,
    kInProgress = 2,
    kErrInvalidArgs = 11,
    kErrNotFound = 12,
    kErrTransport = 13,
    kErrBadState = 14,
    kErrDevice = 15,
};

// A final status a notification may carry; anything else is malformed.
inline bool is_final_code(int64_t c) { return c == kSuccess || (c >= kErrInvalidArgs && c <= kErrDevice); }

// Monotonic nanoseconds: every deadline of the native transports.
inline int64_t now_ns() {
    return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now().time_since_epoch())
        .count();
}

}  // namespace mori
