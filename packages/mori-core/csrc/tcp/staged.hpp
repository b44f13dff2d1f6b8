// GPU memory on the native TCP data plane: a block of device memory leaves or enters the socket
// through mori-core's GPU staging (gpu/staging.hpp), piece by piece, the copy-engine copy of one
// piece running while the socket moves another. The target uses both for its GPU regions, the
// initiator for local GPU memory; Python never runs per transfer.
#pragma once

#include <algorithm>
#include <cstdint>
#include <deque>
#include <memory>
#include <string>
#include <vector>

#include "gpu/disjoint_ranges.hpp"
#include "gpu/staging.hpp"
#include "tcp/wire.hpp"

namespace mori::tcp {

// Pieces a block is copied in, and how many are copied ahead of the socket (at most 4 MiB of
// pinned memory per block in flight, while the copy engine, ~50 GB/s, stays ahead of a socket).
// A block's first pieces are smaller, so that the wire starts early: 256 KiB, then each piece as
// large as what went before, up to 1 MiB. (Smaller first pieces cost more than they overlap: a
// copy's fixed cost, several microseconds, is paid per piece.)
constexpr uint64_t kStageFirstPiece = 256 << 10;
constexpr uint64_t kStagePiece = 1 << 20;
constexpr size_t kStageWindow = 4;
inline uint64_t stage_piece(uint64_t done, uint64_t left) {
    return std::min(left, std::min(kStagePiece, std::max(kStageFirstPiece, done)));
}
// Blocks that one gathered or scattered copy takes at most: a copy of n ranges is n copies for
// the copy engine (and ~0.5 us each of the driver's time), so a peer's tiny blocks cannot make
// one copy of a million.
constexpr size_t kMaxRangesPerCopy = 256;

// Device memory copied out to host memory for sending: spans of it (address, bytes), in order,
// in pieces of at most kStagePiece that never cross a span (the first span's ramping up as
// stage_piece says, the others' whole), the copies kStageWindow copies ahead of the caller
// (across spans: the next block's copy runs while this one is sent). Whole spans in a row that
// fit in one piece together (KV pages, wherever they lie in the GPU; at most kMaxRangesPerCopy)
// share one gathered copy, each still a piece of its own.
class DeviceSource {
public:
    using Span = gpu::DeviceRange;
    struct Piece {
        std::shared_ptr<gpu::Staged> staged;  // the copy it is part of
        uint64_t offset, bytes;               // where in that copy
        size_t span;                          // which span it belongs to
        bool first;                           // its span's first piece
        uint8_t* data() const { return staged->data() + offset; }
        size_t size() const { return static_cast<size_t>(bytes); }
    };
    // Queues the copies of the first pieces; throws (std::runtime_error) when the Stager refuses.
    DeviceSource(gpu::Stager& stager, std::vector<Span> spans);
    bool done() const { return ahead_.empty(); }
    size_t next_span() const { return ahead_.front().span; }  // the span of the next piece (not done())
    // The next piece, its copy waited for (throws when the copy failed or outlived the timeout);
    // valid until pop().
    Piece& next();
    void pop();  // done with the piece next() gave: queues the copy of another
    // Waits for every copy queued (each within the timeout; failures ignored): the device memory
    // they read may then be released.
    void drain() noexcept;

private:
    void fill();   // queues copies until kStageWindow are ahead or no span is left
    void queue();  // queues the next copy
    gpu::Stager& stager_;
    const size_t lane_ = gpu::Stager::thread_lane();
    std::vector<Span> spans_;
    size_t span_ = 0;      // the span the next piece queued comes from
    uint64_t queued_ = 0;  // bytes of it queued
    std::deque<Piece> ahead_;
};

// Host memory that received the bytes of one or more blocks, one after another (`filled` in all),
// bound for device memory `ranges` (one per block): copied there in one copy once nothing more
// joins it (queued; failed: why that copy could not be queued).
struct Landing {
    gpu::Staged staged;
    std::vector<gpu::DeviceRange> ranges;
    uint64_t filled = 0;
    bool queued = false;
    std::string failed;
};

// Small blocks received one after another (KV pages, wherever they land in the GPU): a block of
// at most kStageFirstPiece bytes joins the open landing of the blocks before it when it is for
// the same GPU and fits (its bytes, and at most kMaxRangesPerCopy blocks). A run starts only
// where more than the block is already buffered: a lone block goes as it would alone. One copy,
// scattered, takes them all to the device when the run ends (close(): a block that does not
// fit, the reader's buffer empty after a block, or its owner about to wait). One per connection,
// used by whoever receives on it.
class LandingRun {
public:
    // The landing for such a block bound for [dst, dst + bytes): the open one when the block
    // fits in it, else a new one (the open one's copy queued first); the block's bytes go at
    // filled - bytes. Throws (std::runtime_error) when the Stager cannot lend memory.
    std::shared_ptr<Landing> place(gpu::Stager& stager, uint64_t dst, uint64_t bytes);
    void close();  // queues the open landing's copy, if any (a failure is kept in the landing)
    bool open() const { return open_ != nullptr; }

private:
    gpu::Stager* stager_ = nullptr;
    size_t lane_ = gpu::Stager::thread_lane();
    std::shared_ptr<Landing> open_;
    gpu::DisjointRanges openRanges_;  // the open landing's blocks in device memory
};

// Device bytes [dst, dst + bytes) received from a socket: each piece lands in host memory and is
// copied to the device while the next one is received; with a run, a small block may share its
// landing and copy with the blocks received before and after it (LandingRun).
class DeviceSink {
public:
    DeviceSink(gpu::Stager& stager, uint64_t dst, uint64_t bytes, LandingRun* run = nullptr)
        : stager_(stager), dst_(dst), bytes_(bytes), run_(run) {}
    // Receives every byte of the block from rd; "" or the socket's error. A piece that cannot be
    // staged or copied makes the rest of the block be read and dropped, and finish() say why.
    std::string receive(Reader& rd, const AbortCheck& check);
    // Waits for every copy to the device; "" once all ended, else why one failed (a byte of the
    // block may then be missing on the device).
    std::string finish();
    // Whether every copy to the device has ended (or one failed: finish() says why), waiting for
    // none: a caller goes on receiving while copies run, and finishes this once it is true.
    bool settled();

private:
    std::string receive_joined(Reader& rd, const AbortCheck& check);  // receive() through the run
    gpu::Stager& stager_;
    size_t lane_ = gpu::Stager::thread_lane();
    uint64_t dst_, bytes_;
    LandingRun* run_;
    std::deque<std::shared_ptr<Landing>> inFlight_;
    std::string failed_;
};

}  // namespace mori::tcp
