// Why a target refused a request: one enum for every plane (the TCP data plane's error replies,
// the UCX engine's replies, the same-host ring's), its text and the transfer code it maps to.
#pragma once

#include <cstdint>
#include <string>

namespace mori {

enum Reason : uint32_t {
    kReasonNone = 0,
    kReasonMemory = 1,   // no such registered memory
    kReasonRange = 2,    // offset/size outside the region
    kReasonShape = 3,    // the message's data differs from its blocks
    kReasonGpu = 4,      // GPU memory reached by a copy-in message: the initiator must say it is GPU memory
    kReasonFailed = 5,   // the transport failed to move the data
    kReasonChecked = 6,  // a region's key asked of a checked engine: it serves no one-sided RMA
    kReasonDevice = 7,   // the target's copy to or from its GPU failed
    kReasonAlign = 8,    // an atomic's word is not aligned to its width
    kReasonLast = kReasonAlign,
};

// What a refusal tells the initiator, naming the transfer code it maps to.
std::string reason_text(uint32_t reason);
// The transfer code (mori::Code) of a refusal: ERR_NOT_FOUND for memory that is not there,
// ERR_TRANSPORT and ERR_DEVICE for failed moves and copies, ERR_INVALID_ARGS otherwise.
int reason_code(uint32_t reason);

}  // namespace mori
