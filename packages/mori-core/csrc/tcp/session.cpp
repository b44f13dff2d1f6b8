// Serving one admitted connection of the native TCP target (tcp/target.cpp accepts and admits
// it): each request read and checked, each block's region acquired through the region table and
// its bytes moved, GPU memory through the staging (tcp/staged.hpp); replies gathered and sent.
#include <sys/socket.h>
#include <sys/uio.h>

#include <deque>
#include <functional>
#include <string>
#include <thread>
#include <vector>

#include "base/trace.hpp"
#include "tcp/engine.hpp"
#include "tcp/staged.hpp"

namespace mori::tcp {

namespace {

constexpr size_t kInlineRead = 64 * 1024;  // reads up to this size are copied into the reply buffer
constexpr size_t kFlushBytes = 1 << 20;

// A block the target could not copy to or from its GPU: the reply says so (ERR_DEVICE).
void device_failed(int& code, uint64_t& reason, int& outcome) {
    code = kErrDevice;
    reason = kReasonDevice;
    if (outcome == kSuccess) outcome = code;
}

// Staged writes whose copies run while the connection goes on receiving: past this many, or this
// many bytes, the oldest is waited for (each holds pinned memory and its region).
constexpr size_t kPendingWrites = 16;
constexpr uint64_t kPendingWriteBytes = 4 << 20;

// Staged reads served from one DeviceSource: a staged read and those on the same GPU whose
// requests are already buffered behind it (an initiator sends a batch's read requests together),
// at most this many. Their copies then run ahead of the socket across blocks, and whole blocks in
// a row share a gathered copy, as a staged write's do at the initiator.
constexpr size_t kReadAhead = 64;

// The request checks of the wire (false: malformed, the connection is dropped).
bool request_ok(const ReqHdr& h) {
    return h.magic == kReqMagic && h.block.size <= kMaxBlock && (h.flags & ~kFlagsKnown) == 0 &&
           (h.op == kOpRead || h.op == kOpWrite || h.op == kOpNotify) &&
           (h.op != kOpNotify || (h.flags == 0 && is_final_code(static_cast<int64_t>(h.block.offset))));
}

// Sends a staged read's data (the source's pieces of span `span`, `bytes` in all) after the
// replies `out` holds (cleared), piece by piece as each copy ends; a notifying read (beforeLast
// set) holds its last byte back until beforeLast has made the record. Small data joins `out`
// instead, sent with the next replies (the caller records before it sends them). False when the
// socket or a copy failed.
bool send_staged(int fd, DeviceSource& source, size_t span, uint64_t bytes, std::vector<char>& out,
                 const std::function<void()>& beforeLast) {
    try {
        if (bytes <= kInlineRead) {
            for (; !source.done() && source.next_span() == span; source.pop()) {
                const DeviceSource::Piece& p = source.next();
                trace::mark('E');
                const auto* data = reinterpret_cast<const char*>(p.data());
                out.insert(out.end(), data, data + p.size());
            }
            return true;
        }
        for (uint64_t sent = 0; !source.done() && source.next_span() == span; source.pop()) {
            const DeviceSource::Piece& p = source.next();
            sent += p.size();
            const bool last = sent == bytes;
            const size_t len = p.size() - (last && beforeLast ? 1 : 0);
            struct iovec iov[2] = {{out.data(), out.size()}, {p.data(), len}};
            if (!send_all(fd, iov, 2).empty()) return false;
            out.clear();
            if (last && beforeLast) {
                beforeLast();
                if (!send_bytes(fd, p.data() + len, 1).empty()) return false;
            }
        }
        return true;
    } catch (const std::exception&) {
        return false;
    }
}

}  // namespace

// Serving one admitted connection: requests read and checked (read_request), each block's region
// acquired (the region table's check) and its bytes moved (serve_block), replies gathered in out_
// and sent before the connection waits for more.
class Target::Session {
public:
    Session(Target& t, Conn* conn, std::string peerKey)
        : t_(t), conn_(conn), fd_(conn->fd), peerKey_(std::move(peerKey)), rd_(conn->fd) {
        out_.reserve(kFlushBytes + kInlineRead + 64);
    }
    void run() {
        while (wait_for_request()) {
            ReqHdr h;
            uint64_t uid = 0;
            if (!read_request(h, uid) || !serve_block(h, uid) || !flush_if_full()) break;
        }
        drop_read_ahead();  // nothing of a region is touched once its connection ends
        settle();
    }

private:
    // One block being served: its request, where it lies, its outcome so far, and whether the
    // transfer's outcome is still to record once its bytes have moved.
    struct Block {
        const ReqHdr& h;
        uint64_t uid, addr;
        int code;
        uint64_t reason;
        bool record;
    };

