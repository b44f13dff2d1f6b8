// GPU memory on the native TCP data plane (see tcp/staged.hpp).
#include "tcp/staged.hpp"

#include <algorithm>
#include <exception>

namespace mori::tcp {

DeviceSource::DeviceSource(gpu::Stager& stager, std::vector<Span> spans) : stager_(stager), spans_(std::move(spans)) {
    fill();
}

void DeviceSource::fill() {
    // Pieces of one copy share it: the window counts copies (each copy's first piece is at 0).
    size_t copies = 0;
    for (const Piece& p : ahead_) copies += p.offset == 0;
    for (; copies < kStageWindow && span_ < spans_.size(); ++copies) queue();
}

void DeviceSource::queue() {
    const Span& s = spans_[span_];
    // Only the first span ramps its pieces up: a later span's copies are queued while earlier
    // pieces are on the wire, so small pieces would start nothing sooner and cost a copy each.
    const uint64_t left = s.bytes - queued_;
    uint64_t n = span_ == 0 ? stage_piece(queued_, left) : std::min(left, kStagePiece);
    size_t last = span_;  // spans span_..last go in this copy
    if (queued_ == 0 && n == left && n > 0) {
        // A whole span takes the whole spans after it, up to one piece (the first span's ramp
        // too): one gathered copy, one driver call and one completion for many blocks.
        const uint64_t most = span_ == 0 ? kStageFirstPiece : kStagePiece;
        while (last + 1 < spans_.size() && last + 1 - span_ < kMaxRangesPerCopy && spans_[last + 1].bytes > 0 &&
               n + spans_[last + 1].bytes <= most)
            n += spans_[++last].bytes;
    }
    if (last > span_) {
        auto staged = std::make_shared<gpu::Staged>(stager_.to_host(&spans_[span_], last + 1 - span_, false, lane_));
        uint64_t offset = 0;
        for (size_t k = span_; k <= last; offset += spans_[k++].bytes)
            ahead_.push_back(Piece{staged, offset, spans_[k].bytes, k, true});
        span_ = last + 1;
        return;
    }
    auto staged = std::make_shared<gpu::Staged>(stager_.to_host(s.addr + queued_, n, false, lane_));
    ahead_.push_back(Piece{std::move(staged), 0, n, span_, queued_ == 0});
    queued_ += n;
    if (queued_ == s.bytes) {
        ++span_;
        queued_ = 0;
    }
}

DeviceSource::Piece& DeviceSource::next() {
    ahead_.front().staged->wait();
    return ahead_.front();
}

void DeviceSource::pop() {
    ahead_.pop_front();
    fill();
}

void DeviceSource::drain() noexcept {
    for (Piece& p : ahead_) {
        try {
            p.staged->wait();
        } catch (const std::exception&) {  // timed out or failed: the Stager keeps its memory from reuse
        }
    }
}

std::shared_ptr<Landing> LandingRun::place(gpu::Stager& stager, uint64_t dst, uint64_t bytes) {
    // A block that lands on bytes of a block already in the run goes in a copy after the run's
    // (gpu/disjoint_ranges.hpp); the last condition adds it to the run's ranges when it joins.
    if (open_ && (&stager != stager_ || open_->filled + bytes > open_->staged.size() ||
                  open_->ranges.size() == kMaxRangesPerCopy || !openRanges_.add(dst, bytes)))
        close();
    if (!open_) {
        auto fresh = std::make_shared<Landing>();
        fresh->staged = stager.landing(kStagePiece);
        stager_ = &stager;
        open_ = std::move(fresh);
        openRanges_.clear();
        openRanges_.add(dst, bytes);
    }
    open_->ranges.push_back({dst, bytes});
    open_->filled += bytes;
    return open_;
}

void LandingRun::close() {
    if (!open_) return;
    const std::shared_ptr<Landing> l = std::move(open_);
    try {
        const gpu::Current current(stager_->config());  // the receiving thread may be an application's
        l->staged.shrink(l->filled);
        stager_->to_device(l->ranges.data(), l->ranges.size(), l->staged, false, lane_);
    } catch (const std::exception& e) {
        l->failed = e.what();
    }
    l->queued = true;
}

std::string DeviceSink::receive_joined(Reader& rd, const AbortCheck& check) {
    std::shared_ptr<Landing> into;
    if (failed_.empty()) {
        try {
            into = run_->place(stager_, dst_, bytes_);
        } catch (const std::exception& e) {
            failed_ = e.what();
        }
    }
    char* at = into ? reinterpret_cast<char*>(into->staged.data() + (into->filled - bytes_)) : nullptr;
    std::string e = rd.read_into(at, bytes_, check, !into || !into->staged.pinned());
    if (!e.empty()) return e;
    if (into) inFlight_.push_back(std::move(into));
    // Nothing more in the reader's buffer: the run's copy goes now, as a lone block's would (its
    // owner closes it before waiting anyway, a few microseconds later and in a costlier context).
    if (rd.buffered() == 0) run_->close();
    return "";
}

std::string DeviceSink::receive(Reader& rd, const AbortCheck& check) {
    // A run starts where more than this block is buffered already (another block follows): a
    // lone block then costs what it did before runs (no landing of a piece's size, no wait).
    if (run_ && bytes_ <= kStageFirstPiece && (run_->open() || rd.buffered() > bytes_))
        return receive_joined(rd, check);
    if (run_) run_->close();  // a larger block goes on its own, its pieces copied as they come
    for (uint64_t done = 0; done < bytes_;) {
        const uint64_t n = stage_piece(done, bytes_ - done);
        auto piece = std::make_shared<Landing>();
        if (failed_.empty()) {
            try {
                if (inFlight_.size() >= kStageWindow) {  // bounded: wait for the oldest copy
                    inFlight_.front()->staged.wait();
                    inFlight_.pop_front();
                }
                piece->staged = stager_.landing(n);
            } catch (const std::exception& e) {
                failed_ = e.what();
            }
        }
        char* into = failed_.empty() ? reinterpret_cast<char*>(piece->staged.data()) : nullptr;
        std::string e = rd.read_into(into, n, check, !piece->staged.pinned());  // pinned: through the reader's buffer
        if (!e.empty()) return e;
        if (failed_.empty()) {
            try {
                stager_.to_device(dst_ + done, piece->staged, false, lane_);
                piece->queued = true;
                inFlight_.push_back(std::move(piece));
            } catch (const std::exception& ex) {
                failed_ = ex.what();
            }
        }
        done += n;
    }
    return "";
}

bool DeviceSink::settled() {
    // After a failure the other copies are not waited for (each could outwait the timeout again):
    // memory whose copy may still run is never lent again (Staged::clear). A landing still open
    // (its run not closed) has not settled.
    for (; !inFlight_.empty(); inFlight_.pop_front()) {
        Landing& l = *inFlight_.front();
        if (!failed_.empty()) continue;
        if (!l.queued) return false;
        if (!l.failed.empty()) {
            failed_ = l.failed;
            continue;
        }
        try {
            if (!l.staged.copied()) return false;
        } catch (const std::exception& e) {
            failed_ = e.what();
        }
    }
    return true;
}

std::string DeviceSink::finish() {
    while (!settled()) {
        Landing& l = *inFlight_.front();
        if (!l.queued) {  // the run this block joined ends here
            run_->close();
            continue;
        }
        try {
            l.staged.wait();
        } catch (const std::exception& e) {
            failed_ = e.what();
        }
    }
    return failed_;
}

}  // namespace mori::tcp
