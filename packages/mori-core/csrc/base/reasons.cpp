// Texts and transfer codes of the refusals (see base/reasons.hpp).
#include "base/reasons.hpp"

#include "base/transfer.hpp"

namespace mori {

std::string reason_text(uint32_t reason) {
    switch (reason) {
        case kReasonMemory: return "memory is not registered at the target (ERR_NOT_FOUND)";
        case kReasonRange: return "offset/size out of range of the target's region (ERR_INVALID_ARGS)";
        case kReasonShape: return "the message's data does not match its blocks (ERR_INVALID_ARGS)";
        case kReasonGpu:
            return "the target's memory is GPU memory: say so when submitting (remote_gpu) (ERR_INVALID_ARGS)";
        case kReasonFailed: return "the transport failed to move the data (ERR_TRANSPORT)";
        case kReasonChecked:
            return "the target's engine checks every access (rma=False) and serves no one-sided RMA: "
                   "make both engines with rma=True, between trusted peers only (ERR_NOT_FOUND)";
        case kReasonDevice: return "the target's copy to or from its GPU failed (ERR_DEVICE)";
        case kReasonAlign: return "the word is not aligned to its width (ERR_INVALID_ARGS)";
        default: return "the target refused the request (reason " + std::to_string(reason) + ")";
    }
}

int reason_code(uint32_t reason) {
    switch (reason) {
        case kReasonNone: return kSuccess;
        case kReasonMemory:
        case kReasonChecked: return kErrNotFound;
        case kReasonFailed: return kErrTransport;
        case kReasonDevice: return kErrDevice;
        default: return kErrInvalidArgs;
    }
}

}  // namespace mori