    // Before blocking: answers everything received so far, then waits for the next request.
    // Staged writes are answered as their copies end while the socket is watched: a request that
    // comes meanwhile is served at once (a wait for the copies at every block would stall the
    // connection's receive for a copy's time).
    bool wait_for_request() {
        if (rd_.buffered() != 0) return true;
        // A run left open by requests after its last block, with nothing more on its way: its
        // copy goes now (no poll where no run is open: host memory's requests pay nothing).
        if (landing_.open() && !rd_.readable(0)) landing_.close();
        while (!settle_ended()) {
            if (rd_.readable(0)) return true;
            std::this_thread::yield();
        }
        trace::mark('n');
        if (!out_.empty() && !send_bytes(fd_, out_.data(), out_.size()).empty()) return false;
        trace::mark('N');
        out_.clear();
        conn_->idleSinceNs.store(now_ns());
        if (!rd_.wait_readable(idle_, Reader::kSpinNs).empty()) return false;
        conn_->idleSinceNs.store(0);
        return true;
    }

    // Check: the request frame (and a notifying one's uid). False drops the connection:
    // malformed, or the peer too slow.
    bool read_request(ReqHdr& h, uint64_t& uid) {
        frameStartNs_ = now_ns();
        if (!rd_.fill(sizeof(ReqHdr), mid_frame()).empty()) return false;
        std::memcpy(&h, rd_.data(), sizeof(h));
        rd_.consume(sizeof(h));
        trace::mark('G', h.op);
        if (!request_ok(h)) return false;
        if (h.flags & kFlagNotify) {
            if (!rd_.fill(sizeof(uid), mid_frame()).empty()) return false;
            std::memcpy(&uid, rd_.data(), sizeof(uid));
            rd_.consume(sizeof(uid));
        }
        if (h.flags & kFlagBegin) {
            settle();  // a failure of the transfer before counts for that one
            outcome_ = kSuccess;
        }
        return true;
    }

    // Plan and post: the block's region acquired and held while its bytes move (or the refusal
    // answered), then the transfer's outcome recorded once the last block's bytes have left (or
    // entered) the registered memory, before the initiator can see the transfer finish.
    bool serve_block(const ReqHdr& h, uint64_t uid) {
        if (h.op == kOpNotify) {
            t_.record_inbound(peerKey_, h.block.memId, static_cast<int>(h.block.offset));
            return true;
        }
        Block b{h, uid, 0, kSuccess, 0, (h.flags & kFlagNotify) != 0};
        bool ok = true;
        if (h.op == kOpRead && !ahead_.empty() && same_block(ahead_.front().block, h.block)) {
            ok = read_staged(b);  // acquired when an earlier read started the source
        } else {
            drop_read_ahead();  // a guard: the read-ahead's requests are the next ones read, so it is empty here
            auto use = std::make_unique<RegionUse>(t_, conn_);
            b.code = use->acquire(h.block, b.addr, b.reason);
            if (outcome_ == kSuccess) outcome_ = b.code;
            gpu::Stager* stager = b.code == kSuccess ? use->stager() : nullptr;
            if (h.op == kOpWrite) {
                ok = stager ? write_staged(b, *stager, use) : write_plain(b);
            } else if (stager) {
                start_read_ahead(b, *stager, std::move(use));
                ok = read_staged(b);
            } else {
                ok = read_plain(b);
            }
        }
        if (!ok) return false;
        if (b.record) t_.record_inbound(peerKey_, uid, outcome_);
        return true;
    }

    // A write into GPU memory, answered once every copy to the device has ended (settle, before
    // the replies are sent or a record made): the reply never precedes the bytes, and the region
    // stays held (use) until then. Meanwhile the next requests are received.
    bool write_staged(Block& b, gpu::Stager& stager, std::unique_ptr<RegionUse>& use) {
        DeviceSink sink(stager, b.addr, b.h.block.size, &landing_);
        if (!sink.receive(rd_, mid_frame()).empty()) return false;
        trace::mark('K');
        RepHdr rep{kRepMagic, b.code, b.reason};
        pending_.push_back(PendingWrite{std::move(sink), std::move(use), out_.size(), b.h.block.size});
        pendingBytes_ += b.h.block.size;
        append(&rep, sizeof(rep));
        if (b.record) {
            settle();
            return true;
        }
        settle_ended();
        while (pending_.size() > kPendingWrites || pendingBytes_ > kPendingWriteBytes) retire_oldest();
        return true;
    }

