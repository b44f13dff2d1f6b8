// The UCX engine's messages (active messages) and the bookkeeping of the operations in flight.
//
// Initiator -> target, kAmRequest: a RequestHeader and `count` Entries (remote memory id, offset,
// size) as the active-message header; a write carries the blocks' bytes as its data, in entry
// order. Sent with the reply flag: the target answers on the same endpoint pair.
// Target -> initiator, kAmReply: a ReplyHeader; a successful read carries the bytes, a region
// request a RegionInfo and the packed remote key.
// Initiator -> target, kAmNote: a NoteHeader, the final status of a transfer that asked to notify
// (unless its only request carried kFlagNotify: the target then records the outcome itself).
// Every message carries the ticket its target issued; anything malformed is dropped unread.
// Integers are little-endian (both ends x86-64 or aarch64 Linux).
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "base/reasons.hpp"
#include "base/request.hpp"
#include "ucx/engine.hpp"

namespace mori::ucx {

// A request's blocks: the one request entry (base/request.hpp).
using Entry = RequestEntry;

constexpr unsigned kAmRequest = 0x4d30, kAmReply = 0x4d31, kAmNote = 0x4d32;
// Small blocks travel grouped, up to this many bytes, in one message (ucx/post.cpp). Blocks of GPU
// memory staged at an end move as one gathered copy out, one scattered copy in; a target refuses
// a group of its staged GPU memory over this size (the pinned memory one message takes).
constexpr uint64_t kGroupBytes = 256 << 10;

constexpr uint32_t kMagic = 0x4d435530;  // "0UCM"

// RequestHeader::flags
constexpr uint8_t kFlagRndvReply = 1;  // the initiator's memory is GPU memory: reply by rendezvous
// The transfer's only request, asking to notify: the target records its outcome under uid once
// it has served it (a write's bytes landed, a read's reply sent), and no note follows. That saves
// a message per transfer, and its send on the initiator's waiting thread.
constexpr uint8_t kFlagNotify = 2;
constexpr uint8_t kFlagsKnown = 3;

#pragma pack(push, 1)
struct RequestHeader {
    uint32_t magic;
    uint8_t op;
    uint8_t flags;
    uint16_t count;  // entries following
    uint64_t ticket;
    uint64_t part;  // the initiator's id of this message, echoed in the reply
    uint64_t uid;   // the transfer's (kFlagNotify), else 0
};
struct ReplyHeader {
    uint32_t magic;
    int32_t code;
    uint64_t ticket;  // the ticket of the request: replies are authenticated too
    uint64_t part;
    uint32_t reason;  // why it refused (base/reasons.hpp)
    uint32_t entry;   // the refused entry
};
struct RegionInfo {
    uint64_t addr, size;
    int32_t memType;
    uint32_t rkeyLen;  // followed by the packed remote key
};
struct NoteHeader {
    uint32_t magic;
    int32_t code;
    uint64_t ticket;
    uint64_t uid;
};
#pragma pack(pop)
static_assert(sizeof(RequestHeader) == 32 && sizeof(Entry) == 24 && sizeof(ReplyHeader) == 32 &&
                  sizeof(NoteHeader) == 24 && sizeof(RegionInfo) == 24,
              "wire layout");

// The outcomes a target records for a transfer that notifies (a note, or kFlagNotify): success
// and the target's refusals. A transport failure is not recorded: the link it needed is gone.
inline bool recorded_outcome(int code) { return code == kSuccess || code == kErrInvalidArgs || code == kErrNotFound; }

// One message (checked path) or one lane's run of puts/gets and its flush (RMA path) of a
// transfer, or a region request. Owned by its worker until its last UCX operation has called
// back and its outcome is known.
struct Part {
    ~Part() {
        for (auto& r : pins) --r->pins;
    }
    uint64_t id = 0;
    Op op = kOpRead;
    std::shared_ptr<Transfer> transfer;  // null for a region request
    Link* link = nullptr;
    uint64_t ticket = 0;  // what the target issued to us: sent, and expected back in its reply
    size_t lane = 0;
    std::vector<uint8_t> header;  // RequestHeader + Entries, alive until the send completes
    std::vector<api::Iov> iov;    // local pieces, in entry order
    uint64_t bytes = 0;
    std::vector<std::shared_ptr<Region>> pins;  // local memory in use
    int memType = api::kMemoryHost;
    api::MemHandle* memh = nullptr;  // set when the part is one contiguous local block
    Staged staged;                   // its GPU bytes in host memory, when the engine stages them
    int ops = 0;                     // UCX operations that will still call back
    bool done = false;               // its outcome is known (reported to the transfer)
    struct Answer {                  // a region request's outcome, where its caller waits for it
        RemoteRegion region;
        std::string rkey;
        int code = kInProgress;
        std::string message;
    }* answer = nullptr;

    // Records the outcome (the first one wins) and tells the transfer or the waiting caller.
    void finish(int code, const std::string& msg);

    const Entry& entry(size_t i) const {
        return reinterpret_cast<const Entry*>(header.data() + sizeof(RequestHeader))[i];
    }
    size_t entries() const { return (header.size() - sizeof(RequestHeader)) / sizeof(Entry); }
};

// A target's answer in flight: the regions it reads or writes stay pinned until UCX called back.
struct Serve {
    ~Serve() { unpin(); }
    void unpin() {
        for (auto& r : pins) --r->pins;
        pins.clear();
    }
    // An answer without data (a refusal, a write's reply): its blocks unpinned and dropped, so
    // that send_reply sends none back.
    void drop_blocks() {
        unpin();
        iov.clear();
        staged.clear();
    }
    Worker* worker = nullptr;
    api::Endpoint* replyEp = nullptr;
    ReplyHeader reply{};
    std::vector<std::shared_ptr<Region>> pins;
    std::vector<api::Iov> iov;
    std::string body;                  // region replies: RegionInfo + key
    std::shared_ptr<GpuWords> stager;  // set when the GPU bytes go through staged (ucx/gpu.hpp)
    Staged staged;
    std::string noteKey;  // the initiator's key while the outcome is still to record (kFlagNotify)
    uint64_t noteUid = 0;
    // Records the request's outcome for its initiator (kFlagNotify; once), if recorded_outcome.
    void record(int code);

    static api::Status on_request(Worker& w, const void* header, size_t headerLength, void* data, size_t length,
                                  const api::AmRecvParam* param);
    static api::Status on_reply(Worker& w, const void* header, size_t headerLength, void* data, size_t length,
                                const api::AmRecvParam* param);
    static void on_note(Worker& w, const void* header, size_t headerLength);
};

}  // namespace mori::ucx
