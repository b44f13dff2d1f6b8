// What every native transport of mori-core shares: the outcome codes of a transfer, the clock
// its deadlines are measured on, and how its messages print a timeout.
#pragma once

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <string>

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

// A timeout in seconds as error messages print it ("%g": 5, 0.25).
inline std::string seconds_text(double s) {
    char text[32];
    std::snprintf(text, sizeof(text), "%g", s);
    return text;
}

}  // namespace mori