    // A write into host memory (a refused one's bytes are read and dropped).
    bool write_plain(Block& b) {
        char* dst = b.code == kSuccess ? reinterpret_cast<char*>(b.addr) : nullptr;
        if (!rd_.read_into(dst, b.h.block.size, mid_frame()).empty()) return false;
        RepHdr rep{kRepMagic, b.code, b.reason};
        append(&rep, sizeof(rep));
        return true;
    }

    // A staged read and the staged reads on the same GPU whose requests are already buffered
    // behind it (complete frames, regions acquired now, in order; the first that is not one ends
    // the run and is served on its own when its turn comes): their copies queued in one source.
    void start_read_ahead(const Block& b, gpu::Stager& stager, std::unique_ptr<RegionUse> use) {
        std::vector<DeviceSource::Span> spans{{b.addr, b.h.block.size}};
        ahead_.push_back(AheadRead{b.h.block, b.addr, std::move(use)});
        const char* buf = rd_.data();
        const size_t have = rd_.buffered();
        for (size_t off = 0; ahead_.size() < kReadAhead && have - off >= sizeof(ReqHdr);) {
            ReqHdr h;
            std::memcpy(&h, buf + off, sizeof(h));
            const size_t frame = sizeof(h) + ((h.flags & kFlagNotify) ? sizeof(uint64_t) : 0);
            if (!request_ok(h) || h.op != kOpRead || have - off < frame) break;
            auto next = std::make_unique<RegionUse>(t_, conn_);
            uint64_t addr = 0, reason = 0;
            if (next->acquire(h.block, addr, reason) != kSuccess || next->stager() != &stager) break;
            spans.push_back({addr, h.block.size});
            ahead_.push_back(AheadRead{h.block, addr, std::move(next)});
            off += frame;
        }
        aheadSpan_ = 0;
        try {
            aheadSource_.emplace(stager, std::move(spans));
            trace::mark('K');
        } catch (const std::exception&) {  // no source: read_staged fails the first block, the rest go alone
        }
    }

    // The staged read at the front of the read-ahead: its first piece is copied before the reply
    // says whether it succeeded (a failure ends the read-ahead: the blocks after it are then
    // served on their own); the rest follow the socket. A later failure cannot take the reply
    // back: the connection ends.
    bool read_staged(Block& b) {
        const uint64_t size = b.h.block.size;
        b.addr = ahead_.front().addr;
        try {
            if (!aheadSource_) throw std::runtime_error("no source");
            aheadSource_->next();
        } catch (const std::exception&) {
            drop_read_ahead();
            device_failed(b.code, b.reason, outcome_);
        }
        RepHdr rep{kRepMagic, b.code, b.code == kSuccess ? size : b.reason};
        append(&rep, sizeof(rep));
        if (!aheadSource_) return true;
        std::function<void()> beforeLast;
        if (b.record && size > kInlineRead) beforeLast = [&] { t_.record_inbound(peerKey_, b.uid, outcome_); };
        if (!send_staged(fd_, *aheadSource_, aheadSpan_, size, out_, beforeLast)) return false;
        if (beforeLast) b.record = false;
        ahead_.pop_front();  // its bytes have left: the region is released
        ++aheadSpan_;
        if (ahead_.empty()) aheadSource_.reset();
        return true;
    }

    // Ends the read-ahead: its copies waited for, then its regions released.
    void drop_read_ahead() {
        if (aheadSource_) aheadSource_->drain();
        aheadSource_.reset();
        ahead_.clear();
    }
    static bool same_block(const RequestEntry& a, const RequestEntry& b) {
        return a.memId == b.memId && a.offset == b.offset && a.size == b.size;
    }

