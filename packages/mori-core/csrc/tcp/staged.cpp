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
        // A whole span takes the whole spans after it that continue it in device memory, up to
        // one piece (the first span's ramp too): one copy, and one driver call, for many blocks.
        const uint64_t most = span_ == 0 ? kStageFirstPiece : kStagePiece;
        while (last + 1 < spans_.size() && spans_[last + 1].bytes > 0 &&
               spans_[last + 1].addr == spans_[last].addr + spans_[last].bytes && n + spans_[last + 1].bytes <= most)
            n += spans_[++last].bytes;
    }
    auto staged = std::make_shared<gpu::Staged>(stager_.to_host(s.addr + queued_, n, false, lane_));
    if (last > span_) {
        uint64_t offset = 0;
        for (size_t k = span_; k <= last; offset += spans_[k++].bytes)
            ahead_.push_back(Piece{staged, offset, spans_[k].bytes, k, true});
        span_ = last + 1;
        return;
    }
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

std::string DeviceSink::receive(Reader& rd, const AbortCheck& check) {
    for (uint64_t done = 0; done < bytes_;) {
        const uint64_t n = stage_piece(done, bytes_ - done);
        gpu::Staged piece;
        if (failed_.empty()) {
            try {
                if (inFlight_.size() >= kStageWindow) {  // bounded: wait for the oldest copy
                    inFlight_.front().wait();
                    inFlight_.pop_front();
                }
                piece = stager_.landing(n);
            } catch (const std::exception& e) {
                failed_ = e.what();
            }
        }
        char* into = failed_.empty() ? reinterpret_cast<char*>(piece.data()) : nullptr;
        std::string e = rd.read_into(into, n, check, !piece.pinned());  // pinned: through the reader's buffer
        if (!e.empty()) return e;
        if (failed_.empty()) {
            try {
                stager_.to_device(dst_ + done, piece, false, lane_);
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
    // memory whose copy may still run is never lent again (Staged::clear).
    for (; !inFlight_.empty(); inFlight_.pop_front()) {
        if (!failed_.empty()) continue;
        try {
            if (!inFlight_.front().copied()) return false;
        } catch (const std::exception& e) {
            failed_ = e.what();
        }
    }
    return true;
}

std::string DeviceSink::finish() {
    while (!settled()) {
        try {
            inFlight_.front().wait();
        } catch (const std::exception& e) {
            failed_ = e.what();
        }
    }
    return failed_;
}

}  // namespace mori::tcp