    // A read of host memory: small ones copied into the replies, large ones sent from their
    // place; a notifying read holds its last byte back until the record is made.
    bool read_plain(Block& b) {
        const uint64_t size = b.h.block.size;
        RepHdr rep{kRepMagic, b.code, b.code == kSuccess ? size : b.reason};
        append(&rep, sizeof(rep));
        if (b.code != kSuccess) return true;
        if (size <= kInlineRead) {
            append(reinterpret_cast<const void*>(b.addr), size);
            return true;
        }
        const uint64_t held = b.record ? 1 : 0;
        struct iovec iov[2] = {{out_.data(), out_.size()}, {reinterpret_cast<void*>(b.addr), size - held}};
        if (!send_all(fd_, iov, 2).empty()) return false;
        out_.clear();
        if (!b.record) return true;
        t_.record_inbound(peerKey_, b.uid, outcome_);
        b.record = false;
        return send_bytes(fd_, reinterpret_cast<const void*>(b.addr + size - 1), 1).empty();
    }

    bool flush_if_full() {
        if (out_.size() < kFlushBytes) return true;
        settle();
        if (!send_bytes(fd_, out_.data(), out_.size()).empty()) return false;
        out_.clear();
        return true;
    }
    // Waits for the copies of every pending write (settle), or answers those at the front whose
    // copies have ended (settle_ended: true when none is left).
    void settle() {
        while (!pending_.empty()) retire_oldest();
    }
    bool settle_ended() {
        while (!pending_.empty() && pending_.front().sink.settled()) retire_oldest();
        return pending_.empty();
    }
    // The oldest pending write, once its copies ended: a failed one's reply turned into
    // ERR_DEVICE (and the notifying transfer's outcome), its region released.
    void retire_oldest() {
        PendingWrite& w = pending_.front();
        const bool failed = !w.sink.finish().empty();
        trace::mark('E');
        if (failed) {
            RepHdr rep;
            std::memcpy(&rep, out_.data() + w.replyAt, sizeof(rep));
            uint64_t reason = 0;
            int code = rep.code;
            device_failed(code, reason, outcome_);
            rep.code = code;
            rep.size = reason;
            std::memcpy(out_.data() + w.replyAt, &rep, sizeof(rep));
        }
        pendingBytes_ -= w.bytes;
        pending_.pop_front();
    }
    void append(const void* p, size_t n) {
        out_.insert(out_.end(), static_cast<const char*>(p), static_cast<const char*>(p) + n);
    }
    // A frame (header and payload) must arrive within the I/O timeout of its first byte: a peer
    // trickling a write cannot hold the region (and its deregistration) indefinitely.
    const AbortCheck& mid_frame() const { return midFrame_; }

    Target& t_;
    Conn* conn_;
    int fd_;
    std::string peerKey_;
    Reader rd_;
    std::vector<char> out_;
    int64_t frameStartNs_ = 0;
    const AbortCheck idle_ = [this]() -> std::string { return t_.stop_.load() ? "closed" : ""; };
    const AbortCheck midFrame_ = [this]() -> std::string {
        if (t_.stop_.load()) return "closed";
        return now_ns() - frameStartNs_ > static_cast<int64_t>(t_.ioTimeout_ * 1e9)
                   ? "peer too slow to send a frame (" + t_.timeoutSetting_ + ")"
                   : "";
    };
    int outcome_ = kSuccess;  // first failure of the notifying transfer being served
    // Small staged writes received in a row share a landing and its scattered copy (LandingRun),
    // closed before the connection waits for more requests.
    LandingRun landing_;
    // A staged write answered once its copies to the device have ended: its region stays held
    // and its reply waits in out_ (at replyAt) until then.
    struct PendingWrite {
        DeviceSink sink;
        std::unique_ptr<RegionUse> use;
        size_t replyAt;
        uint64_t bytes;
    };
    std::deque<PendingWrite> pending_;
    uint64_t pendingBytes_ = 0;
    // The read-ahead (start_read_ahead): the staged reads still to serve, each with its region
    // held, and the source of their bytes (the front's pieces are those of span aheadSpan_).
    struct AheadRead {
        RequestEntry block;
        uint64_t addr;
        std::unique_ptr<RegionUse> use;
    };
    std::deque<AheadRead> ahead_;
    std::optional<DeviceSource> aheadSource_;
    size_t aheadSpan_ = 0;
};

void Target::serve(Conn* conn) {
    gpu::own_thread();  // staged copies keep the GPU's context current here (gpu/staging.hpp)
    std::string peerKey;
    bool admitted = false;
    {
        // A small buffer until the peer is admitted: handshaking connections cost little memory.
        Reader hello(conn->fd, sizeof(Hello) + 2 * kMaxNameLen + kMaxTicketLen);
        admitted = handshake(conn, hello, peerKey);
    }
    if (admitted) Session(*this, conn, std::move(peerKey)).run();
}

}  // namespace mori::tcp
